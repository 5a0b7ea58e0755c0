"""Per-token-head scale caches (vLLM's int8/fp8_per_token_head) on the torch path and the Triton kernel.

Each case writes into pools and scale caches full of random bits (NaN and inf
included) and checks every byte of them:

- the written (slot, head) rows and their scales exactly as the port of vLLM's
  writer (tests/vllm_reference.py, reshape_and_cache_per_token_head) stores the
  returned k_rot and the given v: float32 scale ``max(amax / QMAX, 1e-6)``,
  rows ``x * (1 / scale)`` saturated, int8 truncated. Under the Triton CPU
  interpreter fp8 conversions are mis-rounded (triton-lang/triton#8322): there,
  and only for fp8 data bytes, the interpreter's known slips are allowed
  (tests.test_vllm.interpreter_fp8_slips); scales and int8 stay exact;
- the same rows against the float64 oracle (reference.quantize_per_token_head
  of the float64 k_rot and v): v's scales equal (both are the correctly rounded
  quotient), k's within the dtype's rounding of k_rot, dequantized rows within
  one quantization step;
- every other byte of the pools and scale caches (other slots, other layers) untouched.

MLX has no in-place scale caches (its calls return only the pools): the
arguments raise there (tests/test_errors.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import ropepool
from ropepool import RopeSpec, reference
from ropepool.core.dtypes import QMAX
from ropepool.core.layout import page_and_row, paged_view, pool_geometry
from tests.harness import NP_DTYPES, ROUNDING, TOL, assert_close, assert_same_bits, make_positions, make_slots, randn

torch = pytest.importorskip("torch")
ref = pytest.importorskip("tests.vllm_reference")
from tests.params import on_torch  # noqa: E402
from tests.test_vllm import interpreter_fp8_slips  # noqa: E402  (after the skip without torch)

# name: (kv_layout, page_size, layers, layer, pool dtype, q dtype, rotary_dim or None)
CASES = {
    "flat-int8-bf16": (None, 1, None, None, "int8", "bfloat16", None),
    "nhd-e4m3-f16": ("NHD", 4, None, None, "float8_e4m3fn", "float16", None),
    "hnd-int8-layers-f32-partial": ("HND", 4, 2, 1, "int8", "float32", 32),
    "nhd-e5m2-layers-bf16": ("NHD", 2, 3, -1, "float8_e5m2", "bfloat16", None),
    "flat-e4m3-bf16-partial": (None, 1, None, None, "float8_e4m3fn", "bfloat16", 16),
}


def random_bits(rng, shape, dtype):
    """An array of ``dtype`` holding random bytes (NaN, inf and -0.0 among them for floats)."""
    width = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=(*shape, width), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def pool_shape(kv_layout, page_size, layers, P, H, D):
    one = {None: (P, H), "NHD": (P // page_size, page_size, H), "HND": (P // page_size, H, page_size)}[kv_layout]
    return ((layers,) if layers else ()) + one + (D,)


def step_bound(dtype, ratio):
    """How far one stored element may be from ``ratio`` (the row over its scale), in scale units."""
    if dtype == "int8":
        return np.ones_like(ratio)  # truncation
    mantissa, tiny = {"float8_e4m3fn": (3, 2.0**-9), "float8_e5m2": (2, 2.0**-16)}[dtype]
    return np.abs(ratio) * 2.0**-mantissa + tiny  # one step of the format, plus its subnormal spacing


@pytest.mark.parametrize("name", CASES)
@on_torch  # MLX: per-token-head scale caches are a torch feature (docs/mlx.md)
def test_per_token_head(backend, name, rng):
    check_per_token_head(backend, rng, *CASES[name])


def check_per_token_head(X, rng, kv_layout, page_size, layers, layer, pool_dt, dt, rotary_dim, T=9, Hq=4, Hkv=2,
                         D=64, P=24):
    """One call on backend X, checked as the module docstring says."""
    np_pool_dt = {"int8": np.int8, **NP_DTYPES}[pool_dt]
    q, k, v = (randn(rng, T, h, D, dtype=dt, scale=s) for h, s in ((Hq, 1.0), (Hkv, 1.0), (Hkv, 3.0)))
    v[T // 2, 0] = 0  # an all-zero row: the 1e-6 floor, zeros stored
    positions, slots = make_positions(rng, T, high=50_000), make_slots(rng, T, P, skip_every=3 if T > 1 else 0)
    shape = pool_shape(kv_layout, page_size, layers, P, Hkv, D)
    pools = [random_bits(rng, shape, np_pool_dt) for _ in range(2)]
    scales = [random_bits(rng, shape[:-1], np.float32) for _ in range(2)]
    rope = RopeSpec(head_dim=D, rotary_dim=rotary_dim)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope, kv_layout=kv_layout, layer=layer)

    tq, tk, tv, tpos, tslots = (X.array(a) for a in (q, k, v, positions, slots))
    tpools, tscales = [X.array(p) for p in pools], [X.array(s) for s in scales]
    out = ropepool.rope_pool_fused(tq, tk, tv, tpos, tslots, *tpools, k_scale_cache=tscales[0],
                                   v_scale_cache=tscales[1], backend=X.name, **kw)
    assert out[2] is tpools[0] and out[3] is tpools[1], "pools are updated in place and returned"
    got_pools, got_scales = [X.numpy(p) for p in tpools], [X.numpy(s) for s in tscales]
    oracle = reference.rope_pool_fused(q, k, v, positions, slots, *pools, k_scale_cache=scales[0],
                                       v_scale_cache=scales[1], **kw)
    assert_close("q_rot", X.numpy(out[0]), oracle[0], TOL[dt])
    assert_close("k_rot", X.numpy(out[1]), oracle[1], TOL[dt])

    # Exactly as vLLM's writer stores the returned k_rot and the given v (the port, float32).
    geom = pool_geometry(shape, layer, kv_layout)
    want_pools = [torch.from_numpy(p.view(np.uint8).copy()).view(getattr(torch, pool_dt)) for p in pools]
    want_scales = [torch.from_numpy(s.copy()) for s in scales]
    ref.reshape_and_cache_per_token_head(
        out[1].cpu(), tv.cpu(), *(paged_view(p, geom) for p in want_pools),
        *(paged_view(s[..., None], geom)[..., 0] for s in want_scales), tslots.cpu().long())
    for name_, got, want in zip(("k_scale_cache", "v_scale_cache"), got_scales, want_scales):
        assert_same_bits(f"{name_} (written scales as vLLM's, the rest untouched)", got, want.numpy())
    for name_, got, want in zip(("k_pool", "v_pool"), got_pools, want_pools):
        got_t = torch.from_numpy(got.view(np.uint8).copy())
        if X.interpreted and pool_dt != "int8":
            assert interpreter_fp8_slips(got_t, want.view(torch.uint8), want.dtype).all(), name_
        else:
            assert_same_bits(f"{name_} (written rows as vLLM's, the rest untouched)", got, want.view(
                torch.uint8).numpy().view(got.dtype))

    # Against the float64 oracle, and every byte outside the written rows.
    write = slots >= 0
    page, row = page_and_row(slots[write], page_size)
    for i, (rows_ref, dtol) in enumerate(((oracle[1], TOL[dt]), (v.astype(np.float64), 0.0))):
        s_got = paged_view(got_scales[i][..., None], geom)[page, row][..., 0]
        s_ref = paged_view(oracle[4 + i][..., None], geom)[page, row][..., 0]
        if dtol == 0.0:
            assert_same_bits("v scales == the oracle's (both correctly rounded)", s_got, s_ref)
        else:
            err = np.abs(s_got.astype(np.float64) - s_ref) / np.maximum(s_ref, 1.0 / QMAX[pool_dt])
            assert err.max(initial=0.0) <= dtol + ROUNDING["float32"], f"k scales: rel err {err.max():.3g}"
        stored = paged_view(got_pools[i], geom)[page, row].astype(np.float64)
        ratio = rows_ref[write] / s_got[..., None]
        # The writer's float32 ``x * (1 / scale)`` rounds twice: a ratio just above an integer (the row's amax,
        # 127.000002) may come out just below it and truncate one step further.
        arithmetic = 2 * ROUNDING["float32"] * np.abs(ratio)
        bound = (step_bound(pool_dt, ratio) + arithmetic
                 + dtol * np.maximum(1.0, np.abs(rows_ref[write])) / s_got[..., None])
        if not (X.interpreted and pool_dt != "int8"):  # the interpreter's fp8 slips: checked against the port
            assert (np.abs(stored - ratio) <= bound).all(), f"pool {i}: a row beyond one step"
        untouched = np.ones(shape, bool)
        paged_view(untouched, geom)[page, row] = False
        assert_same_bits(f"pool {i} outside the written rows", got_pools[i][untouched], pools[i][untouched])
        untouched_s = np.ones(shape[:-1], bool)
        paged_view(untouched_s[..., None], geom)[page, row] = False
        assert_same_bits(f"scale cache {i} outside the written rows", got_scales[i][untouched_s],
                         scales[i][untouched_s])
