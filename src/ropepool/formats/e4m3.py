"""float8 e4m3 as the DeepSeek V3.2 writers round to it (formats/fp8_ds_mla.py, formats/indexer.py): the
NumPy model's steps. Each scale is a float32 quotient (``float32(amax / 448)``: a float64 quotient of two float32
numbers rounded once to float32 is the correctly rounded float32 quotient), and each stored value the float32
quotient ``float32(x / s)`` rounded to e4m3, nearest even, saturated to +-448."""
from __future__ import annotations

import numpy as np

from ..core.dtypes import FP8_MAX

E4M3_MAX = FP8_MAX["float8_e4m3fn"]  # the writers divide amax by it (kFp8ScaleDivisor; 224 only on ROCm's fnuz)


def e4m3_bytes(q32):
    """float32 quotients as e4m3 bytes: nearest even, saturated to +-448 (``__NV_SATFINITE``)."""
    import ml_dtypes

    q32 = np.clip(np.asarray(q32, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return q32.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def f32_quotient(x, s):
    return (np.asarray(x, dtype=np.float64) / np.asarray(s, dtype=np.float64)).astype(np.float32)
