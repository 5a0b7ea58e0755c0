"""The native CPU kernel (src/ropepool/native), built at install; the rest of the package is pyproject.toml's.

``optional=True``: where it cannot build (no C++ compiler) the install still succeeds, and the torch backend
says once, at the first CPU call, that the general torch code runs instead (ropepool/native/__init__.py).
Build flags: docs/native.md.
"""
from setuptools import Extension, setup


def _native() -> list:
    try:
        from tvm_ffi import libinfo  # build-system requires (pyproject.toml)
    except ImportError:  # only the pure-Python parts (setuptools without the build requirements)
        return []
    lib = libinfo.find_libtvm_ffi()
    common = dict(include_dirs=[libinfo.find_include_path(), libinfo.find_dlpack_include_path()],
                  library_dirs=[lib.rsplit("/", 1)[0]], language="c++", optional=True)
    return [Extension(
        "ropepool.native._rope_native",
        sources=["src/ropepool/native/rope_ffi.cc", "src/ropepool/native/rope_py.cc"],  # (rope_py: Python.h's)
        depends=["src/ropepool/native/rope_kernel.h", "src/ropepool/native/convert.h", "src/ropepool/native/layout.h"],
        libraries=["tvm_ffi"],
        # -ffp-contract=off: no fused multiply-add, so the rotation rounds as the torch ops do (docs/precision.md)
        extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"],
        **common,
    ), Extension(
        # The eager CUDA call's launch of the Triton kernel (backends/triton_native.py): no CUDA needed to build
        # (the driver is opened at run time), so it builds everywhere and is used where there is a GPU.
        "ropepool.native._triton_launch",
        sources=["src/ropepool/native/triton_launch.cc"],
        depends=["src/ropepool/native/layout.h"],
        libraries=["tvm_ffi", "dl"],
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
        **common,
    )]


setup(ext_modules=_native())
