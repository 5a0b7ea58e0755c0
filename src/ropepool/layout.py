"""Every pool layout seen as one: ``[num_pages, page_size, num_kv_heads, head_dim]``.

A slot ``s`` is row ``s % page_size`` of page ``s // page_size`` (vLLM's
slot_mapping); the seed's flat pool is the case ``page_size == 1``. The views
below are views (torch, NumPy) so writing through them writes the caller's
pool; MLX backends invert them to rebuild the pool functionally.
"""
from __future__ import annotations


def paged_view(pool, call):
    """``pool`` (any layout the call accepted) as a 4-D NHD view of one layer."""
    p = pool if call.layer is None else pool[call.layer]
    if call.kv_layout is None:
        return p[:, None]
    if call.kv_layout == "HND":
        return p.swapaxes(1, 2)
    return p


def page_and_row(slots, page_size: int):
    return slots // page_size, slots % page_size
