"""DeepSeek V3.2's lightning-indexer key cache (DeepSeek Sparse Attention), as vLLM writes it.

Each key ``[128]`` as float8_e4m3 divided by ``max(amax, 1e-4) / 448`` (float32), optionally rounded up to a
power of two (``ue8m0``: the format ``indexer_ue8m0``); in each page the keys of its rows first, then their
float32 scales. The semantics are vLLM's writer, read from vllm-project/vllm
csrc/libtorch_stable/cache_kernels.cu at 37cb21c1695d11baba8e369b071d2f44c1561c8f
(indexer_k_quant_and_cache_kernel); docs/layouts.md draws the bytes.

Here: the checks of the call's arguments and cache (``check``, ``check_pages``), the NumPy model
(``oracle_rows``, ``oracle_write``), the writer's float32 steps as array math (``rows``, ``offsets``, ``put``:
torch). The Triton kernel's store is ``backends/triton_stores.py: indexer_store``.
"""
from __future__ import annotations

import numpy as np

from ..core.dtypes import dtype_name
from ..core.layout import page_and_row, paged_view, pool_geometry
from ..errors import RopePoolError
from .e4m3 import E4M3_MAX, e4m3_bytes, f32_quotient

NAMES = ("indexer", "indexer_ue8m0")  # the scales as amax / 448, or rounded up to a power of two
MEANS = {"indexer": "the key as e4m3 in groups of 128, x / s with s = max(amax, 1e-4) / 448; per page the rows' "
                    "values, then their float32 scales (vLLM's indexer_k_quant_and_cache)",
         "indexer_ue8m0": "as indexer, each scale rounded up to a power of two (2 ** ceil(log2(s)))"}
BACKENDS = frozenset({".triton_op", ".torch_eager"})  # the rows that write it (MLX has no views of a byte row)

INDEXER_GROUP = 128  # values per scale: vLLM's kernel reduces one warp's 32 x 4 values
INDEXER_SCALE_FLOOR = 1e-4  # amax below it quantizes as if it were 1e-4 (float32)
SCALE_FMTS = (None, "ue8m0")  # rope_indexer_fused's scale_fmt=, one to each of NAMES


def name(scale_fmt) -> str:
    """The format of the call's ``scale_fmt`` (checked)."""
    return NAMES[SCALE_FMTS.index(scale_fmt)]


def indexer_row_bytes(head_dim: int) -> int:
    """Bytes per token of the indexer cache: the fp8 values and one float32 per group."""
    return head_dim + 4 * (head_dim // INDEXER_GROUP)


def _last(x) -> int:
    return x.shape[-1]


def check(op: str, k, k_cache, quant_block_size, scale_fmt) -> None:
    """An indexer-key write: head_dim a multiple of 128, groups of 128, a uint8 cache of its row size."""
    if scale_fmt not in SCALE_FMTS:
        raise RopePoolError(f"{op} scale_fmt must be None or 'ue8m0'; got {scale_fmt!r}. Fix: 'ue8m0' rounds each "
                            "scale up to a power of two (DeepSeek V3.2's indexer), None keeps amax / 448.")
    if quant_block_size != INDEXER_GROUP:
        raise RopePoolError(f"{op} quantizes the indexer key in groups of {INDEXER_GROUP} values; got "
                            f"quant_block_size={quant_block_size!r}. Fix: pass {INDEXER_GROUP} (vLLM's writer "
                            "takes one scale per 128 values, whatever group size it is given).")
    head_dim = _last(k)
    if head_dim % INDEXER_GROUP:
        raise RopePoolError(f"{op} expects the indexer key's head_dim to be a multiple of {INDEXER_GROUP}; got "
                            f"{head_dim}. Fix: pass the key of DeepSeek V3.2's indexer ([num_tokens, 128]).")
    row = indexer_row_bytes(head_dim)
    if dtype_name(k_cache) != "uint8" or _last(k_cache) != row:
        raise RopePoolError(f"the indexer cache must be uint8 [..., {row}] for head_dim {head_dim} ({head_dim} fp8 "
                            f"values and {row - head_dim} bytes of float32 scales a row); got "
                            f"{dtype_name(k_cache)} with last dim {_last(k_cache)}. Fix: allocate it as vLLM does, "
                            f"torch.zeros(num_blocks, block_size, {row}, dtype=torch.uint8).")


def check_pages(op: str, k_cache, page_size: int) -> None:
    """Torch: each page's bytes in one run, as vLLM's kernel addresses them (``block * block_size * row``)."""
    row = k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or (page_size > 1 and k_cache.stride(-2) != row):
        raise RopePoolError(f"{op} expects each page of the indexer cache to be contiguous (its values, then its "
                            f"scales); got strides {tuple(k_cache.stride())}. Fix: pass the cache as allocated, "
                            f"[num_blocks, block_size, {row}] uint8 in one piece per block.")


# --- the NumPy model (the oracle's) ------------------------------------------------------------------------

def oracle_rows(k, ue8m0: bool):
    """The indexer key ``k [T, D]`` (16-bit or float32) as e4m3 bytes ``[T, D]`` and float32 scales
    ``[T, D // 128]``: ``s = float32(max(amax, float32(1e-4)) / 448)``; with ue8m0
    ``2 ** ceil(float32(log2(s)))``, as ``exp2f(ceilf(log2f(s)))`` (a scale within a rounding step of
    log2 above a power of two stays that power)."""
    k = np.asarray(k)
    T, D = k.shape
    groups = k.astype(np.float64).reshape(T, D // INDEXER_GROUP, INDEXER_GROUP)
    amax = np.maximum(np.abs(groups).max(-1), np.float64(np.float32(INDEXER_SCALE_FLOOR)))
    scale = f32_quotient(amax, E4M3_MAX)
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)).astype(np.float32))).astype(np.float32)
    return e4m3_bytes(f32_quotient(groups, scale[..., None])).reshape(T, D), scale


def oracle_write(k_cache, slots, values, scales, kv_layout=None, layer=None):
    """A copy of ``k_cache`` with the quantized keys at ``slots``, where vLLM keeps them: each page of
    ``page_size`` rows holds, from its first byte, the ``page_size * D`` values of its rows (row by
    row), then their ``page_size * D / 128`` float32 scales. A flat cache is pages of one row."""
    cache = np.array(k_cache, copy=True)
    geom = pool_geometry(cache.shape, layer, kv_layout, headed=False)
    slots = np.asarray(slots)
    write = slots >= 0
    page, row = page_and_row(slots[write], geom.page_size)
    values, scales = np.asarray(values)[write], np.asarray(scales, dtype="<f4")[write]
    D, width = values.shape[1], geom.dim
    # Byte b of a page is at (row b // width, column b % width) of that page's [page_size, width] rows.
    at_value = row[:, None] * D + np.arange(D)
    at_scale = geom.page_size * D + row[:, None] * 4 * scales.shape[1] + np.arange(4 * scales.shape[1])
    view = paged_view(cache, geom)[..., 0, :]  # [num_pages, page_size, width]
    for at, data in ((at_value, values), (at_scale, scales.view(np.uint8).reshape(len(scales), -1))):
        view[page[:, None], at // width, at % width] = data
    return cache


# --- array math: torch tensors and MLX arrays ---------------------------------------------------------------

def rows(k, ue8m0: bool, ops):
    """The indexer key ``k [N, D]`` as ``(e4m3 bytes [N, D], scale bytes [N, 4 * D // 128])``."""
    n, d = k.shape
    groups = ops.f32(k).reshape(n, d // INDEXER_GROUP, INDEXER_GROUP)
    amax = ops.maximum(ops.absmax_last(groups), ops.scalar(INDEXER_SCALE_FLOOR, k))  # fmaxf(amax, 1e-4f)
    scale = amax / ops.scalar(E4M3_MAX, k)
    if ue8m0:
        scale = ops.exp2(ops.ceil(ops.log2(scale)))
    return ops.to_e4m3(groups / scale[..., None]).reshape(n, d), ops.bytes_of(scale)


def offsets(row, head_dim: int, page_size: int, ops):
    """Byte offsets in their page of the values ``[N, D]`` and scales ``[N, 4 * D // 128]`` of rows ``row``:
    a page holds its rows' values, row by row, then their scales (docs/layouts.md)."""
    groups = 4 * (head_dim // INDEXER_GROUP)
    values = row[:, None] * head_dim + ops.arange(head_dim, row)
    scales = page_size * head_dim + row[:, None] * groups + ops.arange(groups, row)
    return values, scales


def put_bytes(cache, geom, page, row, values, scales, ops):
    """Torch: the quantized keys and their scale bytes into pages ``page`` at rows ``row`` (docs/layouts.md)."""
    rows = paged_view(cache, geom)[..., 0, :]  # [num_pages, page_size, row bytes]: a page, byte by byte
    width = rows.shape[-1]
    for at, data in zip(offsets(row, values.shape[1], geom.page_size, ops), (values, scales)):
        rows.index_put_((page[:, None], at // width, at % width), data)


def put(fmt, cache, geom, page, row, k, ops):
    """Torch: the keys ``k [N, D]`` (the call's rows written) quantized as ``fmt`` into ``cache``, in place."""
    put_bytes(cache, geom, page, row, *rows(k, fmt == "indexer_ue8m0", ops), ops)
