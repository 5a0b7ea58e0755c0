"""What is torch's own: q/k/v as views of a fused QKV projection (read in place), q_out / k_out
(new, strided, in place). On the "torch" and "triton" backends; checks as tests.harness.run_checked.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool.checks import validate  # noqa: E402
from tests.harness import (  # noqa: E402
    assert_same_bits,
    backend_for,
    crossed,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
)


@pytest.fixture(params=["torch", "triton"])
def tbackend(request):
    """The backend fixture's torch backends (views and q_out / k_out are torch's)."""
    return backend_for(request.param, big=request.node.get_closest_marker("big") is not None)


@pytest.mark.parametrize("layout,in_place,dtype", crossed([
    pytest.param(layout, in_place, id=f"{layout}-{'in-place' if in_place else 'new-out'}")
    for layout in ("packed", "padded", "kv-interleaved") for in_place in (False, True)]))
def test_fused_qkv_views(tbackend, layout, in_place, dtype, rng):
    """q/k/v as views of one projection output, read (and with in-place, written) where they are."""
    X = tbackend
    T, Hq, Hkv, D, P = 7, 5, 2, 64, 16
    pad = 24 if layout == "padded" else 0
    qkv = X.array(randn(rng, T, (Hq + 2 * Hkv) * D + pad, dtype=dtype))
    if layout == "kv-interleaved":  # [q heads | (k, v) per kv head]
        q = qkv[:, : Hq * D].view(T, Hq, D)
        kv = qkv[:, Hq * D:].view(T, Hkv, 2, D)
        k, v = kv[:, :, 0], kv[:, :, 1]
        assert k.stride() == ((Hq + 2 * Hkv) * D, 2 * D, 1)
    else:
        q, k, v = (x.view(T, h, D) for x, h in zip(qkv[:, : (Hq + 2 * Hkv) * D].split(
            [Hq * D, Hkv * D, Hkv * D], dim=-1), (Hq, Hkv, Hkv)))
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
    qkv0 = X.numpy(qkv)
    slots = make_slots(rng, T, P)
    outs = dict(q_out=q, k_out=k) if in_place else {}
    res = run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, dtype, P, Hkv, D), slots),
                      **outs)
    # Outside q (and k, in place) the projection buffer is untouched: v, padding.
    want = qkv0.copy()
    if in_place:
        want[:, : Hq * D] = X.numpy(res.q_rot).reshape(T, Hq * D)
        k_rot = X.numpy(res.k_rot)
        if layout == "kv-interleaved":
            want[:, Hq * D:].reshape(T, Hkv, 2, D)[:, :, 0] = k_rot
        else:
            want[:, Hq * D: (Hq + Hkv) * D] = k_rot.reshape(T, Hkv * D)
    assert_same_bits("the fused qkv buffer", X.numpy(qkv), want)


@pytest.mark.parametrize("outs,dtype", crossed(["q_out", "k_out", "both", "strided-both", "in-place-q",
                                                "in-place-both"]))
def test_q_out_k_out(tbackend, dtype, outs, rng):
    """Outputs NaN-filled beforehand must be fully written, and nothing outside them."""
    X = tbackend
    T, Hq, Hkv, D, P = 5, 3, 2, 80, 16
    q, k, v = (X.array(randn(rng, T, h, D, dtype=dtype)) for h in (Hq, Hkv, Hkv))
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=q.dtype, device=X.device)  # noqa: E731
    q_buf, k_buf = nan(T, Hq + 1, D), nan(T, Hkv + 1, D)
    kw = {
        "q_out": dict(q_out=nan(T, Hq, D)),
        "k_out": dict(k_out=nan(T, Hkv, D)),
        "both": dict(q_out=nan(T, Hq, D), k_out=nan(T, Hkv, D)),
        "strided-both": dict(q_out=q_buf[:, 1:], k_out=k_buf[:, :Hkv]),
        "in-place-q": dict(q_out=q),
        "in-place-both": dict(q_out=q, k_out=k),
    }[outs]
    slots = make_slots(rng, T, P)
    run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, dtype, P, Hkv, D), slots), **kw)
    if outs == "strided-both":  # the heads outside the output views stay NaN
        assert np.isnan(X.numpy(q_buf[:, 0]).astype(np.float32)).all()
        assert np.isnan(X.numpy(k_buf[:, Hkv]).astype(np.float32)).all()


@pytest.mark.parametrize("first", [1, 9], ids=["first-T1", "first-T9"])
def test_layout_cache_across_token_counts(tbackend, first, rng):
    """One fused-QKV layout called with one token, then more (and the reverse): a layout's later calls
    must not reuse anything of the first call's token count. A one-token view of a projection is dense,
    so tensors made like it would keep its token stride (the bug this catches wrote q_rot past its end)."""
    X = tbackend
    Hq, Hkv, D, P = 3, 1, 64, 32
    ropepool_plan = pytest.importorskip("ropepool.plan")
    ropepool_plan.forget()
    for T in (first, 10 - first, 5):
        W = (Hq + 2 * Hkv) * D
        qkv = X.array(randn(rng, T, W, dtype="bfloat16"))
        # Slices keep the projection's token stride even at T = 1 (view() would renumber it there).
        q, k, v = (qkv[:, a:].as_strided((T, h, D), (W, D, 1)) for a, h in ((0, Hq), (Hq * D, Hkv),
                                                                               ((Hq + Hkv) * D, Hkv)))
        assert q.stride(0) == W
        slots = make_slots(rng, T, P, skip_every=0)
        res = run_checked(X, q, k, v, make_positions(rng, T), slots,
                          poison(make_cache(rng, "bfloat16", P, Hkv, D), slots))
        assert res.q_rot.is_contiguous() and res.k_rot.is_contiguous()


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_large_calls_split_big_tiles(style, monkeypatch, rng):
    """Above small_tokens a token's heads go to one program unless the fused norm's q tile would pass
    32 x 128 features: (64, 8) heads of 128 with the norm are split over two programs, each writing its
    half of the KV heads; without the norm they stay whole."""
    X = backend_for("triton")
    ropepool_plan = pytest.importorskip("ropepool.plan")
    from ropepool.backends import triton_op
    T, Hq, Hkv, D, P = 5, 64, 8, 128, 16
    q, k, v = (X.array(randn(rng, t, h, D, dtype="bfloat16")) for t, h in ((T, Hq), (T, Hkv), (T, Hkv)))
    slots = make_slots(rng, T, P)
    rope = ropepool.RopeSpec(head_dim=D, style=style)
    norm = ropepool.QKNorm(rng.standard_normal(D).astype(np.float32), None, weight_offset=1.0)
    cache = poison(make_cache(rng, "bfloat16", P, Hkv, D), slots)
    cache.owners = [X.array(o) for o in cache.owners]
    args = (q, k, v, X.array(make_positions(rng, T)), X.array(slots), *cache.pools())
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope)
    assert triton_op.large_split(validate.check(*args, **kw)) == 1
    assert triton_op.large_split(validate.check(*args, **kw, qk_norm=X.norm(norm))) == 2
    monkeypatch.setattr(ropepool_plan, "DEFAULT_TUNING", ropepool_plan.Tuning(small_tokens=0))  # every T is large
    ropepool_plan.forget()
    try:
        run_checked(X, q, k, v, make_positions(rng, T), slots, cache, rope=rope, qk_norm=norm)
    finally:
        ropepool_plan.forget()
