"""DeepSeek's YaRN rotary through ropepool's CPU route, against vLLM's own ``DeepseekScalingRotaryEmbedding``.

vLLM builds DeepSeek V2/V3's rotary (``rope_scaling`` yarn: ``get_rope``'s ``deepseek_yarn``) as
``DeepseekScalingRotaryEmbedding`` (vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py),
whose table holds ``cos * mscale`` and ``sin * mscale`` for ``original_max_position_embeddings * factor``
positions, ``mscale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``. The route
(``ropepool.integrations.vllm_cpu``) defers it as ``deepseek_yarn_spec(module)``, a RopeSpec of those
parameters, and the MLA write (``do_kv_cache_update``) rotates q_pe and k_pe with it in one
``rope_latent_fused`` call. Here: the deferral and that write, driven directly (no engine), on q_pe / k_pe
views as vLLM's MLA hands them over, compared with vLLM's own ``forward_native`` on CPU, at distinct
positions up to the table's last row. tests/engines/test_vllm_engine.py serves a DeepSeek V3 checkpoint.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (  # noqa: E402
    DeepseekScalingRotaryEmbedding,
)

from ropepool.integrations import vllm_cpu, vllm_cpu_mla  # noqa: E402

ORIGINAL, FACTOR, ROPE, RANK, HEADS, NOPE = 4096, 40, 64, 512, 4, 32
# (mscale, mscale_all_dim): DeepSeek V3's (1, 1): cos and sin unscaled; vLLM's default mscale_all_dim 0: scaled
# by 0.1 ln(40) + 1; and two where both count
MSCALES = [(1.0, 1.0), (1.0, 0.0), (0.707, 1.0), (1.0, 0.707)]


def build(cls, dtype, is_neox, mscale, mscale_all_dim):
    with set_current_vllm_config(VllmConfig()):  # vLLM's ops read it when built (its tests' default_vllm_config)
        return cls(ROPE, ROPE, ORIGINAL, 10000.0, is_neox, FACTOR, dtype, beta_fast=32, beta_slow=1, mscale=mscale,
                   mscale_all_dim=mscale_all_dim)


def mla_inputs(dtype, t, gen):
    """q [T, heads, nope + rope] and the latent projection [T, rank + rope]: q_pe and k_pe are views of them,
    as DeepseekV2MLAAttention hands them to the rotary op (k_pe [T, 1, rope], token stride rank + rope)."""
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen).to(dtype)
    latent = torch.randn(t, RANK + ROPE, generator=gen).to(dtype)
    return q, latent


@pytest.mark.parametrize("mscale, mscale_all_dim", MSCALES)
def test_spec_is_vllms_yarn(mscale, mscale_all_dim):
    """deepseek_yarn_spec: the frequencies vLLM computes (float32, _compute_inv_freq) and its mscale."""
    rope = build(DeepseekScalingRotaryEmbedding, torch.float32, False, mscale, mscale_all_dim)
    spec = vllm_cpu.deepseek_yarn_spec(rope)
    theirs = rope._compute_inv_freq(rope.scaling_factor).double()
    torch.testing.assert_close(torch.from_numpy(spec.inv_freq), theirs, rtol=2 ** -22, atol=0)
    assert spec.attention_scaling == pytest.approx(rope.mscale, rel=1e-12) and spec.style == "gptj"
    if mscale != mscale_all_dim:
        assert abs(rope.mscale - 1) > 0.01  # a case where mscale and mscale_all_dim both show in the scale


@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mscale, mscale_all_dim", MSCALES)
def test_deferred_rotation_is_vllms(monkeypatch, mscale, mscale_all_dim, dtype, is_neox):
    """The route's deferred DeepSeek rotary, then its MLA write (AMX_MLA's impl, driven directly): q_pe rotated
    in place in q, k_pe rotated in place, the latent row and the rotated k_pe written at each slot (-1: not),
    every other cache element untouched; the rotation vLLM's forward_native's at distinct positions, the
    table's last rows included, within vLLM's float32 angle error (below)."""
    monkeypatch.setattr(vllm_cpu, "_model_served", lambda: True)  # as inside a model every layer of which is served
    gen = torch.Generator().manual_seed(0)
    t = 24
    positions = torch.randperm(ORIGINAL * FACTOR, generator=gen)[:t]
    positions[:4] = torch.tensor([0, 1, ORIGINAL * FACTOR - 1, ORIGINAL * FACTOR - 2])
    q, latent = mla_inputs(dtype, t, gen)
    q_pe, k_pe = q[..., NOPE:], latent[:, None, RANK:]
    kv_c = latent[:, :RANK]
    vllms = build(DeepseekScalingRotaryEmbedding, dtype, is_neox, mscale, mscale_all_dim)
    want_q, want_k = vllms.forward_native(positions, q_pe.clone(), k_pe.clone())

    ours = build(vllm_cpu.DeferredDeepseekScalingRotaryEmbedding, dtype, is_neox, mscale, mscale_all_dim)
    q0, latent0 = q.clone(), latent.clone()
    assert ours(positions, q_pe, k_pe) == (q_pe, k_pe) and torch.equal(q, q0)  # deferred: nothing rotated yet
    cache = torch.randn(8, 16, RANK + ROPE, generator=gen).to(dtype)
    before = cache.clone()
    slots = torch.randperm(8 * 16, generator=gen)[:t]
    slots[5] = -1
    route = object.__new__(vllm_cpu_mla.AMXMLARoute)  # the write needs no state of the impl
    route.do_kv_cache_update(kv_c, k_pe, cache, slots, "auto", None)
    assert not vllm_cpu._pending

    angle = positions.double()[:, None] * torch.from_numpy(vllm_cpu.deepseek_yarn_spec(vllms).inv_freq)[None]
    angle = (torch.cat((angle, angle), -1) if is_neox else angle.repeat_interleave(2, -1))[:, None]  # per feature
    for name, got, want, x0 in (("q_pe", q[..., NOPE:], want_q, q0[..., NOPE:]),
                                ("k_pe", latent[:, None, RANK:], want_k, latent0[:, None, RANK:])):
        # vLLM's float32 table: the frequency and the angle t * f each round to float32 (up to 2^-24 |t f| each,
        # |t f| < 1.7e5 rad here), then cos and sin; bfloat16 also rounds the table, each product and the sum
        size = 2 * x0.double().abs().amax(-1, keepdim=True) * max(vllms.mscale, 1.0)
        slack = size * (angle * 2.0 ** -22 + 2.0 ** -22) + (size * 2.0 ** -6 if dtype == torch.bfloat16 else 0)
        ratio = ((got.double() - want.double()).abs() / slack).max().item()
        assert ratio <= 1, f"{name}: {ratio:.2f} x the bound of vLLM's own rounding"
    assert torch.equal(q[..., :NOPE], q0[..., :NOPE]) and torch.equal(kv_c, latent0[:, :RANK])
    want_cache = before.clone().view(-1, RANK + ROPE)
    keep = slots >= 0
    want_cache[slots[keep]] = torch.cat((kv_c, latent[:, RANK:]), -1)[keep]
    assert torch.equal(cache.view(-1, RANK + ROPE), want_cache)
