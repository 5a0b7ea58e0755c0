"""What is MLX's own: laziness, mx.compile, the graph's size, uint8 pools as e4m3, the backend choice.

The numbers (every shape, layout, feature) are checked against the oracle
on every backend, MLX included, in test_op, test_layouts and test_features.
Here: the call evaluates nothing (no mx.eval, its outputs come back
unevaluated and lazy inputs stay lazy), it runs under mx.compile, its graph
does not grow with the number of tokens (no per-token Python loop), and an
MLX uint8 pool holds exactly what ``mx.to_fp8`` stores for value / scale.

On Linux CI this is MLX's CPU backend (mlx-cpu); on a Mac the same tests run
on MLX's default device (its Apple GPU).
"""
from __future__ import annotations

import io

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]'): "
                                            "the MLX backend is not tested here")

import ropepool  # noqa: E402
from ropepool import QKNorm, RopeSpec, plan
from ropepool.checks import validate  # noqa: E402
from tests.harness import Backend, assert_same_bits, make_positions, make_slots, randn  # noqa: E402

X = Backend("mlx")


def primitives(*arrays) -> int:
    """How many unevaluated operations stand behind ``arrays`` (0: all evaluated)."""
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return f.getvalue().count("shape=rectangle")


def small_call(rng, T=9, dtype="float32"):
    """The arrays of a valid call (MLX) and its scalar arguments."""
    Hq, Hkv, D, P = 4, 2, 64, max(16, T + 4)
    arrays = [randn(rng, T, h, D, dtype=dtype) for h in (Hq, Hkv, Hkv)]
    arrays += [make_positions(rng, T), make_slots(rng, T, P), randn(rng, P, Hkv, D, dtype=dtype),
               randn(rng, P, Hkv, D, dtype=dtype)]
    return [X.array(a) for a in arrays], dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)


def test_never_calls_eval(monkeypatch, rng):
    arrays, kw = small_call(rng)
    mx.eval(*arrays)

    def refuse(*args, **kwargs):
        raise AssertionError("rope_pool_fused forced an evaluation (mx.eval / mx.async_eval)")

    with monkeypatch.context() as m:
        m.setattr(mx, "eval", refuse)
        m.setattr(mx, "async_eval", refuse)
        out = ropepool.rope_pool_fused(*arrays, **kw)
    mx.eval(*out)


def test_outputs_are_lazy(rng):
    """Every output comes back unevaluated (work still in the graph), and lazy inputs stay lazy."""
    arrays, kw = small_call(rng)
    mx.eval(*arrays)
    lazy = [a * 1 for a in arrays[:3]] + arrays[3:5] + [a * 1 for a in arrays[5:]]
    out = ropepool.rope_pool_fused(*lazy, **kw)
    for name, o in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out):
        assert primitives(o) > 0, f"{name} came back evaluated"
    for name, a in zip(("q", "k", "v", "k_pool", "v_pool"), lazy[:3] + lazy[5:]):
        assert primitives(a) > 0, f"{name} (a lazy input) was evaluated by the call"


@pytest.mark.parametrize("what", ["public-call", "public-call-all-traced", "backend-all-traced"])
def test_runs_under_compile(what, rng):
    """Under mx.compile any evaluation of a traced array raises: the call evaluates none.

    public-call: q, k, v and the pools traced (positions and slots are
    constants: validation reads their values). public-call-all-traced:
    positions and slots traced too (their values unread: MLX refuses to
    read them there, validate.check_host_values). backend-all-traced: every
    array traced, the MLX plan alone (as after validation).
    """
    arrays, kw = small_call(rng, dtype="bfloat16")
    q, k, v, positions, slots, k_pool, v_pool = arrays
    eager = ropepool.rope_pool_fused(*arrays, **kw)
    if what == "public-call":
        fn = mx.compile(lambda q, k, v, kp, vp: ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, **kw))
        compiled = fn(q, k, v, k_pool, v_pool)
    elif what == "public-call-all-traced":
        compiled = mx.compile(lambda *a: ropepool.rope_pool_fused(*a, **kw))(*arrays)
    else:
        run = plan.make(validate.check(*arrays, **kw), q, "mlx").bind(*arrays)
        compiled = mx.compile(lambda *a: run(*a))(*arrays)
    for name, c, e in zip(("q_rot", "k_rot", "k_pool", "v_pool"), compiled, eager):
        assert_same_bits(f"{name} compiled vs eager", X.numpy(c), X.numpy(e))


@pytest.mark.parametrize("tokens", [(2, 60), (100, 250)], ids=["compiled", "eager"])
def test_graph_does_not_grow_with_tokens(tokens, rng):
    """The same number of graph nodes for few tokens and for many: no per-token Python loop (decode-sized
    calls run as one compiled graph, larger ones eagerly: each pair stays on one path)."""
    from ropepool.backends import paths

    counts = []
    for T in tokens:
        arrays, kw = small_call(rng, T=T)
        mx.eval(*arrays)
        with paths.counting() as seen:
            counts.append(primitives(*ropepool.rope_pool_fused(*arrays, **kw)))
        assert seen["mlx.compiled"] == (tokens[0] == 2), f"T={T}: {seen['mlx.compiled']} compiled calls"
    assert counts[0] == counts[1], f"graph nodes: {counts[0]} for T={tokens[0]}, {counts[1]} for T={tokens[1]}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_calls_run_the_compiled_graph(dtype, rng):
    """Calls of up to Tuning.compile_tokens tokens run the mx.compile'd graph, traced once and then reused
    (its Python does not run again), with the oracle's numbers; a larger call runs the graph eagerly."""
    from ropepool.backends import paths
    from tests.harness import make_cache, poison, run_checked

    Hq, Hkv, D, P = 4, 2, 64, 128
    for T, compiled in ((plan.DEFAULT_TUNING.compile_tokens, 3), (plan.DEFAULT_TUNING.compile_tokens + 1, 0)):
        with paths.counting() as seen:
            for _ in range(3):
                slots = make_slots(rng, T, P)
                run_checked(X, randn(rng, T, Hq, D, dtype=dtype), randn(rng, T, Hkv, D, dtype=dtype),
                            randn(rng, T, Hkv, D, dtype=dtype), make_positions(rng, T), slots,
                            poison(make_cache(rng, dtype, P, Hkv, D), slots))
        assert seen["mlx.compiled"] == compiled, f"T={T}: {seen['mlx.compiled']} compiled calls of 3"
        traced = seen["mlx.traced"]
        assert traced <= 1 if compiled else traced == 3, f"T={T}: the graph's Python ran {traced} times in 3 calls"


@pytest.mark.parametrize("scales", ["floats", "per-head"])
def test_uint8_pool_is_e4m3_as_to_fp8_stores_it(scales, rng):
    """An MLX uint8 pool holds mx.to_fp8(value / scale): MLX's own conversion, bit for bit, saturated.

    The rotation runs with a norm, so the row quantized is the normalised
    and rotated k the call returns (in q's dtype), as on the other backends.
    """
    T, Hq, Hkv, D, P = 6, 3, 2, 64, 16
    q, k, v = (X.array(randn(rng, T, h, D, dtype="bfloat16", scale=3.0)) for h in (Hq, Hkv, Hkv))
    v = v * X.array(np.array([1.0, 400.0], np.float32)).astype(mx.bfloat16)[:, None]  # head 1 saturates
    k_scale, v_scale = (0.5, 0.25) if scales == "floats" else (X.array(np.array([0.5, 0.05], np.float32)),
                                                               X.array(np.array([0.25, 0.1], np.float32)))
    pools = [mx.array(np.random.default_rng(1).integers(0, 126, (P, Hkv, D)).astype(np.uint8)) for _ in range(2)]
    slots = np.array([3, -1, 0, 7, 15, 9])
    norm = QKNorm(X.array(np.ones(D, np.float32)), None, eps=1e-6)
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
        q, k, v, X.array(make_positions(rng, T)), mx.array(slots), *pools, head_dim=D, num_qo_heads=Hq,
        num_kv_heads=Hkv, k_scale=k_scale, v_scale=v_scale, rope=RopeSpec(head_dim=D, style="gptj"), qk_norm=norm)
    written = slots[slots >= 0]
    for name, pool, rows, scale in (("k_pool", kp, k_rot, k_scale), ("v_pool", vp, v, v_scale)):
        scale = scale if isinstance(scale, float) else scale[:, None]
        want = mx.to_fp8(mx.clip(rows.astype(mx.float32) / scale, -448.0, 448.0))
        assert pool.dtype == mx.uint8
        assert_same_bits(f"{name} rows", np.array(pool)[written], np.array(want)[slots >= 0])
    # |v| > 0.28 saturates: about 93% of N(0, 9) draws, so > 0.8 of 320 holds for any seed
    assert (np.array(vp)[written][:, 1] & 0x7F == 0x7E).mean() > 0.8, "v head 1 saturates to +-448 (0x7e)"


def test_backend_choice(rng):
    arrays, kw = small_call(rng)
    auto = ropepool.rope_pool_fused(*arrays, **kw)
    named = ropepool.rope_pool_fused(*arrays, backend="mlx", **kw)
    for a, b in zip(auto, named):
        assert_same_bits("backend=None vs backend='mlx'", X.numpy(a), X.numpy(b))
    with pytest.raises(ValueError, match=r"^backend 'torch' takes torch arrays; got mlx arrays"):
        ropepool.rope_pool_fused(*arrays, backend="torch", **kw)


@pytest.mark.parametrize("rope", ["plain", "mrope"])
def test_large_calls_run_in_chunks_on_the_cpu(rope, monkeypatch, rng):
    """Above CHUNK_TOKENS tokens a CPU call runs in chunks of about Tuning.chunk_features q features (the last
    one shorter), each writing the pools the last returned: the same numbers as one pass."""
    from ropepool.backends import mlx as backend
    from tests.harness import make_cache, poison, run_checked

    if mx.default_device() != mx.cpu:
        pytest.skip("chunks are for MLX's CPU backend")
    T, Hq, Hkv, D, P = 300, 4, 2, 64, 512
    # 64 tokens a chunk: five, the last of 44
    monkeypatch.setattr(plan, "DEFAULT_TUNING", plan.Tuning(chunk_features=64 * Hq * D))
    sizes, init = [], backend.Prepared.__init__

    def counting_init(self, *a, **kw):  # counts the tokens of each eager pass
        init(self, *a, **kw)
        eager = self.eager
        self.eager = lambda q, *b: sizes.append(q.shape[0]) or eager(q, *b)

    monkeypatch.setattr(backend.Prepared, "__init__", counting_init)
    spec = RopeSpec(head_dim=D, mrope_section=(8, 12, 12)) if rope == "mrope" else RopeSpec(head_dim=D)
    positions = make_positions(rng, T) if rope == "plain" else np.stack([make_positions(rng, T)] * 3)
    slots = make_slots(rng, T, P)
    plan.forget()
    try:
        run_checked(X, randn(rng, T, Hq, D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D), positions, slots,
                    poison(make_cache(rng, "float32", P, Hkv, D), slots), rope=spec)
    finally:
        plan.forget()  # no counting plan stays in the layout cache
    assert sizes == [64, 64, 64, 64, 44], sizes
