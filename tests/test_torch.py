"""rope_pool_fused on PyTorch tensors against the float64 oracle.

Each case runs on two backends: "torch" (the eager path) and "triton" (the
fused kernel: on CUDA when there is a GPU, else under the Triton CPU
interpreter, which skips the cases marked torch_only as too slow for it).

Tolerance (tests/util.py TOL), max |out - ref| / max(1, |ref|) against the
float64 oracle: float32 2e-6, float16 1.5e-3, bfloat16 1.2e-2 (float32
arithmetic and sin/cos, then one rounding to the dtype). Exact, bit for bit:
each written pool row (the returned k_rot row and the given v row), every
other byte of the memory the pools live in, and q, k, v after the call.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

import ropepool
from ropepool import validate
from ropepool.backends import torch_eager
from tests.util import assert_close, assert_same_bits, heads, oracle, plant_poison, run_checked, shape_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float16, torch.bfloat16, torch.float32]
TORCH_ONLY = pytest.mark.torch_only


@pytest.fixture(params=FLOATS, ids=lambda d: str(d).rsplit(".", 1)[-1])
def dtype(request):
    return request.param


# --- inputs -----------------------------------------------------------------------------------

def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def qkv_inputs(gen, T, Hq, Hkv, D, dtype):
    return randn(gen, T, Hq, D, dtype=dtype), randn(gen, T, Hkv, D, dtype=dtype), randn(gen, T, Hkv, D, dtype=dtype)


def make_slots(T, P, gen, idx=torch.int64, skip_every=3):
    """Unique shuffled slots in [0, P); every skip_every-th token gets a (varied) negative slot."""
    slots = torch.randperm(P, generator=gen)[:T]
    if skip_every:
        lowest = torch.iinfo(idx).min
        negatives = torch.tensor([-1, -2, -P, lowest])
        skipped = slots[::skip_every]
        slots[::skip_every] = negatives.repeat(len(skipped))[: len(skipped)]
    return slots.to(DEVICE, idx)


def make_positions(T, gen, idx=torch.int64, high=1_000_000):
    return torch.randint(0, high + 1, (T,), generator=gen).to(DEVICE, idx)


def pools_for(gen, P, Hkv, D, dtype, slots):
    return [plant_poison(randn(gen, P, Hkv, D, dtype=dtype), slots) for _ in range(2)]


# --- shapes -----------------------------------------------------------------------------------

SHAPES = shape_params(big_marks=TORCH_ONLY)


@pytest.mark.parametrize("T,Hq,Hkv,D", SHAPES)
def test_matches_oracle(backend, dtype, T, Hq, Hkv, D, rng):
    idx = torch.int32 if T % 2 else torch.int64
    P = 2 * T + 7
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(T, P, rng, idx, skip_every=3 if T > 1 else 0)
    run_checked(backend, q, k, v, make_positions(T, rng, idx), slots, pools_for(rng, P, Hkv, D, dtype, slots),
                head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=500000.0)


@pytest.mark.parametrize("kind", ["repeated", "shuffled", "zero-and-1e6", "near-1e6", "near-2^24"])
def test_positions(backend, dtype, kind, rng):
    """Shuffled, repeated and large positions (the contract holds up to 2^24)."""
    T, Hq, Hkv, D, P = 24, 4, 2, 128, 40
    if kind == "repeated":
        pos = torch.randint(0, 10**6, (4,), generator=rng).repeat_interleave(6)
    elif kind == "shuffled":
        pos = torch.randperm(T, generator=rng) + int(torch.randint(0, 10**5, (), generator=rng))
    elif kind == "zero-and-1e6":
        pos = torch.tensor([0, 1_000_000]).repeat(T // 2)
    elif kind == "near-1e6":
        pos = torch.randint(999_000, 1_000_001, (T,), generator=rng)
    else:
        pos = torch.randint(2**24 - 10**4, 2**24 + 1, (T,), generator=rng)
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, dtype)
    if kind == "repeated":  # tokens 0-5 share a position: equal inputs there give equal outputs
        q[1:6], k[1:6] = q[0], k[0]
    slots = make_slots(T, P, rng)
    q_rot, k_rot = run_checked(backend, q, k, v, pos.to(DEVICE), slots, pools_for(rng, P, Hkv, D, dtype, slots),
                               **heads(q, k))
    if kind == "repeated":
        assert_same_bits("q_rot of equal rows at one position", q_rot[1:6], q_rot[0].expand(5, Hq, D))
        assert_same_bits("k_rot of equal rows at one position", k_rot[1:6], k_rot[0].expand(5, Hkv, D))


@pytest.mark.parametrize("pos_idx,slot_idx", [(torch.int32, torch.int32), (torch.int32, torch.int64),
                                              (torch.int64, torch.int32), (torch.int64, torch.int64)],
                         ids=["pos32-slot32", "pos32-slot64", "pos64-slot32", "pos64-slot64"])
def test_index_dtypes(backend, pos_idx, slot_idx, rng):
    T, Hq, Hkv, D, P = 13, 4, 2, 64, 20
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.bfloat16)
    slots = make_slots(T, P, rng, slot_idx)
    run_checked(backend, q, k, v, make_positions(T, rng, pos_idx), slots,
                pools_for(rng, P, Hkv, D, torch.bfloat16, slots), **heads(q, k))


@pytest.mark.parametrize("idx", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("which", ["all-skipped", "extremes"])
def test_negative_slots_skip(backend, idx, which, rng):
    """Any slot < 0 skips the write: -1, -pool_size, the int type's minimum."""
    T, Hq, Hkv, D, P = 8, 4, 2, 64, 8
    lo = torch.iinfo(idx).min
    if which == "all-skipped":
        slots = torch.full((T,), -1)
    else:
        slots = torch.tensor([lo, 0, -P, P - 1, lo + 1, -1, 3, -(2**31)])
    slots = slots.to(DEVICE, idx)
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.float32)
    run_checked(backend, q, k, v, make_positions(T, rng), slots, pools_for(rng, P, Hkv, D, torch.float32, slots),
                **heads(q, k))


def test_empty_call(backend, rng):
    T, Hq, Hkv, D, P = 0, 4, 2, 64, 8
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.float16)
    slots = make_slots(T, P, rng)
    q_rot, k_rot = run_checked(backend, q, k, v, make_positions(T, rng), slots,
                               pools_for(rng, P, Hkv, D, torch.float16, slots), **heads(q, k))
    assert q_rot.shape == (0, Hq, D) and k_rot.shape == (0, Hkv, D)


# --- views, outputs, pools --------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["packed", "padded", "kv-interleaved"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new-out", "in-place"])
def test_fused_qkv_views(backend, dtype, layout, in_place, rng):
    """q/k/v as views of one projection output, read (and with in-place, written) where they are."""
    T, Hq, Hkv, D, P = 19, 8, 2, 64, 32
    pad = 24 if layout == "padded" else 0
    qkv = randn(rng, T, (Hq + 2 * Hkv) * D + pad, dtype=dtype)
    if layout == "kv-interleaved":  # [q heads | (k, v) per kv head]
        q = qkv[:, : Hq * D].view(T, Hq, D)
        kv = qkv[:, Hq * D:].view(T, Hkv, 2, D)
        k, v = kv[:, :, 0], kv[:, :, 1]
        assert k.stride() == ((Hq + 2 * Hkv) * D, 2 * D, 1)
    else:
        q, k, v = (x.view(T, h, D) for x, h in zip(qkv[:, : (Hq + 2 * Hkv) * D].split(
            [Hq * D, Hkv * D, Hkv * D], dim=-1), (Hq, Hkv, Hkv)))
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
    qkv0 = qkv.clone()
    slots = make_slots(T, P, rng)
    outs = dict(q_out=q, k_out=k) if in_place else {}
    q_rot, k_rot = run_checked(backend, q, k, v, make_positions(T, rng), slots,
                               pools_for(rng, P, Hkv, D, dtype, slots), **heads(q, k), **outs)
    # Outside q (and k, in place) the projection buffer is untouched: v, padding.
    want = qkv0.clone()
    if in_place:
        want_q = want[:, : Hq * D].view(T, Hq, D)
        want_q.copy_(q_rot)
        if layout == "kv-interleaved":
            want[:, Hq * D:].view(T, Hkv, 2, D)[:, :, 0] = k_rot
        else:
            want[:, Hq * D: (Hq + Hkv) * D] = k_rot.reshape(T, Hkv * D)
    assert_same_bits("the fused qkv buffer", qkv, want)


@pytest.mark.parametrize("outs", ["q_out", "k_out", "both", "strided-both", "in-place-q", "in-place-both"])
def test_q_out_k_out(backend, dtype, outs, rng):
    """Outputs NaN-filled beforehand must be fully written, and nothing outside them."""
    T, Hq, Hkv, D, P = 11, 6, 2, 80, 16
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, dtype)
    q_buf = torch.full((T, Hq + 1, D), float("nan"), dtype=dtype, device=DEVICE)
    k_buf = torch.full((T, Hkv + 1, D), float("nan"), dtype=dtype, device=DEVICE)
    kw = {
        "q_out": dict(q_out=torch.full_like(q, float("nan"))),
        "k_out": dict(k_out=torch.full_like(k, float("nan"))),
        "both": dict(q_out=torch.full_like(q, float("nan")), k_out=torch.full_like(k, float("nan"))),
        "strided-both": dict(q_out=q_buf[:, 1:], k_out=k_buf[:, :Hkv]),
        "in-place-q": dict(q_out=q),
        "in-place-both": dict(q_out=q, k_out=k),
    }[outs]
    slots = make_slots(T, P, rng)
    run_checked(backend, q, k, v, make_positions(T, rng), slots, pools_for(rng, P, Hkv, D, dtype, slots),
                **heads(q, k), **kw)
    if outs == "strided-both":  # the heads outside the output views stay NaN
        assert torch.isnan(q_buf[:, 0]).all() and torch.isnan(k_buf[:, Hkv]).all()


L = 3
POOL_LAYOUTS = {
    # name: (shape of each owner tensor, how many owners, views(owners) -> (k_pool, v_pool), layer)
    "separate-4d-layer0": ((L, "P", "H", "D"), 2, tuple, 0),
    "separate-4d-layer2": ((L, "P", "H", "D"), 2, tuple, 2),
    "kv[0]-kv[1]": ((2, "P", "H", "D"), 1, lambda b: (b[0][0], b[0][1]), None),
    "kv[L,2]-layer1": ((L, 2, "P", "H", "D"), 1, lambda b: (b[0][:, 0], b[0][:, 1]), 1),
    "kv[2,L]-layer1": ((2, L, "P", "H", "D"), 1, lambda b: (b[0][0], b[0][1]), 1),
}


@pytest.mark.parametrize("name", list(POOL_LAYOUTS))
def test_pool_layouts(backend, dtype, name, rng):
    """Layer-stacked pools (layer=) and pools that are views of one KV tensor: other layers untouched."""
    shape, owners, views, layer = POOL_LAYOUTS[name]
    T, Hq, Hkv, D, P = 21, 8, 4, 64, 30
    shape = tuple({"P": P, "H": Hkv, "D": D}.get(s, s) for s in shape)
    slots = make_slots(T, P, rng)
    pools = [randn(rng, *shape, dtype=dtype) for _ in range(owners)]
    for pool in views(pools):
        plant_poison(pool[layer] if layer is not None else pool, slots)
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, dtype)
    run_checked(backend, q, k, v, make_positions(T, rng), slots, pools, views=views, layer=layer, **heads(q, k))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_paged_pools(backend, kv_layout, rng):
    """Slot s is row s % page_size of page s // page_size."""
    T, Hq, Hkv, D, pages, page_size = 14, 4, 2, 64, 5, 4
    shape = (pages, page_size, Hkv, D) if kv_layout == "NHD" else (pages, Hkv, page_size, D)
    slots = make_slots(T, pages * page_size, rng)
    pools = [randn(rng, *shape, dtype=torch.bfloat16) for _ in range(2)]
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.bfloat16)
    row = ((lambda s: (s // page_size, s % page_size)) if kv_layout == "NHD"
           else (lambda s: (s // page_size, slice(None), s % page_size)))
    run_checked(backend, q, k, v, make_positions(T, rng), slots, pools, row=row, kv_layout=kv_layout,
                **heads(q, k))


def test_append_into_filled_pool(backend, dtype, rng):
    """Prefill, then decode steps: earlier rows survive every later call, bit for bit."""
    Hq, Hkv, D, P = 8, 2, 128, 48
    pools = [randn(rng, P, Hkv, D, dtype=dtype) for _ in range(2)]
    order = torch.randperm(P, generator=rng)
    start = 0
    for T in (20, 1, 1, 5):
        q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, dtype)
        slots = order[start: start + T].to(DEVICE)
        positions = torch.arange(start, start + T, device=DEVICE)
        run_checked(backend, q, k, v, positions, slots, pools, **heads(q, k))
        start += T


# --- the kernel's own bounds ------------------------------------------------------------------

@pytest.mark.parametrize("idx", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("where", ["canary-rows", "layer-stack"])
def test_out_of_range_slots_never_written(backend, idx, where, rng):
    """Past validation (as on CUDA, where slots are not checked) no slot writes outside the pool.

    The call's geometry comes from validate.check on valid slots; the backend
    then gets adversarial ones. The pool sits between canary rows of a bigger
    tensor (or between the other layers of a stack), which must survive.
    """
    T, Hq, Hkv, D, P, C = 12, 2, 2, 64, 16, 4
    hi = torch.iinfo(idx).max
    bad = [P, P + 1, P + C - 1, P + C, hi, -1, -C, torch.iinfo(idx).min, 3, 5, 2 * P, -P - 1]
    if idx == torch.int64:
        bad[4] = 2**40
    slots = torch.tensor(bad, dtype=idx, device=DEVICE)
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.float32)
    positions = make_positions(T, rng)
    if where == "canary-rows":
        owners = [randn(rng, P + 2 * C, Hkv, D) for _ in range(2)]
        k_pool, v_pool = (o[C: C + P] for o in owners)
        layer, pool_of = None, (lambda o: o[C: C + P])
    else:
        owners = [randn(rng, L, P, Hkv, D) for _ in range(2)]
        k_pool, v_pool = owners
        layer, pool_of = 1, (lambda o: o[1])
    before = [o.clone() for o in owners]
    valid = torch.arange(T, dtype=idx, device=DEVICE)
    call = validate.check(q, k, v, positions, valid, k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
                          num_kv_heads=Hkv, rope_base=10000.0, rope=None, layer=layer, k_scale=None,
                          v_scale=None, kv_layout=None)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(k, float("nan"))
    if backend == "triton":
        from ropepool.backends import triton_op

        triton_op.launch(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    else:
        torch_eager.run(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)

    none = torch.full((T,), -1)
    ref = oracle(q, k, v, positions, none, pool_of(before[0]), pool_of(before[1]), head_dim=D,
                 num_qo_heads=Hq, num_kv_heads=Hkv)
    assert_close("q_rot", q_out, ref[0], torch.float32)
    assert_close("k_rot", k_out, ref[1], torch.float32)
    want = [b.clone() for b in before]
    for t in (8, 9):  # the only in-range slots: 3 and 5
        pool_of(want[0])[bad[t]], pool_of(want[1])[bad[t]] = k_out[t], v[t]
    assert_same_bits("k pool and its surroundings", owners[0], want[0])
    assert_same_bits("v pool and its surroundings", owners[1], want[1])


def test_rows_are_per_token(backend, rng):
    """Each written row is its own token's (a swap of rows or heads would still be close to the oracle)."""
    T, Hq, Hkv, D, P = 6, 6, 3, 64, 6
    q, k, v = qkv_inputs(rng, T, Hq, Hkv, D, torch.float32)
    pos = torch.arange(T, device=DEVICE) * 1000
    slots = torch.tensor([5, 0, 4, 1, 3, 2], device=DEVICE)
    pools = [torch.zeros(P, Hkv, D, device=DEVICE) for _ in range(2)]
    ref = oracle(q, k, v, pos, slots, *pools, **heads(q, k))
    _, k_rot, kp, vp = ropepool.rope_pool_fused(q, k, v, pos, slots, *pools, backend=backend, **heads(q, k))
    np.testing.assert_allclose(kp.cpu().numpy(), ref[2], rtol=0, atol=2e-6)
    np.testing.assert_array_equal(vp.cpu().numpy(), ref[3])
    assert torch.equal(vp[5], v[0]) and torch.equal(vp[2], v[5]) and torch.equal(kp[0], k_rot[1])

