"""DeepSeek V3.2's two quantized caches (DeepSeek Sparse Attention): their byte formats and checks.

- ``fp8_ds_mla`` (vLLM's ``kv_cache_dtype``, FlashMLA's sparse format): one 656-byte row per token:
  the 512 features of kv_c as float8_e4m3 in four tiles of 128, each tile divided by its own scale
  ``max(amax(|tile|) / 448, FLT_MIN)``; the four float32 scales; the 64 rotated k_pe features in
  the inputs' 16-bit dtype, not quantized.
- The lightning indexer's key cache: each key ``[128]`` as float8_e4m3 divided by
  ``max(amax, 1e-4) / 448`` (float32), optionally rounded up to a power of two (``ue8m0``); in each
  page the keys of its rows first, then their float32 scales.

The semantics are vLLM's writers, read from vllm-project/vllm csrc/libtorch_stable/cache_kernels.cu
at 37cb21c1695d11baba8e369b071d2f44c1561c8f (concat_and_cache_ds_mla_kernel,
indexer_k_quant_and_cache_kernel); docs/layouts.md draws the bytes. The checks here read only
shapes and dtype names, so the NumPy oracle, PyTorch and MLX share them.
"""
from __future__ import annotations

from ..core.dtypes import dtype_name, framework_of
from ..errors import RopePoolError
from .refusals import refuse

E4M3_MAX = 448.0  # the writers divide amax by it (kFp8ScaleDivisor; 224 only on ROCm's fnuz gfx942)

# fp8_ds_mla: one row of a token
DS_MLA_RANK = 512  # kv_lora_rank: 512 float8 values
DS_MLA_TILE = 128  # features per scale
DS_MLA_TILES = DS_MLA_RANK // DS_MLA_TILE
DS_MLA_PE = 64  # rope_dim: 64 16-bit features
DS_MLA_SCALES_AT = DS_MLA_RANK  # byte offset of the four float32 scales
DS_MLA_PE_AT = DS_MLA_SCALES_AT + 4 * DS_MLA_TILES  # 528: byte offset of k_pe
DS_MLA_ROW = DS_MLA_PE_AT + 2 * DS_MLA_PE  # 656 bytes

# the indexer's key cache
INDEXER_GROUP = 128  # values per scale: vLLM's kernel reduces one warp's 32 x 4 values
INDEXER_SCALE_FLOOR = 1e-4  # amax below it quantizes as if it were 1e-4 (float32)
SCALE_FMTS = (None, "ue8m0")


def indexer_row_bytes(head_dim: int) -> int:
    """Bytes per token of the indexer cache: the fp8 values and one float32 per group."""
    return head_dim + 4 * (head_dim // INDEXER_GROUP)


def _last(x) -> int:
    return x.shape[-1]


CACHE_FORMATS = (None, "fp8_ds_mla")


def ds_mla_kpe(op: str, cache_format, ckv_cache, kpe_cache, kv_c, k_pe, scale):
    """rope_latent_fused with ``cache_format``: the arguments checked, and the k_pe part of the caller's
    ``[..., 656]`` cache as a view in k_pe's dtype (the call's kpe cache), or None where the arrays are not
    torch tensors (validation then says what they are)."""
    if cache_format not in CACHE_FORMATS:
        raise RopePoolError(f"{op} cache_format must be None or 'fp8_ds_mla'; got {cache_format!r}. Fix: None "
                            "writes the caches as given (bf16, fp8 with scale=); 'fp8_ds_mla' writes DeepSeek "
                            "V3.2's 656-byte rows.")
    if kpe_cache is not None:
        raise RopePoolError(f"{op} with cache_format='fp8_ds_mla' writes k_pe inside each row: kpe_cache must be "
                            f"None; got a {dtype_name(kpe_cache)} array. Fix: pass the one [..., 656] uint8 cache "
                            "as ckv_cache and kpe_cache=None.")
    if scale is not None:
        raise RopePoolError(f"{op} with cache_format='fp8_ds_mla' computes a scale per tile of 128: scale= must be "
                            "None; got a scale. Fix: drop scale=.")
    if framework_of(ckv_cache) is None or framework_of(kv_c) is None or framework_of(k_pe) is None:
        return None
    check_ds_mla(kv_c, k_pe, ckv_cache)
    if framework_of(ckv_cache) != "torch":
        refuse(framework_of(ckv_cache), "pool.fp8_ds_mla")  # MLX: no views of a byte row
        return None
    if ckv_cache.stride(-1) != 1:
        raise RopePoolError(f"{op} expects each 656-byte fp8_ds_mla row to be contiguous; got a last-dim stride of "
                            f"{ckv_cache.stride(-1)}. Fix: pass the cache (or a view of whole rows) as allocated.")
    return ckv_cache[..., DS_MLA_PE_AT:].view(k_pe.dtype)


def check_ds_mla(kv_c, k_pe, kv_cache) -> None:
    """Rows of ``fp8_ds_mla``: 512 + 64 features in a 16-bit dtype, a uint8 cache of 656-byte rows."""
    if dtype_name(kv_cache) != "uint8" or _last(kv_cache) != DS_MLA_ROW:
        raise RopePoolError(f"fp8_ds_mla rows must be uint8 [..., {DS_MLA_ROW}] (512 fp8 values, 4 float32 scales, "
                            f"64 16-bit k_pe features); got {dtype_name(kv_cache)} with last dim {_last(kv_cache)}. "
                            f"Fix: allocate the cache as vLLM does, torch.zeros(num_blocks, block_size, "
                            f"{DS_MLA_ROW}, dtype=torch.uint8).")
    if _last(kv_c) != DS_MLA_RANK or _last(k_pe) != DS_MLA_PE:
        raise RopePoolError(f"fp8_ds_mla needs kv_lora_rank {DS_MLA_RANK} and rope_dim {DS_MLA_PE}; got kv_c with "
                            f"{_last(kv_c)} and k_pe with {_last(k_pe)} features. Fix: this format is DeepSeek "
                            "V3.2's; other latent sizes use bfloat16 or fp8 caches with scale=.")
    if dtype_name(kv_c) not in ("float16", "bfloat16"):
        raise RopePoolError(f"fp8_ds_mla stores k_pe in the inputs' 16-bit dtype; got {dtype_name(kv_c)}. Fix: "
                            "pass float16 or bfloat16 q_pe, k_pe and kv_c.")


def check_indexer(op: str, k, k_cache, quant_block_size, scale_fmt) -> None:
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


def check_indexer_pages(op: str, k_cache, page_size: int) -> None:
    """Torch: each page's bytes in one run, as vLLM's kernel addresses them (``block * block_size * row``)."""
    row = k_cache.shape[-1]
    if k_cache.stride(-1) != 1 or (page_size > 1 and k_cache.stride(-2) != row):
        raise RopePoolError(f"{op} expects each page of the indexer cache to be contiguous (its values, then its "
                            f"scales); got strides {tuple(k_cache.stride())}. Fix: pass the cache as allocated, "
                            f"[num_blocks, block_size, {row}] uint8 in one piece per block.")
