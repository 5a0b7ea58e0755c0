"""rope_pool_fused and rope_latent_fused: validate, plan, run."""
from __future__ import annotations

from typing import Any

from . import plan
from .checks import dsa, validate
from .checks.blocks import first_array, parts_layout
from .errors import OtherLayout

Array = Any  # a torch.Tensor or an mx.array


def _runner(scalars: tuple, seen: tuple, arrays: tuple, q, backend, call):
    """Every entry point's first call of a layout (``plan.lookup`` found no runner): plan the checked ``call``,
    pick its backend, bind it to ``arrays`` and remember it for calls whose ``seen`` arrays are laid out alike.
    (The check is the caller's, done before: deferring it in a closure would cost a warm call ~1 us.)"""
    run = plan.make(call, q, backend).bind(*arrays)
    plan.remember(scalars, seen, call, run)
    return run


def rope_pool_fused(q: Array, k: Array, v: Array, positions: Array, slots: Array, k_pool: Array, v_pool: Array, *,
                    head_dim: int, num_qo_heads: int, num_kv_heads: int, rope_base: float = 10000.0,
                    rope=None, layer: int | None = None, k_scale=None, v_scale=None, kv_layout: str | None = None,
                    q_out: Array | None = None, k_out: Array | None = None, backend: str | None = None,
                    qk_norm=None, q_scale=None, k_out_scale=None, k_scale_cache: Array | None = None,
                    v_scale_cache: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """Rotate q and k (RoPE) and write the rotated k and v into the KV pools at ``slots``.

    The contract (every argument and what it promises): docs/api.md.

    Parameters
    ----------
    q : [num_tokens, num_qo_heads, head_dim], float16 / bfloat16 / float32
    k, v : [num_tokens, num_kv_heads, head_dim], q's dtype
        Any token and head stride (views of a fused QKV projection are read
        in place); the last dim must be contiguous.
    positions : [num_tokens] (MRoPE: or [3, num_tokens]), int32 or int64
    slots : [num_tokens], int32 or int64
        Pool row of each token; a slot < 0 skips that token's pool write.
    k_pool, v_pool : the KV cache
        ``[pool_size, num_kv_heads, head_dim]`` (the seed's layout);
        ``[num_layers, ...]`` of it with ``layer=``; with ``kv_layout="NHD"``
        ``[num_pages, page_size, num_kv_heads, head_dim]`` and with ``"HND"``
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (slot =
        page * page_size + row); with ``"amx"`` the HND shape, each (page, head)
        block packed as vLLM's CPU AMX cache (docs/layouts.md). q's dtype, or float8 with scales (MLX: uint8
        holding e4m3, as ``mx.to_fp8`` stores it). A block-quantized cache is
        the tuple of its arrays, each in that layout with its own last dim:
        NVFP4 ``(data, block_scales)`` (k_scale / v_scale: its global decode
        scales) or mlx-lm's affine ``(words, scales, biases)``; returned as tuples.
    head_dim, num_qo_heads, num_kv_heads : int
    rope_base : float
        The RoPE base of plain NeoX RoPE; ignored in favour of ``rope``.
    rope : RopeSpec or CosSinCache, optional
        Describes the rotation completely (partial, GPT-J, scaled variants,
        MRoPE, no RoPE), or hands over the engine's own cos/sin table.
    layer : int, optional
        The layer of a layer-stacked pool to write (through a view); negative
        counts from the end.
    k_scale, v_scale : float, one-element or [num_kv_heads] float32 tensor
        fp8 pools store ``value / scale``, saturated to the format's range.
    kv_layout : {None, "NHD", "HND", "amx"}
    q_out, k_out : torch.Tensor, optional
        Where to write q_rot and k_rot (may be q and k themselves); float8
        with ``q_scale`` / ``k_out_scale`` to receive ``x_rot / scale``.
    backend : {None, "triton", "torch", "mlx"}
        None chooses the fastest that can run (``ropepool env`` says why).
    qk_norm : QKNorm, optional
        Per-head RMS norm of q and k before (or after) the rotation.
    q_scale, k_out_scale : float or one-element float32 tensor
        With float8 ``q_out`` / ``k_out``.
    k_scale_cache, v_scale_cache : torch.Tensor, optional
        Per-token-head dynamic scales, vLLM's ``int8_per_token_head`` /
        ``fp8_per_token_head``: float32, shaped like the pools without their
        last dim (any strides), pools int8 / float8. Each written (slot, head)
        row stores ``row * (1 / s)``, saturated (int8: truncated), with
        ``s = max(amax(|row|) / QMAX, 1e-6)`` stored at the same place of the
        scale cache (docs/layouts.md). Not with k_scale / v_scale.

    Returns
    -------
    q_rot, k_rot, k_pool, v_pool
        PyTorch: new q_rot and k_rot (or q_out, k_out) and the same pool
        objects, updated in place. MLX: new arrays; the pools are donated
        (rebind your names to the returned ones).

    Raises
    ------
    ValueError (ropepool.RopePoolError)
        Shapes, dtypes, layouts; slot and position values where checking
        needs no device sync. Raised before anything is written.
    TypeError
        Non-array arguments, mixed frameworks or devices.

    Notes
    -----
    NeoX RoPE by default: pairs ``(x[i], x[i + d/2])``; angle
    ``float32(p) * float32(inv_freq)``, cos/sin and the rotation in float32,
    one cast back at the end. On CUDA out-of-range slots are skipped, never
    written; call ``ropepool.validate_slots`` to have them raise.

    Examples
    --------
    >>> import torch, ropepool
    >>> T, Hq, Hkv, D = 3, 4, 2, 64
    >>> q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
    >>> k_pool, v_pool = torch.zeros(16, Hkv, D), torch.zeros(16, Hkv, D)
    >>> q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
    ...     q, k, v, torch.tensor([0, 1, 2]), torch.tensor([5, -1, 7]), k_pool, v_pool,
    ...     head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    >>> bool((k_pool[5] == k_rot[0]).all()), bool((k_pool[6] == 0).all())
    (True, True)
    """
    arrays = (q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    scalars = plan.pool_key(head_dim, num_qo_heads, num_kv_heads, rope_base, rope, layer, k_scale, v_scale, kv_layout,
                            q_out, k_out, backend, qk_norm, q_scale, k_out_scale, k_scale_cache, v_scale_cache, q, k)
    seen = arrays
    if type(k_pool) is tuple or type(v_pool) is tuple:
        # Block-quantized pools: the layout cache guards their first arrays and keys the others' layouts.
        seen = arrays[:5] + (first_array(k_pool), first_array(v_pool)) + arrays[7:]
        scalars += (parts_layout(k_pool, v_pool),)
    run = plan.lookup(scalars, seen)
    if run is not None:
        try:
            return run(*arrays)
        except OtherLayout:  # a runner found by the key alone, whose kernel saw another layout: nothing done
            run = plan.lookup(scalars, seen, fast=False)
    if run is None:
        run = _runner(scalars, seen, arrays, q, backend, validate.check(
            q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, rope_base=rope_base, rope=rope, layer=layer, k_scale=k_scale, v_scale=v_scale,
            kv_layout=kv_layout, q_out=q_out, k_out=k_out, qk_norm=qk_norm, q_scale=q_scale, k_out_scale=k_out_scale,
            k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache))
    return run(*arrays)


def rope_latent_fused(q_pe: Array, k_pe: Array, kv_c: Array, positions: Array, slots: Array, ckv_cache: Array,
                      kpe_cache: Array | None, *, rope, kv_layout: str | None = None, layer: int | None = None,
                      scale=None, q_pe_out: Array | None = None, backend: str | None = None,
                      cache_format: str | None = None) -> tuple[Array, Array, Array, Array | None]:
    """The latent cache of multi-head latent attention (DeepSeek V2/V3, Kimi K2): rotate q_pe and k_pe,
    write kv_c and the rotated k_pe at ``slots``. The contract: docs/api.md.

    Parameters
    ----------
    q_pe : [num_tokens, num_heads, rope_dim]
    k_pe : [num_tokens, rope_dim] (or [num_tokens, 1, rope_dim]): one head shared by all
    kv_c : [num_tokens, kv_lora_rank], the normalised latent (not rotated)
    positions, slots : as rope_pool_fused
    ckv_cache : [pool_size, kv_lora_rank], paged [num_pages, page_size, kv_lora_rank] with
        ``kv_layout="NHD"``, layer-stacked with ``layer=``
    kpe_cache : the same with rope_dim features. vLLM's combined ``[..., kv_lora_rank + rope_dim]``
        row is passed as the two column views ``cache[..., :kv_lora_rank]``, ``cache[..., kv_lora_rank:]``.
    rope : RopeSpec or CosSinCache rotating the whole rope_dim (DeepSeek: ``from_hf_config``
        gives GPT-J pairs and YaRN with mscale)
    scale : float or one-element float32 tensor; required for fp8 caches, which store value / scale
    q_pe_out : torch.Tensor, optional; may be q_pe (in place)
    cache_format : {None, "fp8_ds_mla"}
        ``"fp8_ds_mla"``: DeepSeek V3.2's (vLLM's ``kv_cache_dtype``) rows. ckv_cache is the one uint8
        ``[..., 656]`` cache and kpe_cache None; each row gets kv_c as e4m3 in 4 tiles of 128 with their
        float32 scales (``max(amax / 448, FLT_MIN)``) and the rotated k_pe in q_pe's 16-bit dtype
        (docs/layouts.md). Torch tensors.

    Returns
    -------
    q_pe_rot, k_pe_rot (k_pe's shape), ckv_cache, kpe_cache
        As rope_pool_fused: torch caches in place, MLX caches donated. With fp8_ds_mla,
        kpe_cache is None.

    Notes
    -----
    Pairs stay in place, as vLLM and FlashInfer store them; transformers'
    ``apply_rotary_pos_emb_interleave`` returns the same values with each
    head's features permuted (evens, then odds).
    """
    arrays = given = (q_pe, k_pe, kv_c, positions, slots, kpe_cache, ckv_cache, q_pe_out, None)
    scalars = plan.latent_key(rope, kv_layout, layer, scale, q_pe_out, backend, cache_format, q_pe)
    if cache_format is not None:  # one [..., 656] cache: the call's kpe cache is a view of its k_pe part
        kpe_cache = dsa.ds_mla_kpe("rope_latent_fused", cache_format, ckv_cache, kpe_cache, kv_c, k_pe, scale)
        arrays = given[:5] + (kpe_cache,) + given[6:]
    run, out = plan.lookup(scalars, given), None
    if run is not None:
        try:
            out = run(*arrays)
        except OtherLayout:  # as rope_pool_fused's
            run = plan.lookup(scalars, given, fast=False)
    if run is None:
        run = _runner(scalars, given, arrays, q_pe, backend, validate.check_latent(
            q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, rope=rope, kv_layout=kv_layout, layer=layer,
            scale=scale, q_pe_out=q_pe_out, cache_format=cache_format))
    q_rot, k_rot, kpe, ckv = run(*arrays) if out is None else out
    return q_rot, k_rot, ckv, given[5] if cache_format is not None else kpe


def rope_indexer_fused(q: Array, k: Array, positions: Array, slots: Array, k_cache: Array, *, rope,
                       scale_fmt: str | None = None, quant_block_size: int = 128, kv_layout: str | None = None,
                       layer: int | None = None, q_out: Array | None = None,
                       backend: str | None = None) -> tuple[Array, Array, Array]:
    """DeepSeek V3.2's lightning-indexer key cache: rotate q and k, write k quantized at ``slots``, as vLLM's
    ``indexer_k_quant_and_cache`` writes it. The contract: docs/api.md; the bytes: docs/layouts.md.

    Parameters
    ----------
    q : [num_tokens, num_heads, head_dim] (DeepSeek V3.2: 64 heads of 128)
    k : [num_tokens, head_dim] (or [num_tokens, 1, head_dim]): one key per token, q's dtype
    positions, slots : as rope_pool_fused
    k_cache : uint8 ``[num_blocks, block_size, head_dim + 4 * head_dim // 128]`` with ``kv_layout="NHD"``
        (vLLM's layout; each block contiguous), ``[pool_size, row]`` flat, layer-stacked with ``layer=``
    rope : RopeSpec or CosSinCache; V3.2's indexer rotates NeoX pairs of the first 64 features
        (``RopeSpec(head_dim=128, rotary_dim=64, ...)`` with the model's scaling)
    scale_fmt : {None, "ue8m0"}
        Each group of 128 stores ``x / s``, ``s = max(amax, 1e-4) / 448`` (float32); ``"ue8m0"`` rounds
        s up to a power of two, as DeepSeek V3.2 does.
    quant_block_size : 128, the only group size of the format
    q_out : torch.Tensor, optional; may be q (in place)

    Returns
    -------
    q_rot, k_rot (k's shape), k_cache
        k_cache updated in place. Torch tensors (the Triton kernel on CUDA, the torch path anywhere).
    """
    given = (q, k, None, positions, slots, k_cache, None, q_out, None)  # no value, no v pool
    scalars = plan.indexer_key(rope, scale_fmt, quant_block_size, kv_layout, layer, q_out, backend, q)
    arrays = (q, k, k, positions, slots, k_cache, k_cache, q_out, None)  # the runner's: v's store is "none"
    run = plan.lookup(scalars, given)
    if run is None:
        run = _runner(scalars, given, arrays, q, backend, validate.check_indexer(
            q, k, positions, slots, k_cache, rope=rope, scale_fmt=scale_fmt, quant_block_size=quant_block_size,
            kv_layout=kv_layout, layer=layer, q_out=q_out))
    q_rot, k_rot, cache, _ = run(*arrays)
    return q_rot, k_rot, cache
