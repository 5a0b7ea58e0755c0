"""The CPU runner's one-token lanes (a decode call): ``torch_cpu.Fast`` takes them from here.

``compiled_one_token`` does all of a decode call in one call of inductor's code, ``one_token`` in the
few torch ops it needs where that is not compiled (yet); ``fused_pairs`` finds one token's q and k
heads in one row (a fused QKV output). Each returns None where it does not apply, and ``Fast.run``
takes the call; the values are ``run``'s, bit for bit (tests/test_cpu_one_token.py).
"""
from __future__ import annotations

import torch

from ..checks.values import STEP
from . import arraymath, paths, torch_cpu_compiled


class OneToken:
    """The lanes as methods of ``Fast`` (its tables, pools, scales and ``table_positions``)."""

    def compiled_one_token(self, q, k, v, positions, slots, k_pool, v_pool):
        """A decode call's lane (``lane``) in one call of inductor's code (torch_cpu_compiled, compiled as the
        steps of more tokens are) that rotates q and k, picks the table's rows and writes both pools: the same
        values as ``run``'s, ~12 us where ``one_token``'s ops take ~25. None where it is not compiled (yet),
        a slot is negative or past the pool, or a position past the table: ``run`` takes the call."""
        (s,), (p,) = slots.tolist(), positions.tolist()
        if not 0 <= s < self.pool_size or not 0 <= p < self.table_positions or v.ndim != 3 or k.ndim != 3 or \
                q.shape[2] != self.rot.rotary_dim or torch_cpu_compiled.failed():
            return None
        tables = self.from_table(0, p)
        if tables is None:
            return None
        out = torch_cpu_compiled.one_token((q, k, v, *tables, positions, slots, k_pool, v_pool, *self.scales),
                                           self.one_graph, self.compiled)
        return None if out is None else (out[0], out[1], k_pool, v_pool)

    def one_token(self, x, q, k, v, positions, slots, k_pool, v_pool):
        """A decode call's lane (``lane``: flat pool of q's dtype or fp8, no norm, a table of ours; ``x``: its q and k
        heads as ``fused_pairs``' one view): the few torch ops it needs, the same values as ``run``'s (the
        table's rows as views, not copies; each pool row written by one copy_). None where it does not apply
        (a slot past the pool, a position past the table): ``run`` takes the call."""
        (s,), (p,) = slots.tolist(), positions.tolist()
        if s >= self.pool_size or not 0 <= p < self.table_positions or v.ndim != 3:
            return None
        if STEP.holds(positions):  # once per step for every layer
            cos, sin = self.cos_sin(positions)[:2]
        else:
            tables = self.from_table(0, p)
            if tables is None:
                return None
            cos, sin = tables[0][p:p + 1], tables[1][p:p + 1]
        # _block's arithmetic in four ops: a product of x (bf16, fp16) and float32 cos/sin is taken in float32
        # (x upcast exactly, as x.float() does), each product rounded, then the sum once into q's dtype.
        both = torch.add(x * cos, x.flip(self.pair_dim) * sin, out=torch.empty(x.shape, dtype=q.dtype))
        (Hq, D), Hkv = q.shape[1:], k.shape[1]
        row = (Hq + Hkv) * D
        q_rot, k_rot = both.as_strided((1, Hq, D), (row, D, 1)), both.as_strided((1, Hkv, D), (row, D, 1), Hq * D)
        if s >= 0:  # a negative slot skips the write
            for i, (pool, rows) in enumerate(((k_pool, k_rot), (v_pool, v))):
                if self.quantized:  # quantized as ``write`` does
                    rows = arraymath.quantize(rows.float(), self.scales[i], self.qmax, self.ops)
                pool[s:s + 1].copy_(rows)
        paths.took("torch_cpu.write", 2)  # as ``write`` counts: each pool, a token written or skipped
        paths.took("torch_cpu.one_token")
        return q_rot, k_rot, k_pool, v_pool

    def fused_pairs(self, q, k):
        """One token's q and k as one ``[1, Hq + Hkv, *pairs]`` view where k's heads follow q's in memory
        (a fused QKV projection's output) and all features rotate; else None."""
        D = q.shape[2]
        if self.rot.rotary_dim != D or k.ndim != 3 or k.shape[2] != D or k.stride(1) != q.stride(1) or \
                k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
            return None
        try:  # past q's storage (k adjacent in another allocation): as_strided refuses
            return q.as_strided((1, q.shape[1] + k.shape[1], *self.pairs), (q.stride(0), q.stride(1), self.pairs[1], 1))
        except RuntimeError:
            return None
