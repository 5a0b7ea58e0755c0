"""DeepSeek V3.2's two stores (``ropepool.checks.dsa``) as array math on torch tensors and MLX arrays.

The float32 steps of vLLM's writers, in their order (``ropepool.reference.dsa`` is the float64
oracle that rounds where they round): scales by IEEE float32 division, values ``x / s`` saturated
and rounded to e4m3, nearest even. Each function takes the rows as the cache receives them and
returns bytes (uint8); where they go in the cache is ``indexer_at`` and the views of ``put``. ``ops``
is the framework's adapter (``torch_arrays.TorchOps``, ``mlx_arrays.MlxOps``).
"""
from __future__ import annotations

from ..checks import dsa
from ..core.layout import paged_view

FLT_MIN = 1.1754943508222875e-38  # float32's smallest normal: the floor of an fp8_ds_mla tile scale


def ds_mla_head(kv_c, ops):
    """The first 528 bytes of the fp8_ds_mla rows of ``kv_c [N, 512]``: its e4m3 values, then the 4 scales."""
    n = kv_c.shape[0]
    tiles = ops.f32(kv_c).reshape(n, dsa.DS_MLA_TILES, dsa.DS_MLA_TILE)
    scale = ops.maximum(ops.absmax_last(tiles) / ops.scalar(dsa.E4M3_MAX, kv_c), ops.scalar(FLT_MIN, kv_c))
    values = ops.to_e4m3(tiles / scale[..., None]).reshape(n, dsa.DS_MLA_RANK)
    return ops.cat([values, ops.bytes_of(scale)], -1)


def ds_mla_rows(kv_c, k_pe, ops):
    """``[N, 656]`` uint8 rows of ``kv_c [N, 512]`` and the rotated ``k_pe [N, 64]`` (both 16-bit)."""
    return ops.cat([ds_mla_head(kv_c, ops), ops.bytes_of(k_pe.reshape(kv_c.shape[0], dsa.DS_MLA_PE))], -1)


def indexer_rows(k, ue8m0: bool, ops):
    """The indexer key ``k [N, D]`` as ``(e4m3 bytes [N, D], scale bytes [N, 4 * D // 128])``."""
    n, d = k.shape
    groups = ops.f32(k).reshape(n, d // dsa.INDEXER_GROUP, dsa.INDEXER_GROUP)
    amax = ops.maximum(ops.absmax_last(groups), ops.scalar(dsa.INDEXER_SCALE_FLOOR, k))  # fmaxf(amax, 1e-4f)
    scale = amax / ops.scalar(dsa.E4M3_MAX, k)
    if ue8m0:
        scale = ops.exp2(ops.ceil(ops.log2(scale)))
    return ops.to_e4m3(groups / scale[..., None]).reshape(n, d), ops.bytes_of(scale)


def indexer_at(row, head_dim: int, page_size: int, ops):
    """Byte offsets in their page of the values ``[N, D]`` and scales ``[N, 4 * D // 128]`` of rows ``row``:
    a page holds its rows' values, row by row, then their scales (docs/layouts.md)."""
    groups = 4 * (head_dim // dsa.INDEXER_GROUP)
    values = row[:, None] * head_dim + ops.arange(head_dim, row)
    scales = page_size * head_dim + row[:, None] * groups + ops.arange(groups, row)
    return values, scales


def put_ds_mla_head(cache, geom, page, row, kv_c, ops):
    """Torch: kv_c's values and scales into the first 528 bytes of the cache rows (page, row) of the layout
    ``geom`` (through views, in place; the rest of each row is the k pool's)."""
    head = ds_mla_head(kv_c, ops)
    paged_view(cache[..., :head.shape[1]], geom).index_put_((page, row, row * 0), head)


def put_indexer(cache, geom, page, row, values, scales, ops):
    """Torch: the quantized keys and their scale bytes into pages ``page`` at rows ``row`` (docs/layouts.md)."""
    rows = paged_view(cache, geom)[..., 0, :]  # [num_pages, page_size, row bytes]: a page, byte by byte
    width = rows.shape[-1]
    for at, data in zip(indexer_at(row, values.shape[1], geom.page_size, ops), (values, scales)):
        rows.index_put_((page[:, None], at // width, at % width), data)


FORMATS = ("fp8_ds_mla", "indexer", "indexer_ue8m0", "none")  # the stores.FORMATS written here


def put(fmt, pool, geom, page, row, rows, ops):
    """Torch: the store ``fmt`` of ``rows [N, D]`` (the call's rows written) into ``pool``, in place. ``ops``:
    ``TorchOps``."""
    if fmt == "fp8_ds_mla":
        put_ds_mla_head(pool, geom, page, row, rows, ops)
    elif fmt != "none":
        put_indexer(pool, geom, page, row, *indexer_rows(rows, fmt == "indexer_ue8m0", ops), ops)

