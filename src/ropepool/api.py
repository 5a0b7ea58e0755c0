"""rope_pool_fused: validate, pick a backend, run it."""
from __future__ import annotations

from . import backends, validate


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
                    rope_base=10000.0, rope=None, layer=None, k_scale=None, v_scale=None, kv_layout=None,
                    q_out=None, k_out=None, backend=None):
    """Rotate q and k (RoPE) and write the rotated k and v into the KV pools at ``slots``.

    Parameters
    ----------
    q : [num_tokens, num_qo_heads, head_dim], float16 / bfloat16 / float32
    k, v : [num_tokens, num_kv_heads, head_dim], q's dtype
        Any token and head stride (views of a fused QKV projection are read
        in place); the last dim must be contiguous.
    positions : [num_tokens], int32 or int64
    slots : [num_tokens], int32 or int64
        Pool row of each token; a slot < 0 skips that token's pool write.
    k_pool, v_pool : the KV cache
        ``[pool_size, num_kv_heads, head_dim]`` (the seed's layout);
        ``[num_layers, ...]`` of it with ``layer=``; with ``kv_layout="NHD"``
        ``[num_pages, page_size, num_kv_heads, head_dim]`` and with ``"HND"``
        ``[num_pages, num_kv_heads, page_size, head_dim]`` (slot =
        page * page_size + row). q's dtype, or float8 with scales.
    head_dim, num_qo_heads, num_kv_heads : int
    rope_base : float
        The RoPE base of plain NeoX RoPE; ignored in favour of ``rope``.
    rope : RopeSpec, optional
        Describes the rotation completely (partial, GPT-J, scaled variants).
    layer : int, optional
        The layer of a layer-stacked pool to write (through a view).
    k_scale, v_scale : float or one-element float32 tensor, optional
        fp8 pools store ``value / scale``, saturated to the format's range.
    kv_layout : {None, "NHD", "HND"}
    q_out, k_out : torch.Tensor, optional
        Where to write q_rot and k_rot (may be q and k themselves).
    backend : {None, "triton", "torch", "mlx"}
        None chooses the fastest that can run (``ropepool env`` says why).

    Returns
    -------
    q_rot, k_rot, k_pool, v_pool
        PyTorch: new q_rot and k_rot (or q_out, k_out) and the same pool
        objects, updated in place. MLX: new arrays, inputs untouched.

    Raises
    ------
    ValueError (ropepool.RopePoolError)
        Shapes, dtypes, head counts, layouts; slot and position values where
        checking needs no device sync. Raised before anything is written.
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
    call = validate.cached(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                           (head_dim, num_qo_heads, num_kv_heads, rope_base, rope, layer, k_scale, v_scale, kv_layout))
    if call is None:
        call = validate.check(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
                              rope=rope, layer=layer, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout,
                              q_out=q_out, k_out=k_out)
    # A Call from validation's cache stands for one layout, so it keeps the pick.
    run = call.cache.get(("run", backend))
    if run is None:
        run = call.cache["run", backend] = backends.pick(call.framework, q, backend).load()
    return run(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
