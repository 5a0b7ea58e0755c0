"""The torch backend on CPU tensors: the same math as ``torch_eager`` in fewer passes over memory.

``torch_eager`` builds whole float32 intermediates with some 25 small ops, each
a pass over the tokens. Here the work goes in blocks of tokens small enough to
stay in the L2 cache. Each pair's two elements are one axis of a view, so the
rotation is ``x * C + swap(x) * S`` over both at once (C = cos, cos; S = -sin,
sin, made once per call for q and k): a few ops per block, written straight
into the output (float32) or upcast once and rounded once into it (bf16,
fp16). The pools are written with one ``index_copy_`` each. Per the contract
(docs/precision.md) angles are ``float32(p) * inv_freq32``, cos/sin are
torch's accurate float32 functions and the arithmetic is float32 throughout,
with the same roundings as ``torch_eager`` (its results bit for bit).

It takes the calls ``covers`` accepts (plain, partial, GPT-J, scaled and
longrope rotations, an engine's table, every pool layout, MLA's latent); the
rest (QK norm, fp8, MRoPE, autograd, torch.compile tracing) stay on ``torch_eager``.
"""
from __future__ import annotations

import torch

from ..layout import page_and_row, paged_view

# Tokens of a block: about 128K floats (512 KB), which measured fastest on a
# 2 MB-per-core L2 (docs/benchmarks.md, CPU section).
_BLOCK_ELEMENTS = 1 << 17


def covers(call, arrays) -> bool:
    """Whether this path runs a call with these arrays (else torch_eager's general code does)."""
    q = arrays[0]
    return (q.device.type == "cpu" and call.norm is None and not (call.fp8 or call.q_fp8 or call.k_fp8)
            and call.rotation.mrope_section is None and not torch.compiler.is_compiling()
            and not any(x is not None and x.requires_grad for x in arrays[:3]))


class Fast:
    """The runner for one checked Call (bound once per layout, like torch_eager.Prepared)."""

    def __init__(self, call, freqs, general):
        self.call, self.rot, self.general = call, call.rotation, general
        r = self.rot.rotary_dim
        # x's rotated features seen as [..., 2, r/2] (NeoX: the pair's two halves) or [..., r/2, 2] (GPT-J),
        # so one broadcast multiply covers both elements of every pair.
        self.pairs, self.pair_dim = ((r // 2, 2), -1) if self.rot.gptj else ((2, r // 2), -2)
        if freqs is not None:  # float32 [sets, half] -> [sets, 1, 2, half] / [sets, 1, half, 2]
            freqs = freqs[:, None].unsqueeze(self.pair_dim).expand(-1, 1, *self.pairs)
        self.freqs = freqs
        self.sign = torch.tensor([-1.0, 1.0]).view((2, 1) if not self.rot.gptj else (1, 2))

    def cos_sin(self, positions):
        """float32 ``C, S [T, 1, *pairs]``: the rotation is ``x * C + swap(x) * S`` (S holds -sin, sin)."""
        rot = self.rot
        if rot.table is not None:
            half = rot.rotary_dim // 2
            rows = rot.table.index_select(0, positions).float()[:, None]
            c, s = rows[..., :half].unsqueeze(self.pair_dim), rows[..., half:2 * half].unsqueeze(self.pair_dim)
            return torch.cat([c, c], self.pair_dim), torch.cat([s, s], self.pair_dim).mul_(self.sign)
        inv = self.freqs[0]
        if rot.long_from is not None and positions.numel() and int(positions.max()) >= rot.long_from:
            inv = self.freqs[1]
        ang = positions[:, None, None, None] * inv  # int * float32: float32(p) * inv_freq32, one rounding
        cos, sin = torch.cos(ang), torch.sin(ang).mul_(self.sign)
        if rot.attention_scaling != 1.0:
            cos.mul_(rot.attention_scaling)
            sin.mul_(rot.attention_scaling)
        return cos, sin

    def rotate(self, x, cos, sin, out):
        """x rotated into ``out`` (new when None), block by block; returns out."""
        r = self.rot.rotary_dim
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype)
        if r < x.shape[-1] and out.data_ptr() != x.data_ptr():
            out[..., r:].copy_(x[..., r:])  # features past rotary_dim pass through
        if r == 0:
            return out
        T, H, D = x.shape
        xr = (x if r == D else x[..., :r]).unflatten(-1, self.pairs)
        outr = (out if r == D else out[..., :r]).unflatten(-1, self.pairs)
        step = max(1, _BLOCK_ELEMENTS // (H * D))
        if T <= step:
            self._block(xr, cos, sin, outr)
        else:
            for i in range(0, T, step):
                self._block(xr[i:i + step], cos[i:i + step], sin[i:i + step], outr[i:i + step])
        return out

    def _block(self, x, cos, sin, out):
        # Each product rounded, then the sum: the formula of torch_eager and vLLM's kernel, bit for bit
        # (addcmul_ would fuse the second product into the sum).
        if x.dtype == torch.float32:
            swapped = x.flip(self.pair_dim).mul_(sin)  # a copy: out may be x itself
            torch.mul(x, cos, out=out).add_(swapped)
        else:  # float32 math from the 16-bit input, one rounding at the end
            x = x.float()
            swapped = x.flip(self.pair_dim).mul_(sin)
            out.copy_(x.mul_(cos).add_(swapped))

    def write(self, pool, rows, slots, keep):
        """``rows [T, H, dim]`` into the pool at ``slots``; ``keep``: the tokens written (None: all)."""
        if keep is not None:
            rows, slots = rows[keep], slots[keep]
        view = paged_view(pool, self.call.pool)
        if view.stride(0) == view.shape[1] * view.stride(1):  # pages of rows (flat, NHD): one index a slot
            view.flatten(0, 1).index_copy_(0, slots, rows.to(pool.dtype))
        else:
            view.index_put_(page_and_row(slots, self.call.pool.page_size), rows.to(pool.dtype))

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        slots, positions = slots.long(), positions.long()
        lo, hi = torch.aminmax(slots) if slots.numel() else (0, 0)
        table = self.rot.table
        # Slots past the pool, positions outside the engine's table: only a runner called without
        # validation sees them (tests do); the general path masks them.
        if hi >= self.call.pool_size or (table is not None and positions.numel() and not (
                0 <= positions.min() and positions.max() < table.shape[0])):
            return self.general(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
        cos, sin = self.cos_sin(positions) if self.rot.rotary_dim else (None, None)
        q_rot = self.rotate(q, cos, sin, q_out)
        k3, v3 = (x if x.ndim == 3 else x[:, None] for x in (k, v))  # MLA: one latent head
        k_rot = self.rotate(k3, cos, sin, None if k_out is None else k_out.view(k3.shape))
        keep = None if lo >= 0 else slots >= 0  # a negative slot skips the token's write
        self.write(k_pool, k_rot, slots, keep)
        self.write(v_pool, v3, slots, keep)
        return q_rot, k_rot.view(k.shape) if k_out is None else k_out, k_pool, v_pool
