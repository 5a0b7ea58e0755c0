"""The torch backend's CPU path (backends/torch_cpu.py, torch_cpu_compiled.py) against the float64 oracle.

Each test counts the fast path's pool writes, so a call that silently went to
torch_eager's general code fails it. Checks as tests.harness.run_checked:
q_rot / k_rot within the dtype's tolerance, written pool rows bit for bit,
every other byte of the pools' memory untouched, inputs unchanged.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ropepool import CosSinCache, RopeSpec  # noqa: E402
from ropepool.backends import paths, torch_cpu, torch_cpu_compiled  # noqa: E402
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

ROPES = {
    "plain": lambda D: RopeSpec(head_dim=D, base=500000.0),
    "partial-gptj": lambda D: RopeSpec(head_dim=D, rotary_dim=D // 4, style="gptj"),
    "yarn": lambda D: RopeSpec(head_dim=D, scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 4096}),
    "table": lambda D: CosSinCache(_table(D), is_neox=True),
    "none": lambda D: RopeSpec(head_dim=D, rotary_dim=0),
}
TABLE_POSITIONS = 1 << 14
X = Backend("torch", "cpu")  # the CPU path, on a machine with a GPU too


@functools.lru_cache(maxsize=None)
def _table(D):
    return cos_sin_table(TABLE_POSITIONS, RopeSpec(head_dim=D).inv_freq)


LAYOUTS = {"flat": {}, "NHD": dict(kv_layout="NHD", page_size=4), "HND": dict(kv_layout="HND", page_size=4),
           "layer": dict(layers=3, layer=1)}


OPS, STEP, STEP_WRITE = "torch_cpu.write", "torch_cpu.compiled_step", "torch_cpu.compiled_write"


class _Since:
    """The fast paths' counts (backends/paths.py) since the test began: ``[OPS]`` pools written by torch
    ops, ``[STEP]`` calls rotated by the compiled step, ``[STEP_WRITE]`` calls whose pools it wrote."""

    def __init__(self):
        self.start = {p: paths.count(p) for p in (OPS, STEP, STEP_WRITE)}

    def __getitem__(self, path):
        return paths.count(path) - self.start[path]


@pytest.fixture
def fast_writes():
    """How the fast path wrote the pools: a call that silently went to torch_eager's general code writes
    none of them."""
    return _Since()


@pytest.fixture
def compiled(monkeypatch):
    """The compiled step on from 2 tokens and compiled in the call (the suite runs with it off), from a clean
    state; the test fails if it gave up (its warning would otherwise only slow the call down)."""
    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "sync")
    monkeypatch.setattr(torch_cpu_compiled, "MIN_TOKENS", 2)
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    yield
    assert not torch_cpu_compiled._state["failed"], "the compiled step gave up (see the warning)"


def fused_qkv(rng, T, Hq, Hkv, D, dtype):
    """q, k, v as views of one projection output (token stride (Hq + 2 Hkv) * D)."""
    qkv = torch.from_numpy(randn(rng, T, (Hq + 2 * Hkv) * D, dtype="float32")).to(getattr(torch, dtype))
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("T", [1, 7, 130])  # 130 tokens of 9 x 256: three blocks
def test_fast_path_matches_oracle(dtype, rope, layout, T, rng, fast_writes):
    check_fast_path(dtype, rope, layout, T, rng, fast_writes, skip_every=4, high=2**24)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", sorted(set(ROPES) - {"none"}))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_step_matches_oracle(dtype, rope, layout, rng, fast_writes, compiled):
    """The compiled step: 7 tokens, every one written, at positions below the cos/sin table's bound (it picks
    the table's rows and, but for HND pages and partial RoPE, writes the pools); 5 above it (cos/sin computed,
    the pools written the same way); 130 with skipped tokens (the pools written by torch ops)."""
    check_fast_path(dtype, rope, layout, 7, rng, fast_writes, skip_every=0, high=100_000)
    check_fast_path(dtype, rope, layout, 5, rng, fast_writes, skip_every=0, high=2**24)
    check_fast_path(dtype, rope, layout, 130, rng, fast_writes, skip_every=4, high=2**24)
    step_writes = 0 if layout == "HND" or rope == "partial-gptj" else 2
    assert (fast_writes[STEP], fast_writes[STEP_WRITE], fast_writes[OPS]) == (3, step_writes, 6 - 2 * step_writes)


def check_fast_path(dtype, rope, layout, T, rng, fast_writes, skip_every, high):
    Hq, Hkv, D, P = 9, 3, 256, 160
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P, skip_every=skip_every)  # shuffled; with skip_every some negative (skipped)
    cache = poison(make_cache(rng, dtype, P, Hkv, D, **LAYOUTS[layout]), slots)
    positions = make_positions(rng, T, high=TABLE_POSITIONS - 1 if rope == "table" else high)
    before = fast_writes[OPS] + 2 * fast_writes[STEP_WRITE]
    run_checked(X, q, k, v, positions, slots, cache, rope=ROPES[rope](D))
    assert fast_writes[OPS] + 2 * fast_writes[STEP_WRITE] - before == 2, "both pools written by the fast path"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", ["plain", "yarn", "table"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("T", [1, 9, 16])
def test_few_rows_rotate_q_and_k_as_one(dtype, rope, layout, T, rng, fast_writes):
    """q and k apart, as a model's own projections hand them (ropepool demo's calls), few rows: run's few lane
    (one copy of both, rotated in place by _block's ops) gives the oracle's results, skipped slots included;
    more rows than its bound take the other paths."""
    Hq, Hkv, D, P = 4, 2, 32, 64
    with paths.counting() as seen:
        for tokens in (T, 40):  # 40 x 6 x 32 elements: past _FEW_ELEMENTS
            q, k, v = (torch.from_numpy(randn(rng, tokens, h, D, dtype="float32")).to(getattr(torch, dtype))
                       for h in (Hq, Hkv, Hkv))
            slots = make_slots(rng, tokens, P, skip_every=4)
            cache = poison(make_cache(rng, dtype, P, Hkv, D, **LAYOUTS[layout]), slots)
            positions = make_positions(rng, tokens, high=TABLE_POSITIONS - 1 if rope == "table" else 100_000)
            run_checked(X, q, k, v, positions, slots, cache, rope=ROPES[rope](D))
    assert seen["torch_cpu.few"] == 1 and fast_writes[OPS] == 4


@pytest.mark.parametrize("dtype", FLOATS)
def test_in_place_and_strided_outputs(dtype, rng, fast_writes):
    """q_out = q (in place) and a strided k_out: the rotation reads a pair before writing it."""
    T, Hq, Hkv, D, P = 40, 4, 2, 64, 64
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    k_out = torch.empty(T, Hkv, 2 * D, dtype=q.dtype)[..., :D]
    slots = make_slots(rng, T, P)
    run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, dtype, P, Hkv, D), slots),
                q_out=q, k_out=k_out)
    assert fast_writes[OPS] == 2


def test_compiled_rotation(monkeypatch, rng, fast_writes):
    """Inductor's code (on in this test, from 2 tokens) gives the oracle's results for each dtype and for
    q/k seen through a fused QKV row or contiguous, with in-place and strided outputs; each call is counted
    and compiled once per key."""
    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "sync")
    monkeypatch.setattr(torch_cpu_compiled, "MIN_TOKENS", 2)
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setattr(torch_cpu_compiled, "_compiled", {})
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    ran = []
    rotate = torch_cpu_compiled.rotate
    monkeypatch.setattr(torch_cpu_compiled, "rotate", lambda *a: ran.append(rotate(*a)) or ran[-1])
    Hq, Hkv, D, P = 3, 1, 64, 64
    for T, dtype, fused, in_place in ((5, "bfloat16", True, False), (5, "float32", True, False),
                                      (7, "float32", True, False), (9, "float32", True, True),
                                      (11, "float32", False, False)):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
        if not fused:
            q, k = q.contiguous(), k.contiguous()
        slots = make_slots(rng, T, P)
        outs = dict(q_out=q, k_out=torch.empty(T, Hkv, 2 * D, dtype=q.dtype)[..., :D]) if in_place else {}
        run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, dtype, P, Hkv, D), slots),
                    **outs)
    assert ran == [True] * 5 and (fast_writes[STEP], fast_writes[OPS]) == (5, 10)  # tokens skipped: ops write
    assert not torch_cpu_compiled._state["failed"]
    assert len(torch_cpu_compiled._compiled) == 4, "T = 5 and 7 share one compiled function"


@pytest.mark.parametrize("failure", ["compile", "results"])
def test_compile_failure_falls_back(monkeypatch, rng, fast_writes, failure):
    """No working C++ compiler, or compiled code whose results differ from the ops' (both simulated; the
    first call in place, so wrong results have overwritten q): one warning, then the torch ops, with the
    oracle's results."""
    def broken(args, pair_dim, aliases):
        if failure == "compile":
            raise RuntimeError("no C++ compiler")
        return lambda *a: [out.zero_() for out in a[4:6]]

    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "sync")
    monkeypatch.setattr(torch_cpu_compiled, "MIN_TOKENS", 2)
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setattr(torch_cpu_compiled, "_compiled", {})
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    monkeypatch.setattr(torch_cpu_compiled, "_compile", broken)
    T, Hq, Hkv, D, P = 6, 2, 1, 32, 16
    for i in range(2):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
        slots = make_slots(rng, T, P)
        match = "no C.. compiler" if failure == "compile" else "differ from the torch ops"
        with pytest.warns(RuntimeWarning, match=match) if i == 0 else _no_warning():
            run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, "float32", P, Hkv, D),
                                                                          slots), **({"q_out": q} if i == 0 else {}))
    assert torch_cpu_compiled._state["failed"] and (fast_writes[STEP], fast_writes[OPS]) == (0, 4)


def test_compiles_in_the_background(monkeypatch, rng, fast_writes):
    """By default no call compiles: a layout's first COMPILE_AFTER calls run the torch ops (the first call of
    a process stays fast), then its graph compiles in a background thread while the ops serve, and later
    calls run it; every call with the oracle's results."""
    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "on")
    monkeypatch.setattr(torch_cpu_compiled, "MIN_TOKENS", 2)
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setattr(torch_cpu_compiled, "COMPILE_AFTER", 3)
    monkeypatch.setattr(torch_cpu_compiled, "_compiled", {})
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    started = []
    build = torch_cpu_compiled._build
    monkeypatch.setattr(torch_cpu_compiled, "_build", lambda *a: started.append(a[0]) or build(*a))
    T, Hq, Hkv, D, P = 6, 3, 1, 64, 32

    def call():
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")
        slots = make_slots(rng, T, P, skip_every=0)
        run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, "bfloat16", P, Hkv, D), slots))

    for i in range(3):
        call()
        assert len(started) == (i == 2) and fast_writes[STEP] == 0, f"call {i}: nothing compiled in a call"
    torch_cpu_compiled.wait()
    call()
    assert (fast_writes[STEP], fast_writes[STEP_WRITE], fast_writes[OPS]) == (1, 1, 6)
    assert not torch_cpu_compiled._state["failed"]


def test_a_background_compile_failure_falls_back(monkeypatch, rng, fast_writes):
    """A compile that fails in the background thread (a torch whose private inductor API changed,
    simulated): one warning, the compiled step off, and every call before and after it served by the
    torch ops with the oracle's results."""
    def broken(args, pair_dim, aliases):
        raise AttributeError("module 'torch._inductor.compile_fx' has no attribute 'compile_fx'")

    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "on")
    monkeypatch.setattr(torch_cpu_compiled, "MIN_TOKENS", 2)
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setattr(torch_cpu_compiled, "COMPILE_AFTER", 2)
    monkeypatch.setattr(torch_cpu_compiled, "_compiled", {})
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    monkeypatch.setattr(torch_cpu_compiled, "_compile", broken)
    T, Hq, Hkv, D, P = 6, 2, 1, 32, 16
    with pytest.warns(RuntimeWarning, match="has no attribute"):
        for i in range(4):
            q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
            slots = make_slots(rng, T, P)
            run_checked(X, q, k, v, make_positions(rng, T), slots,
                        poison(make_cache(rng, "float32", P, Hkv, D), slots))
            if i == 1:
                torch_cpu_compiled.wait()
    assert torch_cpu_compiled._state["failed"] and (fast_writes[STEP], fast_writes[OPS]) == (0, 8)


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", [n for n, (*_, pool) in NORMS.items() if pool == "float"])
@pytest.mark.parametrize("T", [1, 9, 130])
def test_qk_norm_on_the_fast_path(dtype, name, T, rng, fast_writes):
    """QK norm (before or after RoPE, with or without weights, partial and GPT-J rotations) on the fast path,
    q/k as views of a fused QKV row, within the norm's bound of the oracle."""
    D, spec_kw, norm_kw, _ = NORMS[name]
    norm = norm_for(rng, D, **norm_kw)
    Hq, Hkv, P = 3, 2, 2 * T + 5
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P)
    run_checked(X, q, k, v, make_positions(rng, T, high=100_000), slots,
                poison(make_cache(rng, dtype, P, Hkv, D), slots), rope=RopeSpec(head_dim=D, **spec_kw),
                qk_norm=norm, arith=norm_arith(norm))
    assert fast_writes[OPS] == 2


SCALES = {"floats": (0.37, 0.61), "per-head": (np.array([0.37, 1.9, 0.05], np.float32), 0.5),
          "one-element": (np.array([0.25], np.float32), np.array([2.5], np.float32))}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("fp8,scales", [("float8_e4m3fn", "floats"), ("float8_e4m3fn", "per-head"),
                                        ("float8_e5m2", "one-element")])
@pytest.mark.parametrize("T", [1, 9])
def test_fp8_pools_on_the_fast_path(dtype, layout, fp8, scales, T, rng, fast_writes):
    """fp8 pools (value / scale, saturated; scales as floats, per head, one element) on the fast path, pool
    rows bit for bit the oracle's quantized rows, skipped tokens untouched."""
    Hq, Hkv, D, P = 4, 3, 64, 40
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, dtype)
    slots = make_slots(rng, T, P, skip_every=4 if T > 1 else 0)  # (one skipped token would write nothing)
    cache = poison(make_cache(rng, fp8, P, Hkv, D, **LAYOUTS[layout]), slots)
    k_scale, v_scale = SCALES[scales]
    run_checked(X, q, k, v, make_positions(rng, T), slots, cache, k_scale=k_scale, v_scale=v_scale)
    assert fast_writes[OPS] == 2


def test_uncovered_features_take_the_general_path(rng, fast_writes):
    """MRoPE positions are not the fast path's: the call runs (checked) on torch_eager."""
    T, Hq, Hkv, D, P = 5, 2, 1, 64, 8
    q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")
    slots = make_slots(rng, T, P)
    run_checked(X, q, k, v, make_positions(rng, 3 * T).reshape(3, T), slots, make_cache(rng, "bfloat16", P, Hkv, D),
                rope=RopeSpec(head_dim=D, mrope_section=(8, 12, 12)))
    assert fast_writes[OPS] == 0


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


@pytest.fixture
def spy(monkeypatch):
    """The results of Fast's methods named, call by call: spy("from_table") -> that list."""
    seen = {}

    def watch(name):
        method = getattr(torch_cpu.Fast, name)

        def wrapped(self, *a):
            seen[name].append(method(self, *a))
            return seen[name][-1]

        seen[name] = []
        monkeypatch.setattr(torch_cpu.Fast, name, wrapped)
        return seen[name]
    return watch


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("scaling", [None, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)])
def test_cos_sin_table_and_past_its_bound(monkeypatch, spy, style, scaling, rng, fast_writes):
    """Few tokens at positions below the bound read cos/sin from the table, which grows by chunks as
    positions rise; past the bound (or past _TABLE_TOKENS tokens) they are computed. Oracle's results each time."""
    monkeypatch.setattr(torch_cpu, "_TABLES", {})
    monkeypatch.setattr(torch_cpu, "_table_bytes", [0])
    monkeypatch.setattr(torch_cpu, "_TABLE_POSITIONS", 1000)
    monkeypatch.setattr(torch_cpu, "_TABLE_CHUNK", 256)
    from_table = spy("from_table")
    Hq, Hkv, D, P = 3, 1, 64, 128  # rotary_dim / 2 = 32: the table's smallest
    rope = RopeSpec(head_dim=D, style=style, scaling=scaling)
    rows = []
    for T, high in ((1, 200), (7, 600), (1, 999), (3, 5000), (torch_cpu._TABLE_TOKENS + 1, 500)):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
        positions = make_positions(rng, T, high=high)
        positions[0] = high  # the largest position reached
        slots = make_slots(rng, T, P)
        run_checked(X, q, k, v, positions, slots, poison(make_cache(rng, "float32", P, Hkv, D), slots), rope=rope)
        (tables,) = torch_cpu._TABLES.values()
        rows.append(next(iter(tables.values()))[0].shape[0])
    assert len(from_table) == 3 and fast_writes[OPS] == 10
    assert rows == [256, 768, 1024, 1024, 1024]


def test_fused_qk_of_one_token(spy, rng, fast_writes):
    """One token of a fused QKV output rotates q and k as one view, into contiguous q_rot and k_rot;
    q and k of separate tensors, several tokens, or partial RoPE do not."""
    fused = spy("fused_pairs")
    Hq, Hkv, D, P = 4, 2, 64, 32
    for T, separate, rope in ((1, False, None), (1, True, None), (1, False, RopeSpec(head_dim=D, rotary_dim=32)),
                              (5, False, None)):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "bfloat16")
        if separate:
            q, k = q.clone(), k.clone()
        slots = make_slots(rng, T, P)
        res = run_checked(X, q, k, v, make_positions(rng, T), slots, poison(make_cache(rng, "bfloat16", P, Hkv, D),
                                                                           slots), rope=rope)
        assert res.q_rot.is_contiguous() and res.k_rot.is_contiguous()
    assert [x is not None for x in fused] == [True, False, False] and fast_writes[OPS] == 8


def test_a_steps_arrays_are_checked_and_rotated_once(spy, rng):
    """Positions and slots a serving step registers (values.STEP) have their values checked and their
    cos/sin made once for every layer's call, with the oracle's results; an unregistered array, even
    equal, is checked in full; the next step starts afresh."""
    from ropepool import RopePoolError
    from ropepool.checks.values import STEP

    computed = spy("_cos_sin")
    T, Hq, Hkv, D, P = 5, 2, 1, 64, 32
    positions, slots = torch.from_numpy(make_positions(rng, T)), torch.from_numpy(make_slots(rng, T, P))

    def layer(pos, slt):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
        run_checked(X, q, k, v, pos, slt, poison(make_cache(rng, "float32", P, Hkv, D), slt.numpy()))

    try:
        STEP.begin(positions, slots)
        for _ in range(3):
            layer(positions, slots)
        assert len(computed) == 1, "cos/sin once for the step's three layers"
        bad = slots.clone()
        bad[1] = bad[0] = 3  # not the step's array: checked, though the step's passed
        with pytest.raises(RopePoolError, match="unique"):
            layer(positions, bad)
        STEP.begin(positions.clone(), slots)  # the next step
        layer(STEP.arrays[0], slots)
        assert len(computed) == 2
    finally:
        STEP.begin()


def test_a_steps_skipped_slots_per_array(rng):
    """Two groups of layers in one step (values.STEP holds both slot arrays, each with skipped tokens): each
    call writes its own array's rows, with the oracle's results (the skipped tokens are found once per array
    and step, never taken from the other array's)."""
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


def test_a_steps_groups_share_its_cos_sin(spy, rng):
    """Layers of two cache groups (pools of two sizes, each group's slots registered as its first layer
    comes: values.STEP.add) make the step's cos/sin of one rotation once, with the oracle's results;
    another rotation makes its own."""
    from ropepool import RopeSpec
    from ropepool.checks.values import STEP

    computed = spy("_cos_sin")
    T, Hq, Hkv, D = 5, 2, 1, 64
    positions = torch.from_numpy(make_positions(rng, T))
    slots = {P: torch.from_numpy(make_slots(rng, T, P)) for P in (32, 48)}
    try:
        STEP.begin(positions)
        for P, rope in ((32, None), (48, None), (32, RopeSpec(head_dim=D, base=1e6))):
            if not STEP.holds(slots[P]):
                STEP.add(slots[P])
            q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
            run_checked(X, q, k, v, positions, slots[P], poison(make_cache(rng, "float32", P, Hkv, D),
                                                                   slots[P].numpy()), rope=rope)
        assert len(computed) == 2, "once for the two groups' layers, once for the other rotation"
    finally:
        STEP.begin()
