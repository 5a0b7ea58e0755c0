"""RopeSpec against transformers: frequencies, attention scaling, config reading, the seq_len rule, bad specs.

Every reference value comes from transformers itself (ROPE_INIT_FUNCTIONS, the
models' compute_default_rope_parameters and rotary modules) on configs built
here; nothing is downloaded.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")
from transformers import (
    CONFIG_MAPPING,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from ropepool.errors import RopePoolError
from ropepool.rotation.hf_config import FAMILIES
from ropepool.rotation.spec import RopeSpec

# transformers builds inv_freq in float32 (arange cast to float32, then base ** exponent
# and, for yarn, the ramp in float32); the float32 rounding of the exponent is amplified
# by ln(base) (up to ~14 for base 1e6), so it agrees with the float64 formula to a few
# 1e-7 only. attention_scaling is Python float arithmetic there: compare it tightly.
INV_FREQ_RTOL = 2e-6
SCALING_RTOL = 1e-12

ROTARY_MODULES = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "phi": PhiRotaryEmbedding,
                  "phi3": Phi3RotaryEmbedding, "gpt_neox": GPTNeoXRotaryEmbedding}

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Arbitrary but distinct per pair, so a swapped or misaligned list shows.
SHORT = [float(x) for x in np.linspace(1.0, 1.25, 48)]
LONG = [float(x) for x in np.linspace(1.0, 40.0, 48)]


def llama31():
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                       rope_parameters=dict(LLAMA31))


def phi3_longrope(**kw):
    kw = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
          "original_max_position_embeddings": 4096,
          "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}} | kw
    return Phi3Config(**kw)


def qwen2(**kw):
    return Qwen2Config(hidden_size=3584, num_attention_heads=28, rope_theta=1e6, **kw)


def neox20b():
    return GPTNeoXConfig(hidden_size=6144, num_attention_heads=64, rotary_pct=0.25)


def yarn(max_position_embeddings, **rope):
    return LlamaConfig(head_dim=64, max_position_embeddings=max_position_embeddings,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0} | rope)


def dynamic_x2():
    return LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0})


CONFIGS = [
    pytest.param(llama31, None, id="llama3.1-8b-llama3"),
    pytest.param(lambda: LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072,
                                     rope_parameters=dict(LLAMA31, factor=32.0)), None, id="llama3.2-1b-head64-llama3"),
    pytest.param(qwen2, None, id="qwen2-7b-theta1e6"),
    pytest.param(lambda: qwen2(max_position_embeddings=131072, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), None, id="qwen2.5-yarn-x4"),
    pytest.param(lambda: yarn(131072, rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                              truncate=False, original_max_position_embeddings=4096), None, id="yarn-no-truncate"),
    pytest.param(lambda: yarn(163840, factor=40.0, mscale=0.707, mscale_all_dim=1.0,
                              original_max_position_embeddings=4096), None, id="yarn-mscale"),
    pytest.param(lambda: yarn(16384, factor=None, attention_factor=1.5, beta_fast=16, beta_slow=2,
                              original_max_position_embeddings=4096), None, id="yarn-factor-from-ratio"),
    pytest.param(phi3_longrope, None, id="phi3-longrope-unpinned"),
    pytest.param(phi3_longrope, 4096, id="phi3-longrope-at-original"),
    pytest.param(phi3_longrope, 4097, id="phi3-longrope-beyond-original"),
    pytest.param(phi3_longrope, 131072, id="phi3-longrope-at-max"),
    pytest.param(lambda: phi3_longrope(num_attention_heads=24, partial_rotary_factor=0.75), 131072,
                 id="phi4-mini-longrope-partial-0.75"),
    pytest.param(lambda: LlamaConfig(rope_scaling={"type": "linear", "factor": 2.0}), None, id="linear-x2"),
    pytest.param(dynamic_x2, None, id="dynamic-x2-unpinned"),
    pytest.param(dynamic_x2, 3000, id="dynamic-x2-within-max"),
    pytest.param(dynamic_x2, 10000, id="dynamic-x2-beyond-max"),
    pytest.param(neox20b, None, id="gpt-neox-20b-partial-0.25"),
    pytest.param(lambda: PhiConfig(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4), None,
                 id="phi-2-partial-0.4"),
    pytest.param(lambda: LlamaConfig(hidden_size=2048, num_attention_heads=32), None, id="head-dim-64"),
    pytest.param(lambda: LlamaConfig(hidden_size=4096, num_attention_heads=32), None, id="head-dim-128"),
    pytest.param(lambda: LlamaConfig(hidden_size=2048, num_attention_heads=8, head_dim=256), None, id="head-dim-256"),
]


def hf_init(config, seq_len):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, scaling = ROTARY_MODULES[config.model_type].compute_default_rope_parameters(config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
    return inv_freq.double().numpy(), scaling


@pytest.mark.parametrize("make_config, seq_len", CONFIGS)
def test_matches_transformers(make_config, seq_len):
    config = make_config()
    spec = RopeSpec.from_hf_config(config, seq_len=seq_len)
    inv_freq, scaling = hf_init(config, seq_len)
    assert spec.inv_freq.dtype == np.float64 and spec.inv_freq.shape == (spec.rotary_dim // 2,)
    np.testing.assert_allclose(spec.inv_freq, inv_freq, rtol=INV_FREQ_RTOL, atol=0)
    np.testing.assert_allclose(spec.attention_scaling, scaling, rtol=SCALING_RTOL)
    assert spec.rope_type == config.rope_parameters["rope_type"]
    assert spec.style == "neox"


def test_rotary_dims_read_from_configs():
    assert RopeSpec.from_hf_config(neox20b()).rotary_dim == 24
    assert RopeSpec.from_hf_config(PhiConfig(hidden_size=2560, num_attention_heads=32,
                                             partial_rotary_factor=0.4)).rotary_dim == 32
    phi4 = RopeSpec.from_hf_config(phi3_longrope(num_attention_heads=24, partial_rotary_factor=0.75))
    assert (phi4.head_dim, phi4.rotary_dim) == (128, 96)


def test_gptj_interleaved_matches_transformers():
    config = GPTJConfig(n_embd=4096, n_head=16, rotary_dim=64)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.style, spec.head_dim, spec.rotary_dim, spec.base) == ("gptj", 256, 64, 10000.0)
    # GPT-J ships its table, not inv_freq: [sin | cos] per position, angles in float32.
    table = create_sinusoidal_positions(64, config.rotary_dim).double().numpy()
    angles = np.arange(64)[:, None] * spec.inv_freq
    np.testing.assert_allclose(table, np.concatenate([np.sin(angles), np.cos(angles)], axis=1), rtol=0, atol=1e-5)


# --- the seq_len rule against transformers' rotary modules at run time ---------------------------

def run_module(module, n):
    """The module's frequencies after a forward over positions 0..n-1 (its largest is n - 1)."""
    module(torch.zeros(1), torch.arange(n)[None])
    return module.inv_freq.double().numpy()


def test_dynamic_rule_matches_transformers_forward():
    config = dynamic_x2()
    spec = RopeSpec.from_hf_config(config)
    module = LlamaRotaryEmbedding(config)
    for n in (100, 4096, 10000, 20000, 100):  # within, at, beyond max twice, then back within
        np.testing.assert_allclose(spec.at_seq_len(n).inv_freq, run_module(module, n), rtol=INV_FREQ_RTOL)
    np.testing.assert_allclose(spec.inv_freq, spec.at_seq_len(4096).inv_freq, rtol=0)
    assert spec.long_inv_freq is None and spec.long_from is None


def test_longrope_rule_matches_transformers_forward():
    config = phi3_longrope()
    spec = RopeSpec.from_hf_config(config)
    assert spec.long_from == 4096 and spec.long_inv_freq.shape == spec.inv_freq.shape
    module = Phi3RotaryEmbedding(config)
    # largest position 4095 < long_from: short factors; 4096 >= long_from: long factors, for the whole call
    np.testing.assert_allclose(spec.inv_freq, run_module(module, 4096), rtol=INV_FREQ_RTOL)
    np.testing.assert_allclose(spec.long_inv_freq, run_module(module, 4097), rtol=INV_FREQ_RTOL)
    np.testing.assert_allclose(spec.attention_scaling, module.attention_scaling, rtol=SCALING_RTOL)


def test_longrope_pinned_picks_one_set():
    spec = RopeSpec.from_hf_config(phi3_longrope())
    short, long = spec.at_seq_len(4096), spec.at_seq_len(4097)
    np.testing.assert_array_equal(short.inv_freq, spec.inv_freq)
    np.testing.assert_array_equal(long.inv_freq, spec.long_inv_freq)
    for pinned in (short, long):
        assert pinned.long_inv_freq is None and pinned.long_from is None
        assert pinned.attention_scaling == spec.attention_scaling


def test_at_seq_len_is_a_pinned_copy():
    spec = RopeSpec(head_dim=64, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=1024)
    pinned = spec.at_seq_len(5000)
    assert pinned.seq_len == 5000 and spec.seq_len is None
    assert pinned != spec and pinned.at_seq_len(None) == spec and hash(pinned.at_seq_len(None)) == hash(spec)


# --- from_hf_config: config objects and their dict forms, both spellings -------------------------

@pytest.mark.parametrize("make_config, as_dict", [
    pytest.param(llama31, lambda c: {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                                     "rope_scaling": {k: v for k, v in LLAMA31.items() if k != "rope_theta"}},
                 id="llama3.1-rope_scaling-dict"),
    pytest.param(llama31, lambda c: c.to_dict(), id="llama3.1-rope_parameters-dict"),
    pytest.param(llama31, lambda c: {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                                     "rope_parameters": {k: v for k, v in LLAMA31.items() if k != "rope_theta"}},
                 id="llama3.1-rope_parameters-theta-outside"),
    pytest.param(phi3_longrope, lambda c: {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
                                           "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                           "rope_scaling": {"type": "longrope", "short_factor": SHORT,
                                                            "long_factor": LONG}},
                 id="phi3-top-level-original"),
    pytest.param(neox20b, lambda c: {"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
                            "max_position_embeddings": 2048, "rotary_pct": 0.25, "rotary_emb_base": 10000},
                 id="gpt-neox-rotary_pct"),
    pytest.param(lambda: GPTJConfig(n_embd=4096, n_head=16, rotary_dim=64), lambda c: c.to_dict(), id="gptj-n_embd"),
    pytest.param(qwen2, lambda c: c.to_dict(), id="qwen2-default"),
])
def test_dict_and_object_give_one_spec(make_config, as_dict):
    config = make_config()
    spec, from_dict = RopeSpec.from_hf_config(config), RopeSpec.from_hf_config(as_dict(config))
    assert from_dict == spec and hash(from_dict) == hash(spec)
    np.testing.assert_array_equal(from_dict.inv_freq, spec.inv_freq)


def test_from_hf_config_equals_hand_built_spec():
    spec = RopeSpec.from_hf_config(llama31())
    by_hand = RopeSpec(head_dim=128, base=500000.0, max_position_embeddings=131072,
                       scaling={k: v for k, v in LLAMA31.items() if k != "rope_theta"})
    assert spec == by_hand
    assert RopeSpec.from_hf_config(qwen2()).scaling is None


def test_from_hf_config_defaults_and_seq_len():
    spec = RopeSpec.from_hf_config({"hidden_size": 1024, "num_attention_heads": 16}, seq_len=77)
    assert (spec.head_dim, spec.rotary_dim, spec.base, spec.max_position_embeddings, spec.seq_len) == (
        64, 64, 10000.0, None, 77)


def test_legacy_type_key_equals_rope_type():
    new = RopeSpec(head_dim=64, scaling={"rope_type": "linear", "factor": 2.0})
    old = RopeSpec(head_dim=64, scaling={"type": "linear", "factor": 2.0})
    assert old.rope_type == "linear"
    np.testing.assert_array_equal(new.inv_freq, old.inv_freq)
    np.testing.assert_allclose(new.inv_freq, RopeSpec(head_dim=64).inv_freq / 2, rtol=1e-15)


# --- bad specs -------------------------------------------------------------------------------------

LONG32 = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
          "original_max_position_embeddings": 4096}
LLAMA3 = {k: v for k, v in LLAMA31.items() if k != "rope_theta"}


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


BAD = [
    pytest.param({"head_dim": 64, "rotary_dim": 31}, r"RopeSpec\.rotary_dim must be an even int", id="odd-rotary-dim"),
    pytest.param({"head_dim": 64, "rotary_dim": 128}, r"RopeSpec\.rotary_dim .*head_dim=64",
                 id="rotary-dim-over-head-dim"),
    pytest.param({"head_dim": 64, "style": "interleaved"}, r"RopeSpec\.style", id="bad-style"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "ntk"}}, r"RopeSpec\.scaling\['rope_type'\].*'ntk'",
                 id="unknown-rope-type"),
    pytest.param({"head_dim": 64, "scaling": {"type": "su"}}, r"RopeSpec\.scaling\['rope_type'\].*'su'",
                 id="unknown-legacy-type"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "linear"}},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'linear'", id="linear-missing-factor"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "dynamic"}, "max_position_embeddings": 2048},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'dynamic'", id="dynamic-missing-factor"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "linear", "factor": 0}},
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0.*got 0", id="factor-zero"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "linear", "factor": -2.0}},
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0", id="factor-negative"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "linear", "factor": "2"}},
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0", id="factor-string"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "dynamic", "factor": 2.0}},
                 r"RopeSpec\.max_position_embeddings is required for rope_type 'dynamic'", id="dynamic-without-max"),
    pytest.param({"head_dim": 64, "rotary_dim": 2, "scaling": {"rope_type": "dynamic", "factor": 2.0},
                  "max_position_embeddings": 2048}, r"RopeSpec\.rotary_dim must be > 2", id="dynamic-rotary-dim-2"),
    pytest.param({"head_dim": 64, "scaling": without(LLAMA3, "factor")},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'llama3'", id="llama3-missing-factor"),
    pytest.param({"head_dim": 64, "scaling": without(LLAMA3, "low_freq_factor")},
                 r"RopeSpec\.scaling\['low_freq_factor'\] is required", id="llama3-missing-low"),
    pytest.param({"head_dim": 64, "scaling": without(LLAMA3, "high_freq_factor")},
                 r"RopeSpec\.scaling\['high_freq_factor'\] is required", id="llama3-missing-high"),
    pytest.param({"head_dim": 64, "scaling": without(LLAMA3, "original_max_position_embeddings")},
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'llama3' "
                 r"unless RopeSpec\.max_position_embeddings is set", id="llama3-missing-original"),
    pytest.param({"head_dim": 64, "scaling": dict(LLAMA3, high_freq_factor=0.5)},
                 r"RopeSpec\.scaling\['high_freq_factor'\] must be at least low_freq_factor=1\.0; got 0\.5",
                 id="llama3-high-below-low"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "yarn", "factor": 4.0}},
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'yarn'",
                 id="yarn-missing-original"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'yarn' unless", id="yarn-missing-factor"),
    pytest.param({"head_dim": 64, "scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0},
                  "max_position_embeddings": 4096},
                 r"RopeSpec\.scaling\['attention_factor'\] must be a number > 0", id="yarn-bad-attention-factor"),
    pytest.param({"head_dim": 64, "scaling": without(LONG32, "short_factor"), "max_position_embeddings": 131072},
                 r"RopeSpec\.scaling\['short_factor'\] is required for rope_type 'longrope'",
                 id="longrope-missing-short"),
    pytest.param({"head_dim": 64, "scaling": without(LONG32, "long_factor"), "max_position_embeddings": 131072},
                 r"RopeSpec\.scaling\['long_factor'\] is required for rope_type 'longrope'",
                 id="longrope-missing-long"),
    pytest.param({"head_dim": 64, "scaling": dict(LONG32, long_factor=[2.0] * 31), "max_position_embeddings": 131072},
                 r"RopeSpec\.scaling\['long_factor'\] must have rotary_dim // 2 = 32 entries.*got shape \(31,\)",
                 id="longrope-long-wrong-length"),
    pytest.param({"head_dim": 128, "rotary_dim": 96, "scaling": dict(LONG32, short_factor=[1.0] * 64),
                  "max_position_embeddings": 131072},
                 r"RopeSpec\.scaling\['short_factor'\] must have rotary_dim // 2 = 48 entries",
                 id="longrope-short-sized-for-head-dim"),
    pytest.param({"head_dim": 64, "scaling": dict(LONG32, short_factor=[1.0] * 31 + [0.0]),
                  "max_position_embeddings": 131072},
                 r"RopeSpec\.scaling\['short_factor'\] must hold numbers > 0.*got \[0\.0\]", id="longrope-zero-entry"),
    pytest.param({"head_dim": 64, "scaling": without(LONG32, "original_max_position_embeddings") | {"factor": 32.0}},
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'longrope'",
                 id="longrope-missing-original"),
    pytest.param({"head_dim": 64, "seq_len": 0}, r"RopeSpec\.seq_len must be a positive int or None",
                 id="seq-len-zero"),
    pytest.param({"head_dim": 64, "seq_len": 4096.0}, r"RopeSpec\.seq_len must be a positive int", id="seq-len-float"),
    pytest.param({"head_dim": 64, "max_position_embeddings": -1},
                 r"RopeSpec\.max_position_embeddings must be a positive", id="max-position-negative"),
]


def check_message(excinfo):
    assert excinfo.type is RopePoolError
    message = str(excinfo.value)
    assert "got " in message and "Fix: " in message, message


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_spec_raises(kwargs, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        RopeSpec(**kwargs)
    check_message(excinfo)


@pytest.mark.parametrize("config, match", [
    pytest.param({"model_type": "llama", "max_position_embeddings": 2048},
                 r"RopeSpec\.from_hf_config needs head_dim, or hidden_size and num_attention_heads", id="no-head-dim"),
    pytest.param({"hidden_size": 2048, "num_attention_heads": 16,
                  "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
                 r"RopeSpec\.from_hf_config reads one RoPE per model; got layers whose RoPE differs "
                 r"\(rotary_dim=128 base=10000 default; rotary_dim=128 base=1e\+06 default\)\. "
                 r"Fix: RopeSpec\.for_layers\(config\)", id="per-layer-rope"),
    pytest.param({"model_type": "llama4_text", "hidden_size": 1024, "num_attention_heads": 8},
                 r"RopeSpec\.for_layers needs num_hidden_layers in the config", id="nope-family-without-layers"),
    pytest.param({"model_type": "gemma3_text", "hidden_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 2,
                  "layer_types": ["sliding_attention", "chunked_attention"],
                  "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                      "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                 r"RopeSpec\.for_layers found no rope_parameters for layer 1 of type 'chunked_attention'",
                 id="layer-type-without-parameters"),
    pytest.param({"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128},
                 r"RopeSpec\.from_hf_config needs head_dim", id="mla-without-qk_rope_head_dim"),
    pytest.param({"hidden_size": 2048, "num_attention_heads": 32, "partial_rotary_factor": 0.3},
                 r"RopeSpec\.rotary_dim must be an even int", id="odd-partial-rotary-dim"),
    pytest.param({"hidden_size": 2048, "num_attention_heads": 16, "rope_scaling": {"type": "linear"}},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'linear'", id="config-missing-factor"),
])
def test_bad_config_raises(config, match):
    read = RopeSpec.for_layers if match.startswith(r"RopeSpec\.for_layers") else RopeSpec.from_hf_config
    with pytest.raises(ValueError, match=match) as excinfo:
        read(config)
    check_message(excinfo)


# --- the family table: pair styles, defaults, layers -------------------------------------------

def build(model_type, **fields):
    """transformers' own config object from config.json-style fields (the reference for the dict form)."""
    return CONFIG_MAPPING[model_type](**fields)


# config.json-style dicts as released models ship them (RoPE fields only, small sizes otherwise).
# Each must read as transformers' config class reads the same fields.
SMALL = {"hidden_size": 512, "num_attention_heads": 4, "head_dim": 128}
YARN_V3 = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
           "original_max_position_embeddings": 4096}
LLAMA4_SCALING = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192}
LEGACY = [
    pytest.param("gemma3_text", SMALL | {"num_hidden_layers": 12, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                                         "sliding_window_pattern": 6,
                                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                 id="gemma3-rope_local_base_freq"),
    pytest.param("qwen2_vl_text", {"hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 2,
                                   "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
                 id="qwen2-vl-legacy-mrope"),
    pytest.param("deepseek_v3", {"hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 2,
                                 "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "max_position_embeddings": 163840,
                                 "rope_theta": 10000, "rope_scaling": YARN_V3}, id="deepseek-v3-config-json"),
    pytest.param("glm4", SMALL | {"num_hidden_layers": 2}, id="glm4-partial-default-0.5"),
    pytest.param("gpt_neox", {"hidden_size": 6144, "num_attention_heads": 64, "num_hidden_layers": 2},
                 id="gpt-neox-rotary-pct-default-0.25"),
    pytest.param("cohere2", SMALL | {"num_hidden_layers": 8, "sliding_window": 4096, "sliding_window_pattern": 4},
                 id="cohere2-pattern"),
    pytest.param("llama4_text", SMALL | {"num_hidden_layers": 8, "no_rope_layers": [], "rope_theta": 500000.0,
                                         "rope_scaling": LLAMA4_SCALING}, id="llama4-empty-no_rope_layers"),
    pytest.param("smollm3", {"hidden_size": 512, "num_attention_heads": 4, "num_hidden_layers": 8, "rope_theta": 5e6,
                             "no_rope_layers": [1, 1, 0, 1, 1, 1, 0, 1]}, id="smollm3-no_rope_layers"),
    pytest.param("exaone4", SMALL | {"num_hidden_layers": 8, "sliding_window": 4096, "sliding_window_pattern": 4},
                 id="exaone4-pattern"),
    pytest.param("qwen3_next", SMALL | {"head_dim": 256, "num_hidden_layers": 8, "rope_theta": 1e7},
                 id="qwen3-next-partial-default-0.25"),
    pytest.param("phi", {"hidden_size": 2560, "num_attention_heads": 32, "num_hidden_layers": 2},
                 id="phi-partial-default"),
    pytest.param("minimax", SMALL | {"num_hidden_layers": 4, "rope_theta": 1e7}, id="minimax-linear-layers"),
    pytest.param("mixtral", SMALL | {"num_hidden_layers": 2}, id="mixtral-theta-default-1e6"),
    pytest.param("helium", SMALL | {"num_hidden_layers": 2}, id="helium-theta-default-1e5"),
    pytest.param("gemma3_text", SMALL | {"num_hidden_layers": 6}, id="gemma3-theta-defaults"),
]


@pytest.mark.parametrize("model_type, fields", LEGACY)
def test_dict_reads_like_transformers_config_class(model_type, fields):
    fields = {"max_position_embeddings": 131072} | fields  # the config class has its own default
    as_dict = {"model_type": model_type, **fields}
    config = build(model_type, **fields)
    assert RopeSpec.for_layers(as_dict) == RopeSpec.for_layers(config) == RopeSpec.for_layers(config.to_dict())
    assert len(RopeSpec.for_layers(config)) == config.num_hidden_layers


def test_gemma3_two_ropes_by_layer_type():
    config = build("gemma3_text", hidden_size=512, num_attention_heads=4, head_dim=128, num_hidden_layers=12,
                   rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    specs = RopeSpec.for_layers(config)
    module = Gemma3RotaryEmbedding(config)
    for i, (spec, layer_type) in enumerate(zip(specs, config.layer_types)):
        assert layer_type == ("full_attention" if i % 6 == 5 else "sliding_attention")
        assert (spec.base, spec.rope_type) == ((1e6, "linear") if i % 6 == 5 else (10000.0, "default"))
        np.testing.assert_allclose(spec.inv_freq, getattr(module, f"{layer_type}_inv_freq").double().numpy(),
                                   rtol=INV_FREQ_RTOL)
    with pytest.raises(RopePoolError, match=r"reads one RoPE per model.*RopeSpec\.for_layers\(config\)"):
        RopeSpec.from_hf_config(config)


@pytest.mark.parametrize("model_type, fields, nope", [
    pytest.param("llama4_text", {"num_hidden_layers": 8}, [3, 7], id="llama4-every-4th"),
    pytest.param("llama4_text", {"num_hidden_layers": 4, "no_rope_layers": [0, 1, 1, 1]}, [0], id="llama4-explicit"),
    pytest.param("smollm3", {"num_hidden_layers": 8, "no_rope_layer_interval": 2}, [1, 3, 5, 7], id="smollm3-interval"),
    pytest.param("cohere2", {"num_hidden_layers": 8, "sliding_window": 4096}, [3, 7], id="cohere2-full-layers"),
    pytest.param("exaone4", {"num_hidden_layers": 8, "sliding_window": 4096}, [3, 7], id="exaone4-full-layers"),
    pytest.param("exaone4", {"num_hidden_layers": 4, "sliding_window": None, "layer_types": ["full_attention"] * 4}, [],
                 id="exaone4-without-sliding-window"),
    pytest.param("qwen3_next", {"num_hidden_layers": 8, "head_dim": 256}, [0, 1, 2, 4, 5, 6], id="qwen3-next-linear"),
    pytest.param("minimax", {"num_hidden_layers": 4}, [1, 3], id="minimax-linear"),
])
def test_layers_without_rope(model_type, fields, nope):
    config = build(model_type, **{"hidden_size": 512, "num_attention_heads": 4, "head_dim": 128} | fields)
    specs = RopeSpec.for_layers(config)
    assert [i for i, s in enumerate(specs) if s.rotary_dim == 0] == nope
    assert all(s.head_dim == config.head_dim for s in specs)
    rotating = {s for s in specs if s.rotary_dim}
    assert len(rotating) == 1
    if model_type in ("qwen3_next", "minimax") or not nope:  # linear attention layers have no RoPE to disagree
        assert RopeSpec.from_hf_config(config) == rotating.pop()
    else:
        with pytest.raises(RopePoolError, match=r"layers whose RoPE differs .*no RoPE.*Fix: RopeSpec\.for_layers"):
            RopeSpec.from_hf_config(config)


@pytest.mark.parametrize("model_type, style, fields", [
    ("llama", "neox", {}), ("qwen3", "neox", {}), ("gemma2", "neox", {}), ("glm4_moe", "neox", {}),
    ("gptj", "gptj", {}), ("cohere", "gptj", {}), ("glm", "gptj", {}), ("glm4", "gptj", {}), ("helium", "gptj", {}),
    ("ernie4_5", "gptj", {}), ("deepseek_v2", "gptj", {}), ("deepseek_v3", "gptj", {}),
    ("deepseek_v3", "neox", {"rope_interleave": False}), ("llama4_text", "gptj", {"no_rope_layers": [1, 1]}),
])
def test_pair_style_per_family(model_type, style, fields):
    config = {"model_type": model_type, "hidden_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 2,
              "qk_rope_head_dim": 64, "n_embd": 1024, "n_head": 8, **fields}
    assert RopeSpec.from_hf_config(config).style == style
    other = "gptj" if style == "neox" else "neox"
    assert RopeSpec.from_hf_config(config, style=other).style == other  # style= overrides the table
    assert {s.style for s in RopeSpec.for_layers(config, style=other)} == {other}


def test_multimodal_configs_read_their_text_config():
    qwen3_vl = build("qwen3_vl", text_config={"hidden_size": 512, "num_attention_heads": 4, "head_dim": 128,
                                                  "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                                   "mrope_section": [24, 20, 20]}})
    for config in (qwen3_vl, qwen3_vl.to_dict()):
        spec = RopeSpec.from_hf_config(config)  # no mrope_interleaved flag: Qwen3-VL always interleaves
        assert (spec.mrope_section, spec.mrope_interleaved, spec.base) == ((24, 20, 20), True, 5e6)
    qwen2_vl = {"model_type": "qwen2_vl", "text_config": {"hidden_size": 3584, "num_attention_heads": 28,
                                                          "rope_theta": 1e6}}  # no sections: transformers' default
    spec = RopeSpec.from_hf_config(qwen2_vl)
    assert (spec.mrope_section, spec.mrope_interleaved, spec.rope_type) == ((16, 24, 24), False, "default")
    gemma3 = build("gemma3", text_config={"hidden_size": 512, "num_attention_heads": 4, "head_dim": 128,
                                              "num_hidden_layers": 6})
    assert RopeSpec.for_layers(gemma3) == RopeSpec.for_layers(gemma3.text_config)


def test_llama4_scaling_with_equal_low_and_high_factors_matches_transformers():
    config = build("llama4_text", hidden_size=512, num_attention_heads=4, head_dim=128, num_hidden_layers=4,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192})
    spec = RopeSpec.for_layers(config)[0]
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    np.testing.assert_allclose(spec.inv_freq, inv_freq.double().numpy(), rtol=INV_FREQ_RTOL)
    assert spec.style == "gptj"


def test_uniform_models_give_one_spec_per_layer():
    config = llama31()
    specs = RopeSpec.for_layers(config)
    assert len(specs) == config.num_hidden_layers and set(specs) == {RopeSpec.from_hf_config(config)}


def test_plain_dict_without_model_type_is_neox():
    spec = RopeSpec.from_hf_config({"hidden_size": 1024, "num_attention_heads": 8})
    assert (spec.style, spec.rotary_dim) == ("neox", 128)


def test_unknown_model_type_raises_unless_style_is_given():
    config = {"model_type": "not_a_model", "hidden_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 2}
    for read in (RopeSpec.from_hf_config, RopeSpec.for_layers):
        with pytest.raises(ValueError, match=r"no verified pair style for model_type 'not_a_model'.*style=") as exc:
            read(config)
        check_message(exc)
        assert RopeSpec.from_hf_config(config, style="gptj").style == "gptj"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_table_defaults_are_the_config_classes(model_type):
    """What a config.json may leave out, the table fills in as transformers' config class does."""
    family = FAMILIES[model_type]
    config = build(model_type)
    text = getattr(config, "text_config", None) or config
    theta = getattr(text, "default_theta", 10000.0)
    assert (family.theta, family.local_base) == ((theta["global"], theta["local"]) if isinstance(theta, dict)
                                                 else (theta, None))
    if family.rotary == "partial":
        params = text.rope_parameters
        params = params.get("full_attention", params)
        assert family.partial == params.get("partial_rotary_factor", 1.0)
