"""Shared test helpers: random inputs, the oracle on them, comparisons."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import ropepool

# Max |out - ref| allowed, relative to max(1, |ref|): float32 arithmetic and
# sin/cos; one rounding of the result to the dtype (bf16: 2^-8, f16: 2^-11).
TOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2}
NP_DTYPES = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """float64 for float tensors (fp8 kept as ml_dtypes fp8), ints as they are."""
    x = x.detach().cpu()
    if x.dtype in NP_DTYPES:
        return x.contiguous().view(torch.uint8).numpy().view(NP_DTYPES[x.dtype])
    if x.is_floating_point():
        return x.double().numpy()
    return x.numpy()


def oracle(*arrays, **kwargs):
    return ropepool.reference.rope_pool_fused(*(to_numpy(a) for a in arrays), **kwargs)


def assert_close(name, out: torch.Tensor, ref: np.ndarray, dtype):
    got = to_numpy(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} vs {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN (unwritten?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    tol = TOL[dtype]
    if err.size and err.max() > tol:
        bad = np.argwhere(err > tol)[:5].tolist()
        raise AssertionError(f"{name}: max rel err {err.max():.3g} > {tol} for {dtype}; first at {bad}")


def random_slots(T: int, pool_size: int, gen, skip_every: int = 0) -> torch.Tensor:
    """Unique shuffled slots; every skip_every-th token gets -1."""
    slots = torch.randperm(pool_size, generator=gen)[:T]
    if skip_every:
        slots[::skip_every] = -1
    return slots


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``x`` (on the CPU) as same-width ints: NaN payloads and -0.0 compare exactly."""
    return x.detach().cpu().contiguous().view(_INT_OF_SIZE[x.element_size()])


def assert_same_bits(name, got: torch.Tensor, want: torch.Tensor):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{name}: shape {list(g.shape)} vs {list(w.shape)}"
    bad = (g != w).nonzero()
    if len(bad):
        first = tuple(bad[0].tolist())
        raise AssertionError(f"{name}: {len(bad)} of {g.numel()} elements differ bit for bit; first at {first}: "
                             f"got {got.detach().cpu()[first].item()!r}, want {want.detach().cpu()[first].item()!r}; "
                             f"mismatching indices {bad[:5].tolist()}")


POISON = (float("nan"), float("inf"), float("-inf"), -0.0)


def plant_poison(pool, slots):
    """NaN-fill rows that will be written; plant NaN/inf/-inf/-0.0 in rows that must survive."""
    written = sorted(s for s in slots.tolist() if s >= 0)
    kept = sorted(set(range(pool.shape[0])) - set(written))
    for r in written[::2]:
        pool[r] = float("nan")
    for i, r in enumerate(kept[:8]):
        pool[r].view(-1)[i % 3::3] = POISON[i % len(POISON)]
    return pool


def run_checked(backend, q, k, v, positions, slots, pools, *, views=tuple, row=lambda s: s, layer=None,
                kv_layout=None, q_out=None, k_out=None, **kw):
    """Run the op and check all it returns and every byte it may or may not write.

    pools: the tensors that own the pools' memory; views(pools) -> (k_pool, v_pool).
    row(s): the index of slot s in one layer of a pool (paged layouts differ).
    """
    k_pool, v_pool = views(pools)
    before = [p.clone() for p in pools]
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    ptrs = (k_pool.data_ptr(), v_pool.data_ptr())
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, layer=layer, kv_layout=kv_layout, q_out=q_out, k_out=k_out,
        backend=backend, **kw)

    assert kp is k_pool and vp is v_pool, "the pools come back as the same objects"
    assert (kp.data_ptr(), vp.data_ptr()) == ptrs
    # q_rot/k_rot: the given outputs, or new tensors (empty ones have no memory to compare).
    assert q_rot is q_out if q_out is not None else (q.numel() == 0 or q_rot.data_ptr() != q.data_ptr())
    assert k_rot is k_out if k_out is not None else (k.numel() == 0 or k_rot.data_ptr() != k.data_ptr())
    for name, x, x0, out in (("q", q, q0, q_out), ("k", k, k0, k_out), ("v", v, v0, None)):
        if out is None or out.data_ptr() != x.data_ptr():
            assert_same_bits(f"{name} after the call (inputs are never modified)", x, x0)

    ref = oracle(q0, k0, v0, positions, slots, *views(before), head_dim=kw["head_dim"],
                 num_qo_heads=kw["num_qo_heads"], num_kv_heads=kw["num_kv_heads"],
                 rope_base=kw.get("rope_base", 10000.0), rope=kw.get("rope"), layer=layer, kv_layout=kv_layout)
    assert_close("q_rot", q_rot, ref[0], q.dtype)
    assert_close("k_rot", k_rot, ref[1], q.dtype)

    # The pools' memory: as before, except each written row, which holds the
    # returned k_rot row and the given v row, bit for bit.
    want = [p.clone() for p in before]
    wk, wv = views(want)
    if layer is not None:
        wk, wv = wk[layer], wv[layer]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            wk[row(s)], wv[row(s)] = k_rot[t], v0[t]
    for i, (p, w) in enumerate(zip(pools, want)):
        assert_same_bits(f"pool memory {i} (written rows == k_rot/v, the rest untouched)", p, w)
    return q_rot, k_rot


def heads(q, k):
    return dict(head_dim=q.shape[2], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1])




# (T, Hq, Hkv, D): the named shapes every backend's numeric tests run. The
# last four are too big for the Triton interpreter (CI's CPU run).
_SHAPES = [(1, 1, 1, 64), (1, 32, 8, 128), (17, 32, 8, 128), (5, 4, 4, 80), (9, 8, 1, 256), (33, 6, 3, 64),
           (64, 4, 2, 80), (423, 16, 4, 128), (300, 12, 2, 80), (130, 8, 8, 256), (200, 7, 1, 64)]


def shape_params(big_marks=()):
    import pytest

    out = []
    for i, (T, Hq, Hkv, D) in enumerate(_SHAPES):
        name = f"T{T}-Hq{Hq}-Hkv{Hkv}-D{D}" + ("-MQA" if Hkv == 1 else "")
        out.append(pytest.param(T, Hq, Hkv, D, id=name, marks=big_marks if i >= 7 else ()))
    return out
