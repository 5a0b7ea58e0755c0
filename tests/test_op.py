"""rope_pool_fused on every backend against the float64 oracle: shapes, positions, slots, RoPE variants.

Every test runs on each backend of the ``backend`` fixture (torch, the
Triton kernel: on CUDA or under the CPU interpreter, which skips the cases
marked big, and MLX) through ``tests.harness.run_checked``, which checks
q_rot / k_rot against the oracle (``harness.TOL``: float32 2e-6, float16
1.5e-3, bfloat16 1.2e-2 relative to max(1, |ref|)), every pool byte bit for
bit, the inputs and the framework's aliasing rule.
"""
from __future__ import annotations

import numpy as np
import pytest

from ropepool import RopePoolError, RopeSpec, native
from tests.harness import (
    FLOATS,
    assert_same_bits,
    crossed,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
)

BIG = pytest.mark.big


def qkv(rng, T, Hq, Hkv, D, dtype):
    return randn(rng, T, Hq, D, dtype=dtype), randn(rng, T, Hkv, D, dtype=dtype), randn(rng, T, Hkv, D, dtype=dtype)


def flat_cache(rng, P, Hkv, D, dtype, slots):
    return poison(make_cache(rng, dtype, P, Hkv, D), slots)


# (T, Hq, Hkv, D): named shapes. Under the interpreter a program costs ~20 ms and
# a decode-sized call splits a token's heads over up to 8 programs, so the
# bigger ones run on CUDA (and on the torch and MLX paths) only.
SHAPES = [
    pytest.param(1, 1, 1, 64, id="T1-Hq1-Hkv1-D64"),
    pytest.param(1, 32, 8, 128, id="T1-Hq32-Hkv8-D128"),
    pytest.param(5, 4, 4, 80, id="T5-Hq4-Hkv4-D80"),
    pytest.param(9, 7, 1, 256, id="T9-Hq7-Hkv1-D256-MQA"),
    pytest.param(13, 6, 3, 64, id="T13-Hq6-Hkv3-D64"),
    pytest.param(33, 6, 3, 64, id="T33-Hq6-Hkv3-D64", marks=BIG),
    pytest.param(17, 32, 8, 128, id="T17-Hq32-Hkv8-D128", marks=BIG),
    pytest.param(64, 4, 2, 80, id="T64-Hq4-Hkv2-D80", marks=BIG),
    pytest.param(423, 16, 4, 128, id="T423-Hq16-Hkv4-D128", marks=BIG),
    pytest.param(300, 12, 2, 80, id="T300-Hq12-Hkv2-D80", marks=BIG),
    pytest.param(130, 8, 8, 256, id="T130-Hq8-Hkv8-D256", marks=BIG),
    pytest.param(200, 7, 1, 64, id="T200-Hq7-Hkv1-D64-MQA", marks=BIG),
]


@pytest.mark.parametrize("T,Hq,Hkv,D,dtype", crossed(SHAPES))
def test_matches_oracle(backend, dtype, T, Hq, Hkv, D, rng):
    idx = "int32" if T % 2 else "int64"
    P = 2 * T + 7
    slots = make_slots(rng, T, P, skip_every=3 if T > 1 else 0, idx=idx)
    run_checked(backend, *qkv(rng, T, Hq, Hkv, D, dtype), make_positions(rng, T, idx=idx), slots,
                flat_cache(rng, P, Hkv, D, dtype, slots), rope_base=500000.0)


@pytest.mark.parametrize("kind,dtype", crossed(["repeated", "shuffled", "zero-and-1e6", "near-1e6", "near-2^24"]))
def test_positions(backend, dtype, kind, rng):
    """Shuffled, repeated and large positions (the contract holds up to 2^24)."""
    T, Hq, Hkv, D, P = 12, 3, 1, 128, 20
    pos = {
        "repeated": lambda: np.repeat(rng.integers(0, 10**6, 3), 4),
        "shuffled": lambda: rng.permutation(T) + int(rng.integers(0, 10**5)),
        "zero-and-1e6": lambda: np.tile([0, 1_000_000], T // 2),
        "near-1e6": lambda: rng.integers(999_000, 1_000_001, T),
        "near-2^24": lambda: rng.integers(2**24 - 10**4, 2**24 + 1, T),
    }[kind]()
    q, k, v = qkv(rng, T, Hq, Hkv, D, dtype)
    if kind == "repeated":  # tokens 0-3 share a position: equal inputs there give equal outputs
        q[1:4], k[1:4] = q[0], k[0]
    slots = make_slots(rng, T, P)
    res = run_checked(backend, q, k, v, pos.astype(np.int64), slots, flat_cache(rng, P, Hkv, D, dtype, slots))
    if kind == "repeated":
        for name, x in (("q_rot", res.q_rot), ("k_rot", res.k_rot)):
            x = backend.numpy(x)
            assert_same_bits(f"{name} of equal rows at one position", x[1:4], np.broadcast_to(x[0], x[1:4].shape))


@pytest.mark.parametrize("pos_idx,slot_idx", [("int32", "int32"), ("int32", "int64"), ("int64", "int32"),
                                              ("int64", "int64")],
                         ids=["pos32-slot32", "pos32-slot64", "pos64-slot32", "pos64-slot64"])
def test_index_dtypes(backend, pos_idx, slot_idx, rng):
    T, Hq, Hkv, D, P = 7, 3, 1, 64, 20
    slots = make_slots(rng, T, P, idx=slot_idx)
    run_checked(backend, *qkv(rng, T, Hq, Hkv, D, "bfloat16"), make_positions(rng, T, idx=pos_idx), slots,
                flat_cache(rng, P, Hkv, D, "bfloat16", slots))


@pytest.mark.parametrize("idx", ["int32", "int64"])
@pytest.mark.parametrize("which", ["all-skipped", "extremes"])
def test_negative_slots_skip(backend, idx, which, rng):
    """Any slot < 0 skips the write: -1, -pool_size, the int type's minimum."""
    T, Hq, Hkv, D, P = 8, 3, 2, 64, 8
    lo = int(np.iinfo(idx).min)
    slots = np.array([-1] * T if which == "all-skipped" else [lo, 0, -P, P - 1, lo + 1, -1, 3, -(2**31)], idx)
    run_checked(backend, *qkv(rng, T, Hq, Hkv, D, "float32"), make_positions(rng, T), slots,
                flat_cache(rng, P, Hkv, D, "float32", slots))


def test_empty_call(backend, rng):
    T, Hq, Hkv, D, P = 0, 4, 2, 64, 8
    slots = make_slots(rng, T, P)
    res = run_checked(backend, *qkv(rng, T, Hq, Hkv, D, "float16"), make_positions(rng, T), slots,
                      flat_cache(rng, P, Hkv, D, "float16", slots))
    assert tuple(res.q_rot.shape) == (0, Hq, D) and tuple(res.k_rot.shape) == (0, Hkv, D)


@pytest.mark.parametrize("dtype", FLOATS)
def test_append_into_filled_pool(backend, dtype, rng):
    """Prefill, then decode steps into one cache: earlier rows survive every later call, bit for bit
    (MLX: each call takes the pools the last one returned)."""
    Hq, Hkv, D, P = 5, 1, 128, 24
    cache = make_cache(rng, dtype, P, Hkv, D)
    order = rng.permutation(P)
    start = 0
    for T in (9, 1, 1, 4):
        slots = order[start: start + T].astype(np.int64)
        run_checked(backend, *qkv(rng, T, Hq, Hkv, D, dtype), np.arange(start, start + T), slots, cache)
        start += T


def test_rows_are_per_token(backend, rng):
    """Each written row is its own token's (a swap of rows or heads would still be close to the oracle)."""
    T, Hq, Hkv, D, P = 6, 3, 3, 64, 6
    slots = np.array([5, 0, 4, 1, 3, 2])
    cache = make_cache(rng, "float32", P, Hkv, D)
    q, k, v = qkv(rng, T, Hq, Hkv, D, "float32")
    res = run_checked(backend, q, k, v, np.arange(T) * 1000, slots, cache)
    k_pool, v_pool = (backend.numpy(p) for p in cache.pools())
    for t, s in enumerate(slots):
        assert_same_bits(f"v row of token {t}", v_pool[s], v[t])
        assert_same_bits(f"k row of token {t}", k_pool[s], backend.numpy(res.k_rot)[t])


def _longrope():
    n = 24
    return RopeSpec(head_dim=64, rotary_dim=48, base=10000.0, max_position_embeddings=131072, scaling=dict(
        rope_type="longrope", short_factor=list(np.linspace(1.0, 1.2, n)), long_factor=list(np.linspace(1.0, 40.0, n)),
        original_max_position_embeddings=4096))


ROPES = {
    "partial-0.5": lambda: RopeSpec(head_dim=128, rotary_dim=64, base=10000.0),
    "partial-0.25-gptj": lambda: RopeSpec(head_dim=64, rotary_dim=16, style="gptj"),
    "gptj": lambda: RopeSpec(head_dim=128, style="gptj", base=1e6),
    "yarn-x4": lambda: RopeSpec(head_dim=128, base=1e6, scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    "llama3": lambda: RopeSpec(head_dim=128, base=500000.0, scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    "longrope-short": _longrope,
    "longrope-long": _longrope,
}


@pytest.mark.parametrize("name,dtype", crossed(list(ROPES)))
def test_rope_specs(backend, dtype, name, rng):
    """Partial rotary, GPT-J pairs, attention scaling, longrope's switch to the long factors."""
    spec = ROPES[name]()
    T, Hq, Hkv, D, P = 7, 3, 1, spec.head_dim, 16
    positions = make_positions(rng, T, high=4000 if name == "longrope-short" else 100_000)
    if name == "longrope-long":  # one token past the original context switches all of them
        positions = np.r_[4096, make_positions(rng, T - 1, high=100)]
    q, k, v = qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P)
    res = run_checked(backend, q, k, v, positions, slots, flat_cache(rng, P, Hkv, D, dtype, slots), rope=spec)
    if spec.rotary_dim < D:  # the features past rotary_dim are copied, bit for bit
        assert_same_bits("unrotated features", backend.numpy(res.q_rot)[..., spec.rotary_dim:],
                         q[..., spec.rotary_dim:])


@pytest.mark.parametrize("idx", ["int32", "int64"])
@pytest.mark.parametrize("layers", [None, 3], ids=["flat", "layer-stack"])
def test_out_of_range_slots_never_written(backend, idx, layers, rng):
    """Past validation (as on CUDA, where slot values are not read) no slot writes outside its pool.

    The call is checked on valid slots, then its runner gets adversarial
    ones. The pool sits between the other layers of a stack, or is surrounded
    by canary rows of a bigger tensor (torch); none may change. The CPU kernel
    (torch on CPU) raises validation's error before it writes.
    """
    T, Hq, Hkv, D, P = 12, 3, 2, 64, 16
    bad = np.array([P, P + 1, 2 * P, np.iinfo(idx).max, -1, -P - 1, np.iinfo(idx).min, 3, 5, 3 * P, -2,
                    2**31 - 1 if idx == "int32" else 2**40], idx)
    cache = make_cache(rng, "float32", P, Hkv, D, layers=layers, layer=1)
    if backend.framework == "torch" and layers is None:  # canary rows around the pool, in one tensor
        cache.owners = [randn(rng, P + 8, Hkv, D) for _ in range(2)]
        cache.views = lambda o: (o[0][4: 4 + P], o[1][4: 4 + P])
    if backend.name == "torch" and backend.device == "cpu" and native.kernel() is not None:
        # The CPU kernel checks every slot itself: validation's error, before it writes (every byte kept).
        before = [np.array(o, copy=True) for o in cache.owners]  # (NumPy until run_checked converts them)
        with pytest.raises(RopePoolError, match="slots must be < pool_size"):
            run_checked(backend, *qkv(rng, T, Hq, Hkv, D, "float32"), make_positions(rng, T), bad, cache, bypass=True)
        assert all(np.array_equal(b, backend.numpy(o), equal_nan=True) for b, o in zip(before, cache.owners))
        return
    run_checked(backend, *qkv(rng, T, Hq, Hkv, D, "float32"), make_positions(rng, T), bad, cache, bypass=True)
