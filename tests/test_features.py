"""The second round's features on every backend against the float64 oracle (tests.harness.run_checked).

QK-norm, MRoPE, the engine's cos/sin table, layers without RoPE, MLA's
latent cache, per-head fp8 scales, fp8 q/k outputs and head counts that do
not divide. The oracle takes the norm weights and the table as NumPy arrays;
the harness hands each backend the same values in its framework.

Tolerances: ``harness.TOL`` (float32 arithmetic 2e-6 relative to max(1,
|ref|), plus one rounding to the dtype), except with a norm: the normalised
row is multiplied by the gain ``g = weight_offset + weight``, so the float32
error of the rotated, normalised values grows with ``|g|`` while the
reference may not (a rotation can cancel); the arithmetic bound is
``2e-6 * max(1, max|g|)``. Measured on every backend: at most 0.13 of it
(D = 64 to 256, |g| up to 2.5).
"""
from __future__ import annotations

import numpy as np
import pytest

from ropepool import CosSinCache, QKNorm, RopePoolError, RopeSpec, native
from tests.harness import (
    TOL,
    Cache,
    assert_same_bits,
    cos_sin_table,
    crossed,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
    run_latent_checked,
)
from tests.params import mlx_has, on_backends, on_torch


def qkv(rng, T, Hq, Hkv, D, dtype, scale=1.0):
    return [randn(rng, T, h, D, dtype=dtype, scale=scale) for h in (Hq, Hkv, Hkv)]


def norm_for(rng, D, offset=0.0, q=True, k=True, after_rope=False, eps=1e-6, weights="float32"):
    """A QKNorm with NumPy weights around the gain a model has (Qwen3 w ~ 1; Gemma's 1 + w with w ~ 0), in the
    float dtype ``weights`` (a model's norm weights need not be q's dtype)."""
    from tests.harness import NP_DTYPES

    weight = lambda: ((1.0 - offset) + 0.5 * rng.standard_normal(D)).astype(np.float32).astype(  # noqa: E731
        NP_DTYPES.get(weights, weights))
    return QKNorm(weight() if q else None, weight() if k else None, eps=eps, weight_offset=offset,
                  after_rope=after_rope)


def norm_arith(norm) -> float:
    """The float32 arithmetic bound with a norm (module docstring)."""
    gains = [np.abs(norm.weight_offset + w).max() for w in norm.weights if w is not None] or [1.0]
    return TOL["float32"] * max(1.0, *gains)


def call(backend, rng, dtype, T, Hq, Hkv, D, *, slots=None, positions=None, pool="float", P=None, **kw):
    """One checked call on a poisoned flat cache (``pool``: "float" for q's dtype, or an fp8 dtype)."""
    P = P or 2 * T + 5
    slots = make_slots(rng, T, P) if slots is None else slots
    positions = make_positions(rng, T, high=100_000) if positions is None else positions
    pool_dtype = dtype if pool == "float" else pool
    cache = poison(make_cache(rng, pool_dtype, P, Hkv, D, scale=4.0 if pool != "float" else 1.0), slots)
    return run_checked(backend, *qkv(rng, T, Hq, Hkv, D, dtype, scale=2.0), positions, slots, cache, **kw)


# --- QK-norm ----------------------------------------------------------------------------------

# name: (head_dim, RopeSpec kwargs, norm kwargs, pool)
# name -> (head_dim, RopeSpec arguments, norm_for arguments, the pool: "float" for q's dtype or an fp8 dtype).
# tests/test_native.py runs the float-pool cases on every pool layout of the native kernel.
NORMS = {
    "qwen3": (128, {}, dict(offset=0.0), "float"),
    "gemma3-offset1-bf16-weights": (256, dict(base=1e6), dict(offset=1.0, weights="bfloat16"), "float"),
    "llama4-l2-after-gptj": (128, dict(style="gptj", base=5e5), dict(q=False, k=False, after_rope=True), "float"),
    "after-offset1-f64-weights": (64, {}, dict(offset=1.0, after_rope=True, weights="float64"), "float"),
    "q-weight-only-partial-f16-weights": (64, dict(rotary_dim=32), dict(k=False, weights="float16"), "float"),
    "k-weight-only-gptj-partial": (128, dict(rotary_dim=64, style="gptj"), dict(q=False, offset=1.0), "float"),
    "odd-dim-big-eps": (72, {}, dict(eps=0.5), "float"),
    "qwen3-fp8-pool": (128, {}, dict(offset=0.0), "float8_e4m3fn"),
}


@pytest.mark.parametrize("name,dtype", crossed(list(NORMS)))
def test_qk_norm(backend, name, dtype, rng):
    D, spec_kw, norm_kw, pool = NORMS[name]
    norm = norm_for(rng, D, **norm_kw)
    fp8 = {} if pool == "float" else dict(k_scale=0.37, v_scale=0.61)
    res = call(backend, rng, dtype, 7, 3, 1, D, rope=RopeSpec(head_dim=D, **spec_kw), qk_norm=norm, pool=pool,
               arith=norm_arith(norm), **fp8)
    if norm.q_weight is None and norm.k_weight is None:  # L2 norm: every head of q_rot has rms 1 (+ rounding)
        rms = np.sqrt((backend.numpy(res.q_rot).astype(np.float64) ** 2).mean(-1))
        assert np.allclose(rms, 1.0, atol=1e-5 + 4 * TOL[dtype]), rms


def test_norm_without_weight_ignores_offset(backend, rng):
    """No weight means g = 1 (docs/api.md, QKNorm), whatever weight_offset says."""
    norm = QKNorm(None, None, eps=1e-6, weight_offset=0.5)
    call(backend, rng, "float32", 5, 3, 1, 64, qk_norm=norm)


# --- MRoPE ------------------------------------------------------------------------------------

MROPES = {
    "qwen2vl-chunked": dict(head_dim=128, base=1e6, mrope_section=(16, 24, 24)),
    "qwen3vl-interleaved": dict(head_dim=128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True),
    "partial-chunked": dict(head_dim=128, rotary_dim=64, mrope_section=(8, 12, 12)),
    "partial-interleaved-gptj": dict(head_dim=64, rotary_dim=48, style="gptj", mrope_section=(8, 8, 8),
                                     mrope_interleaved=True),
    "gptj-chunked-yarn": dict(head_dim=64, style="gptj", mrope_section=(10, 11, 11), scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
}


@pytest.mark.parametrize("name,dtype", crossed(list(MROPES)))
def test_mrope(backend, name, dtype, rng):
    """[3, T] positions (time, height, width): each frequency takes its row's position."""
    spec = RopeSpec(**MROPES[name])
    call(backend, rng, dtype, 6, 3, 1, spec.head_dim, positions=make_positions(rng, 18).reshape(3, 6), rope=spec)


@pytest.mark.parametrize("name", ["qwen2vl-chunked", "partial-interleaved-gptj"])
def test_mrope_1d_positions(backend, name, rng):
    """[T] positions with an MRoPE spec mean three equal rows: the same bits as [3, T] of them."""
    spec = RopeSpec(**MROPES[name])
    T, Hq, Hkv, D, P = 5, 3, 1, spec.head_dim, 12
    q, k, v = qkv(rng, T, Hq, Hkv, D, "float32")
    pos, slots = make_positions(rng, T), make_slots(rng, T, P)
    outs = []
    for p in (pos, np.stack([pos] * 3)):
        res = run_checked(backend, q, k, v, p, slots, make_cache(rng, "float32", P, Hkv, D), rope=spec)
        outs.append([backend.numpy(x) for x in (res.q_rot, res.k_rot)])
    for name_, a, b in zip(("q_rot", "k_rot"), *outs):
        assert_same_bits(f"{name_}: [T] positions vs three equal rows", a, b)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_mrope_with_norm_and_fp8_pool(backend, dtype, rng):
    spec = RopeSpec(head_dim=128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True)
    norm = norm_for(rng, 128)
    call(backend, rng, dtype, 5, 3, 1, 128, positions=make_positions(rng, 15).reshape(3, 5), rope=spec,
         qk_norm=norm, arith=norm_arith(norm), pool="float8_e4m3fn", k_scale=0.5, v_scale=0.25)


# --- the engine's cos/sin table ---------------------------------------------------------------

MAX_POSITION = 4096

# name: (head_dim, rotary_dim, is_neox, table dtype, mrope_section, interleaved)
TABLES = {
    "neox-full-f32": (128, 128, True, "float32", None, False),
    "gptj-full-f32": (64, 64, False, "float32", None, False),
    "neox-partial-bf16": (128, 64, True, "bfloat16", None, False),
    "gptj-partial-bf16": (64, 32, False, "bfloat16", None, False),
    "neox-mrope-chunked": (128, 128, True, "float32", (16, 24, 24), False),
    "gptj-mrope-interleaved-partial": (128, 96, False, "bfloat16", (16, 16, 16), True),
}


def table_rope(name, base=1e4):
    D, r, neox, tdt, section, inter = TABLES[name]
    inv_freq = RopeSpec(head_dim=r, base=base).inv_freq
    return D, CosSinCache(cos_sin_table(MAX_POSITION, inv_freq, tdt), is_neox=neox, mrope_section=section,
                          mrope_interleaved=inter)


@pytest.mark.parametrize("name,dtype", crossed(list(TABLES)))
def test_cos_sin_cache(backend, name, dtype, rng):
    D, rope = table_rope(name)
    T = 6
    rows = 3 if rope.mrope_section else 1
    pos = make_positions(rng, rows * T, high=MAX_POSITION - 1).reshape(rows, T)
    pos = pos[0] if rows == 1 else pos
    call(backend, rng, dtype, T, 3, 1, D, positions=pos, rope=rope)


@pytest.mark.parametrize("name", ["neox-full-f32", "gptj-partial-bf16", "neox-mrope-chunked"])
def test_positions_outside_the_table(backend, name, rng):
    """Validation bypassed (as on CUDA): a token whose position is outside the table (negative, past
    it, huge; MRoPE: any of its rows) is rotated by zero and writes nothing; the others are exact. The CPU
    kernel (torch on CPU) checks every value itself and raises validation's error before it writes
    (tests/test_native.py checks the pools keep every byte)."""
    D, rope = table_rope(name)
    T = 8
    bad = np.array([MAX_POSITION, -1, 2**31 - 1, -(2**31), 5, MAX_POSITION - 1, 0, 10**9])
    if rope.mrope_section:
        bad = np.stack([bad, np.roll(bad, 1) % MAX_POSITION, np.full(T, 7)])
        bad[2, 4] = MAX_POSITION + 3  # one bad row is enough
    slots = make_slots(rng, T, 2 * T, skip_every=0)
    if backend.name == "torch" and backend.device == "cpu" and native.kernel() is not None:
        with pytest.raises(RopePoolError, match="positions must be"):
            call(backend, rng, "float32", T, 3, 2, D, positions=bad, slots=slots, rope=rope, bypass=True)
        return
    res = call(backend, rng, "float32", T, 3, 2, D, positions=bad, slots=slots, rope=rope, bypass=True)
    skipped = ~((bad >= 0) & (bad < MAX_POSITION)).reshape(-1, T).all(0)
    assert skipped.sum() >= 4
    # Rotated by zero: q_rot is q itself, bit for bit (the oracle read table row 0 = (1, 0) there).
    assert_same_bits("q_rot of tokens outside the table", backend.numpy(res.q_rot)[skipped],
                     res.ref[0][skipped].astype(np.float32))


# --- layers without RoPE ----------------------------------------------------------------------

@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_no_rope_layer(backend, dtype, with_norm, rng):
    """RopeSpec(rotary_dim=0): q, k pass through (normalised with a norm); k, v still written."""
    D = 64
    norm = norm_for(rng, D, after_rope=True) if with_norm else None
    T, P = 5, 12
    slots = make_slots(rng, T, P)
    q, k, v = qkv(rng, T, 3, 2, D, dtype)
    cache = poison(make_cache(rng, dtype, P, 2, D), slots)
    res = run_checked(backend, q, k, v, make_positions(rng, T), slots, cache, rope=RopeSpec(head_dim=D, rotary_dim=0),
                      qk_norm=norm, arith=norm_arith(norm) if norm else TOL["float32"])
    if norm is None:
        assert_same_bits("q_rot of a layer without RoPE", backend.numpy(res.q_rot), q)
        assert_same_bits("k_rot of a layer without RoPE", backend.numpy(res.k_rot), k)


# --- heads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(3, 2), (2, 3), (6, 4), (5, 3)], ids=["Hq3-Hkv2", "Hq2-Hkv3", "Hq6-Hkv4",
                                                                          "Hq5-Hkv3"])
def test_heads_that_do_not_divide(backend, Hq, Hkv, rng):
    call(backend, rng, "bfloat16", 5, Hq, Hkv, 64)


# --- fp8 scales and outputs -------------------------------------------------------------------

@on_backends("fp8,kind", [("float8_e4m3fn", "k-and-v"), ("float8_e5m2", "k-and-v"), ("float8_e4m3fn", "k-only")],
             can=lambda b, fp8, kind: mlx_has(b, fp8))
def test_per_head_scales(backend, fp8, kind, rng, request):
    """k_scale / v_scale as [num_kv_heads] float32: each head divided by its own scale (k-only: v_scale
    a float beside them)."""
    Hkv = 3
    k_scale = np.array([0.37, 1.9, 0.05], np.float32)
    v_scale = np.array([2.5, 0.11, 0.7], np.float32) if kind == "k-and-v" else 0.5
    call(backend, rng, "bfloat16", 6, 3, Hkv, 64, pool=fp8, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("which", ["q", "k", "both-e5m2", "both-tensor-scales"])
@on_torch  # q_out / k_out are torch tensors
def test_fp8_outputs(backend, which, rng):
    """fp8 q_out / k_out receive x_rot / scale, saturated, rounded once from float32 (torch tensors only).

    Compared with the oracle's quantize exactly, except where the float32
    value's error bound crosses a rounding boundary (harness.check_fp8); under
    the Triton interpreter its fp8 conversion bug is allowed (triton#8322)."""
    import torch

    fp8 = "float8_e5m2" if which == "both-e5m2" else "float8_e4m3fn"
    T, Hq, Hkv, D = 6, 3, 2, 64
    q_scale = np.array([0.3], np.float32) if which == "both-tensor-scales" else 0.3
    k_scale = np.array([0.05], np.float32) if which == "both-tensor-scales" else 0.05
    out = lambda h: torch.full((T, h, D), float("nan"), device=backend.device).to(getattr(torch, fp8))  # noqa: E731
    kw = {}
    if which != "k":
        kw.update(q_out=out(Hq), q_scale=q_scale)
    if which != "q":
        kw.update(k_out=out(Hkv), k_out_scale=k_scale)
    res = call(backend, rng, "bfloat16", T, Hq, Hkv, D, **kw)
    if which != "k":
        assert res.q_rot is kw["q_out"]


# --- MLA: rope_latent_fused -------------------------------------------------------------------

DEEPSEEK = dict(head_dim=64, style="gptj", base=1e4, scaling=dict(
    rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
    mscale_all_dim=1.0))
RANK, ROPE_DIM, HEADS = 96, 64, 3

# name: (kv_layout, page_size, layers, layer, k_pe [T, 1, r], cache dtype, scale, rope)
LATENT = {
    "flat": (None, 1, None, None, False, "bfloat16", None, "spec"),
    "flat-k_pe-3d-table": (None, 1, None, None, True, "bfloat16", None, "table"),
    "paged-NHD": ("NHD", 8, None, None, False, "float16", None, "spec"),
    "layers-paged-NHD": ("NHD", 8, 3, -1, False, "float32", None, "spec"),
    "layers-flat": (None, 1, 3, 1, True, "bfloat16", None, "spec"),
    "fp8-float-scale": ("NHD", 8, None, None, False, "float8_e4m3fn", 0.21, "spec"),
    "fp8-tensor-scale-layers": (None, 1, 2, 0, False, "float8_e4m3fn", np.array([0.07], np.float32), "table"),
}


def latent_rope(kind):
    spec = RopeSpec(**DEEPSEEK)
    if kind == "spec":
        return spec
    table = cos_sin_table(MAX_POSITION, spec.inv_freq) * np.float32(spec.attention_scaling)
    return CosSinCache(table.astype(np.float32), is_neox=False)


@pytest.mark.parametrize("name", list(LATENT))
def test_latent(backend, name, rng, request):
    kv_layout, ps, layers, layer, k3, cdt, scale, rope_kind = LATENT[name]
    T, P = 7, 32
    dtype = "bfloat16" if cdt.startswith("float8") else cdt
    slots = make_slots(rng, T, P)
    # ckv (kv_lora_rank wide) first, kpe (rope_dim) second
    cache = poison(make_cache(rng, cdt, P, 1, RANK, v_dim=ROPE_DIM, kv_layout=kv_layout, page_size=ps,
                              layers=layers, layer=layer, headed=False, scale=4.0 if scale is not None else 1.0),
                   slots)
    k_pe = randn(rng, T, 1, ROPE_DIM, dtype=dtype) if k3 else randn(rng, T, ROPE_DIM, dtype=dtype)
    run_latent_checked(backend, randn(rng, T, HEADS, ROPE_DIM, dtype=dtype), k_pe, randn(rng, T, RANK, dtype=dtype),
                       make_positions(rng, T, high=MAX_POSITION - 1), slots, cache, rope=latent_rope(rope_kind),
                       scale=scale)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@on_torch  # column views to write through are torch's
def test_latent_vllm_combined_row(backend, fp8, rng):
    """vLLM's one cache of [..., kv_lora_rank + rope_dim] rows, passed as two column views (torch);
    q_pe_out=q_pe rotates q_pe in place."""
    T, P, ps = 6, 32, 8
    cdt = "float8_e4m3fn" if fp8 else "bfloat16"
    slots = make_slots(rng, T, P)
    combined = randn(rng, P // ps, ps, RANK + ROPE_DIM, dtype=cdt)
    cache = poison(Cache([combined], "NHD", ps, views=lambda o: (o[0][..., :RANK], o[0][..., RANK:]), headed=False),
                   slots)
    q_pe = backend.array(randn(rng, T, HEADS, ROPE_DIM, dtype="bfloat16"))
    res = run_latent_checked(backend, q_pe, randn(rng, T, ROPE_DIM, dtype="bfloat16"),
                             randn(rng, T, RANK, dtype="bfloat16"), make_positions(rng, T), slots, cache,
                             rope=RopeSpec(**DEEPSEEK), scale=0.3 if fp8 else None, q_pe_out=q_pe)
    assert res.q_rot is q_pe
