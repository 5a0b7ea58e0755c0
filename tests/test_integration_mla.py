"""A tiny DeepSeek-V3 served through ``rope_latent_fused`` in transformers' own continuous batching (float32, CPU).

The model is built from a config written here (seeded random weights, no
download): 3 layers, the first dense and two MoE (4 routed experts, 2 per
token, one shared; transformers' MoE runs on the CPU), 4 heads of 16 nope +
16 rope features, kv_lora_rank 32, DeepSeek V3's YaRN (factor 40, mscale =
mscale_all_dim = 1), both ``rope_interleave`` settings, with and without
``q_lora_rank``. Greedy ``generate_batch`` through ropepool gives exactly the
tokens of ``generate_batch`` as shipped and of plain ``generate`` (transformers'
own MLA with its own cache), with the same log-probabilities; every MLA layer
makes one ``rope_latent_fused`` call per step; and transformers' latent cache
holds what ropepool wrote, equal to the rows transformers writes there itself.
A wrong rotation is caught by the log-probabilities.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")
transformers = pytest.importorskip("transformers")

import ropepool  # noqa: E402
from ropepool.cli import demo
from ropepool.integrations import transformers as rp
from ropepool.integrations.transformers import attention, latent
from tests.test_hf_mla import V3_YARN, in_place
from tests.test_integration import (
    LOGPROB_TOL,
    PROMPT_LENGTHS,
    StepSpy,
    frozen_heap,  # noqa: F401  (transformers' batching manager calls gc.collect() when it stops)
    generate,
    generate_batch,
    max_gap,
    served_both_ways,
)

pytestmark = pytest.mark.skipif(
    not hasattr(pytest.importorskip("transformers.generation.continuous_batching.cache"), "MLACacheAllocator"),
    reason="this transformers' continuous batching has no latent cache (MLACacheAllocator)")
LORA, NOPE, ROPE = 32, 16, 16


def build_model(interleave: bool, q_lora_rank: int | None, attn_implementation: str = "sdpa"):
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=16,
        max_position_embeddings=163840, rope_parameters=dict(V3_YARN), rope_interleave=interleave,
        initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.float().eval()
    g = model.generation_config
    g.eos_token_id, g.pad_token_id, g.bos_token_id, g.do_sample = None, 0, None, False
    return model


class Spy(StepSpy):
    """Records every ``rope_latent_fused`` call with its layer."""

    def __init__(self, model, monkeypatch):
        super().__init__(model, next(m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")))
        update, op = latent.LatentStep.update, latent.rope_latent_fused

        def spy_update(step, *args, **kwargs):
            self._layer = step.layer
            return update(step, *args, **kwargs)

        def spy_op(q_pe, k_pe, kv_c, positions, slots, ckv, kpe, **kw):
            out = op(q_pe, k_pe, kv_c, positions, slots, ckv, kpe, **kw)
            self.calls.append({"layer": self._layer, "rope": kw["rope"], "slots": slots.clone(),
                               "row": torch.cat((kv_c, out[1]), -1)})
            return out

        monkeypatch.setattr(latent.LatentStep, "update", spy_update)
        monkeypatch.setattr(latent, "rope_latent_fused", spy_op)


@pytest.mark.parametrize("interleave, q_lora_rank, attn_implementation", [
    pytest.param(True, 32, "sdpa", id="interleave-q-lora"),
    pytest.param(True, None, "sdpa", id="interleave-q-proj"),
    pytest.param(False, 32, "sdpa", id="rotate-half-q-lora"),
    pytest.param(False, None, "sdpa", id="rotate-half-q-proj"),
    pytest.param(True, 32, "eager", id="interleave-paged-eager"),
])
def test_deepseek_v3_through_rope_latent_fused_equals_transformers(interleave, q_lora_rank, attn_implementation,
                                                                    monkeypatch):
    model = build_model(interleave, q_lora_rank, attn_implementation)
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    spy = Spy(model, monkeypatch)
    shipped = served_both_ways(model, prompts, spy)

    # One call per MLA layer per step, with DeepSeek's rotation from the config.
    layers = {m.layer_idx: attention._LAYERS[m] for m in model.modules() if m in attention._LAYERS}
    assert sorted(layers) == [0, 1, 2]
    assert [sum(c["layer"] is layers[i] for c in spy.calls) for i in layers] == [spy.steps] * 3
    assert all(c["rope"] == ropepool.RopeSpec.from_hf_config(model.config) for c in spy.calls)
    assert spy.calls[0]["rope"].style == ("gptj" if interleave else "neox")

    # transformers' latent cache holds kv_c | k_pe_rot as ropepool wrote them, where transformers writes its own.
    shipped_cache, fused_cache = spy.caches
    for i, layer in layers.items():
        last = {}
        for c in (c for c in spy.calls if c["layer"] is layer):
            last.update((s, c["row"][row]) for row, s in enumerate(c["slots"].tolist()) if s >= 0)
        slots = torch.tensor(sorted(last))
        ckv, kpe = latent.columns(fused_cache, i)
        assert torch.equal(torch.cat((ckv, kpe), -1)[slots], torch.stack([last[s] for s in sorted(last)]))
        ckv_ref, kpe_ref = latent.columns(shipped_cache, i)
        tol = 0 if i == 0 else 1e-5  # layer 0's kv_c (not rotated) comes from the embeddings: the same bits
        torch.testing.assert_close(ckv[slots], ckv_ref[slots], rtol=tol, atol=tol)
        torch.testing.assert_close(kpe[slots], in_place(kpe_ref[slots], interleave), rtol=1e-5, atol=1e-5)

    # Plain generate (transformers' own MLA and DynamicCache) is untouched by enable() and agrees.
    n = len(spy.calls)
    plain = generate(model, prompts)
    assert len(spy.calls) == n and plain[0] == shipped[0] and max_gap(plain, shipped) < LOGPROB_TOL

    rp.disable(model)
    assert generate_batch(model, prompts)[0] == shipped[0] and len(spy.calls) == n


@pytest.mark.parametrize("wrong", ["pair-style", "base"])
def test_a_wrong_rotation_is_caught(wrong, monkeypatch):
    """The log-probabilities compared above see the other pair style, or a RoPE base off by 1%."""
    model = build_model(True, 32)
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    shipped = generate_batch(model, prompts)
    rp.enable(model)
    for module in (m for m in model.modules() if m in attention._LAYERS):
        layer = attention._LAYERS[module]
        rope = (dataclasses.replace(layer.rope, style="neox") if wrong == "pair-style"
                else dataclasses.replace(layer.rope, base=layer.rope.base * 1.01))
        monkeypatch.setitem(attention._LAYERS, module, dataclasses.replace(layer, rope=rope))
    assert max_gap(generate_batch(model, prompts), shipped) > 10 * LOGPROB_TOL


def test_without_a_latent_cache_enable_refuses(monkeypatch):
    from transformers.generation.continuous_batching import cache

    model = build_model(True, 32)
    monkeypatch.delattr(cache, "MLACacheAllocator")
    with pytest.raises(ropepool.RopePoolError, match=r"caches MLA latents \(MLACacheAllocator\); transformers "):
        rp.enable(model)
    assert not rp.is_enabled(model)
