"""The ``cache_format=`` argument of rope_latent_fused: DeepSeek V3.2's fp8_ds_mla rows (formats/fp8_ds_mla.py).

The format's own checks read only shapes and dtype names, so the NumPy oracle, PyTorch and MLX share them;
here the call's arguments around it, and the k_pe part of the cache as the call's kpe cache.
"""
from __future__ import annotations

from ..core.dtypes import dtype_name, framework_of
from ..errors import RopePoolError
from ..formats import fp8_ds_mla
from .refusals import refuse

CACHE_FORMATS = (None, fp8_ds_mla.NAME)


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
    fp8_ds_mla.check(kv_c, k_pe, ckv_cache)
    if framework_of(ckv_cache) != "torch":
        refuse(framework_of(ckv_cache), "pool.fp8_ds_mla")  # MLX: no views of a byte row
        return None
    if ckv_cache.stride(-1) != 1:
        raise RopePoolError(f"{op} expects each 656-byte fp8_ds_mla row to be contiguous; got a last-dim stride of "
                            f"{ckv_cache.stride(-1)}. Fix: pass the cache (or a view of whole rows) as allocated.")
    return ckv_cache[..., fp8_ds_mla.DS_MLA_PE_AT:].view(k_pe.dtype)
