"""vLLM's per-token-head KV cache (``kv_cache_dtype`` int8_per_token_head / fp8_per_token_head).

The pools are int8 or float8 and each has a float32 scale cache shaped like it without its last dim
(``k_scale_cache`` / ``v_scale_cache``): each written (slot, head) row stores ``row * (1 / s)``, saturated
(int8: truncated), with ``s = max(amax(|row|) / QMAX, 1e-6)`` stored at the same place of the scale cache
(docs/layouts.md). The scale caches are checked with the other arrays of the call (checks/pools.py:
``check_scale_caches``).

Here: the float64 model (``oracle_rows``, the oracle's ``reference.quantize_per_token_head``) and the
kernel's float32 steps as array math (``rows``: torch). The Triton kernel's store is its ``PTH`` branch.
"""
from __future__ import annotations

import numpy as np

from ..core.dtypes import QMAX

NAME = "per_token_head"
MEANS = ("row * (1 / s) saturated (int8: truncated), s = max(amax(|row|) / qmax, 1e-6) stored in the scale cache "
         "at the row's place (vLLM's int8/fp8_per_token_head)")
BACKENDS = frozenset({".triton_op", ".torch_eager"})  # the rows that write it (MLX calls are functional)


def oracle_rows(x, dtype):
    """vLLM's per-token-head quantizer (int8/fp8_per_token_head), in float64: each row of ``x [..., D]``
    gets ``s = max(amax(|row|) / QMAX, 1e-6)`` and stores ``row / s`` saturated to ``[-QMAX, QMAX]``,
    int8 truncated toward zero (vLLM's Triton store converts so), fp8 rounded to nearest even.

    Returns ``(stored rows in dtype, s as float32 [...])``. QMAX: 127 (int8), 448 (e4m3), 57344 (e5m2);
    vLLM's -128 floor for int8 is never reached (|row / s| <= 127).
    """
    x = np.asarray(x, dtype=np.float64)
    qmax = QMAX[np.dtype(dtype).name]
    s = np.maximum(np.abs(x).max(-1, initial=0.0) / qmax, 1e-6)
    y = np.clip(x / s[..., None], -qmax, qmax)
    return (np.trunc(y) if np.dtype(dtype).kind == "i" else y).astype(dtype), s.astype(np.float32)


def rows(x, qmax: float, integer: bool, ops):
    """vLLM's per-token-head quantizer (``oracle_rows``) in float32 as its kernel does it:
    for ``x [N, H, D]``, ``s = max(amax(|row|) / qmax, 1e-6)`` ``[N, H]`` and the rows ``x * (1 / s)``
    saturated, truncated toward zero for int8. The caller casts the rows once."""
    s = ops.clip(ops.div(ops.absmax_last(x), qmax), 1e-6, None)
    y = ops.clip(x * (1.0 / s)[..., None], -qmax, qmax)
    return (ops.trunc(y) if integer else y), s
