"""The model configurations tests/hf_conformance.py holds ropepool to, built in code (nothing is downloaded).

RoPE fields are the released models' (theta, scaling, partial factor, head_dim,
MRoPE sections, layer rules); sizes that do not touch the rotation are small.
Positions reach 1e5 (a longer table than GPT-J 6B's 2048 rows, so it can).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import transformers as tf


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make_config: Callable
    max_position: int = 100000  # the largest position of the call (always present)
    layer: int | None = None  # check RopeSpec.for_layers(config)[layer]; None: RopeSpec.from_hf_config(config)
    min_position: int = 0
    low_below: int | None = None  # longrope calls that switch to the long factors: also positions below this
    pin_seq_len: bool = False  # dynamic: pin spec.seq_len to largest position + 1, transformers' rule
    triton_cpu: bool = False  # also run the Triton interpreter on CPU (kept small)


LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Phi-3 style factors (48 per set: rotary_dim 96); made up but distinct per pair, so a
# swapped or misaligned list shows. The long set reaches Phi-3-mini-128k's ~40x.
SHORT_FACTOR = [round(1.0 + 0.25 * i / 47, 6) for i in range(48)]
LONG_FACTOR = [round(1.0 + 39.0 * (i / 47) ** 2, 6) for i in range(48)]
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


def phi3(**kw):
    kw = {"hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
          "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
          "rope_scaling": {"type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}} | kw
    return tf.Phi3Config(**kw)


def dynamic():
    return tf.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def llama4():  # Llama 4 Scout's text model: complex (interleaved) RoPE, llama3 scaling with low == high, NoPE every 4th
    return tf.Llama4TextConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                               num_hidden_layers=4, max_position_embeddings=10485760, rope_parameters={
                                   **LLAMA31, "factor": 16.0, "high_freq_factor": 1.0})


def gemma3():  # Gemma 3 27B: local 10k on sliding layers, 1M with linear x8 on every 6th (global) layer
    return tf.Gemma3TextConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                               num_hidden_layers=6, max_position_embeddings=131072, rope_parameters={
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


def smollm3():
    return tf.SmolLM3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
                            max_position_embeddings=65536, rope_parameters={"rope_type": "default", "rope_theta": 5e6})


def cohere2():  # Command R7B: interleaved RoPE on sliding layers, none on every 4th (full attention)
    return tf.Cohere2Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                            num_hidden_layers=4, sliding_window=4096, max_position_embeddings=131072,
                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def exaone4():  # EXAONE 4.0 32B: RoPE on sliding layers only ("LLLG")
    return tf.Exaone4Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                            num_hidden_layers=4, sliding_window=4096, sliding_window_pattern=4,
                            max_position_embeddings=131072, rope_parameters=dict(LLAMA31, rope_theta=1e6, factor=16.0))


def deepseek_v3(**kw):
    return tf.DeepseekV3Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                               kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               max_position_embeddings=163840, rope_parameters=dict(DEEPSEEK_YARN), **kw)


def qwen_vl(config_cls, rope, **text):
    """A multimodal Qwen config: its text model's RoPE (the vision tower is not built)."""
    text = {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
            "max_position_embeddings": 128000} | text
    return config_cls(text_config=text | rope)


def qwen3_5():  # Qwen3.5: partial 0.25 over a 256-wide head, interleaved MRoPE, linear attention on 3 of 4 layers
    return qwen_vl(tf.Qwen3_5Config, {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}}, head_dim=256, num_hidden_layers=4)


def small(config_cls, head_dim=128, **kw):
    """A config of the family with the given RoPE fields and small sizes elsewhere."""
    return config_cls(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, **kw)


def theta(value, **kw):
    return {"rope_parameters": dict(rope_type="default", rope_theta=value, **kw)}


CASES = [
    Case("llama3.1-8b", lambda: tf.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters=dict(LLAMA31)), triton_cpu=True),
    Case("llama3.2-1b-head64", lambda: tf.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters=dict(LLAMA31, factor=32.0))),
    Case("llama-dynamic-x2-beyond", dynamic, 20000, pin_seq_len=True),
    Case("llama-dynamic-x2-within", dynamic, 4095, pin_seq_len=True),
    Case("llama4-scout-rope-layer", llama4, layer=0, triton_cpu=True),
    Case("llama4-scout-nope-layer", llama4, layer=3),
    Case("mistral-7b-linear-x4", lambda: tf.MistralConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=1e6)),
    Case("mixtral-8x7b", lambda: tf.MixtralConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                                   max_position_embeddings=131072, **theta(1e6))),
    Case("qwen2-7b-theta1e6", lambda: tf.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, **theta(1e6))),
    Case("qwen2.5-7b-yarn-x4", lambda: tf.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
        max_position_embeddings=131072,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    Case("qwen2-moe-57b", lambda: tf.Qwen2MoeConfig(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                                     max_position_embeddings=65536, **theta(1e6))),
    Case("qwen3-8b", lambda: small(tf.Qwen3Config, max_position_embeddings=40960, **theta(1e6))),
    Case("qwen3-30b-a3b-moe", lambda: small(tf.Qwen3MoeConfig, max_position_embeddings=40960, **theta(1e6))),
    Case("qwen3-next-80b-partial-0.25", lambda: small(
        tf.Qwen3NextConfig, head_dim=256, num_hidden_layers=4, max_position_embeddings=262144,
        **theta(1e7, partial_rotary_factor=0.25)), layer=3),
    Case("qwen2-vl-7b-mrope-legacy", lambda: qwen_vl(tf.Qwen2VLConfig, {
        "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=None)),
    Case("qwen2.5-vl-7b-mrope", lambda: qwen_vl(tf.Qwen2_5_VLConfig, {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=None)),
    Case("qwen3-vl-8b-mrope-interleaved", lambda: qwen_vl(tf.Qwen3VLConfig, {"rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}}),
        triton_cpu=True),
    Case("qwen3.5-partial-mrope", qwen3_5, layer=3),
    Case("gemma-7b-head256", lambda: small(tf.GemmaConfig, head_dim=256, max_position_embeddings=8192)),
    Case("gemma2-9b", lambda: small(tf.Gemma2Config, head_dim=256, max_position_embeddings=8192)),
    Case("gemma3-27b-sliding-layer", gemma3, layer=0),
    Case("gemma3-27b-global-layer-linear-x8", gemma3, layer=5, triton_cpu=True),
    Case("phi3-mini-longrope-short", phi3, 4095),
    Case("phi3-mini-longrope-long", phi3, low_below=4096),
    Case("phi3-mini-longrope-long-edge", phi3, 4096, low_below=4096),
    Case("phi4-mini-longrope-partial-0.75", lambda: phi3(
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75), low_below=4096, triton_cpu=True),
    Case("phi-2-partial-0.4", lambda: tf.PhiConfig(
        hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4, max_position_embeddings=131072)),
    Case("gpt-oss-20b-yarn", lambda: small(tf.GptOssConfig, head_dim=64, num_local_experts=4,
                                           num_experts_per_tok=2)),
    Case("deepseek-v3-yarn-mscale-interleave", deepseek_v3, triton_cpu=True),
    Case("deepseek-v3-rope-interleave-off", lambda: deepseek_v3(rope_interleave=False)),
    Case("deepseek-v2-lite-complex", lambda: tf.DeepseekV2Config(
        hidden_size=512, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
        rope_parameters=dict(DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707))),
    Case("glm4-9b-interleaved-partial", lambda: small(tf.Glm4Config, max_position_embeddings=131072,
                                                      **theta(10000.0, partial_rotary_factor=0.5)), triton_cpu=True),
    Case("glm-4-9b-hf", lambda: small(tf.GlmConfig, max_position_embeddings=131072,
                                      **theta(10000.0, partial_rotary_factor=0.5))),
    Case("glm4.5-moe-neox-partial", lambda: small(tf.Glm4MoeConfig, max_position_embeddings=131072,
                                                  **theta(1e6, partial_rotary_factor=0.5))),
    Case("cohere-command-r-interleaved", lambda: tf.CohereConfig(
        hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        **theta(8e6))),
    Case("cohere2-r7b-sliding-layer", cohere2, layer=0),
    Case("cohere2-r7b-nope-layer", cohere2, layer=3),
    Case("smollm3-3b-rope-layer", smollm3, layer=0),
    Case("smollm3-3b-nope-layer", smollm3, layer=3, triton_cpu=True),
    Case("olmo2-7b", lambda: tf.Olmo2Config(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                                            **theta(500000.0))),
    Case("gpt-j-6b-interleaved", lambda: tf.GPTJConfig(n_embd=4096, n_head=16, rotary_dim=64, n_positions=100001)),
    Case("gpt-neox-20b-partial-0.25", lambda: tf.GPTNeoXConfig(
        hidden_size=6144, num_attention_heads=64, rotary_pct=0.25, max_position_embeddings=131072)),
    Case("stablelm-3b-partial-0.25", lambda: tf.StableLmConfig(
        hidden_size=2560, num_attention_heads=32, max_position_embeddings=4096,
        **theta(10000.0, partial_rotary_factor=0.25))),
    Case("granite-3-8b", lambda: tf.GraniteConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                                  max_position_embeddings=131072, **theta(1e7))),
    Case("llama-head256", lambda: tf.LlamaConfig(
        hidden_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072)),
    # further families of the table
    Case("helium-2b-interleaved", lambda: small(tf.HeliumConfig, max_position_embeddings=4096, **theta(100000.0))),
    Case("ernie4.5-interleaved", lambda: small(tf.Ernie4_5Config, max_position_embeddings=131072, **theta(500000.0))),
    Case("exaone4-sliding-layer", exaone4, layer=0),
    Case("exaone4-nope-layer", exaone4, layer=3),
    Case("minimax-attention-layer", lambda: small(tf.MiniMaxConfig, num_hidden_layers=2, num_local_experts=2,
                                                  max_position_embeddings=131072, **theta(1e7)), layer=0),
    Case("nemotron-partial-0.5", lambda: small(tf.NemotronConfig, max_position_embeddings=4096,
                                               **theta(10000.0, partial_rotary_factor=0.5))),
    Case("persimmon-8b-partial-0.5", lambda: tf.PersimmonConfig(hidden_size=4096, num_attention_heads=64,
                                                                max_position_embeddings=16384, **theta(25000.0))),
    Case("olmo3-full-layer-llama3", lambda: tf.Olmo3Config(
        hidden_size=4096, num_attention_heads=32, num_hidden_layers=4, max_position_embeddings=65536,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                         "full_attention": dict(LLAMA31)}), layer=3),
]
# the rest of the table: each family at its config class's RoPE defaults, small sizes
SMALL = {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}
MLA = {"num_key_value_heads": 4}
DEFAULTS = [(t, "", {"head_dim": 128}) for t in (
    "ministral", "granitemoe", "granitemoeshared", "olmo", "olmoe", "starcoder2", "phimoe", "seed_oss", "apertus",
    "arcee", "bitnet", "ernie4_5_moe", "qwen3_vl_moe_text")] + [
    ("qwen3_5_moe_text", "", {"head_dim": 256}), ("glm4_moe_lite", "", MLA),
    ("glm4_moe_lite", "-rope-interleave-off", MLA | {"rope_interleave": False}), ("youtu", "", MLA)]
CASES += [Case(f"{model_type}{suffix}-defaults", lambda model_type=model_type, kw=kw: tf.CONFIG_MAPPING[model_type](
    **SMALL | kw)) for model_type, suffix, kw in DEFAULTS]
CASES_BY_NAME = {c.name: c for c in CASES}
