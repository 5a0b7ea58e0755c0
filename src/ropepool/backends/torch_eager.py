"""The PyTorch path: vectorised tensor code that runs on any torch device.

It is the CPU implementation and the fallback where Triton is missing. On a
GPU the boolean mask of valid slots makes it synchronise with the device; the
Triton kernel does not.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..layout import page_and_row, paged_view

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@lru_cache(maxsize=256)
def freq_table(spec, device: torch.device) -> torch.Tensor:
    """float32 ``[n_sets, rotary_dim // 2]``: row 0 the frequencies, row 1 longrope's long ones."""
    rows = [spec.inv_freq] if spec.long_inv_freq is None else [spec.inv_freq, spec.long_inv_freq]
    return torch.from_numpy(np.stack(rows).astype(np.float32)).to(device)


def cos_sin(spec, positions: torch.Tensor):
    """float32 ``cos, sin [T, rotary_dim // 2]``, attention scaling included."""
    table = freq_table(spec, positions.device)
    inv_freq = table[0]
    if spec.long_from is not None:
        # Decided on the device (no sync): any position past the original
        # context switches the whole call to the long factors.
        use_long = (positions.max() >= spec.long_from) if positions.numel() else torch.tensor(False)
        inv_freq = torch.where(use_long.to(table.device), table[1], table[0])
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return ang.cos() * spec.attention_scaling, ang.sin() * spec.attention_scaling


def rotate(x: torch.Tensor, cos, sin, spec) -> torch.Tensor:
    r = spec.rotary_dim
    xf = x[..., :r].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if spec.style == "neox":
        x1, x2 = xf.chunk(2, dim=-1)
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    if r < x.shape[-1]:
        return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)
    return rot.to(x.dtype)


def store(rows: torch.Tensor, pool_dtype, scale) -> torch.Tensor:
    if scale is None:
        return rows
    if not isinstance(scale, torch.Tensor):
        # PyTorch's CUDA kernels turn division by a Python number into a
        # multiplication by its reciprocal (an fp8 step off, now and then).
        scale = torch.full((), scale, dtype=torch.float32, device=rows.device)
    top = FP8_MAX[pool_dtype]
    return (rows.float() / scale).clamp(-top, top).to(pool_dtype)


def run(call, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
    spec = call.spec
    cos, sin = cos_sin(spec, positions)
    q_rot, k_rot = rotate(q, cos, sin, spec), rotate(k, cos, sin, spec)
    if q_out is not None:
        q_rot = q_out.copy_(q_rot)
    if k_out is not None:
        k_rot = k_out.copy_(k_rot)
    # Out-of-range slots are masked, not only negative ones: on a GPU nothing
    # has checked them, and no input may write outside the pool.
    write = (slots >= 0) & (slots < call.pool_size)
    page, row = page_and_row(slots[write].long(), call.page_size)
    for pool, rows, scale in ((k_pool, k_rot, call.k_scale), (v_pool, v, call.v_scale)):
        paged_view(pool, call).index_put_((page, row), store(rows[write], pool.dtype, scale))
    return q_rot, k_rot, k_pool, v_pool
