"""The CPU path's one-token lane (backends/torch_cpu.py ``Fast.one_token``): a decode call of a fused QKV
output into a flat pool. Each case counts the lane (backends/paths.py), checks the oracle's results
(tests.harness.run_checked: pool rows bit for bit, the rest of the pools untouched) and compares the
lane's outputs bit for bit with those of the same call with the lane turned off."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import CosSinCache, RopeSpec  # noqa: E402
from ropepool.backends import paths, torch_cpu, torch_cpu_compiled  # noqa: E402
from ropepool.checks.values import STEP  # noqa: E402
from tests.harness import FLOATS, Backend, cos_sin_table, make_cache, poison, run_checked  # noqa: E402
from tests.test_cpu_path import fused_qkv  # noqa: E402

X = Backend("torch", "cpu")
LANE = "torch_cpu.one_token"
Hq, Hkv, D, P = 4, 2, 64, 32


POOLS = {"q's dtype": (None, None, None), "e4m3, float scales": ("float8_e4m3fn", 0.37, 0.61),
         "e5m2, one-element scales": ("float8_e5m2", np.array([0.25], np.float32), np.array([2.5], np.float32))}


def _call(q, k, v, positions, slots, pools, rope, scales, paged=None):
    k_pool, v_pool = (X.array(x.copy()) for x in pools)
    k_scale, v_scale = (torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in scales)
    out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
                                   num_kv_heads=Hkv, rope=rope, backend="torch", k_scale=k_scale, v_scale=v_scale,
                                   kv_layout=(paged or {}).get("kv_layout"))
    return [x.clone() for x in out]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rope", ["plain", "yarn"])
@pytest.mark.parametrize("slot", [5, -1])
@pytest.mark.parametrize("step", [False, True])
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_one_token_lane(dtype, rope, slot, step, pool, rng, monkeypatch):
    """Plain and scaled rotations, bf16/fp16/fp32, a written and a skipped token, positions of a serving
    step (values.STEP) or not, pools of q's dtype or fp8 (value / scale): the lane runs, with the oracle's
    results and the general run's bits."""
    pool_dtype, *scales = POOLS[pool]
    spec = RopeSpec(head_dim=D, base=500000.0, scaling=None if rope == "plain" else {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    q, k, v = fused_qkv(rng, 1, Hq, Hkv, D, dtype)
    positions, slots = torch.tensor([int(rng.integers(0, 5000))]), torch.tensor([slot])
    cache = poison(make_cache(rng, pool_dtype or dtype, P, Hkv, D), slots.numpy())
    pools = [np.asarray(x).copy() for x in cache.owners]
    try:
        if step:
            STEP.begin(positions, slots)
        with paths.counting() as seen:
            run_checked(X, q, k, v, positions, slots, cache, rope=spec, k_scale=scales[0], v_scale=scales[1])
            lane = _call(q, k, v, positions, slots, pools, spec, scales)
        assert seen[LANE] == 2
        monkeypatch.setattr(torch_cpu.Fast, "one_token", lambda *a: None)
        with paths.counting() as seen:
            general = _call(q, k, v, positions, slots, pools, spec, scales)
        assert seen[LANE] == 0
    finally:
        STEP.begin()
    for a, b in zip(lane, general):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("case", ["separate", "paged", "table", "partial", "past-pool"])
def test_one_token_lane_not_taken(case, rng):
    """Calls outside the lane (q and k apart, a paged pool, an engine's table, partial RoPE, a slot past
    the pool of a runner called unchecked) go the general way, with the oracle's results."""
    q, k, v = fused_qkv(rng, 1, Hq, Hkv, D, "bfloat16")
    if case == "separate":
        q, k = q.clone(), k.clone()
    rope = {"table": CosSinCache(cos_sin_table(4096, RopeSpec(head_dim=D).inv_freq), is_neox=True),
            "partial": RopeSpec(head_dim=D, rotary_dim=32)}.get(case, RopeSpec(head_dim=D))
    positions, slots = torch.tensor([17]), torch.tensor([3])
    layout = dict(kv_layout="NHD", page_size=4) if case == "paged" else {}
    cache = poison(make_cache(rng, "bfloat16", P, Hkv, D, **layout), slots.numpy())
    with paths.counting() as seen:
        # past-pool: validation would refuse the slot; the bound runner gets it (bypass) and writes nothing
        run_checked(X, q, k, v, positions, torch.tensor([P]) if case == "past-pool" else slots, cache, rope=rope,
                    bypass=case == "past-pool", kv_layout=layout.get("kv_layout"))
    assert seen[LANE] == 0


COMPILED = "torch_cpu.compiled_one_token"
# (dtype, rope, pool layout, pool): each axis's values once, a graph each (~3 s to compile where inductor's disk
# cache does not hold it)
GRAPH_CASES = [("bfloat16", "plain", "flat", "q's dtype"), ("float32", "gptj", "NHD", "e4m3, float scales"),
               ("float16", "yarn", "HND", "e5m2, one-element scales"), ("bfloat16", "gptj", "HND", "q's dtype"),
               ("bfloat16", "plain", "flat", "e4m3, per-head scales")]
POOLS["e4m3, per-head scales"] = ("float8_e4m3fn", np.array([0.3, 2.0], np.float32), np.array([1.5, 0.2], np.float32))


@pytest.mark.parametrize("case", GRAPH_CASES, ids=["-".join(c) for c in GRAPH_CASES])
def test_compiled_one_token(case, rng, monkeypatch):
    """Compiled (ROPEPOOL_CPU_COMPILE=sync), the lane is one call of inductor's code: for q and k apart
    or in one row, flat and paged pools, fp8 with float, one-element and per-head scales, each call runs it
    with the oracle's results and the general run's bits; a negative slot goes to the torch ops."""
    dtype, rope, layout, pool = case
    pool_dtype, *scales = POOLS[pool]
    spec = RopeSpec(head_dim=D, base=500000.0, style="gptj" if rope == "gptj" else "neox", scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64} if rope == "yarn" else None)
    paged = {} if layout == "flat" else dict(kv_layout=layout, page_size=4)
    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "sync")
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)
    for fused, slot in ((True, 5), (False, 9), (True, -1)):
        q, k, v = fused_qkv(rng, 1, Hq, Hkv, D, dtype)
        if not fused:
            q, k, v = q.clone(), k.clone(), v.clone()
        positions, slots = torch.tensor([int(rng.integers(0, 5000))]), torch.tensor([slot])
        cache = poison(make_cache(rng, pool_dtype or dtype, P, Hkv, D, **paged), slots.numpy())
        pools = [np.asarray(x).copy() for x in cache.owners]
        with paths.counting() as seen:
            run_checked(X, q, k, v, positions, slots, cache, rope=spec, k_scale=scales[0], v_scale=scales[1],
                        kv_layout=paged.get("kv_layout"))
            lane = _call(q, k, v, positions, slots, pools, spec, scales, paged)
        assert seen[COMPILED] == (2 if slot >= 0 else 0), (fused, slot)
        with monkeypatch.context() as m:
            m.setattr(torch_cpu.Fast, "compiled_one_token", lambda *a: None)
            m.setattr(torch_cpu.Fast, "one_token", lambda *a: None)
            general = _call(q, k, v, positions, slots, pools, spec, scales, paged)
        for a, b in zip(lane, general):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch_cpu_compiled.failed(), "the compiled one-token step gave up (see the warning)"


def test_two_graphs_compile_in_the_background_at_once(rng, monkeypatch):
    """A one-token call and a 5-token call, each of a layout whose graph starts compiling in the background:
    the two compiles run one after the other (traced at once in two threads they failed, which turned the
    compiled path off for the process), and then each layout's calls run their graph."""
    monkeypatch.setenv("ROPEPOOL_CPU_COMPILE", "on")
    monkeypatch.setattr(torch_cpu, "_FEW_ELEMENTS", 0)  # small calls too: not the few-rows lane
    monkeypatch.setattr(torch_cpu_compiled, "COMPILE_AFTER", 1)
    monkeypatch.setattr(torch_cpu_compiled, "_compiled", {})
    monkeypatch.setitem(torch_cpu_compiled._state, "failed", False)

    def call(T):
        q, k, v = fused_qkv(rng, T, Hq, Hkv, D, "float32")
        slots = torch.from_numpy(rng.permutation(P)[:T])
        cache = poison(make_cache(rng, "float32", P, Hkv, D), slots.numpy())
        run_checked(X, q, k, v, torch.from_numpy(rng.integers(0, 5000, T)), slots, cache)

    call(1)
    call(5)  # (its graph starts compiling while the one-token graph does)
    torch_cpu_compiled.wait()
    assert not torch_cpu_compiled.failed(), "a compile failed (see the warning)"
    with paths.counting() as seen:
        call(1)
        call(5)
    assert (seen[COMPILED], seen["torch_cpu.compiled_step"]) == (1, 1)
