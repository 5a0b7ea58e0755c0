"""torch.compile(fullgraph=True) of a function that calls rope_pool_fused traces the whole call.

The aot_eager backend keeps it fast; the "triton" backend goes through the
torch.ops.ropepool.rope_pool custom op (on the GPU where there is one, else
the kernel under the interpreter). Compiled and eager calls give the same
bits: q_rot, k_rot and both pools (on CPU with the QK norm, the eager call's native kernel sums the squares
in another order: within float32's bound there). The version with inductor and CUDA graphs
is in tests/gpu.
"""
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import QKNorm, RopeSpec, plan  # noqa: E402
from tests.harness import (
    TOL,
    assert_close,
    assert_same_bits,
    backend_for,
    fp8_ordinal,
    make_positions,
    make_slots,
    randn,
)


def compiled_and_eager(X, features, rng, remembered):
    T, Hq, Hkv, D, P = 6, 3, 2, 64, 16
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=5e5, backend=X.name)
    pool_dtype, positions = "float32", make_positions(rng, T)
    if features != "plain":
        kw.update(rope=RopeSpec(head_dim=D, mrope_section=(8, 12, 12), mrope_interleaved=True),
                  qk_norm=QKNorm(X.array(randn(rng, D)), None, weight_offset=1.0), k_scale=0.5,
                  v_scale=X.array(np.array([0.25], np.float32)), rope_base=10000.0)
        pool_dtype, positions = "float8_e4m3fn", make_positions(rng, 3 * T).reshape(3, T)

    def step(q, k, v, pos, slots, kp, vp):
        return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, **kw)[:2]

    # NumPy dtypes in the validation caches first, as after any oracle call.
    ropepool.reference.rope_pool_fused(
        randn(rng, T, Hq, D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D), np.arange(T), np.arange(T),
        randn(rng, P, Hkv, D), randn(rng, P, Hkv, D), head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    arrays = [X.array(a) for a in (randn(rng, T, Hq, D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D), positions,
                                   make_slots(rng, T, P))]
    pools = [X.array(randn(rng, P, Hkv, D, dtype=pool_dtype, scale=4.0)) for _ in range(2)]
    copies = [p.clone() for p in pools]
    plan.forget()  # only this call's layout in the cache
    want = step(*arrays, *pools)  # eager first: it also imports the backend (see test_compile_first_in_a_process)
    if not remembered:  # a remembered RopeSpec breaks dynamo (test_compile_after_an_eager_call_with_a_spec)
        plan.forget()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*arrays, *copies)
    # A traced call runs the general torch code; an eager CPU call with the QK norm runs the native kernel, whose
    # sum of squares is in another order (docs/precision.md): the normed rows within float32's bound, their fp8
    # pool bytes within one step. Everything else bit for bit.
    normed = X.name == "torch" and "qk_norm" in kw
    for what, g, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), (*got, *copies), (*want, *pools)):
        g, w = X.numpy(g), X.numpy(w)
        if normed and what in ("q_rot", "k_rot"):
            assert_close(f"{what}: compiled vs eager", g, w, TOL["float32"])
        elif normed and what == "k_pool":
            steps = np.abs(fp8_ordinal(g) - fp8_ordinal(w))
            assert steps.max() <= 1, f"k_pool: compiled vs eager: {int(steps.max())} fp8 steps apart"
        else:
            assert_same_bits(f"{what}: compiled vs eager", g, w)


@pytest.mark.parametrize("name,features", [("torch", "plain"), ("torch", "spec-norm-mrope-fp8-pool"),
                                           ("triton", "spec-norm-mrope-fp8-pool")])
def test_compile_fullgraph_matches_eager(name, features, rng):
    compiled_and_eager(backend_for(name), features, rng, remembered=features == "plain")


def test_compile_after_an_eager_call_with_a_spec(rng):
    compiled_and_eager(backend_for("torch"), "spec-norm-mrope-fp8-pool", rng, remembered=True)


FIRST = """
import sys, numpy as np, torch, ropepool
a = np.load(sys.argv[1])
q, k, v, positions, slots, k_pool, v_pool = (torch.from_numpy(a[n]) for n in a.files)  # in savez order
step = lambda *x: ropepool.rope_pool_fused(*x, head_dim=64, num_qo_heads=2, num_kv_heads=1, backend="torch")[:2]
q_rot, k_rot = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, positions, slots, k_pool, v_pool)
np.savez(sys.argv[2], q_rot=q_rot.numpy(), k_rot=k_rot.numpy(), k_pool=k_pool.numpy(), v_pool=v_pool.numpy())
"""


def test_compile_first_in_a_process(rng, tmp_path):
    """A server may compile its model before any eager call: the op must trace in a fresh process, and the
    compiled call give the oracle's q_rot and k_rot and write the pools (written rows, the rest untouched)."""
    T, D, P = 4, 64, 8
    given = dict(q=randn(rng, T, 2, D), k=randn(rng, T, 1, D), v=randn(rng, T, 1, D),
                 positions=make_positions(rng, T), slots=make_slots(rng, T, P),  # two tokens skipped
                 k_pool=randn(rng, P, 1, D), v_pool=randn(rng, P, 1, D))
    np.savez(tmp_path / "given.npz", **given)
    done = subprocess.run([sys.executable, "-c", FIRST, str(tmp_path / "given.npz"), str(tmp_path / "got.npz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "got.npz")
    oracle = ropepool.reference.rope_pool_fused(*given.values(), head_dim=D, num_qo_heads=2, num_kv_heads=1)
    assert_close("q_rot (compiled first)", got["q_rot"], oracle[0], TOL["float32"])
    assert_close("k_rot (compiled first)", got["k_rot"], oracle[1], TOL["float32"])
    written, slots = given["slots"] >= 0, given["slots"]
    want_k, want_v = given["k_pool"].copy(), given["v_pool"].copy()
    want_k[slots[written]], want_v[slots[written]] = got["k_rot"][written], given["v"][written]
    assert_same_bits("k_pool (k_rot at the written slots, the rest untouched)", got["k_pool"], want_k)
    assert_same_bits("v_pool (v at the written slots, the rest untouched)", got["v_pool"], want_v)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_compile_per_token_head(name, rng):
    """Per-token-head scale caches under torch.compile (the custom op declares them written, through the
    paged views it is handed): compiled == eager, pools and scale caches bit for bit."""
    X = backend_for(name)
    T, Hq, Hkv, D, P = 6, 3, 2, 64, 16

    def step(q, k, v, pos, slots, kp, vp, ks, vs):
        return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
                                        kv_layout="NHD", k_scale_cache=ks, v_scale_cache=vs, backend=X.name)[:2]

    arrays = [X.array(a) for a in (randn(rng, T, Hq, D), randn(rng, T, Hkv, D), randn(rng, T, Hkv, D),
                                   make_positions(rng, T), make_slots(rng, T, P))]
    written = [torch.zeros(P // 4, 4, Hkv, D, dtype=torch.int8, device=X.device) for _ in range(2)] + [
        torch.zeros(P // 4, 4, Hkv, device=X.device) for _ in range(2)]
    copies = [w.clone() for w in written]
    plan.forget()
    want = step(*arrays, *written)
    plan.forget()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*arrays, *copies)
    names = ("q_rot", "k_rot", "k_pool", "v_pool", "k_scale_cache", "v_scale_cache")
    for what, g, w in zip(names, (*got, *copies), (*want, *written)):
        assert_same_bits(f"{what}: compiled vs eager", X.numpy(g), X.numpy(w))
    assert written[2].abs().sum() > 0, "scales were written"


@pytest.mark.parametrize("fmt", ["nvfp4", "affine4", "affine8"])
def test_compile_block_pools(fmt, rng):
    """Block-quantized (tuple) pools under torch.compile(fullgraph=True): traced calls go to the torch code
    (the custom op takes no tuples); compiled == eager, every array of both caches bit for bit, and the
    written slots changed."""
    T, Hq, Hkv, D, P = 5, 4, 2, 64, 16
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, kv_layout="NHD")
    if fmt == "nvfp4":
        kw.update(k_scale=0.25, v_scale=0.5)
        parts = ((D // 2, torch.uint8), (D // 16, torch.float8_e4m3fn))
    else:
        bits = int(fmt[-1])
        parts = ((D * bits // 32, torch.uint32), (D // 32, torch.bfloat16), (D // 32, torch.bfloat16))

    def step(q, k, v, pos, slots, kp, vp):
        return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, **kw)[:2]

    arrays = [torch.from_numpy(randn(rng, T, h, D, scale=3.0)).bfloat16() for h in (Hq, Hkv, Hkv)] + [
        torch.from_numpy(a) for a in (make_positions(rng, T), make_slots(rng, T, P))]
    start = [tuple(torch.from_numpy(rng.integers(0, 256, (P // 4, 4, Hkv, n * dt.itemsize), dtype=np.uint8)).view(dt)
                   for n, dt in parts) for _ in "kv"]  # random bytes: unwritten rows must keep them
    eager = [tuple(x.clone() for x in p) for p in start]
    compiled = [tuple(x.clone() for x in p) for p in start]
    plan.forget()
    want = step(*arrays, *eager)
    plan.forget()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*arrays, *compiled)
    for what, g, w in zip(("q_rot", "k_rot"), got, want):
        assert_same_bits(f"{what}: compiled vs eager", g, w)
    for cache, g_parts, w_parts, s_parts in zip("kv", compiled, eager, start):
        for i, (g, w) in enumerate(zip(g_parts, w_parts)):
            assert_same_bits(f"{cache}_pool[{i}]: compiled vs eager", g.view(torch.uint8), w.view(torch.uint8))
        assert not torch.equal(w_parts[0].view(torch.uint8), s_parts[0].view(torch.uint8)), "rows were written"


@pytest.mark.parametrize("fmt", ["latent", "fp8_ds_mla", "indexer", "indexer_ue8m0"])
def test_compile_dsa_caches(fmt, rng):
    """The latent cache (vLLM's combined bf16 row as two views) and DeepSeek V3.2's caches (fp8_ds_mla rows, the
    indexer's keys with either scale format) under torch.compile(fullgraph=True): compiled == eager on every
    output and the whole cache, bit for bit (the same random bytes to start with, so rows never written are
    checked too), and rows were written. (torch 2.11's dynamo failed on all but the first: core/stores.py.)"""
    from tests.test_dsa_bytes import scaled_rows
    from tests.test_dsa_ops import INDEXER_ROPE, MLA_ROPE

    T, P = 7, 24
    positions, slots = (torch.from_numpy(a) for a in (make_positions(rng, T, 8192), make_slots(rng, T, P)))
    if fmt in ("latent", "fp8_ds_mla"):
        arrays = [torch.from_numpy(randn(rng, T, 3, 64)).bfloat16(), torch.from_numpy(randn(rng, T, 64)).bfloat16(),
                  torch.from_numpy(scaled_rows(rng, T, 512, "float32")).bfloat16()]
        width = 656 if fmt == "fp8_ds_mla" else 576 * 2  # the latent row: 512 + 64 bf16 features, as bytes

        def step(q_pe, k_pe, kv_c, pos, slots, cache):
            if fmt == "latent":
                row = cache.view(torch.bfloat16)
                return ropepool.rope_latent_fused(q_pe, k_pe, kv_c, pos, slots, row[..., :512], row[..., 512:],
                                                  rope=MLA_ROPE, kv_layout="NHD")[:2]
            return ropepool.rope_latent_fused(q_pe, k_pe, kv_c, pos, slots, cache, None, rope=MLA_ROPE,
                                              kv_layout="NHD", cache_format="fp8_ds_mla")[:2]
    else:
        arrays = [torch.from_numpy(randn(rng, T, 4, 128)).bfloat16(),
                  torch.from_numpy(scaled_rows(rng, T, 128, "float32")).bfloat16()]
        width, scale_fmt = 132, ("ue8m0" if fmt == "indexer_ue8m0" else None)

        def step(q, k, pos, slots, cache):
            return ropepool.rope_indexer_fused(q, k, pos, slots, cache, rope=INDEXER_ROPE, scale_fmt=scale_fmt,
                                               kv_layout="NHD")[:2]

    start = torch.from_numpy(rng.integers(0, 256, (P // 4, 4, width), dtype=np.uint8))
    eager, compiled = start.clone(), start.clone()
    plan.forget()
    want = step(*arrays, positions, slots, eager)
    plan.forget()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*arrays, positions, slots, compiled)
    for what, g, w in zip(("q_rot", "k_rot"), got, want):
        assert_same_bits(f"{what}: compiled vs eager", g, w)
    assert_same_bits("cache: compiled vs eager", compiled, eager)
    assert not torch.equal(eager, start), "rows were written"
