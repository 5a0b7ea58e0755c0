"""MLA's latent cache against transformers' own DeepseekV3Attention.

What transformers (5.17 to 5.25) caches for DeepSeek V3 is the latent itself:
``cache.update(kv_nope, k_rot)`` with ``kv_nope = kv_a_layernorm(...)``
``[B, 1, T, kv_lora_rank]`` as the layer's "keys" and the rotated shared
``k_rot [B, 1, T, qk_rope_head_dim]`` as its "values"; per-head keys and
values are expanded from them (``kv_b_proj``) after the cache. So the whole
cache is comparable, row for row, with what ``ropepool.rope_latent_fused``
writes. Each case builds one DeepseekV3Attention from a config in code (no
download, random weights), runs its own forward with its own rotary module
and a fresh ``DynamicCache``, and catches the query attention sees (its last
``qk_rope_head_dim`` features are the rotated q_pe). ropepool gets the module's
own q_pe, k_pe and normalised kv_c (views of its projections, no copy) and
writes vLLM's combined ``[slots, kv_lora_rank + rope_dim]`` row through its two
column views. Compared:

- kv_c rows: bit for bit the kv_nope transformers caches;
- k_pe rows: bit for bit ropepool's k_pe_rot, which is held to transformers'
  cached k_rot, and q_pe_rot to its rotated q, by test_hf_norm's bounds
  (no norm; transformers rounds cos, sin, two products and a sum: 3);
- every other cache row and column untouched (poisoned rows included).

Pairs: with ``rope_interleave=True`` (DeepSeek's checkpoints) transformers'
``apply_rotary_pos_emb_interleave`` rotates pairs ``(x[2i], x[2i+1])`` and
returns them permuted, evens then odds; ropepool keeps each pair in place
(GPT-J pairs, as vLLM and FlashInfer store them), so transformers' output is
un-permuted before the comparison. With ``rope_interleave=False`` both rotate
NeoX halves. YaRN: DeepSeek V3's own parameters (factor 40, mscale =
mscale_all_dim = 1: attention scaling 1), and the same without mscale_all_dim,
where transformers scales cos and sin by ``0.1 ln(40) + 1``. The specs are
built here: ``from_hf_config`` does not give DeepSeek's GPT-J pairs yet.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

import ropepool
from ropepool import RopeSpec
from tests.harness import assert_same_bits
from tests.test_hf_norm import (
    DEVICE,
    INTERPRETER,
    angles,
    check_freqs,
    check_replica,
    check_rotation,
    hf_forward,
    modeling,
    randomize,
    rounding_bounds,
    transformers,
)
from tests.torch_fixtures import backend, rng  # noqa: F401,E402

V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
NO_ALL_DIM = {k: v for k, v in V3_YARN.items() if k != "mscale_all_dim"}
CASES = {  # name: (rope_parameters, rope_interleave)
    "v3-interleave": (V3_YARN, True),
    "v3-rotate-half": (V3_YARN, False),
    "yarn-attention-scaling-interleave": (NO_ALL_DIM, True),
}
LORA, ROPE, NOPE, HEADS = 512, 64, 32, 4


def build(name, dtype, gen):
    params, interleave = CASES[name]
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=32, max_position_embeddings=163840,
        rope_parameters=dict(params), rope_interleave=interleave)
    mod = modeling("deepseek_v3")
    attn = randomize(mod.DeepseekV3Attention(cfg, 0), gen).to(DEVICE, dtype)
    spec = RopeSpec(head_dim=ROPE, base=params["rope_theta"], style="gptj" if interleave else "neox",
                    scaling=params, max_position_embeddings=cfg.max_position_embeddings)
    return cfg, attn, mod.DeepseekV3RotaryEmbedding(cfg).to(DEVICE), spec


def in_place(x, interleave):
    """transformers' interleaved output (evens, then odds) with each pair back in place."""
    if not interleave:
        return x
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), -1).flatten(-2)


@pytest.mark.parametrize("name, dtype", [  # the interpreter: float32 once per pair style
    pytest.param(name, dt, id=f"{name}-{dt_id}",
                 marks=pytest.mark.torch_only if dt_id == "f32" and name.startswith("yarn") else ())
    for name in CASES for dt_id, dt in (("f32", torch.float32), ("bf16", torch.bfloat16))])
def test_latent_cache_matches_transformers(name, dtype, backend, rng):
    T = 4 if backend == "triton" and INTERPRETER else 24
    cfg, attn, rotary, spec = build(name, dtype, rng)
    pos = torch.randint(0, 160000, (T,), generator=rng)
    pos[0], pos[1] = 163839, 0
    slots = torch.randperm(2 * T + 3, generator=rng)[:T]
    slots[::3] = -1
    positions, slots = pos.to(DEVICE), slots.to(DEVICE)
    hidden = torch.randn(1, T, cfg.hidden_size, generator=rng).to(DEVICE, dtype)
    cache = torch.randn(2 * T + 3, LORA + ROPE, generator=rng).to(DEVICE, dtype)  # vLLM's combined row
    cache[::4, ::7] = float("nan")
    before = cache.clone()
    with torch.no_grad():
        emb = rotary(hidden, positions[None])
        q_tf, _, _, cached = hf_forward(attn, hidden, emb)
        q_pe = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))[0].view(T, HEADS, NOPE + ROPE)[..., NOPE:]
        kv = attn.kv_a_proj_with_mqa(hidden)[0]
        kv_c, k_pe = attn.kv_a_layernorm(kv[:, :LORA]), kv[:, LORA:]
        views = cache[:, :LORA], cache[:, LORA:]
        q_rot, k_rot, ckv, kpe = ropepool.rope_latent_fused(q_pe, k_pe, kv_c, positions, slots, *views, rope=spec,
                                                            backend=backend)

    assert ckv is views[0] and kpe is views[1] and k_rot.shape == k_pe.shape
    kv_tf, kpe_tf = cached.keys[0, 0], cached.values[0, 0]  # what transformers caches: [T, LORA], [T, ROPE]
    assert_same_bits("kv_c transformers caches", kv_tf, kv_c)
    want = before.clone()
    live = slots >= 0
    want[slots[live]] = torch.cat((kv_c, k_rot), -1)[live]
    assert_same_bits("the latent cache (written rows: kv_c | k_pe_rot; the rest untouched)", cache, want)

    interleave = CASES[name][1]
    check_freqs(spec.rotation.freqs[0], rotary.inv_freq, spec.base)
    assert spec.attention_scaling == pytest.approx(rotary.attention_scaling, rel=1e-6)
    theta_rp, theta_tf = angles(spec.rotation.freqs[0], positions), angles(rotary.inv_freq, positions)
    check_replica(emb, theta_tf, rotary.attention_scaling, dtype)
    c_rp, c_tf = rounding_bounds(ROPE, dtype, backend, 3)
    for what, x, rp, tf in (("q_pe", q_pe, q_rot, q_tf[..., NOPE:]),
                            ("k_pe", k_pe[:, None], k_rot[:, None], kpe_tf[:, None])):
        check_rotation(f"{what} {name} {dtype} {backend}", rp, in_place(tf, interleave), x, theta_rp, theta_tf,
                       scaling=rotary.attention_scaling, r=ROPE, style="gptj" if interleave else "neox", c_rp=c_rp,
                       c_tf=c_tf)


def test_yarn_cases_differ_in_attention_scaling():
    """The premise of the third case: transformers scales its cos/sin there, not in DeepSeek V3's own."""
    scaling = {name: build(name, torch.float32, torch.Generator().manual_seed(0))[2].attention_scaling
               for name in CASES}
    assert scaling["v3-interleave"] == 1.0
    assert scaling["yarn-attention-scaling-interleave"] == pytest.approx(0.1 * torch.log(torch.tensor(40.0)) + 1)
