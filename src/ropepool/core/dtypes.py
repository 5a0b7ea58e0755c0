"""Frameworks and dtypes by name, without importing any framework.

Every module that needs to know what an array is asks here. Nothing in this
module imports torch or mlx: an array's type and dtype are read from the
object itself, so the NumPy oracle and the MLX path run where torch is absent.
"""
from __future__ import annotations

import sys

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The largest finite value of each fp8 format: stores saturate to it.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Per-token-head caches (vLLM's int8_per_token_head / fp8_per_token_head) may also be int8: each
# (token, head) row stores row * (1 / scale), saturated, with scale = max(amax(|row|) / QMAX, 1e-6) (docs/layouts.md).
QMAX = {**FP8_MAX, "int8": 127.0}
# MLX has no fp8 dtype: mx.to_fp8 stores e4m3 in uint8 arrays, so on MLX a
# uint8 pool is an e4m3 pool.
MLX_FP8 = {"uint8": "float8_e4m3fn"}

FRAMEWORK_TYPES = {"torch": "torch.Tensor", "mlx": "mx.array", "numpy": "numpy.ndarray"}
_BY_TYPE: dict = {}


def framework_of(x) -> str | None:
    """"torch", "mlx", "numpy" or None, from the type alone (cached per type)."""
    t = type(x)
    fw = _BY_TYPE.get(t, False)
    if fw is False:
        fw = _BY_TYPE[t] = _framework_of_type(t)
    return fw


def _framework_of_type(t) -> str | None:
    mod = t.__module__
    if mod.startswith("torch"):
        torch = sys.modules.get("torch")  # a torch type exists only if torch is imported
        return "torch" if torch is not None and issubclass(t, torch.Tensor) else None
    if mod.startswith("mlx"):
        return "mlx" if t.__name__ == "array" else None
    if mod == "numpy":
        import numpy as np

        return "numpy" if issubclass(t, np.ndarray) else None
    return None


def dtype_name(x) -> str:
    """``"bfloat16"`` for torch.bfloat16, mx.bfloat16 and ml_dtypes' bfloat16 alike."""
    return str(x.dtype).rsplit(".", 1)[-1]


def tracing(framework: str) -> bool:
    """Under torch.compile tensors are fakes: no data pointers and no values to read."""
    if framework != "torch":
        return False
    return sys.modules["torch"].compiler.is_compiling()
