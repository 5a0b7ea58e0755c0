"""On MLX a call costs time in proportion to its tokens, never to the pool (docs/api.md: MLX's pools are donated).

Each case times a T = 1 call (evaluated, pools rebound as a decode loop does)
on a small pool and on one 64 times larger, interleaved call by call in one
process so that both see the same machine, and compares the medians. A copy
of the large pool (what the first MLX path did on every call) costs tens of
milliseconds against a few hundred microseconds for the call, so the bound
(3x) holds on a loaded 2-core machine and still catches a copy by a wide
margin; the control case holds the old pools, forcing that copy, and must
exceed it. Runs with or without torch.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]')")

import ropepool  # noqa: E402

HQ, HKV, D = 32, 8, 128  # Llama-3-8B
SMALL, LARGE = 1024, 65536
BOUND = 3.0
WARMUP, CALLS = 5, 41


def _decode_loop(pool_shape, pool_dtype, slots, layer=None, k_scale=None, keep_old=False):
    """A caller running T = 1 calls into its own pools; ``step()`` times one evaluated call."""
    gen = np.random.default_rng(0)
    T = len(slots)
    q, k, v = (mx.array(gen.standard_normal((T, h, D)).astype(np.float32)).astype(mx.bfloat16)
               for h in (HQ, HKV, HKV))
    positions, slots = mx.array(np.arange(T, dtype=np.int32) + 1000), mx.array(np.array(slots, dtype=np.int32))
    pools = [mx.zeros(pool_shape, dtype=pool_dtype) for _ in range(2)]
    mx.eval(q, k, v, positions, slots, *pools)
    scales = {"k_scale": k_scale, "v_scale": k_scale} if k_scale else {}
    held, times = [], []

    def step():
        t0 = time.perf_counter()
        out = ropepool.rope_pool_fused(q, k, v, positions, slots, *pools, head_dim=D, num_qo_heads=HQ,
                                       num_kv_heads=HKV, layer=layer, **scales)
        if keep_old:  # another reference to the old pools: MLX must copy them
            held[:] = pools[:]
        pools[:] = out[2:]
        mx.eval(*out)
        times.append(time.perf_counter() - t0)

    return step, times


def _median_ratio(make_small, make_large, warmup=WARMUP, calls=CALLS):
    """Median time per call, large pool over small pool, timed alternately after a warm-up."""
    (small, t_small), (large, t_large) = make_small(), make_large()
    for _ in range(warmup):
        small()
        large()
    del t_small[:], t_large[:]
    for i in range(calls):
        for step in ((small, large) if i % 2 else (large, small)):
            step()
    return float(np.median(t_large) / np.median(t_small)), np.median(t_small) * 1e6, np.median(t_large) * 1e6


def _pools(rows, layers=None):
    return (rows, HKV, D) if layers is None else (layers, rows // layers, HKV, D)


CASES = {
    # name: (pool dims for `rows`, pool dtype, slots, extra keywords)
    "flat-bf16": (lambda rows: _pools(rows), mx.bfloat16, [17], {}),
    "skipped-token": (lambda rows: _pools(rows), mx.bfloat16, [-1, 5], {}),
    "layer-stack": (lambda rows: _pools(rows, layers=4), mx.bfloat16, [3], {"layer": 2}),
    "fp8-e4m3": (lambda rows: _pools(rows), mx.uint8, [9], {"k_scale": 0.5}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_call_cost_does_not_grow_with_the_pool(case):
    shape, dtype, slots, kw = CASES[case]
    ratio, small_us, large_us = _median_ratio(lambda: _decode_loop(shape(SMALL), dtype, slots, **kw),
                                              lambda: _decode_loop(shape(LARGE), dtype, slots, **kw))
    assert ratio < BOUND, (
        f"{case}: a T={len(slots)} call on a {LARGE}-row pool takes {large_us:.0f} us, {ratio:.1f}x the "
        f"{small_us:.0f} us on a {SMALL}-row pool (bound {BOUND}x): the call copies the pool instead of "
        "scattering into its donated buffer (see backends/mlx.py::write)")


def test_control_a_held_pool_is_copied():
    """The measurement sees a copy: with the old pools still referenced, MLX copies them on every call."""
    shape, dtype, slots, _ = CASES["flat-bf16"]
    ratio, small_us, large_us = _median_ratio(lambda: _decode_loop(shape(SMALL), dtype, slots, keep_old=True),
                                              lambda: _decode_loop(shape(LARGE), dtype, slots, keep_old=True),
                                              warmup=1, calls=5)  # each copy costs tens of ms: a few suffice
    assert ratio > BOUND, (f"holding the old pools should force a copy of the {LARGE}-row pool, but the call took "
                           f"{large_us:.0f} us vs {small_us:.0f} us ({ratio:.1f}x): the test cannot see a copy")
