"""MLX's affine 4/8-bit KV cache (``mx.quantize``, mlx-lm's ``QuantizedKVCache``)."""
from __future__ import annotations

AFFINE_BITS = (4, 8)  # the kv_bits mlx-lm's quantized cache is used with here
AFFINE_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize has
