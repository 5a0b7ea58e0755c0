"""ropepool's compiled CPU kernel (rope_kernel.h, bound by rope_ffi.cc), a CPython module (rope_py.cc).

``pip install`` builds ``_rope_native`` here (setup.py); ``ROPEPOOL_NATIVE_LIB`` names another build (the
sanitizer job's, .ci/sanitize). ``kernel()`` is the loaded module, or None where there is none (no compiler at
install, apache-tvm-ffi's library missing, a torch without the DLPack exchange API): then one line on stderr
names the fix, and the torch backend's native row says why in ``ropepool env`` (``why_not``); the general torch
code runs those calls. docs/native.md has the build.
"""
from __future__ import annotations

import ctypes
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
    """The loaded kernel module (``rope_pool``, ``rope_pool_norm``, ``bind``, ``cfg_names``, ``isa``: rope_py.cc),
    reading torch tensors through torch's DLPack exchange API, or None (``why()`` says why)."""
    if "module" not in _state:
        _state["module"], _state["why"] = _load()
        if _state["module"] is None:
            print(f"ropepool: {_state['why']}", file=sys.stderr)
    return _state["module"]


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
    import torch

    exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if exchange is None:
        return None, (f"native CPU kernel needs torch's DLPack exchange API, which torch {torch.__version__} has "
                      "not; using the general torch code. Fix: pip install 'torch>=2.11'")
    if not load_tvm_ffi_library():
        return None, ("native CPU kernel needs apache-tvm-ffi's library, which is not installed; using the general "
                      "torch code. Fix: pip install 'ropepool[torch]'")
    try:  # (the module's name, whatever the file's: ROPEPOOL_NATIVE_LIB's build has its own)
        spec = importlib.util.spec_from_file_location(f"{__name__}._rope_native", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.use(exchange)
        return module, None
    except (ImportError, ValueError) as e:  # a build for another Python, tvm-ffi or DLPack; a broken file
        return None, (f"native CPU kernel {path} did not load ({type(e).__name__}: {e}); using the general torch "
                      "code. Fix: reinstall ropepool (`pip install -e .` in a checkout) against this apache-tvm-ffi")


def load_tvm_ffi_library() -> bool:
    """Load apache-tvm-ffi's C++ library, which the native modules link (its TensorView and errors), without
    importing its Python package (26-65 ms, most of a process's first call: docs/native.md). False: not
    installed."""
    if "tvm_lib" not in _state:
        spec = importlib.util.find_spec("tvm_ffi")
        found = [] if spec is None else [p for d in spec.submodule_search_locations or ()
                                         for p in glob.glob(os.path.join(d, "lib", "libtvm_ffi.*"))]
        try:  # RTLD_GLOBAL: the modules' references to it resolve to this copy
            _state["tvm_lib"] = ctypes.CDLL(sorted(found)[0], mode=ctypes.RTLD_GLOBAL) if found else None
        except OSError:
            _state["tvm_lib"] = None
    return _state["tvm_lib"] is not None
