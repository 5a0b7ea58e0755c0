"""q_rot / k_rot against transformers itself, for every model family of ropepool's table.

The cases live in tests/hf_cases.py, the comparison and its bounds in
tests/hf_conformance.py (``python -m tests.hf_conformance`` prints the same
numbers as a table): each case builds a transformers config in code, runs the
family's own rotary-embedding module and apply function on random q/k at
arbitrary positions (shuffled, repeated, up to 1e5; ``[3, T]`` for MRoPE;
longrope below and across its switch point) and compares with ropepool through
``RopeSpec.from_hf_config(config)`` or ``RopeSpec.for_layers(config)[layer]``.

The bounds (derived in tests/hf_conformance.py): every rotated element within
``A * (dtheta + C)`` of transformers' output, with A the size of its pair
(times attention_scaling), dtheta the difference between the two float32
angles (from transformers computing its frequencies in float32; held to
(ln(base) + 8) float32 epsilons, so it cannot hide a wrong frequency) and C the
rounding both sides are entitled to: float32 1e-6 each; bfloat16 transformers
3 * 2^-8 (cos/sin, both products and the sum rounded), ropepool 2^-8 (one
rounding; 2^-7 under the Triton CPU interpreter, whose cast truncates). Each
side is also held to its own bound against the exact float64 rotation,
pass-through features and layers without RoPE must be bit-identical, and the
spec read from ``config.to_dict()`` must equal the one read from the config.
A wrong pair style or a wrong partial factor misses these bounds by orders of
magnitude (the negative tests below).
"""
from __future__ import annotations

import dataclasses
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

pytest.importorskip("transformers")

from ropepool.rotation.hf_config import FAMILIES
from tests import hf_conformance as hfc
from tests.hf_cases import CASES, CASES_BY_NAME

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# (device, backend, q heads, kv heads, tokens): the Triton interpreter is slow, so it gets 16 tokens.
RUNS = {
    "torch": ("cpu", "torch", 4, 2, 64),
    "triton-interp": ("cpu", "triton", 2, 1, 16),
    "cuda": ("cuda", None, 32, 8, 512),  # the default backend there: the Triton kernel
}


def _params():
    out = []
    for case in CASES:
        for dt in DTYPES:
            out.append(pytest.param(case.name, dt, "torch", id=f"{case.name}-{dt}-torch"))
            if case.triton_cpu and dt == "bf16":  # the interpreter is slow: the dtype where its cast matters
                out.append(pytest.param(case.name, dt, "triton-interp", id=f"{case.name}-{dt}-triton-interp",
                                        marks=pytest.mark.skipif(not INTERPRETER,
                                                                 reason="needs TRITON_INTERPRET=1 (no GPU)")))
            out.append(pytest.param(case.name, dt, "cuda", id=f"{case.name}-{dt}-cuda",
                                    marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")))
    return out


def run(name, dt="f32", run="torch", **kw):
    device, backend, hq, hkv, tokens = RUNS[run]
    return hfc.run_case(name, device, DTYPES[dt], backend, num_tokens=tokens, num_heads=hq, num_kv_heads=hkv, **kw)


@pytest.mark.parametrize("name, dt, how", _params())
def test_matches_transformers(name, dt, how):
    # One fixed input set per case (run_case seeds from the case name): the float32 bounds are tight
    # (0.998 of the bound at worst), so CI should not draw new ones.
    res = run(name, dt, how)
    assert res["interpreter"] == (how == "triton-interp")
    bad = hfc.check(res)
    assert not bad, f"{name} {dt} {res['backend']} on {res['device']}: " + "; ".join(bad) + f"\n{res}"
    case = CASES_BY_NAME[name]
    if case.low_below is not None or name.endswith("-short"):  # longrope: which set the call used
        assert res["used_long"] == (res["max_position"] >= 4096), res
    if res["attention_rotates"] is not None:  # the layer rule was checked against the family's attention
        assert res["attention_rotates"] == (res["rotary_dim"] > 0)


def test_every_family_of_the_table_has_a_case():
    covered = set()
    for case in CASES:
        config = case.make_config()
        covered |= {config.model_type, (getattr(config, "text_config", None) or config).model_type}
    # composite (multimodal) types are read through their text config, which has its own case
    aliases = {"gemma3": "gemma3_text", "llama4": "llama4_text", "qwen2_vl": "qwen2_vl_text",
               "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
               "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
    for model_type, text_type in aliases.items():
        assert FAMILIES[model_type] == FAMILIES[text_type]
    assert set(FAMILIES) - set(aliases) <= covered, set(FAMILIES) - set(aliases) - covered


# --- the bounds catch what they must ---------------------------------------------------------

def test_float32_tight_where_the_angles_agree():
    """Where transformers' float32 frequency is ropepool's bit for bit, the rotations agree to float32 rounding."""
    res = run("qwen2-7b-theta1e6")
    assert res["same_angle_rel"] <= 1e-6, res
    assert res["freq_ulps"] <= 1, res  # theta 1e6 over a 128-wide head: at most one ulp apart


@pytest.mark.parametrize("name, dt", [
    ("gpt-j-6b-interleaved", "f32"), ("llama4-scout-rope-layer", "bf16"), ("deepseek-v3-yarn-mscale-interleave", "f32"),
    ("glm4-9b-interleaved-partial", "bf16"), ("cohere-command-r-interleaved", "f32"), ("llama3.1-8b", "bf16"),
    ("qwen3-vl-8b-mrope-interleaved", "f32"), ("glm4.5-moe-neox-partial", "f32"),
])
def test_wrong_pair_style_fails(name, dt):
    spec = hfc.case_specs(CASES_BY_NAME[name], CASES_BY_NAME[name].make_config(), None)[0]
    wrong = dataclasses.replace(spec, style="neox" if spec.style == "gptj" else "gptj")
    res = run(name, dt, rope=wrong)
    assert res["bound_ratio"] > 100 and res["max_rel_err"] > 0.1, res


@pytest.mark.parametrize("name, rotary_dim", [
    ("phi-2-partial-0.4", 40), ("phi4-mini-longrope-partial-0.75", 128), ("gpt-neox-20b-partial-0.25", 32),
    ("glm4-9b-interleaved-partial", 128), ("stablelm-3b-partial-0.25", 40), ("qwen3-next-80b-partial-0.25", 128),
])
def test_wrong_partial_factor_fails(name, rotary_dim):
    spec = hfc.case_specs(CASES_BY_NAME[name], CASES_BY_NAME[name].make_config(), None)[0]
    scaling = spec.scaling
    if spec.rope_type == "longrope":  # one factor per frequency of the wrong width
        scaling = dict(scaling, short_factor=[1.0] * (rotary_dim // 2), long_factor=[1.0] * (rotary_dim // 2))
    wrong = dataclasses.replace(spec, rotary_dim=rotary_dim, scaling=scaling)
    res = run(name, rope=wrong)
    assert res["bound_ratio"] > 100 or not res["pass_exact"], res


def test_nope_layer_that_rotates_fails():
    """A spec that rotates a layer the family leaves without RoPE is caught by the attention-module check."""
    res = run("smollm3-3b-nope-layer", rope=ropepool_spec("smollm3-3b-rope-layer"))
    assert res["attention_rotates"] is False and res["rotary_dim"] == 0
    assert not res["pass_exact"] and hfc.check(res)


def ropepool_spec(name):
    case = CASES_BY_NAME[name]
    return hfc.case_specs(case, case.make_config(), None)[0]


def test_table_runs(capsys):
    cases = ["gpt-j-6b-interleaved", "cohere2-r7b-sliding-layer", "cohere2-r7b-nope-layer"]
    assert hfc.main(["--quick", "--families", *(arg for name in cases for arg in ("--case", name))]) == 0
    out = capsys.readouterr().out
    assert "gpt-j-6b-interleaved" in out and "conforms" in out and "| gptj | gptj | 64/256 |" in out
    assert "| cohere2 | gptj | 0/128, 128/128 | default |" in out  # the layers without RoPE: rotary_dim 0
