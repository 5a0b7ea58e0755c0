"""The layout cache's key-only hit of the native CPU kernel's runner (plan/cache.py, ``_FAST``): a later call of
the same key reaches the kernel without the guard, the kernel compares the call's layout with the one it was bound
to, and any other layout is looked up with the guards or checked in full, as if the key-only hit did not exist:
the same error (nothing written) or the same bits as a first call of that layout.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import RopePoolError, plan  # noqa: E402
from ropepool.backends import paths, torch_native  # noqa: E402
from ropepool.plan import cache  # noqa: E402

pytestmark = pytest.mark.skipif(torch_native.native.kernel() is None, reason="the native kernel is not built")

Hq, Hkv, D, P = 4, 2, 64, 32
CALL = "torch_native.call"


@pytest.fixture(autouse=True)
def forgotten():
    plan.forget()
    yield
    plan.forget()


def make(T=1, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    positions = torch.arange(T) * 5 + 3
    slots = torch.arange(T) * 3 + 1
    return [q, k, v, positions, slots, torch.zeros(P, Hkv, D, dtype=dtype), torch.zeros(P, Hkv, D, dtype=dtype)]


def call(q, k, v, positions, slots, k_pool, v_pool):
    return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
                                    num_kv_heads=Hkv)


def first_call(arrays):
    """What the call gives checked in full, nothing remembered (on copies of the pools): its outputs or its error."""
    saved = (dict(cache._SEEN), dict(cache._FAST))
    plan.forget()
    try:
        k_pool = arrays[5].clone()
        return call(*arrays[:5], k_pool, k_pool if arrays[6] is arrays[5] else arrays[6].clone())
    except RopePoolError as e:
        return e
    finally:
        plan.forget()
        cache._SEEN.update(saved[0])
        cache._FAST.update(saved[1])


def same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_key_only_hit(monkeypatch):
    """A later one-token call of the layout runs the kernel with no guard compared (``entry`` not called)."""
    call(*make())
    want = first_call(make(seed=1))
    monkeypatch.setattr(cache, "entry", lambda *a: pytest.fail("the guarded lookup ran"))
    with paths.counting() as seen:
        same_bits(call(*make(seed=1)), want)
    assert seen[CALL] == 1


def _fused(a):  # q, k, v as views of one projection row: other token strides
    qkv = torch.cat([x.reshape(1, -1) for x in a[:3]], 1)
    a[:3] = [x.view(1, -1, D) for x in qkv.split([Hq * D, Hkv * D, Hkv * D], 1)]


def _strided_dim(a):  # q's last dim strided: validation refuses it (the kernel could read it)
    a[0] = torch.cat([a[0], a[0]], -1)[..., ::2]


def _v_tokens(a):  # v with two tokens, q and k with one
    a[2] = torch.cat([a[2], a[2]])


def _one_pool(a):  # both pools one memory
    a[6] = a[5]


def _pool_dtype(a):  # float16 pools for bfloat16 q, k, v
    a[5], a[6] = a[5].half(), a[6].half()


def _slots_int32(a):
    a[4] = a[4].int()


def _pools_grow(a):  # more rows: the slots' bound changes
    a[5], a[6] = torch.zeros(2 * P, Hkv, D, dtype=a[5].dtype), torch.zeros(2 * P, Hkv, D, dtype=a[6].dtype)


def _slot_twice(a):  # three tokens (the layout's own), two of them to one slot: refused by the value check
    a[:] = make(T=3, seed=4)
    a[4] = torch.tensor([1, 1, 4])


@pytest.mark.parametrize("change", [_fused, _strided_dim, _v_tokens, _one_pool, _pool_dtype, _slots_int32, _pools_grow,
                                    _slot_twice])
def test_other_layout_as_first_call(change):
    """A call of the key in another layout after a key-only runner exists: the first call's error with every pool
    byte unchanged, or its bits (the layout bound anew, then found by its key)."""
    call(*make())
    arrays = make(seed=2)
    change(arrays)
    want = first_call(arrays)
    before = [x.clone() for x in arrays[5:7]]
    if isinstance(want, RopePoolError):
        with pytest.raises(RopePoolError) as got:
            call(*arrays)
        assert str(got.value) == str(want)
        same_bits(arrays[5:7], before)
        return
    with paths.counting() as seen:
        same_bits(call(*arrays), want)
    again = first_call(arrays)
    with paths.counting() as seen_again:
        same_bits(call(*arrays), again)  # the new layout's runner, found by its key
    assert seen[CALL] == seen_again[CALL] == 1


class _Sub(torch.Tensor):
    """A tensor subclass (validation refuses it)."""


def test_subclass_refused():
    """A tensor subclass has no layout the kernel sees: after a key-only runner exists, a call with one is checked in
    full and refused, as a first call is, nothing written."""
    call(*make())
    arrays = make(seed=3)
    arrays[1] = arrays[1].as_subclass(_Sub)
    with pytest.raises(TypeError, match="expects k to be a torch.Tensor"):
        call(*arrays)
    assert not arrays[5].any()


def test_autograd_goes_to_the_general_code():
    """q requiring grad after a key-only runner exists: the general torch code, as a first call (autograd)."""
    call(*make(dtype=torch.float32))
    arrays = make(dtype=torch.float32, seed=3)
    arrays[0].requires_grad_()
    with paths.counting() as seen:
        q_rot, *_ = call(*arrays)
    assert seen[CALL] == 0 and q_rot.requires_grad


def test_transformers_layer_in_another_layout():
    """transformers' bound layer call (integrations/transformers/attention.py run_layer) given q, k, v of other
    strides after its first call: the bits of a first call of that layout (the kernel's runner raised OtherLayout,
    nothing done, and the call was checked in full)."""
    from ropepool.integrations.transformers import attention, paged
    from ropepool.integrations.transformers.model import Layer

    layer = Layer(0, ropepool.RopeSpec(head_dim=D), None, None)

    def run(q, k, v, pools):
        kv = paged.LayerKV(*pools, torch.tensor([3, 9]), torch.tensor([4, 7]), torch.empty(0, dtype=torch.int64),
                           None, ("step",), 9)
        return attention.run_layer(layer, q, k, v, kv)

    def fresh(T):
        a = make(T=T, dtype=torch.float32, seed=T)
        return a[:3], a[5:7]

    (q, k, v), pools = fresh(2)
    run(q, k, v, pools)
    (q, k, v), pools = fresh(2)
    qkv = torch.cat([x.reshape(2, -1) for x in (q, k, v)], 1)  # the same values, other token strides
    views = [x.view(2, -1, D) for x in qkv.split([Hq * D, Hkv * D, Hkv * D], 1)]
    want_pools = [x.clone() for x in pools]
    attention._BOUND.clear()
    plan.forget()
    want = run(*views, want_pools)
    (q, k, v), pools = fresh(2)
    attention._BOUND.clear()
    plan.forget()
    run(q, k, v, pools)  # bound to contiguous q, k, v
    same_bits(run(*views, pools), want)
    same_bits(pools, want_pools)
