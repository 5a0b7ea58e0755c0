"""No cache of ropepool keeps a caller's table alive, and every cache stays within its bound.

Each test measures: weak references to the tables the calls used (dead once the caller drops them),
the caches' own sizes and bytes, and what the process still holds (Python objects: pymalloc's blocks;
MLX's active memory). Small tables and few heads: what is measured is what is retained across calls,
not how large a call is.
"""
import gc
import os
import sys
import weakref

import numpy as np
import pytest

import ropepool
from ropepool import plan, reference
from tests.harness import HAS

torch = pytest.importorskip("torch") if HAS["torch"] else None
pytestmark = pytest.mark.skipif(not HAS["torch"], reason="needs torch")

T, Hq, Hkv, D, P = 3, 2, 1, 64, 16
CALLS = 10_000


_ARGS = {}


def _call(rope, positions=(0, 1, 2), layer=None, T=T, backend=None):
    """One call on arrays made once per (token count, layer or not): only ``rope`` is new."""
    key = (T, layer is None)
    if key not in _ARGS:
        q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
        pools = [torch.zeros(P, Hkv, D) if layer is None else torch.zeros(4, P, Hkv, D) for _ in range(2)]
        _ARGS[key] = (q, k, v, torch.zeros(T, dtype=torch.int64), torch.arange(T) * 2, *pools)
    args = _ARGS[key]
    args[3].copy_(torch.tensor(positions[:T]))
    out = ropepool.rope_pool_fused(*args, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope, layer=layer,
                                   backend=backend)
    return args, out


class _Alive:
    """How many of the objects ``watch`` was given are still alive (a finalizer each, gone with it)."""

    def __init__(self):
        self.n = 0

    def watch(self, x):
        self.n += 1
        weakref.finalize(x, self._freed)

    def _freed(self):
        self.n -= 1


def _check_oracle(rope, args, out):
    """The results of one of the calls against the float64 oracle (q_rot, k_rot)."""
    q, k, v, pos, slots, kp, vp = (x.numpy() for x in args)
    if kp.ndim == 4:
        return
    rope_np = ropepool.CosSinCache(rope.cos_sin_cache.numpy(), is_neox=rope.is_neox)
    want = reference.rope_pool_fused(q, k, v, pos, slots, np.zeros_like(kp), np.zeros_like(vp), head_dim=D,
                                     num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope_np)
    for got, ref in zip(out[:2], want[:2]):
        np.testing.assert_allclose(got.numpy(), ref, atol=2e-6, rtol=0)


def _retained_blocks(run, n):
    """Python objects (pymalloc's blocks: ``sys.getallocatedblocks``, no tracing cost) still allocated after
    ``run(i)`` for i < n, past a warm-up of 100 calls. A cache that kept one small object a call would
    show some n of them."""
    for i in range(100):
        run(i)
    gc.collect()
    before = sys.getallocatedblocks()
    for i in range(100, n):
        run(i)
    gc.collect()
    return sys.getallocatedblocks() - before


def test_fresh_tables_are_freed():
    """10,000 CosSinCache objects over fresh tables, each called once and dropped: every table is freed, the
    layout cache keeps none of them, and fewer than 1,000 Python objects are retained (torch keeps a few hundred
    of its own; one kept per call would be 9,900)."""
    plan.forget()
    alive = _Alive()

    def run(i):
        table = torch.randn(8, 32)
        rope = ropepool.CosSinCache(table, is_neox=bool(i % 2))
        args, out = _call(rope)
        if i % 5000 == 0:
            _check_oracle(rope, args, out)
        alive.watch(table)

    grew = _retained_blocks(run, CALLS)
    assert alive.n == 0
    assert len(plan.cache._SEEN) == 0
    assert grew < 1000, grew


def test_one_table_many_cos_sin_caches():
    """10,000 new CosSinCache objects over one table: one remembered key, found again by each; the table is
    freed once the caller drops it, and the key with it."""
    plan.forget()
    tables = [torch.randn(8, 32)]
    misses = []
    full_check = ropepool.checks.validate.check

    def counted(*a, **kw):
        misses.append(type(a[0]))  # the oracle's own check (numpy) aside
        return full_check(*a, **kw)

    ropepool.checks.validate.check = counted
    try:
        def run(i):
            rope = ropepool.CosSinCache(tables[0], is_neox=True)
            args, out = _call(rope)
            if i % 5000 == 0:
                _check_oracle(rope, args, out)

        grew = _retained_blocks(run, CALLS)
    finally:
        ropepool.checks.validate.check = full_check
    assert misses.count(torch.Tensor) == 1 and len(plan.cache._SEEN) == 1
    assert grew < 1000, grew
    ref = weakref.ref(tables[0])
    tables.clear()
    assert ref() is None and len(plan.cache._SEEN) == 0


def test_caller_arrays_in_keys_stay_in_the_bytes_bound(monkeypatch):
    """A fresh QKNorm (its weight tensors) per call: the layout cache holds their bytes within its bound
    (a tight one here, 16 KB), so all but the last few of 2,000 weights are freed."""
    monkeypatch.setattr(plan.cache, "_MAX_BYTES", 16 << 10)
    plan.forget()
    alive = _Alive()
    for _ in range(2000):
        w = torch.randn(D)
        alive.watch(w)
        q, k, v, pos, slots, kp, vp = _ARGS.get((T, True)) or _call(None)[0]
        ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
                                 qk_norm=ropepool.QKNorm(w, w))
        del w
        assert plan.cache._held[0] <= 16 << 10
    assert alive.n <= (16 << 10) // (2 * 4 * D), alive.n
    plan.forget()


def test_many_rotations_stay_in_the_cpu_tables_bound(monkeypatch):
    """RopeSpecs of 200 bases at positions up to 12,000: the CPU path's cos/sin tables never exceed their
    bound in bytes (a tight one here, 4 MB), and the equal specs of every later pass share the first
    pass's tables."""
    from ropepool.backends import torch_native

    monkeypatch.setattr(torch_native, "_TABLE_BYTES", 4 << 20)
    torch_native.drop_tables()
    plan.forget()
    sizes = []
    for _ in range(2):
        for base in range(200):
            _call(ropepool.RopeSpec(head_dim=D, base=1000.0 + base % 20), positions=(5, 12_000, 7))
            sizes.append(sum(t.nbytes for pair in torch_native._TABLES.values() for t in pair))
            assert torch_native._table_bytes[0] == sizes[-1]
    assert max(sizes) <= 4 << 20, max(sizes)
    assert len(torch_native._TABLES) <= 20
    torch_native.drop_tables()


def test_decode_loop_stays_flat():
    """A long loop of decode-sized calls with changing token counts, layers and rotations (a computed one,
    fresh CosSinCache objects over two live tables, fresh tables): after warm-up the caches' sizes do not
    change and fewer than 1,000 Python objects are retained (one kept per call would be 4,900)."""
    plan.forget()
    tables = [torch.randn(64, 32), torch.randn(64, 64)]
    specs = [ropepool.RopeSpec(head_dim=D), ropepool.RopeSpec(head_dim=D, base=500000.0, rotary_dim=32)]

    def rope_of(i):
        kind = i % 4
        if kind < 2:
            return specs[kind]
        if kind == 2:
            return ropepool.CosSinCache(tables[i // 4 % 2], is_neox=bool(i // 8 % 2))
        return ropepool.CosSinCache(torch.randn(64, 32))

    def run(i):
        _call(rope_of(i), positions=(i % 60, 3, 1), layer=None if i % 3 == 0 else i % 4, T=1 + i % 3)

    sizes = []

    def sized(i):
        run(i)
        if i >= 200 and i % 500 == 0:
            sizes.append((len(plan.cache._SEEN), sum(map(len, plan.cache._SEEN.values()))))

    grew = _retained_blocks(sized, 5000)
    assert len(set(sizes)) == 1, sizes
    assert grew < 1000, grew


def test_triton_launcher_keeps_no_table():
    """The Triton launcher (here under its CPU interpreter) reads the table per call through its weak
    reference: fresh tables are freed."""
    if not HAS["triton"]:
        pytest.skip("needs triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the launcher on CPU tensors, under the interpreter (set where there is no GPU)")
    plan.forget()
    refs = []
    for _ in range(4):
        table = torch.randn(8, 32)
        rope = ropepool.CosSinCache(table)
        args, out = _call(rope, backend="triton")
        _check_oracle(rope, args, out)
        refs.append(weakref.ref(table))
        del table, rope, args, out
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_vllm_table_map_keeps_no_table():
    """The vLLM adapter's map of tables to CosSinCache: 10,000 fresh tables through ``_table`` and a few
    through ``rope_and_cache``, all freed; its entries go with them and stay under _MAX_TABLES."""
    from ropepool.integrations import vllm

    plan.forget()
    refs = []
    for _ in range(CALLS):
        table = torch.randn(8, 32)
        assert vllm._table(table, True).cos_sin_cache is table
        assert vllm._table(table, True) is vllm._table(table, True)
        refs.append(weakref.ref(table))
        assert len(vllm._TABLES) <= vllm._MAX_TABLES
    for _ in range(20):
        table = torch.randn(8, 32)
        q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
        kv_cache = torch.zeros(2, 4, 4, Hkv, D)
        vllm.rope_and_cache(q, k, v, torch.arange(T), table, True, kv_cache, torch.arange(T))
        refs.append(weakref.ref(table))
    del table
    assert sum(r() is not None for r in refs) == 0
    assert len(vllm._TABLES) == 0 and len(plan.cache._SEEN) == 0


@pytest.mark.skipif(not HAS["mlx"], reason="needs mlx")
def test_mlx_fresh_tables_are_freed():
    """MLX: 2,000 CosSinCache objects over fresh mx.array tables, each called and dropped: the tables are
    freed (weak references dead), MLX's active memory comes back, one key per live table at most."""
    import mlx.core as mx

    plan.forget()
    q, k, v = (mx.random.normal((T, h, D)) for h in (Hq, Hkv, Hkv))
    pos, slots = mx.array([0, 1, 2]), mx.array([0, 2, 4])
    pools = [mx.zeros((P, Hkv, D)) for _ in range(2)]
    refs, active = [], []
    for i in range(2000):
        table = mx.random.normal((8, 32))
        rope = ropepool.CosSinCache(table, is_neox=True)
        out = ropepool.rope_pool_fused(q, k, v, pos, slots, *pools, head_dim=D, num_qo_heads=Hq,
                                       num_kv_heads=Hkv, rope=rope)
        mx.eval(*out)
        pools = list(out[2:])
        refs.append(weakref.ref(table))
        del table, rope, out
        if i in (100, 1999):
            gc.collect()
            active.append(mx.get_active_memory())
    assert sum(r() is not None for r in refs) == 0
    assert len(plan.cache._SEEN_MLX) == 0
    assert active[1] <= active[0] + (64 << 10), active


@pytest.mark.skipif(not HAS["mlx"], reason="needs mlx")
def test_torch_and_mlx_calls_in_one_process_both_hit(monkeypatch):
    """Calls on torch tensors and on MLX arrays with the same scalar arguments, alternating: each framework's
    layout is checked once, then found (the torch cache's key matched the MLX calls too, which were then
    checked in full every time)."""
    import mlx.core as mx

    plan.forget()
    spec = ropepool.RopeSpec(head_dim=D)
    margs = [mx.array(x.numpy()) for x in _call(spec)[0]]
    checks = []
    full_check = ropepool.checks.validate.check
    monkeypatch.setattr(ropepool.checks.validate, "check",
                        lambda *a, **kw: checks.append(type(a[0])) or full_check(*a, **kw))
    for _ in range(10):
        _call(spec)
        out = ropepool.rope_pool_fused(*margs, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=spec)
        margs[5:7] = out[2:]
    assert checks == [mx.array], checks  # the torch layout was checked by _call above, before counting


def _per_token_head_call(pools, scales, backend=None, check=False):
    """One int8 per-token-head call (NHD pages of 4) writing ``pools`` and ``scales``; with ``check``, the
    pools and scale caches it wrote equal, bit for bit, what vLLM's writer (the port in tests/vllm_reference.py)
    stores from the returned k_rot and the given v, and q_rot/k_rot equal the float64 oracle."""
    from tests import vllm_reference

    q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
    pos, slots = torch.tensor([3, 0, 9]), torch.tensor([5, -1, 14])
    before = [x.clone() for x in (*pools, *scales)]
    out = ropepool.rope_pool_fused(q, k, v, pos, slots, *pools, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
                                   kv_layout="NHD", k_scale_cache=scales[0], v_scale_cache=scales[1],
                                   backend=backend)
    if check:
        want = [x.clone() for x in before]
        vllm_reference.reshape_and_cache_per_token_head(out[1], v, *want, slots)
        for got, exp in zip((*pools, *scales), want):
            assert torch.equal(got, exp)
        want = reference.rope_pool_fused(*(x.numpy() for x in (q, k, v, pos, slots, *before[:2])), head_dim=D,
                                         num_qo_heads=Hq, num_kv_heads=Hkv, kv_layout="NHD",
                                         k_scale_cache=before[2].numpy(), v_scale_cache=before[3].numpy())
        for got, ref in zip(out[:2], want[:2]):
            np.testing.assert_allclose(got.numpy(), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("fresh_pools", [False, True], ids=["same-pools", "fresh-pools"])
def test_fresh_scale_caches_are_freed(fresh_pools):
    """2,000 fresh per-token-head scale caches (k_scale_cache, v_scale_cache), each pair called once and dropped,
    over one pair of pools or fresh pools each time: every scale cache is freed, the layout cache keeps no key
    for them, and the results are vLLM's writer's. One pair called 100 times is one key, checked once."""
    plan.forget()
    alive = _Alive()
    shape = (P // 4, 4, Hkv)
    same = [torch.zeros(*shape, D, dtype=torch.int8) for _ in range(2)]
    for i in range(2000):
        pools = [torch.zeros(*shape, D, dtype=torch.int8) for _ in range(2)] if fresh_pools else same
        scales = [torch.zeros(shape) for _ in range(2)]
        _per_token_head_call(pools, scales, check=i % 500 == 0)
        for s in scales:
            alive.watch(s)
        assert len(plan.cache._SEEN) <= 1
        del scales, pools, s
    assert alive.n == 0
    assert len(plan.cache._SEEN) == 0 and len(plan.cache._WATCHED) == 0

    scales = [torch.zeros(shape) for _ in range(2)]
    checks = []
    full_check = ropepool.checks.validate.check
    ropepool.checks.validate.check = lambda *a, **kw: checks.append(type(a[0])) or full_check(*a, **kw)
    try:
        for i in range(100):
            _per_token_head_call(same, scales, check=i == 99)
    finally:
        ropepool.checks.validate.check = full_check
    assert checks.count(torch.Tensor) == 1 and len(plan.cache._SEEN) == 1
    ref = weakref.ref(scales[0])
    del scales
    assert ref() is None and len(plan.cache._SEEN) == 0


def test_triton_launcher_keeps_no_scale_cache():
    """The Triton launcher (here under its CPU interpreter) reads the scale caches per call through weak
    references: fresh ones are freed, and what it wrote is vLLM's writer's."""
    if not HAS["triton"]:
        pytest.skip("needs triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the launcher on CPU tensors, under the interpreter (set where there is no GPU)")
    plan.forget()
    pools = [torch.zeros(P // 4, 4, Hkv, D, dtype=torch.int8) for _ in range(2)]
    refs = []
    for _ in range(4):
        scales = [torch.zeros(P // 4, 4, Hkv) for _ in range(2)]
        _per_token_head_call(pools, scales, backend="triton", check=True)
        refs += [weakref.ref(s) for s in scales]
        del scales
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert len(plan.cache._SEEN) == 0


def test_in_place_calls_find_their_layout(monkeypatch):
    """q_out=q, k_out=k (vLLM's way): checked in full once, then found; outputs of their own are another key
    (checked again), and the in-place layout is still found after them."""
    plan.forget()
    full, full_check = [], ropepool.checks.validate.check
    monkeypatch.setattr(ropepool.checks.validate, "check", lambda *a, **kw: full.append(1) or full_check(*a, **kw))
    q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
    args = (v, torch.arange(T), torch.arange(T), *(torch.zeros(P, Hkv, D) for _ in range(2)))
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    for _ in range(3):
        ropepool.rope_pool_fused(q, k, *args, q_out=q, k_out=k, **kw)
    assert len(full) == 1
    ropepool.rope_pool_fused(q, k, *args, q_out=torch.empty_like(q), k_out=torch.empty_like(k), **kw)
    ropepool.rope_pool_fused(q, k, *args, q_out=q, k_out=k, **kw)
    assert len(full) == 2
