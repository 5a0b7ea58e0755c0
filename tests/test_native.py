"""The torch backend's CPU kernel (backends/torch_native.py, ropepool/native) against the float64 oracle and,
bit for bit, against the general torch code (torch_eager), which gives today's CPU results.

Each test counts the kernel's calls (paths: ``torch_native.call``), so a call that silently went to
torch_eager fails it. Checks as tests.harness.run_checked: q_rot / k_rot within the dtype's tolerance,
written pool rows bit for bit, every other byte of the pools' memory untouched, inputs unchanged.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import CosSinCache, RopePoolError, RopeSpec, backends, plan  # noqa: E402
from ropepool.backends import paths, torch_native  # noqa: E402
from ropepool.checks import validate  # noqa: E402
from ropepool.checks.values import check_values  # noqa: E402
from tests.harness import (  # noqa: E402
    FLOATS,
    Backend,
    cos_sin_table,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
)
from tests.test_features import NORMS, norm_arith, norm_for  # noqa: E402

pytestmark = pytest.mark.skipif(torch_native.native.kernel() is None, reason="the native kernel is not built")

ROPES = {
    "plain": lambda D: RopeSpec(head_dim=D, base=500000.0),
    "partial-gptj": lambda D: RopeSpec(head_dim=D, rotary_dim=D // 4, style="gptj"),
    "yarn": lambda D: RopeSpec(head_dim=D, scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 4096}),
    "longrope": lambda D: RopeSpec(head_dim=D, max_position_embeddings=8192, scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 4096,
        "short_factor": [1.0 + i / D for i in range(D // 2)], "long_factor": [2.0 + i / D for i in range(D // 2)]}),
    "table": lambda D: CosSinCache(_table(D), is_neox=True),
    "table-gptj-bf16": lambda D: CosSinCache(_table(D, "bfloat16"), is_neox=False),
    "none": lambda D: RopeSpec(head_dim=D, rotary_dim=0),
}
TABLE_POSITIONS = 1 << 14
X = Backend("torch", "cpu")  # the CPU path, on a machine with a GPU too
CALL = "torch_native.call"


@functools.lru_cache(maxsize=None)
def _table(D, dtype="float32"):
    return cos_sin_table(TABLE_POSITIONS, RopeSpec(head_dim=D).inv_freq, dtype)


LAYOUTS = {"flat": {}, "NHD": dict(kv_layout="NHD", page_size=4), "HND": dict(kv_layout="HND", page_size=4),
           "layer": dict(layers=3, layer=1)}


class _Since:
    """``[path]``: how many times a path ran since the test began."""

    def __init__(self):
        self.start = paths.count(CALL)

    def __getitem__(self, path):
        return paths.count(path) - self.start


@pytest.fixture
def calls():
    """The kernel's calls in the test."""
    return _Since()


def fused_qkv(rng, T, Hq, Hkv, D, dtype):
    """q, k, v as views of one projection output (token stride (Hq + 2 Hkv) * D)."""
    qkv = torch.from_numpy(randn(rng, T, (Hq + 2 * Hkv) * D, dtype="float32")).to(getattr(torch, dtype))
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


def positions_for(rng, rope, T, high):
    return make_positions(rng, T, high=TABLE_POSITIONS - 1 if rope.startswith("table") else high)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("T", [1, 7, 130])
def test_matches_oracle(dtype, rope, layout, T, rng):
    """Every rotation, dtype and pool layout, q/k/v views of a fused QKV row, shuffled and skipped slots, positions
    up to 2^24 (past the tables' bound: cos/sin per call) or, with a table, inside it."""
    Hq, Hkv, D, P = 9, 3, 128, 160
    for high in (5000, 2**24):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
        slots = make_slots(rng, T, P, skip_every=4)
        cache = poison(make_cache(rng, dtype, P, Hkv, D, **LAYOUTS[layout]), slots)
        with paths.counting() as seen:
            run_checked(X, q, k, v, positions_for(rng, rope, T, high), slots, cache, rope=ROPES[rope](D))
        assert seen[CALL] == 1, "the kernel ran the call"


def _eager_rows(monkeypatch):
    """The registry without the native row: calls go to torch_eager."""
    monkeypatch.setattr(backends, "BACKENDS", tuple(b for b in backends.BACKENDS if b.module != ".torch_native"))


def _both(monkeypatch, make, call):
    """``call(*make())`` through the kernel and through torch_eager, each on fresh copies of the arrays."""
    results = []
    for eager in (False, True):
        arrays = [x.clone() if isinstance(x, torch.Tensor) else x for x in make()]
        plan.forget()  # (the layout cache would find the other row's runner)
        with monkeypatch.context() as m:
            if eager:
                _eager_rows(m)
            with paths.counting() as seen:
                out = call(*arrays)
            assert seen[CALL] == (0 if eager else 1)
        results.append([x for x in out if isinstance(x, torch.Tensor)])
    return results


def _same_bits(a, b):
    """Bit for bit, but a NaN's sign and payload (which operand's NaN an operation returns is the CPU's and the
    compiler's choice: docs/precision.md)."""
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        nan = x.float().isnan()
        assert torch.equal(nan, y.float().isnan()), "NaN in the same places"
        x, y = (t.contiguous().view(torch.uint8).view(*t.shape, -1) for t in (x, y))
        assert torch.equal(x[~nan], y[~nan]), "not bit for bit"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("T", [1, 16, 70])
def test_bit_identical_to_torch_eager(dtype, rope, T, rng, monkeypatch):
    """The kernel's q_rot, k_rot and pools are torch_eager's bits: the same float32 roundings (no fused
    multiply-add) and cos/sin of torch's functions (docs/precision.md), rotary_dim // 2 = 16 (partial) too."""
    Hq, Hkv, D, P = 4, 2, 64, 128
    spec = X.rope(ROPES[rope](D))
    pos = torch.from_numpy(positions_for(rng, rope, T, 200_000))

    def make():
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
        slots = torch.from_numpy(make_slots(rng, T, P))
        kp, vp = (torch.zeros(P // 4, 4, Hkv, D, dtype=q.dtype) for _ in range(2))
        return q, k, v, pos, slots, kp, vp

    def call(q, k, v, positions, slots, kp, vp):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                        num_kv_heads=Hkv, rope=spec, kv_layout="NHD")

    arrays = make()
    _same_bits(*_both(monkeypatch, lambda: arrays, call))


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_fp8_bit_identical_to_torch_eager(fp8, dtype, rng, monkeypatch):
    """fp8 pools (per-head scales) and fp8 q_out / k_out: the kernel's fp8 rounding and saturation are PyTorch's
    cast of the clamped values, bit for bit, over values past the fp8 range, subnormal and NaN."""
    T, Hq, Hkv, D, P = 33, 4, 2, 64, 64
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    scale = 1 / 4096 if fp8 == "float8_e4m3fn" else 1 / 2**20
    with torch.no_grad():  # huge, tiny and NaN values
        q.mul_(torch.from_numpy(10.0 ** rng.uniform(-12, 3, q.shape)).to(q.dtype))
        k[::5, 0, ::7] = float("nan")
    dt = getattr(torch, fp8)
    k_scale, q_scale = torch.tensor([0.5, 3.0]), torch.tensor([scale])
    arrays = (q, k, v, torch.from_numpy(make_positions(rng, T, 3000)), torch.from_numpy(make_slots(rng, T, P)),
              torch.zeros(P, Hkv, D, dtype=dt), torch.zeros(P, Hkv, D, dtype=dt),
              torch.empty(T, Hq, D, dtype=dt), torch.empty(T, Hkv, D, dtype=dt))

    def call(q, k, v, positions, slots, kp, vp, qo, ko):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                        num_kv_heads=Hkv, k_scale=k_scale, v_scale=0.37, q_out=qo, k_out=ko,
                                        q_scale=q_scale, k_out_scale=0.25)

    _same_bits(*_both(monkeypatch, lambda: arrays, call))


@pytest.mark.parametrize("dtype", FLOATS)
def test_in_place_and_strided_outputs(dtype, rng, calls):
    """q_out = q (in place) and a strided k_out: a row is read before it is written."""
    T, Hq, Hkv, D, P = 40, 4, 2, 64, 64
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    k_out = torch.empty(T, Hkv, 2 * D, dtype=q.dtype)[..., :D]
    slots = make_slots(rng, T, P)
    run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, dtype, P, Hkv, D), slots),
                q_out=q, k_out=k_out)
    assert calls[CALL] == 1


def test_strided_pools_and_inputs(rng, calls):
    """Pools whose head dim is strided (seen transposed), q/k/v with odd token and head strides."""
    T, Hq, Hkv, D, P = 9, 3, 2, 32, 24
    q = torch.randn(T, Hq, 2 * D)[..., :D]
    k, v = (torch.randn(Hkv, T, D).transpose(0, 1) for _ in range(2))
    kp, vp = (torch.zeros(P, D, Hkv).transpose(1, 2) for _ in range(2))
    slots = torch.from_numpy(make_slots(rng, T, P))
    positions = torch.from_numpy(make_positions(rng, T, 5000))
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                                  num_kv_heads=Hkv)
    ref = ropepool.reference.rope_pool_fused(q.numpy(), k.numpy(), v.numpy(), positions.numpy(), slots.numpy(),
                                             np.zeros((P, Hkv, D), np.float32), np.zeros((P, Hkv, D), np.float32),
                                             head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    for got, want in zip((q_rot, k_rot, kp, vp), ref):
        np.testing.assert_allclose(got.numpy(), want, atol=2e-6, rtol=0)
    assert calls[CALL] == 1


SCALES = {"floats": (0.37, 0.61), "per-head": (np.array([0.37, 1.9, 0.05], np.float32), 0.5),
          "one-element": (np.array([0.25], np.float32), np.array([2.5], np.float32))}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("fp8,scales", [("float8_e4m3fn", "floats"), ("float8_e4m3fn", "per-head"),
                                        ("float8_e5m2", "one-element")])
@pytest.mark.parametrize("T", [1, 9])
def test_fp8_pools(dtype, layout, fp8, scales, T, rng, calls):
    """fp8 pools (value / scale, saturated; scales as floats, per head, one element), pool rows bit for bit the
    oracle's quantized rows, skipped tokens untouched."""
    Hq, Hkv, D, P = 4, 3, 64, 40
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P, skip_every=4 if T > 1 else 0)
    cache = poison(make_cache(rng, fp8, P, Hkv, D, **LAYOUTS[layout]), slots)
    k_scale, v_scale = SCALES[scales]
    run_checked(X, q, k, v, make_positions(rng, T), slots, cache, k_scale=k_scale, v_scale=v_scale)
    assert calls[CALL] == 1


def _runner(rng, T=6, P=16, layout="NHD", rope=None):
    """A bound runner (plan.make(...).bind), called without the API's value checks, and its arrays."""
    Hq, Hkv, D = 2, 2, 64
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")
    kp, vp = (torch.from_numpy(randn(rng, P // 4, 4, Hkv, D)).to(torch.bfloat16) for _ in range(2))
    positions, slots = torch.arange(T), torch.arange(T)
    call = validate.check(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
                          kv_layout=layout, rope=rope)
    return plan.make(call, q).bind(q, k, v, positions, slots, kp, vp, None, None), (q, k, v, positions, slots, kp,
                                                                                      vp)


@pytest.mark.parametrize("bad", ["slot past the pool", "negative position", "position past the table"])
def test_bad_values_raise_before_any_write(bad, rng, calls):
    """A slot or position out of range, at the last token (every earlier one valid), given to the runner with no
    check before: it raises validation's error and the pools keep every byte."""
    table = X.rope(CosSinCache(_table(64), is_neox=True))
    run, (q, k, v, positions, slots, kp, vp) = _runner(rng, rope=table if "table" in bad else None)
    positions, slots = positions.clone(), slots.clone()
    if bad == "slot past the pool":
        slots[-1] = 16
    elif bad == "negative position":
        positions[-1] = -3
    else:
        positions[-1] = TABLE_POSITIONS
    before = [x.clone() for x in (kp, vp)]
    with pytest.raises(RopePoolError, match="slots must be < pool_size|positions must be"):
        run(q, k, v, positions, slots, kp, vp)
    _same_bits(before, (kp, vp))
    assert calls[CALL] == 0


@pytest.mark.parametrize("rope", ["plain", "table"])
def test_hits_leave_values_to_the_kernel(rope, rng, calls, monkeypatch):
    """On a layout cache hit the Python value check is skipped (the kernel checks): bad values still raise
    validation's message with every pool byte kept, a position past 2^24 still warns, a slot twice among several
    tokens is refused."""
    Hq, Hkv, D, P = 2, 2, 64, 16
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=X.rope(ROPES[rope](D)))
    q, k, v = fused_qkv(rng, 1, Hq, Hkv, D, "bfloat16")
    kp, vp = (torch.from_numpy(randn(rng, P, Hkv, D)).to(torch.bfloat16) for _ in range(2))
    ropepool.rope_pool_fused(q, k, v, torch.tensor([3]), torch.tensor([5]), kp, vp, **kw)  # the layout bound
    checked = []
    spy = validate.check_host_values
    monkeypatch.setattr(validate, "check_host_values", lambda *a: (checked.append(a[2].numel()), spy(*a))[1])
    ropepool.rope_pool_fused(q, k, v, torch.tensor([4]), torch.tensor([6]), kp, vp, **kw)
    assert checked == [] and calls[CALL] == 2
    bad = {"slots must be < pool_size": ([4], [P]), "positions must be >= 0": ([-1], [6])}
    if rope == "table":
        bad["positions must be < the cos/sin table's max_position"] = ([TABLE_POSITIONS], [6])
    for message, (positions, slots) in bad.items():
        before = [x.clone() for x in (kp, vp)]
        with pytest.raises(RopePoolError, match=message):
            ropepool.rope_pool_fused(q, k, v, torch.tensor(positions), torch.tensor(slots), kp, vp, **kw)
        _same_bits(before, (kp, vp))
    if rope == "plain":
        with pytest.warns(RuntimeWarning, match=r"^positions above 2\^24 = 16777216 \(the largest given: 20000000\)"):
            ropepool.rope_pool_fused(q, k, v, torch.tensor([20_000_000]), torch.tensor([6]), kp, vp, **kw)
    assert checked == []
    for T in (3, 70):  # (pairs compared, then sorted)
        q2, k2, v2 = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")  # (another token stride: a layout of its own)
        ropepool.rope_pool_fused(q2, k2, v2, torch.arange(T), -torch.ones(T, dtype=torch.int64), kp, vp, **kw)
        slots = torch.full((T,), -1)
        slots[T // 2], slots[-1] = 6, 6
        before, checked[:] = [x.clone() for x in (kp, vp)], []
        with pytest.raises(RopePoolError, match="slots must be unique"):
            ropepool.rope_pool_fused(q2, k2, v2, torch.arange(T), slots, kp, vp, **kw)
        _same_bits(before, (kp, vp))
        assert checked == [], "the hit's values left to the kernel"


def test_tables_grow_and_past_their_bound(monkeypatch, rng, calls):
    """cos/sin rows of ropepool's frequencies come from a table grown by chunks as positions rise (the call that
    needs more rows writes nothing before they are there); past the bound they are computed per call. The
    oracle's results each time."""
    monkeypatch.setattr(torch_native, "_TABLES", {})
    monkeypatch.setattr(torch_native, "_table_bytes", [0])
    monkeypatch.setattr(plan, "DEFAULT_TUNING", plan.Tuning(table_positions=1000, table_chunk=256))
    Hq, Hkv, D, P = 3, 1, 64, 128
    rope = RopeSpec(head_dim=D, scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    rows = []
    for T, high in ((1, 200), (7, 600), (1, 999), (3, 5000), (80, 500)):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
        positions = make_positions(rng, T, high=high)
        positions[0] = high
        slots = make_slots(rng, T, P)
        run_checked(X, q, k, v, positions, slots, poison(make_cache(rng, "float32", P, Hkv, D), slots), rope=rope)
        (table,) = torch_native._TABLES.values()
        rows.append(table.shape[0])
    assert rows == [256, 768, 1024, 1024, 1024] and calls[CALL] == 5


def test_latent(rng, calls):
    """MLA's latent caches: q_pe / k_pe rotated (GPT-J pairs, YaRN), kv_c and k_pe written, paged."""
    from tests.harness import run_latent_checked

    T, H, R, L, P = 7, 4, 64, 128, 32
    rope = RopeSpec(head_dim=R, style="gptj", max_position_embeddings=163840, scaling={
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0})
    slots = make_slots(rng, T, P)
    cache = poison(make_cache(rng, "bfloat16", P, 1, L, v_dim=R, kv_layout="NHD", page_size=8, headed=False), slots)
    q_pe = randn(rng, T, H, R, dtype="bfloat16")
    run_latent_checked(X, q_pe, randn(rng, T, R, dtype="bfloat16"), randn(rng, T, L, dtype="bfloat16"),
                       make_positions(rng, T, 100_000), slots, cache, rope=rope)
    assert calls[CALL] == 1


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", sorted(n for n, case in NORMS.items() if case[3] == "float"))
@pytest.mark.parametrize("layout,pool", [("flat", "float"), ("NHD", "float"), ("HND", "float8_e4m3fn")])
@pytest.mark.parametrize("T", [1, 9])
def test_norm_matches_oracle(dtype, name, layout, pool, T, rng, calls):
    """The fused QK norm (before or after RoPE, gain w or 1 + w, q-only / k-only / no weights, weights in any float
    dtype, a head_dim not a multiple of the kernel's 16 lanes) against the oracle, by the kernel."""
    D, spec_kw, norm_kw, _ = NORMS[name]
    Hq, Hkv, P = 4, 2, 24
    norm = norm_for(rng, D, **norm_kw)
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P, skip_every=4 if T > 1 else 0)
    cache = poison(make_cache(rng, dtype if pool == "float" else pool, P, Hkv, D, **LAYOUTS[layout]), slots)
    scales = {} if pool == "float" else dict(k_scale=0.37, v_scale=0.61)
    run_checked(X, q, k, v, make_positions(rng, T, 100_000), slots, cache, rope=RopeSpec(head_dim=D, **spec_kw),
                qk_norm=norm, arith=norm_arith(norm), **scales)
    assert calls[CALL] == 1


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("after_rope", [False, True])
def test_norm_close_to_torch_eager(dtype, after_rope, rng, monkeypatch):
    """With the QK norm the kernel's sum of squares runs in its own order (docs/precision.md): every other step
    rounds where torch_eager's does, so results differ from torch_eager's by float32 rounding of the sum at most:
    float32 within 4e-6 (measured 1.4e-6), bf16 / fp16 by at most one step of the dtype."""
    T, Hq, Hkv, D, P = 33, 4, 2, 128, 64
    norm = X.norm(norm_for(rng, D, offset=1.0, after_rope=after_rope))
    pos = torch.from_numpy(make_positions(rng, T, 100_000))

    def make():
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
        slots = torch.from_numpy(make_slots(rng, T, P))
        return q, k, v, pos, slots, torch.zeros(P, Hkv, D, dtype=q.dtype), torch.zeros(P, Hkv, D, dtype=q.dtype)

    def call(q, k, v, positions, slots, kp, vp):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                        num_kv_heads=Hkv, qk_norm=norm)

    arrays = make()
    native, eager = _both(monkeypatch, lambda: arrays, call)
    step = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}[dtype]
    for x, y in zip(native, eager):
        x, y = x.double(), y.double()
        assert ((x - y).abs() <= 4e-6 + step * y.abs().clamp(min=1.0)).all(), (x - y).abs().max()


def test_norm_weights_read_per_call(rng, calls):
    """The weights are read at each call: an in-place update of the module's weight is seen."""
    T, Hq, Hkv, D, P = 3, 2, 1, 64, 8
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
    w = torch.nn.Parameter(torch.ones(D))
    norm = ropepool.QKNorm(w, None, eps=1e-6)
    args = (q, k, v, torch.arange(T), torch.arange(T), torch.zeros(P, Hkv, D), torch.zeros(P, Hkv, D))
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, qk_norm=norm)
    before = ropepool.rope_pool_fused(*args, **kw)[0].clone()
    with torch.no_grad():
        w.mul_(2.0)
    after = ropepool.rope_pool_fused(*args, **kw)[0]
    assert torch.equal(after, before * 2.0) and calls[CALL] == 2


def test_uncovered_features_take_the_general_path(rng, calls):
    """Autograd is not the kernel's: a call whose q requires grad runs on torch_eager, and gives a graph."""
    T, Hq, Hkv, D, P = 5, 2, 1, 64, 8
    q, k, v = (x.detach().float().requires_grad_() for x in fused_qkv(rng, T, Hq, Hkv, D, "float32"))
    q_rot, _, _, _ = ropepool.rope_pool_fused(q, k, v, torch.arange(T), torch.arange(T), torch.zeros(P, Hkv, D),
                                              torch.zeros(P, Hkv, D), head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    assert q_rot.requires_grad and calls[CALL] == 0


def test_without_the_kernel_one_line_and_the_general_path(tmp_path):
    """No built kernel (a path that is not one): one line on stderr naming the fix, `ropepool env`'s reason, and
    calls on torch_eager with the same results."""
    code = ("import torch, ropepool; from ropepool import backends; q = torch.randn(2, 2, 64); "
            "ropepool.rope_pool_fused(q, q[:, :1], q[:, :1], torch.arange(2), torch.arange(2), torch.zeros(4, 1, 64),"
            " torch.zeros(4, 1, 64), head_dim=64, num_qo_heads=2, num_kv_heads=1); "
            "print(backends.BACKENDS[1].why_not(None))")
    # (without the sanitizer's runtime, .ci/sanitize's: this process loads no sanitized code)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["ROPEPOOL_NATIVE_LIB"] = str(tmp_path / "missing.so")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("ropepool:")]
    assert len(lines) == 1 and "Fix:" in lines[0] and "did not load" in lines[0], done.stderr
    assert "did not load" in done.stdout


@pytest.mark.parametrize("T", [1, 16, 64])
def test_few_values_checked_without_numpy(monkeypatch, T, rng):
    """Up to 64 tokens the values are read as Python ints: NumPy's unique is not reached, and the
    same errors come out of the full check."""
    monkeypatch.setattr(np, "unique", lambda *a, **kw: pytest.fail("np.unique on a few values"))
    slots = torch.from_numpy(make_slots(rng, T, 1024))
    positions = torch.from_numpy(make_positions(rng, T))
    check_values(positions, slots, 1024)
    if T > 1:
        slots[-1] = slots[0] if slots[0] >= 0 else slots[1]
        monkeypatch.undo()
        with pytest.raises(ValueError, match="slots must be unique"):
            check_values(positions, slots, 1024)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        check_values(-positions - 1, slots, 1024)


def test_a_steps_skipped_slots_per_array(rng):
    """Two groups of layers in one step (values.STEP holds both slot arrays, each with skipped tokens): each
    call writes its own array's rows, with the oracle's results."""
    from ropepool.checks.values import STEP

    T, Hq, Hkv, D, P = 5, 2, 1, 64, 32
    positions = torch.from_numpy(make_positions(rng, T))
    groups = [torch.from_numpy(make_slots(rng, T, P)) for _ in range(2)]
    assert all((s < 0).any() for s in groups) and not torch.equal(*groups)
    try:
        STEP.begin(positions, *groups)
        for slots in (*groups, groups[0]):
            q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
            run_checked(X, q, k, v, positions, slots, poison(make_cache(rng, "float32", P, Hkv, D), slots.numpy()))
    finally:
        STEP.begin()


def test_kernel_errors_reach_python_with_their_kind():
    """The module raises the kernel's errors (tvm-ffi's, thrown in C++) as the Python exceptions of their kind, with
    their message, and does nothing else: a cfg address of 0 is refused before any array is written."""
    rng = np.random.default_rng(0)
    T, Hq, Hkv, D, P = 3, 4, 2, 64, 16
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")
    pools = [torch.full((P, Hkv, D), float("nan"), dtype=q.dtype) for _ in range(2)]
    positions, slots = torch.tensor([5, 900, 3]), torch.tensor([7, -1, 12])
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, positions, slots, *pools, **kw)
    run = plan.lookup(plan.pool_key(D, Hq, Hkv, 10000.0, *(None,) * 13, q, k),
                      (q, k, v, positions, slots, *pools, None, None))
    assert run.__self__.fn is torch_native.native.kernel().rope_pool
    before = [x.clone() for x in (q_rot, k_rot, *pools)]
    with pytest.raises(ValueError, match="cfg: the address of an int64"):
        run.__self__.fn(q, k, v, positions, slots, *pools, q_rot, k_rot, run.__self__.table, 0)
    with pytest.raises(TypeError, match="10 arrays and cfg's address"):
        run.__self__.fn(q, k, v)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, (q_rot, k_rot, *pools)))


def test_calls_import_no_ffi_package():
    """A process's first call loads the kernel without importing tvm-ffi's Python package, only its C++ library
    (the package's import took 26-65 ms, most of a first call, on the dev VM: docs/native.md)."""
    code = ("import sys, torch, ropepool; from ropepool import native; q = torch.randn(2, 2, 64); "
            "ropepool.rope_pool_fused(q, q[:, :1], q[:, :1], torch.arange(2), torch.arange(2), torch.zeros(4, 1, 64),"
            " torch.zeros(4, 1, 64), head_dim=64, num_qo_heads=2, num_kv_heads=1); "
            "assert native.kernel() is not None; print(sorted(m for m in sys.modules if m.startswith('tvm_ffi')))")
    # (the installed build, without the sanitizer's runtime and build: .ci/sanitize's)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ROPEPOOL_NATIVE_LIB")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[]", done.stdout
