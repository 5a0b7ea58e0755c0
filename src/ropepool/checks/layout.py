"""Every pool layout seen as one: ``[num_pages, page_size, num_heads, dim]``.

A slot ``s`` is row ``s % page_size`` of page ``s // page_size`` (vLLM's
slot_mapping); the seed's flat pool is the case ``page_size == 1``. MLA's
latent caches have no head dim: they are the case ``num_heads == 1``.
``pool_geometry`` reads a layout from a shape (validation and every backend
use it); ``paged_view`` makes the 4-D view, a view on torch, NumPy and MLX,
so writing through it writes the caller's pool.
"""
from __future__ import annotations

from dataclasses import dataclass

KV_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class PoolGeometry:
    layer: int | None  # the layer written, of a layer-stacked pool
    kv_layout: str | None  # None: flat [pool_size, heads, dim]
    headed: bool  # False: a latent cache with no head dim ([..., dim])
    num_layers: int  # 1 without a layer dim
    num_pages: int
    page_size: int
    num_heads: int
    dim: int

    @property
    def pool_size(self) -> int:
        """How many slots: rows of one layer."""
        return self.num_pages * self.page_size

    @property
    def rows(self) -> int:
        """Rows of ``dim`` features in the whole tensor (every layer, page and head)."""
        return self.num_layers * self.num_pages * self.page_size * self.num_heads


def pool_rank(kv_layout: str | None, layer: int | None, headed: bool = True) -> int:
    """How many dims a pool of this layout has."""
    return 2 + (kv_layout is not None) + (layer is not None) + headed


def pool_geometry(shape, layer: int | None, kv_layout: str | None, headed: bool = True) -> PoolGeometry:
    """The geometry of a pool of ``shape`` (rank already checked against ``pool_rank``)."""
    shape = tuple(shape)
    num_layers = 1
    if layer is not None:
        num_layers, shape = shape[0], shape[1:]
    if not headed:
        shape = shape[:-1] + (1,) + shape[-1:]
    if kv_layout is None:
        (pages, heads, dim), page_size = shape, 1
    elif kv_layout == "NHD":
        pages, page_size, heads, dim = shape
    else:
        pages, heads, page_size, dim = shape
    return PoolGeometry(layer, kv_layout, headed, num_layers, pages, page_size, heads, dim)


def paged_view(pool, geom: PoolGeometry):
    """``pool`` as a 4-D NHD view of the layer written: ``[num_pages, page_size, num_heads, dim]``."""
    p = pool if geom.layer is None else pool[geom.layer]
    if not geom.headed:
        p = p[..., None, :]
    if geom.kv_layout is None:
        return p[:, None]
    if geom.kv_layout == "HND":
        return p.swapaxes(1, 2)
    return p


def page_and_row(slots, page_size: int):
    return slots // page_size, slots % page_size


def row_ids(geom: PoolGeometry, page, row, head):
    """Index of (page, row, head) in the pool seen as ``[rows, dim]`` (contiguous pools), any framework."""
    if geom.kv_layout == "HND":
        ids = (page * geom.num_heads + head) * geom.page_size + row
    else:
        ids = (page * geom.page_size + row) * geom.num_heads + head
    if geom.layer is not None:
        ids = ids + geom.layer * (geom.rows // geom.num_layers)
    return ids
