"""The block-quantized KV-cache formats, as the engines' own writers store them: NumPy models.

Both formats quantize each written row in float32 arithmetic, so bit-exact
agreement needs the same float32 steps, not float64: the models are float32
models of the engines' quantizers, read from their source, and take the rows
as the engine receives them (already rounded to the model's dtype). The
float64 oracle (``ropepool.reference``) rotates in float64, rounds the row to
q's dtype and hands it to them. Each model lives in its format's module, with
its source cited: ``nvfp4_rows`` (FlashInfer's NVFP4, formats/nvfp4.py) and
``affine_rows`` (MLX's ``mx.quantize``, formats/affine.py); ``write_rows``
puts the parts in a pool.
"""
from __future__ import annotations

import numpy as np

from ..core.layout import page_and_row, paged_view, pool_geometry
from ..formats.affine import affine_rows
from ..formats.nvfp4 import e2m1_codes, e4m3, nvfp4_rows

__all__ = ["affine_rows", "e2m1_codes", "e4m3", "nvfp4_rows", "write_rows"]


def write_rows(parts, stored, slots, *, kv_layout=None, layer=None):
    """New copies of a pool's ``parts`` (data, scales, ...: each shaped like the pool with its own last dim),
    token ``t``'s ``stored[i][t]`` written at slot ``slots[t]`` of part ``i``; slots below 0 write nothing."""
    slots = np.asarray(slots)
    write = slots >= 0
    out = []
    for part, rows in zip(parts, stored):
        part = np.array(part, copy=True)
        geom = pool_geometry(part.shape, layer, kv_layout)
        page, row = page_and_row(slots[write], geom.page_size)
        paged_view(part, geom)[page, row] = np.asarray(rows)[write]
        out.append(part)
    return out
