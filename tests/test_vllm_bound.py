"""integrations.vllm.layer_rope_and_cache: an engine layer's runner bound after a first checked call.

Its later calls must do what ``rope_and_cache`` (the checked call, tests/test_vllm.py and the engine tests)
does, bit for bit, on the CPU route's cache layouts; and a call the bound runner may not take (another cache,
another rotation, other strides, disagreeing token counts, bad slot or position values) goes through the
checks, as ``rope_pool_fused``'s layout cache would send it.
"""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

import ropepool
from ropepool.integrations import vllm as rv
from tests.harness import assert_same_bits

HQ, HKV, D, BLOCKS, BS = 8, 2, 32, 6, 16


def inputs(gen, dtype, T):
    """q, k, v as views of one fused projection (vLLM's), positions and T distinct slots (one skipped)."""
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], -1))
    positions = torch.randint(0, 4000, (T,), generator=gen)
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:T]
    slots[T // 2] = -1
    return q, k, v, positions, slots


def cache(gen, dtype):
    return torch.randn(BLOCKS, HKV, BS, 2 * D, generator=gen).to(dtype)  # vLLM's CPU cache shape (and packed's)


def tables(gen):
    t = torch.randn(4096, D, generator=gen)
    return ropepool.CosSinCache.held_weakly(t, is_neox=True), t


@pytest.fixture
def checked(monkeypatch):
    """Counts the calls that go through rope_and_cache (the checked call), not the bound runner."""
    calls = []
    original = rv.rope_and_cache

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(rv, "rope_and_cache", counting)
    return calls, original


def both(original, holder, args, kv_a, kv_b, layout, rope, norm):
    """The call through layer_rope_and_cache into kv_a and through rope_and_cache into kv_b, on copies of q and k
    (contiguous), v as given; asserts q, k and the caches the same bits."""
    q, k, v, pos, slots = args
    qa, ka, qb, kb = q.clone(), k.clone(), q.clone(), k.clone()
    rv.layer_rope_and_cache(holder, qa, ka, v, pos, kv_a, slots, layout=layout, rope=rope, qk_norm=norm)
    original(qb, kb, v, pos, None, None, kv_b, slots, layout=layout, rope=rope, qk_norm=norm)
    for name, a, b in (("q", qa, qb), ("k", ka, kb), ("kv_cache", kv_a, kv_b)):
        assert_same_bits(name, a, b)


@pytest.mark.parametrize("layout", ["cpu", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_bound_calls_are_the_checked_calls(checked, layout, dtype, normed):
    calls, original = checked
    gen = torch.Generator().manual_seed(7)
    rope, _ = tables(gen)
    norm = ropepool.QKNorm(torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5) if normed else None
    kv_a = cache(gen, dtype)
    kv_b = kv_a.clone()
    holder = types.SimpleNamespace()
    # a prefill, then decode steps of the batch as it changes (one token: the views' strides are others, torch
    # gives a dim of size 1 its own, so the layout cache's guard and the bound key miss: a checked call, bound anew)
    for step, (T, checked_calls) in enumerate(((9, 1), (3, 1), (3, 1), (5, 1), (2, 1), (1, 2), (1, 2), (4, 3))):
        both(original, holder, inputs(gen, dtype, T), kv_a, kv_b, layout, rope, norm)
        assert len(calls) == checked_calls, f"step {step}: {len(calls)} checked calls, expected {checked_calls}"


def test_values_are_checked_on_bound_calls(checked):
    """Broken on purpose (no value check on a bound call): the slot past the pool was skipped, not refused."""
    calls, _ = checked
    gen = torch.Generator().manual_seed(8)
    rope, table = tables(gen)  # (held here: the CosSinCache holds it weakly)
    kv = cache(gen, torch.float32)
    holder = types.SimpleNamespace()
    q, k, v, pos, slots = inputs(gen, torch.float32, 4)
    rv.layer_rope_and_cache(holder, q, k, v, pos, kv, slots, layout="cpu", rope=rope)
    for bad_slots, bad_pos, what in ((torch.tensor([0, 1, BLOCKS * BS, 2]), pos, "slots"),
                                     (torch.tensor([5, 6, 5, 7]), pos, "slot"),
                                     (slots, torch.tensor([3, -1, 4, 5]), "positions")):
        q, k, v, _, _ = inputs(gen, torch.float32, 4)
        q0, k0, kv0 = q.clone(), k.clone(), kv.clone()
        with pytest.raises(ropepool.RopePoolError, match=what):
            rv.layer_rope_and_cache(holder, q, k, v, bad_pos, kv, bad_slots, layout="cpu", rope=rope)
        for name, x, x0 in (("q", q, q0), ("k", k, k0), ("kv_cache", kv, kv0)):
            assert_same_bits(f"{name} after a refused call", x, x0)
    assert len(calls) == 1  # the bound runner's value checks refused them, not a checked call


def test_unpadded_calls_hand_the_engine_tensors_to_the_runner(checked):
    """Without padding the bound runner gets vLLM's own q, k, v and positions (no views made per call); padded rows
    (more queries than slots) are still cut off, and stay untouched."""
    calls, original = checked
    gen = torch.Generator().manual_seed(10)
    rope, table = tables(gen)  # (held here: the CosSinCache holds it weakly)
    kv_a = cache(gen, torch.float32)
    kv_b = kv_a.clone()
    holder = types.SimpleNamespace()
    both(original, holder, inputs(gen, torch.float32, 5), kv_a, kv_b, "cpu", rope, None)
    bound, seen = holder._ropepool_bound, []
    holder._ropepool_bound = (*bound[:4], lambda *a: seen.append(a) or bound[4](*a), *bound[5:])
    q, k, v, pos, slots = inputs(gen, torch.float32, 5)
    q, k = q.clone(), k.clone()  # strided as both() gives them: the layout bound
    rv.layer_rope_and_cache(holder, q, k, v, pos, kv_a, slots, layout="cpu", rope=rope)
    assert [x is y for x, y in zip(seen[0][:5], (q, k, v, pos, slots))] == [True] * 5
    kv_b = kv_a.clone()
    q, k, v, pos, _ = inputs(gen, torch.float32, 7)  # 7 rows, 5 slots: the engine's padding
    both(original, holder, (q, k, v, pos, inputs(gen, torch.float32, 5)[4]), kv_a, kv_b, "cpu", rope, None)
    assert seen[1][0].shape[0] == 5 and len(calls) == 1  # (the bound runner took both)


def test_what_the_runner_may_not_take_is_checked(checked):
    """Broken on purpose, one at a time: without the cache's identity in the bound key the new cache stayed
    untouched (written into the old one); without the rope's, the new table went unused; without the token
    count check, a positions tensor shorter than the slots reached the runner."""
    calls, original = checked
    gen = torch.Generator().manual_seed(9)
    rope, _ = tables(gen)
    kv_a = cache(gen, torch.float32)
    kv_b = kv_a.clone()
    holder = types.SimpleNamespace()
    both(original, holder, inputs(gen, torch.float32, 3), kv_a, kv_b, "cpu", rope, None)
    # another cache of the same layout (another layer's tensor, a cache allocated anew)
    kv_c = cache(gen, torch.float32)
    kv_d = kv_c.clone()
    kv_a0 = kv_a.clone()
    both(original, holder, inputs(gen, torch.float32, 3), kv_c, kv_d, "cpu", rope, None)
    assert_same_bits("the earlier cache", kv_a, kv_a0)
    # another table
    other, table = tables(gen)  # (the table held here: a CosSinCache holds it weakly, as vLLM's module does)
    both(original, holder, inputs(gen, torch.float32, 3), kv_c, kv_d, "cpu", other, None)
    # q, k and v of their own (contiguous: other strides than the fused projection's views)
    q, k, v, pos, slots = inputs(gen, torch.float32, 3)
    both(original, holder, (q.contiguous(), k.contiguous(), v.contiguous(), pos, slots), kv_c, kv_d, "cpu",
         rope, None)
    assert len(calls) == 4
    # disagreeing token counts (fewer positions, values or queries than slots), after a call that bound this
    # layout: checked, and refused before anything is written
    both(original, holder, inputs(gen, torch.float32, 3), kv_c, kv_d, "cpu", rope, None)
    for short, what in ((3, "positions"), (2, "v shape"), (0, "positions")):
        args = list(inputs(gen, torch.float32, 3))
        args[:2] = args[0].clone(), args[1].clone()  # q and k strided as both() gives them
        args[short] = args[short][:2]
        kv_c0 = kv_c.clone()
        with pytest.raises(ropepool.RopePoolError, match=what):
            rv.layer_rope_and_cache(holder, *args[:4], kv_c, args[4], layout="cpu", rope=rope)
        assert_same_bits("the cache after a refused call", kv_c, kv_c0)


def test_freed_table_refused(checked):
    """The engine's table freed after the runner was bound (the CosSinCache holds it weakly): refused, nothing
    written."""
    gen = torch.Generator().manual_seed(12)
    rope, table = tables(gen)
    kv = cache(gen, torch.float32)
    holder = types.SimpleNamespace()
    q, k, v, pos, slots = inputs(gen, torch.float32, 3)
    rv.layer_rope_and_cache(holder, q, k, v, pos, kv, slots, layout="cpu", rope=rope)
    del table
    q, k, v, pos, slots = inputs(gen, torch.float32, 3)
    q0, kv0 = q.clone(), kv.clone()
    with pytest.raises(ropepool.RopePoolError, match="table of this rotation .* was freed"):
        rv.layer_rope_and_cache(holder, q, k, v, pos, kv, slots, layout="cpu", rope=rope)
    assert_same_bits("q after a refused call", q, q0)
    assert_same_bits("kv_cache after a refused call", kv, kv0)
