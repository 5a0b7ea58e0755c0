"""Every pool layout seen as one: ``[num_pages, page_size, num_heads, dim]``.

A slot ``s`` is row ``s % page_size`` of page ``s // page_size`` (vLLM's
slot_mapping); the seed's flat pool is the case ``page_size == 1``. MLA's
latent caches have no head dim: they are the case ``num_heads == 1``.
``pool_geometry`` reads a layout from a shape (validation and every backend
use it); ``paged_view`` makes the 4-D view, a view on torch, NumPy and MLX,
so writing through it writes the caller's pool.

A tiled layout (``TILED``: vLLM's CPU AMX cache, ``kv_layout="amx"``) has the
HND shape but stores each (page, head) block's ``page_size x dim`` values in
tiles, which no 4-D view reaches; split the row into (row // tile, row % tile)
and the feature likewise and the address is affine again: ``tiled_view`` is
that 6-D view (torch), ``write_at`` gives any layout's view, index and rows.
Another tiled layout would be its tiles in ``TILED``, its name in ``KV_LAYOUTS``,
its feature ``"layout.<name>"`` (plan.build, support.py: the rows that
write it: torch through ``write_at``, the Triton kernel through its tile
constexprs, triton_op._pool_strides) and its offsets in the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

KV_LAYOUTS = ("NHD", "HND", "amx")
# kv_layout -> how each (page, head) block of the k pool and of the v pool is stored: (tokens a tile, features a
# tile, token-major). Token-major: the block is [page_size / tt, dim / td, tt, td] (vLLM's AMX keys: 16 tokens
# x 2 features, the bf16 pairs of a token together); feature-major: [dim / td, page_size / tt, td, tt] (its
# values: 2 tokens x 16 features, each feature's pair of tokens together). docs/layouts.md shows the bytes.
TILED = {"amx": ((16, 2, True), (2, 16, False))}


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

    def written(self, slots):
        """Which tokens' rows are written, any framework's int array: ``0 <= slot < pool_size`` (a negative slot
        skips its token; one past the pool is masked, never written, as on a GPU nothing checks it). The array
        paths mask with this; the Triton kernel with its ``pool_size`` argument (Launch: this geometry's); the
        host check (checks/values.py) raises for slots past ``pool_size``."""
        return (slots >= 0) & (slots < self.pool_size)

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
    else:  # HND, and the tiled layouts' shape
        pages, heads, page_size, dim = shape
    return PoolGeometry(layer, kv_layout, headed, num_layers, pages, page_size, heads, dim)


def paged_view(pool, geom: PoolGeometry):
    """``pool`` as a 4-D NHD view of the layer written: ``[num_pages, page_size, num_heads, dim]``."""
    assert geom.kv_layout not in TILED, "a tiled pool has no 4-D view: write it through write_at"
    p = pool if geom.layer is None else pool[geom.layer]
    if not geom.headed:
        p = p[..., None, :]
    if geom.kv_layout is None:
        return p[:, None]
    if geom.kv_layout == "HND":
        return p.swapaxes(1, 2)
    return p


def tiled_view(pool, geom: PoolGeometry, which: int):
    """A tiled pool (``which``: 0 the k pool, 1 the v pool) of the layer written, as the 6-D torch view
    ``[num_pages, page_size // tt, tt, num_heads, dim // td, td]``: row r, feature d of a head are at
    ``[page, r // tt, r % tt, head, d // td, d % td]``. Each (page, head) block must be one contiguous run
    (checks/pools.py: ``check_tiled``)."""
    tt, td, token_major = TILED[geom.kv_layout][which]
    p = pool if geom.layer is None else pool[geom.layer]
    pages, heads, rows, dim = p.shape
    if token_major:  # the block as [rows / tt, dim / td, tt, td]
        return p.flatten(-2).unflatten(-1, (rows // tt, dim // td, tt, td)).permute(0, 2, 4, 1, 3, 5)
    return p.flatten(-2).unflatten(-1, (dim // td, rows // tt, td, tt)).permute(0, 3, 5, 1, 2, 4)


def write_at(pool, geom: PoolGeometry, which: int, page, row, rows):
    """``(view, index, values)`` with ``view[index] = values`` writing ``rows [n, heads, dim]`` at (page, row)
    of ``pool`` (``which``: 0 the k pool, 1 the v pool) in any layout (torch)."""
    if geom.kv_layout not in TILED:
        return paged_view(pool, geom), (page, row), rows
    tt, td, _ = TILED[geom.kv_layout][which]
    return tiled_view(pool, geom, which), (page, row // tt, row % tt), rows.unflatten(-1, (-1, td))


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
