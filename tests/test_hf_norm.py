"""Fused QK-norm + RoPE against transformers' own attention modules (the second oracle).

Each case builds one attention module of a family from a config in code (no
download, random weights, random norm weights, one head of q and k scaled to
1e-3 so that eps matters and one to 50), runs the module's own ``forward``
with its own rotary module and a fresh ``DynamicCache``, and catches the q and
k that reach attention (a capturing attention function registered with
transformers' ``AttentionInterface``) and the k and v the cache holds.
ropepool gets the module's own projections of the same hidden states, the
norm from ``QKNorm.from_hf_attention(module)``, arbitrary positions (shuffled,
repeated, up to 40000) and shuffled slots into a poisoned pool.

The bound
---------
Per rotated element, ``A = sqrt(2) * |e|`` where ``|e|`` is the length of its
pair in the exact (float64) result (pass-through features: ``|e_i|``); each
side rotates the normalised pair ``n`` by its own float32 angle, and every
rounding either side makes is a factor ``(1 + d)``, ``|d| <= u``, on a term no
larger than ``s * (|n1| + |n2|) <= A``. With ``k`` roundings in a chain:

    |side - exact(side's angle)| <= ((1 - u)^-k - 1) * A + F32(D) * A
    |ropepool - transformers|   <= A * dtheta + both of the above

- ``A * dtheta``: the two float32 angles differ only because transformers
  computes its frequencies in float32; a pair of length ``A / sqrt(2)`` moves
  by at most that. The frequencies themselves are held to
  ``(ln(base) + 8) * 2^-24`` relative, so dtheta cannot hide a wrong one.
- ropepool: one rounding (``k = 1``) to the dtype at the end; 2 under the
  Triton CPU interpreter, whose float32 -> bfloat16 cast truncates.
- transformers, bfloat16 (it rounds between steps): Qwen3 / Qwen3-MoE /
  Qwen3-VL ``w * x_hat.to(dtype)``: the normalised value and the weight
  product (2), then RoPE: cos, sin, both products and the sum (3): ``k = 5``.
  Gemma 3, Qwen3-Next, Qwen3.5 ``(x_hat * (1 + w)).to(dtype)``: 1 + 3 = 4.
  Llama 4: float32 complex RoPE rounded once, the norm of that rounded value
  (its rsqrt moves by at most ``u / (1 - u)``), the final cast: 3.
- ``F32(D)``: float32 arithmetic on both sides, chiefly the sum of D squares
  (torch's vectorised lanes, Triton's tree): ``(D / 8 + 24) * 2^-24``.
  Both sides in float32 use ``k = 0``.

The exact reference is this module's own: the family's expected offset and
order (the table below, not hf_norm's), the module's eps and weights,
transformers' attention scaling. It is held to transformers' output by the
same bound (``tf_vs_exact``), so it is checked, not assumed. The pool rows
hold ropepool's k_rot bit for bit, v rows equal the v transformers caches,
untouched rows keep their poison.

RoPE specs: ``RopeSpec.from_hf_config`` reads Qwen3, Qwen3-MoE and Qwen3-Next
right today; Gemma 3 (per-layer-type parameters), Llama 4 (interleaved pairs)
and the MRoPE families get an explicit spec here until its family table lands.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

transformers = pytest.importorskip("transformers")

import ropepool  # noqa: E402
from ropepool import QKNorm, RopePoolError, RopeSpec  # noqa: E402
from tests.harness import assert_same_bits  # noqa: E402
from tests.torch_fixtures import backend, rng  # noqa: F401,E402

CAPTURE = "ropepool_capture"
U = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}  # roundings counted in k; float32's go to F32(D)


def _capture(module, query, key, value, attention_mask, **kwargs):
    module.ropepool_seen = (query, key, value)
    return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype,
                       device=query.device), None


transformers.AttentionInterface.register(CAPTURE, _capture)


# --- the harness (test_hf_mrope and test_hf_mla use it too) ---------------------------------------

def f32_slack(head_dim: int) -> float:
    return (head_dim / 8 + 24) * 2.0 ** -24


def chain(k: int, dtype) -> float:
    """Relative error of k roundings to dtype in a chain of products: (1 - u)^-k - 1."""
    return (1 - U[dtype]) ** -k - 1


def freq_rel_tol(base: float) -> float:
    """ropepool's float32 frequencies vs transformers' float32 ones (benchmarks/hf_conformance.py)."""
    return (math.log(base) + 8) * 2.0 ** -24


def hf_forward(attn, hidden, position_embeddings, **kw):
    """transformers' own forward; returns (q, k, v) [T, H, D] as attention sees them, and the cache's layer."""
    attn.config._attn_implementation = CAPTURE
    cache = transformers.DynamicCache()
    name = "cache" if "cache" in inspect.signature(attn.forward).parameters else "past_key_values"  # <= 5.2x
    with torch.no_grad():
        attn(hidden, position_embeddings=position_embeddings, attention_mask=None, **{name: cache}, **kw)
    q, k, v = (x[0].transpose(0, 1) for x in attn.ropepool_seen)
    return q, k, v, cache.layers[attn.layer_idx]


def angles(freqs, positions, rows=None) -> torch.Tensor:
    """float64 [T, half] of the float32 angle ``float32(p) * float32(f)``; MRoPE: each frequency's row."""
    f = torch.as_tensor(freqs).float().cpu()
    p = positions.cpu().float()
    p = p[torch.as_tensor(rows)].T if p.ndim == 2 else p[:, None].expand(-1, f.numel())
    return (p * f[None, :]).double()


def _pairs(x, r, style):
    if style == "neox":
        return x[..., : r // 2], x[..., r // 2: r], lambda a, b: torch.cat((a, b), -1)
    return x[..., 0:r:2], x[..., 1:r:2], lambda a, b: torch.stack((a, b), -1).flatten(-2)


@dataclasses.dataclass(frozen=True)
class Norm:
    """The norm as this test expects it (not as hf_norm reads it)."""

    weight: torch.Tensor | None
    eps: float
    offset: float
    after_rope: bool

    def __call__(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.weight is None else y * (self.offset + self.weight.double().cpu())


def exact(x, theta, scaling, r, style, norm: Norm | None = None):
    """float64 x [T, H, D] normalised and rotated by theta [T, r/2] in the norm's order."""
    x = x.double()
    if norm is not None and not norm.after_rope:
        x = norm(x)
    x1, x2, back = _pairs(x, r, style)
    c, s = (theta.cos() * scaling)[:, None, :], (theta.sin() * scaling)[:, None, :]
    x = torch.cat((back(x1 * c - x2 * s, x1 * s + x2 * c), x[..., r:]), -1)
    return norm(x) if norm is not None and norm.after_rope else x


def pair_size(e, r, style):
    """A: sqrt(2) * the length of each rotated element's pair of e; |e_i| for pass-through features."""
    e1, e2, back = _pairs(e, r, style)
    a = math.sqrt(2) * (e1 * e1 + e2 * e2).sqrt()
    return torch.cat((back(a, a), e[..., r:].abs()), -1)


def check_rotation(name, rp, tf, x, theta_rp, theta_tf, *, scaling, r, style, norm=None, c_rp, c_tf):
    """The three bounds of the module docstring on rp and tf [T, H, D] (any dtype)."""
    x, rp, tf = (y.detach().cpu() for y in (x, rp, tf))
    e_rp, e_tf = exact(x, theta_rp, scaling, r, style, norm), exact(x, theta_tf, scaling, r, style, norm)
    a = pair_size(e_tf, r, style)
    dth = (theta_rp - theta_tf).abs()
    dth = _pairs(x, r, style)[2](dth, dth)[:, None, :]
    dth = torch.cat((dth, dth.new_zeros(dth.shape[0], 1, x.shape[-1] - r)), -1)  # pass-through: no angle
    rp, tf = rp.double(), tf.double()
    for what, err, allowed in (
            ("ropepool vs exact", (rp - e_rp).abs(), a * c_rp),
            ("transformers vs exact (this test's model of the family, or the spec's pairs, is wrong)",
             (tf - e_tf).abs(), a * c_tf),
            ("ropepool vs transformers", (rp - tf).abs(), a * (dth + c_rp + c_tf))):
        bad = err > allowed  # exact zeros (a zero input) have a zero bound and must be exact
        if bool(bad.any()):
            t, h, i = (int(j) for j in bad.nonzero()[0])
            worst = float((err / allowed)[bad].max())
            raise AssertionError(f"{name}: {what}: max {worst:.3g} of the bound; first at token {t} head {h} "
                                 f"feature {i}: ropepool {float(rp[t, h, i])!r}, transformers {float(tf[t, h, i])!r}, "
                                 f"exact {float(e_tf[t, h, i])!r}, bound {float(allowed[t, h, i]):.3g}")


def check_freqs(spec_freqs, hf_freqs, base):
    f_rp, f_tf = torch.as_tensor(spec_freqs).double(), hf_freqs.detach().cpu().double()
    rel = float(((f_rp - f_tf).abs() / f_tf).max())
    assert rel <= freq_rel_tol(base), f"frequencies {rel:.3g} relative from transformers' (> {freq_rel_tol(base):.3g})"


def check_replica(emb, theta_tf, scaling, dtype):
    """transformers' own cos (its cat(freqs, freqs), or Llama 4's complex table) is cos(theta_tf) * scaling:
    the angles this test recomputes, MRoPE rows included, are the ones transformers used."""
    cos = emb[0] if isinstance(emb, tuple) else emb.real
    cos = cos.reshape(-1, cos.shape[-1])[:, : theta_tf.shape[1]].detach().cpu().double()
    err = float((cos - theta_tf.cos() * scaling).abs().max())
    assert err <= chain(1, dtype) * scaling + 1e-6, f"transformers' cos is {err:.3g} from the recomputed angles"


def positions_and_slots(gen, T, pool_size, top=40000):
    pos = torch.randint(0, top, (T,), generator=gen)
    pos[0], pos[1], pos[2:4] = top - 1, 0, pos[T - 1]
    slots = torch.randperm(pool_size, generator=gen)[:T]
    slots[::4] = -1
    return pos[torch.randperm(T, generator=gen)], slots


def poisoned_pool(gen, P, H, D, dtype):
    pool = torch.randn(P, H, D, generator=gen).to(dtype)
    pool[::3, 0, ::5] = float("nan")
    return pool


def check_pools(k_pool, v_pool, before, slots, k_rot, v):
    """Written rows hold k_rot and v bit for bit; every other row is as it was (poison included)."""
    want_k, want_v = before[0].clone(), before[1].clone()
    live = slots >= 0
    want_k[slots[live]], want_v[slots[live]] = k_rot[live], v[live]
    assert_same_bits("k_pool", k_pool, want_k)
    assert_same_bits("v_pool", v_pool, want_v)


def compare_attention(attn, hidden, emb, hf_freqs, scaling, positions, slots, spec, *, norm, tf_roundings, backend,
                      gen):
    """transformers' forward of ``attn`` vs ropepool on the module's own projections of ``hidden``.

    emb: the family rotary module's output for ``positions`` ([T], or [3, T] MRoPE); hf_freqs, scaling: its
    float32 frequencies and attention scaling; norm: (offset, after_rope) as the family computes it, or None;
    tf_roundings: transformers' bfloat16 roundings (k of the module docstring).
    """
    cfg, dtype = attn.config, hidden.dtype
    T, D, Hq, Hkv = hidden.shape[1], attn.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    with torch.no_grad():
        q_tf, _, v_tf, cached = hf_forward(attn, hidden, emb)
        q = attn.q_proj(hidden)[0].view(T, Hq, -1)[..., :D]  # [q, gate] per head: a strided view, no copy
        k = attn.k_proj(hidden)[0].view(T, Hkv, D)
        v = attn.v_proj(hidden)[0].view(T, Hkv, D)
        pools = [poisoned_pool(gen, len(slots) * 2 + 3, Hkv, D, dtype).to(hidden.device) for _ in range(2)]
        before = [p.clone() for p in pools]
        q_rot, k_rot, k_pool, v_pool = ropepool.rope_pool_fused(
            q, k, v, positions, slots, *pools, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=spec,
            qk_norm=QKNorm.from_hf_attention(attn), backend=backend)
    k_tf, v_cached = (x[0].transpose(0, 1) for x in (cached.keys, cached.values))
    assert_same_bits("v transformers caches", v_cached, v)
    assert torch.equal(v_tf, v)
    check_pools(k_pool, v_pool, before, slots, k_rot, v)
    check_freqs(spec.rotation.freqs[0], hf_freqs, spec.base)
    assert spec.attention_scaling == pytest.approx(scaling, rel=1e-6)

    rows = spec.rotation.rows
    theta_rp, theta_tf = angles(spec.rotation.freqs[0], positions, rows), angles(hf_freqs, positions, rows)
    check_replica(emb, theta_tf, scaling, dtype)
    c_rp, c_tf = rounding_bounds(D, dtype, backend, tf_roundings)
    for name, x, rp, tf in (("q", q, q_rot, q_tf), ("k", k, k_rot, k_tf)):
        expected = None if norm is None else Norm(norm_weight(attn, name), cfg.rms_norm_eps, *norm)
        check_rotation(f"{name} {type(attn).__name__} {dtype} {backend}", rp, tf, x, theta_rp, theta_tf,
                       scaling=scaling, r=spec.rotary_dim, style=spec.style, norm=expected, c_rp=c_rp, c_tf=c_tf)


def rounding_bounds(head_dim, dtype, backend, tf_roundings):
    """(c_rp, c_tf) of the module docstring."""
    interp = backend == "triton" and INTERPRETER and dtype != torch.float32
    return chain(2 if interp else 1, dtype) + f32_slack(head_dim), chain(tf_roundings, dtype) + f32_slack(head_dim)


def norm_weight(attn, which):
    norm = getattr(attn, f"{which}_norm", None) or attn.qk_norm
    w = getattr(norm, "weight", None)
    return None if w is None else w.detach()


def randomize(module, gen, heads=()):
    """Random weights (norm weights too, never ones); the listed (projection, head_dim) rows of head 0 x 1e-3,
    of the last head x 50, so one head sits where eps matters and one far above it."""
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.ndim == 2 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
        for proj, width in heads:
            w = getattr(module, proj).weight
            w[:width] *= 1e-3
            w[-width:] *= 50.0
    return module


# --- the families ----------------------------------------------------------------------------------

def modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _rotary_plain(rotary, x, position_ids, layer_type):
    return rotary(x, position_ids), rotary.inv_freq, rotary.attention_scaling


def _rotary_three_rows(rotary, x, position_ids, layer_type):  # MRoPE families, text: three equal rows
    return _rotary_plain(rotary, x, position_ids.expand(3, -1, -1), layer_type)


def _rotary_per_layer_type(rotary, x, position_ids, layer_type):  # Gemma 3: one RoPE per layer type
    return (rotary(x, position_ids, layer_type), getattr(rotary, f"{layer_type}_inv_freq"),
            getattr(rotary, f"{layer_type}_attention_scaling"))


SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536}
LLAMA4_SCOUT = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


@dataclasses.dataclass(frozen=True)
class Family:
    family: str  # transformers.models.<family>
    attention: str
    rotary: str
    config: Callable
    spec: Callable  # config -> RopeSpec
    offset: float  # what the family's norm computes: x_hat * (offset + w)
    after_rope: bool
    k_tf: int  # transformers' roundings to bfloat16 along the chain (module docstring)
    layer_idx: int = 0
    gated: bool = False  # q_proj holds [q, gate] per head (Qwen3-Next, Qwen3.5)
    rotary_call: Callable = _rotary_plain

    def build(self, gen, dtype):
        cfg = self.config()
        mod = modeling(self.family)
        attn = getattr(mod, self.attention)(cfg, self.layer_idx)
        d = cfg.head_dim
        randomize(attn, gen, [("q_proj", 2 * d if self.gated else d), ("k_proj", d)])
        return cfg, attn.to(DEVICE, dtype), getattr(mod, self.rotary)(cfg).to(DEVICE)


def _cfg(name, **kw):
    return lambda: getattr(transformers, name)(**SMALL, **kw)


QWEN3 = {"head_dim": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
QWEN3_VL = {"head_dim": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True}}
QWEN3_5 = {"head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True}}


def _qwen3_vl_spec(cfg):
    return RopeSpec(head_dim=128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True)


def _qwen3_5_spec(cfg):
    return RopeSpec(head_dim=256, rotary_dim=64, base=1e7, mrope_section=(11, 11, 10), mrope_interleaved=True)


FAMILIES = {f.family + ("" if not f.layer_idx else f"-layer{f.layer_idx}"): f for f in [
    Family("qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding", _cfg("Qwen3Config", **QWEN3),
           RopeSpec.from_hf_config, 0.0, False, 5),
    Family("qwen3_moe", "Qwen3MoeAttention", "Qwen3MoeRotaryEmbedding", _cfg("Qwen3MoeConfig", **QWEN3),
           RopeSpec.from_hf_config, 0.0, False, 5),
    Family("qwen3_vl", "Qwen3VLTextAttention", "Qwen3VLTextRotaryEmbedding", _cfg("Qwen3VLTextConfig", **QWEN3_VL),
           _qwen3_vl_spec, 0.0, False, 5, rotary_call=_rotary_three_rows),
    Family("qwen3_vl_moe", "Qwen3VLMoeTextAttention", "Qwen3VLMoeTextRotaryEmbedding",
           _cfg("Qwen3VLMoeTextConfig", **QWEN3_VL), _qwen3_vl_spec, 0.0, False, 5, rotary_call=_rotary_three_rows),
    Family("qwen3_next", "Qwen3NextAttention", "Qwen3NextRotaryEmbedding",
           _cfg("Qwen3NextConfig", head_dim=256, partial_rotary_factor=0.25,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
           RopeSpec.from_hf_config, 1.0, False, 4, layer_idx=3, gated=True),
    Family("qwen3_5", "Qwen3_5Attention", "Qwen3_5TextRotaryEmbedding", _cfg("Qwen3_5TextConfig", **QWEN3_5),
           _qwen3_5_spec, 1.0, False, 4, layer_idx=3, gated=True, rotary_call=_rotary_three_rows),
    Family("qwen3_5_moe", "Qwen3_5MoeAttention", "Qwen3_5MoeTextRotaryEmbedding",
           _cfg("Qwen3_5MoeTextConfig", **QWEN3_5), _qwen3_5_spec, 1.0, False, 4, layer_idx=3, gated=True,
           rotary_call=_rotary_three_rows),
    Family("gemma3", "Gemma3Attention", "Gemma3RotaryEmbedding",
           _cfg("Gemma3TextConfig", head_dim=256, rope_parameters=GEMMA3_ROPE),
           lambda c: RopeSpec(head_dim=256, base=1e4), 1.0, False, 4, rotary_call=_rotary_per_layer_type),
    Family("gemma3", "Gemma3Attention", "Gemma3RotaryEmbedding",
           _cfg("Gemma3TextConfig", head_dim=256, rope_parameters=GEMMA3_ROPE),
           lambda c: RopeSpec(head_dim=256, base=1e6, scaling={"rope_type": "linear", "factor": 8.0}),
           1.0, False, 4, layer_idx=5, rotary_call=_rotary_per_layer_type),
    Family("llama4", "Llama4TextAttention", "Llama4TextRotaryEmbedding",
           _cfg("Llama4TextConfig", head_dim=128, rope_parameters=LLAMA4_SCOUT),
           lambda c: RopeSpec(head_dim=128, base=5e5, style="gptj", scaling=LLAMA4_SCOUT,
                              max_position_embeddings=c.max_position_embeddings),
           0.0, True, 3),
]}
# The MoE variants' attention is a copy of the dense one: the Triton CPU interpreter skips them.
MOE_COPIES = ("qwen3_moe", "qwen3_vl_moe", "qwen3_5_moe-layer3")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
TOKENS = {"torch": 24, "triton": 4 if INTERPRETER else 24}  # the interpreter is slow


def _cases():
    """Every family in float32 and bfloat16; the Triton CPU interpreter takes bfloat16 (its float32 path is the
    same kernel without the final rounding) and float32 for two families, one per pair style."""
    def interp(name, dt_id):
        return name not in MOE_COPIES and (dt_id == "bf16" or name in ("qwen3", "llama4"))

    return [pytest.param(name, dt, id=f"{name}-{dt_id}", marks=() if interp(name, dt_id) else pytest.mark.torch_only)
            for name in FAMILIES for dt_id, dt in (("f32", torch.float32), ("bf16", torch.bfloat16))]


@pytest.mark.parametrize("name, dtype", _cases())
def test_matches_transformers(name, dtype, backend, rng):
    fam, T = FAMILIES[name], TOKENS[backend]
    cfg, attn, rotary = fam.build(rng, dtype)
    positions, slots = (x.to(DEVICE) for x in positions_and_slots(rng, T, 2 * T + 3))
    hidden = torch.randn(1, T, cfg.hidden_size, generator=rng).to(DEVICE, dtype)
    layer_type = cfg.layer_types[fam.layer_idx] if getattr(cfg, "layer_types", None) else None
    with torch.no_grad():
        emb, hf_freqs, scaling = fam.rotary_call(rotary, hidden, positions[None], layer_type)
    compare_attention(attn, hidden, emb, hf_freqs, scaling, positions, slots, fam.spec(cfg),
                      norm=(fam.offset, fam.after_rope), tf_roundings=fam.k_tf, backend=backend, gen=rng)


# --- what from_hf_attention reads, and what it refuses ---------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_reads_the_family(name, rng):
    fam = FAMILIES[name]
    cfg, attn, _ = fam.build(rng, torch.float32)
    norm = QKNorm.from_hf_attention(attn)
    assert (norm.eps, norm.weight_offset, norm.after_rope) == (cfg.rms_norm_eps, fam.offset, fam.after_rope)
    if fam.after_rope:  # Llama 4: one weightless norm for q and k
        assert norm.q_weight is None and norm.k_weight is None
    else:  # the module's own parameters: no copy, later in-place updates are seen
        assert norm.q_weight is attn.q_norm.weight and norm.k_weight is attn.k_norm.weight


def _attention(family, attention, config, layer_idx=0, **kw):
    cfg = getattr(transformers, config)(**SMALL, **kw)
    return getattr(modeling(family), attention)(cfg, layer_idx)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _attention("llama", "LlamaAttention", "LlamaConfig"), id="llama"),
    pytest.param(lambda: _attention("qwen2", "Qwen2Attention", "Qwen2Config"), id="qwen2"),
    pytest.param(lambda: _attention("llama4", "Llama4TextAttention", "Llama4TextConfig", 3), id="llama4-nope-layer"),
    pytest.param(lambda: _attention("llama4", "Llama4TextAttention", "Llama4TextConfig", use_qk_norm=False),
                 id="llama4-without-qk-norm"),
])
def test_no_norm_is_none(make):
    assert QKNorm.from_hf_attention(make()) is None


class CustomAttention(torch.nn.Module):
    """An attention class hf_norm does not know, with per-head norms (or identities)."""

    def __init__(self, norm):
        super().__init__()
        self.head_dim = 16
        self.q_proj = torch.nn.Linear(8, 16)
        self.q_norm, self.k_norm = norm(), norm()


def test_identity_norms_are_none():
    assert QKNorm.from_hf_attention(CustomAttention(torch.nn.Identity)) is None


class LigerRMSNorm(torch.nn.Module):  # the name a Liger patch gives the norm it swaps in
    def __init__(self):
        super().__init__()
        self.weight, self.variance_epsilon, self.offset = torch.nn.Parameter(torch.ones(128)), 1e-6, 0.0


def _qwen3(change):
    attn = _attention("qwen3", "Qwen3Attention", "Qwen3Config", head_dim=128)
    change(attn)
    return attn


@pytest.mark.parametrize("make,exc,match", [
    pytest.param(lambda: _attention("olmo2", "Olmo2Attention", "Olmo2Config"), RopePoolError,
                 r"^QKNorm\.from_hf_attention reads per-head q/k norms only; got Olmo2Attention\.q_norm over 64 "
                 r"features with head_dim 16: a norm over all heads", id="olmo2"),
    pytest.param(lambda: _attention("olmo3", "Olmo3Attention", "Olmo3Config"), RopePoolError,
                 r"^QKNorm\.from_hf_attention reads per-head q/k norms only; got Olmo3Attention\.q_norm", id="olmo3"),
    pytest.param(lambda: _attention("minimax_m2", "MiniMaxM2Attention", "MiniMaxM2Config", head_dim=16),
                 RopePoolError, r"^QKNorm\.from_hf_attention reads per-head q/k norms only; got "
                 r"MiniMaxM2Attention\.q_norm over 64 features .*\(OLMo 2/3, MiniMax M2\)", id="minimax-m2"),
    pytest.param(lambda: CustomAttention(lambda: modeling("qwen3").Qwen3RMSNorm(16)), RopePoolError,
                 r"^QKNorm\.from_hf_attention does not know the attention class CustomAttention; got norms "
                 r"\['k_norm', 'q_norm'\]", id="unknown-class-with-norms"),
    pytest.param(lambda: _qwen3(lambda a: setattr(a, "q_norm", LigerRMSNorm())), RopePoolError,
                 r"^QKNorm\.from_hf_attention expects Qwen3Attention\.q_norm to be one of \['Qwen3RMSNorm'\], as "
                 r"transformers builds it; got LigerRMSNorm", id="patched-norm"),
    pytest.param(lambda: _qwen3(lambda a: delattr(a, "k_norm")), RopePoolError,
                 r"^QKNorm\.from_hf_attention expects Qwen3Attention\.k_norm to be one of .*; got nothing",
                 id="missing-k_norm"),
    pytest.param(lambda: _qwen3(lambda a: setattr(a.q_norm, "variance_epsilon", None)), RopePoolError,
                 r"^QKNorm\.from_hf_attention expects a finite float eps in Qwen3Attention\.q_norm\.variance_epsilon; "
                 r"got None", id="eps-unreadable"),
    pytest.param(lambda: _qwen3(lambda a: setattr(a.k_norm, "variance_epsilon", 1e-5)), RopePoolError,
                 r"^QKNorm\.from_hf_attention needs one eps for q and k; got Qwen3Attention\.q_norm eps 1e-06 and "
                 r"k_norm eps 1e-05", id="eps-differ"),
    pytest.param(lambda: modeling("qwen3").Qwen3DecoderLayer(transformers.Qwen3Config(**SMALL), 0), TypeError,
                 r"^QKNorm\.from_hf_attention expects the attention module, not the decoder layer; got "
                 r"Qwen3DecoderLayer\. Fix: pass its \.self_attn", id="decoder-layer"),
    pytest.param(lambda: {"q_norm": None}, TypeError,
                 r"^QKNorm\.from_hf_attention expects a transformers attention module \(a torch\.nn\.Module\); got "
                 r"dict", id="not-a-module"),
])
def test_refuses_what_it_cannot_read(make, exc, match):
    module = make()
    with pytest.raises(exc, match=match) as info:
        QKNorm.from_hf_attention(module)
    assert "Fix:" in str(info.value)
