"""ropepool's compiled CPU kernel (rope_kernel.h, bound by rope_ffi.cc), loaded through apache-tvm-ffi.

``pip install`` builds ``_rope_native`` here (setup.py); ``ROPEPOOL_NATIVE_LIB`` names another build (the
sanitizer job's, .ci/sanitize). ``kernel()`` is the loaded module, or None where there is none (no compiler at
install, tvm-ffi missing): then one line on stderr names the fix, and the torch backend's native row says why in
``ropepool env`` (``why_not``); the general torch code runs those calls. docs/native.md has the build.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_state: dict = {}


def library() -> str | None:
    """The path of the kernel's shared library (None: not built)."""
    env = os.environ.get("ROPEPOOL_NATIVE_LIB")
    if env:
        return env
    found = sorted(glob.glob(os.path.join(_HERE, "_rope_native*.so")) + glob.glob(os.path.join(_HERE,
                                                                                              "_rope_native*.pyd")))
    return found[0] if found else None


def kernel():
    """The loaded kernel module (``rope_pool``, ``isa``), or None (``why()`` says why)."""
    if "module" not in _state:
        _state["module"], _state["why"] = _load()
        if _state["module"] is None:
            print(f"ropepool: {_state['why']}", file=sys.stderr)
    return _state["module"]


def entry(exchange_api):
    """The kernel's CPython entry (rope_py.cc: ``rope_pool`` reading torch tensors through ``exchange_api``, torch's
    ``Tensor.__dlpack_c_exchange_api__``), or None (no kernel, a build without it): the same function as
    ``kernel().rope_pool``, ~0.9 us cheaper a one-token call (rope_py.cc)."""
    if "entry" not in _state:
        _state["entry"] = None
        path = library()
        if kernel() is not None and path is not None:
            try:  # the same library, imported as the extension module it also is
                spec = importlib.util.spec_from_file_location(f"{__name__}._rope_native", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                module.use(exchange_api)
                _state["entry"] = module
            except Exception:  # (ImportError: a build without the entry; ValueError: another DLPack)
                pass
    return _state["entry"]


def why() -> str | None:
    """Why there is no kernel here (None: there is one)."""
    kernel()
    return _state["why"]


def _load():
    path = library()
    if path is None:
        return None, ("native CPU kernel not built (no C++ compiler at install?); using the general torch code. "
                      "Fix: install a C++ compiler (g++ or clang++) and run `pip install -e .` (or `pip install "
                      "ropepool`) again")
    try:
        tvm_ffi = _import_tvm_ffi()
    except ImportError:
        return None, ("native CPU kernel needs apache-tvm-ffi, which is not installed; using the general torch "
                      "code. Fix: pip install 'ropepool[torch]'")
    try:
        return tvm_ffi.load_module(path), None
    except Exception as e:  # a build for another tvm-ffi, a broken file
        return None, (f"native CPU kernel {path} did not load ({type(e).__name__}: {e}); using the general torch "
                      "code. Fix: reinstall ropepool (`pip install -e .` in a checkout) against this apache-tvm-ffi")


def _import_tvm_ffi():
    """``import tvm_ffi``, without the ml_dtypes it imports where installed (0.7 s on a 2-core VM, more than the
    rest of a first call: docs/native.md). tvm-ffi then maps no ml_dtypes NumPy dtypes, which ropepool never hands
    it (torch tensors only); ml_dtypes stays importable as before."""
    if "tvm_ffi" in sys.modules or "ml_dtypes" in sys.modules:
        import tvm_ffi

        return tvm_ffi
    sys.modules["ml_dtypes"] = None  # (an ImportError inside, which tvm-ffi catches)
    try:
        import tvm_ffi
    finally:
        del sys.modules["ml_dtypes"]
    return tvm_ffi
