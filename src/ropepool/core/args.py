"""The kernels' arguments, named once: every backend reads them by these names.

``ARRAYS``: a call's arrays, in every runner's signature. ``Extras``: the
arrays the kernels read besides them (the plan's ``fixed``; a plan's
``extras()`` reads the weakly held ones per call). ``POINTERS``: the Triton
kernel's pointer arguments in its order, which its signature and the custom
op's follow (tests/test_plan.py); the MLX graph names those it reads
(backends/mlx.py: ``READS``), and the CPU kernel names its own settings
(native/rope_ffi.cc: ``ROPEPOOL_CFG``, filled by name in backends/torch_native.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out", "k_out")
# What a native runner (the CPU kernel, the CUDA launcher) returns for arrays not laid out as those it was bound
# to, having read and written nothing: native/layout.h's OTHER_LAYOUT (tests/test_plan.py compares them).
OTHER_LAYOUT = -2


class Extras(NamedTuple):
    """The arrays the kernels read besides the call's."""

    freqs: Any = None  # float32 [sets, rotary_dim // 2] (NumPy; None with a table or without RoPE)
    table: Any = None  # the engine's cos/sin table (held weakly)
    q_weight: Any = None
    k_weight: Any = None
    k_scale: Any = None  # a float or an array (the stores' scales)
    v_scale: Any = None
    q_scale: Any = None
    k_out_scale: Any = None
    k_scale_cache: Any = None  # per-token-head scale caches (held weakly); Triton: block pools' scales
    v_scale_cache: Any = None
    k_bias_cache: Any = None  # Triton: affine pools' biases (block pools' arrays are the call's, given per call)
    v_bias_cache: Any = None


EXTRAS = Extras._fields
# ``use_long``: LongRoPE's choice of factors, made per call on the device (triton_launch.long_factors).
POINTERS = ARRAYS + ("use_long",) + EXTRAS
