"""RopeSpec against transformers: frequencies, attention scaling, config reading, the seq_len rule, bad specs.

Every reference value comes from transformers itself (ROPE_INIT_FUNCTIONS, the
models' compute_default_rope_parameters and rotary modules) on configs built
here; nothing is downloaded.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTNeoXConfig, LlamaConfig, Phi3Config, PhiConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from ropepool.errors import RopePoolError
from ropepool.spec import RopeSpec

# transformers builds inv_freq in float32 (arange cast to float32, then base ** exponent
# and, for yarn, the ramp in float32); the float32 rounding of the exponent is amplified
# by ln(base) (up to ~14 for base 1e6), so it agrees with the float64 formula to a few
# 1e-7 only. attention_scaling is Python float arithmetic there: compare it tightly.
INV_FREQ_RTOL = 2e-6
SCALING_RTOL = 1e-12

ROTARY_MODULES = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "phi": PhiRotaryEmbedding,
                  "phi3": Phi3RotaryEmbedding, "gpt_neox": GPTNeoXRotaryEmbedding}

LLAMA31 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
# Arbitrary but distinct per pair, so a swapped or misaligned list shows.
SHORT = [float(x) for x in np.linspace(1.0, 1.25, 48)]
LONG = [float(x) for x in np.linspace(1.0, 40.0, 48)]


def llama31():
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                       rope_parameters=dict(LLAMA31))


def phi3_longrope(**kw):
    kw = dict(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
              original_max_position_embeddings=4096,
              rope_scaling=dict(type="longrope", short_factor=SHORT, long_factor=LONG)) | kw
    return Phi3Config(**kw)


def qwen2(**kw):
    return Qwen2Config(hidden_size=3584, num_attention_heads=28, rope_theta=1e6, **kw)


def neox20b():
    return GPTNeoXConfig(hidden_size=6144, num_attention_heads=64, rotary_pct=0.25)


def yarn(max_position_embeddings, **rope):
    return LlamaConfig(head_dim=64, max_position_embeddings=max_position_embeddings,
                       rope_parameters=dict(rope_type="yarn", rope_theta=10000.0) | rope)


def dynamic_x2():
    return LlamaConfig(max_position_embeddings=4096, rope_scaling=dict(rope_type="dynamic", factor=2.0))


CONFIGS = [
    pytest.param(llama31, None, id="llama3.1-8b-llama3"),
    pytest.param(lambda: LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072,
                                     rope_parameters=dict(LLAMA31, factor=32.0)), None, id="llama3.2-1b-head64-llama3"),
    pytest.param(qwen2, None, id="qwen2-7b-theta1e6"),
    pytest.param(lambda: qwen2(max_position_embeddings=131072, rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=32768)), None, id="qwen2.5-yarn-x4"),
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
    pytest.param(lambda: LlamaConfig(rope_scaling=dict(type="linear", factor=2.0)), None, id="linear-x2"),
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
    pytest.param(dict(head_dim=64, rotary_dim=31), r"RopeSpec\.rotary_dim must be an even int", id="odd-rotary-dim"),
    pytest.param(dict(head_dim=64, rotary_dim=128), r"RopeSpec\.rotary_dim .*head_dim=64",
                 id="rotary-dim-over-head-dim"),
    pytest.param(dict(head_dim=64, style="interleaved"), r"RopeSpec\.style", id="bad-style"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "ntk"}), r"RopeSpec\.scaling\['rope_type'\].*'ntk'",
                 id="unknown-rope-type"),
    pytest.param(dict(head_dim=64, scaling={"type": "su"}), r"RopeSpec\.scaling\['rope_type'\].*'su'",
                 id="unknown-legacy-type"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "linear"}),
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'linear'", id="linear-missing-factor"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "dynamic"}, max_position_embeddings=2048),
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'dynamic'", id="dynamic-missing-factor"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "linear", "factor": 0}),
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0.*got 0", id="factor-zero"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "linear", "factor": -2.0}),
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0", id="factor-negative"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "linear", "factor": "2"}),
                 r"RopeSpec\.scaling\['factor'\] must be a number > 0", id="factor-string"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "dynamic", "factor": 2.0}),
                 r"RopeSpec\.max_position_embeddings is required for rope_type 'dynamic'", id="dynamic-without-max"),
    pytest.param(dict(head_dim=64, rotary_dim=2, scaling={"rope_type": "dynamic", "factor": 2.0},
                      max_position_embeddings=2048), r"RopeSpec\.rotary_dim must be > 2", id="dynamic-rotary-dim-2"),
    pytest.param(dict(head_dim=64, scaling=without(LLAMA3, "factor")),
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'llama3'", id="llama3-missing-factor"),
    pytest.param(dict(head_dim=64, scaling=without(LLAMA3, "low_freq_factor")),
                 r"RopeSpec\.scaling\['low_freq_factor'\] is required", id="llama3-missing-low"),
    pytest.param(dict(head_dim=64, scaling=without(LLAMA3, "high_freq_factor")),
                 r"RopeSpec\.scaling\['high_freq_factor'\] is required", id="llama3-missing-high"),
    pytest.param(dict(head_dim=64, scaling=without(LLAMA3, "original_max_position_embeddings")),
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'llama3' "
                 r"unless RopeSpec\.max_position_embeddings is set", id="llama3-missing-original"),
    pytest.param(dict(head_dim=64, scaling=dict(LLAMA3, high_freq_factor=1.0)),
                 r"RopeSpec\.scaling\['high_freq_factor'\] must be greater than low_freq_factor",
                 id="llama3-high-le-low"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "yarn", "factor": 4.0}),
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'yarn'",
                 id="yarn-missing-original"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "yarn", "original_max_position_embeddings": 4096}),
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'yarn' unless", id="yarn-missing-factor"),
    pytest.param(dict(head_dim=64, scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0},
                      max_position_embeddings=4096),
                 r"RopeSpec\.scaling\['attention_factor'\] must be a number > 0", id="yarn-bad-attention-factor"),
    pytest.param(dict(head_dim=64, scaling=without(LONG32, "short_factor"), max_position_embeddings=131072),
                 r"RopeSpec\.scaling\['short_factor'\] is required for rope_type 'longrope'",
                 id="longrope-missing-short"),
    pytest.param(dict(head_dim=64, scaling=without(LONG32, "long_factor"), max_position_embeddings=131072),
                 r"RopeSpec\.scaling\['long_factor'\] is required for rope_type 'longrope'",
                 id="longrope-missing-long"),
    pytest.param(dict(head_dim=64, scaling=dict(LONG32, long_factor=[2.0] * 31), max_position_embeddings=131072),
                 r"RopeSpec\.scaling\['long_factor'\] must have rotary_dim // 2 = 32 entries.*got shape \(31,\)",
                 id="longrope-long-wrong-length"),
    pytest.param(dict(head_dim=128, rotary_dim=96, scaling=dict(LONG32, short_factor=[1.0] * 64),
                      max_position_embeddings=131072),
                 r"RopeSpec\.scaling\['short_factor'\] must have rotary_dim // 2 = 48 entries",
                 id="longrope-short-sized-for-head-dim"),
    pytest.param(dict(head_dim=64, scaling=dict(LONG32, short_factor=[1.0] * 31 + [0.0]),
                      max_position_embeddings=131072),
                 r"RopeSpec\.scaling\['short_factor'\] must hold numbers > 0.*got \[0\.0\]", id="longrope-zero-entry"),
    pytest.param(dict(head_dim=64, scaling=without(LONG32, "original_max_position_embeddings") | {"factor": 32.0}),
                 r"RopeSpec\.scaling\['original_max_position_embeddings'\] is required for rope_type 'longrope'",
                 id="longrope-missing-original"),
    pytest.param(dict(head_dim=64, seq_len=0), r"RopeSpec\.seq_len must be a positive int or None", id="seq-len-zero"),
    pytest.param(dict(head_dim=64, seq_len=4096.0), r"RopeSpec\.seq_len must be a positive int", id="seq-len-float"),
    pytest.param(dict(head_dim=64, max_position_embeddings=-1), r"RopeSpec\.max_position_embeddings must be a positive",
                 id="max-position-negative"),
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
                 r"RopeSpec\.from_hf_config reads one RoPE per model.*full_attention", id="per-layer-rope"),
    pytest.param({"hidden_size": 2048, "num_attention_heads": 32, "partial_rotary_factor": 0.3},
                 r"RopeSpec\.rotary_dim must be an even int", id="odd-partial-rotary-dim"),
    pytest.param({"hidden_size": 2048, "num_attention_heads": 16, "rope_scaling": {"type": "linear"}},
                 r"RopeSpec\.scaling\['factor'\] is required for rope_type 'linear'", id="config-missing-factor"),
])
def test_bad_config_raises(config, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        RopeSpec.from_hf_config(config)
    check_message(excinfo)
