"""q_rot / k_rot against transformers itself, for real model configurations.

The cases, the comparison and the tolerances live in benchmarks/hf_conformance.py
(``python benchmarks/hf_conformance.py`` prints the same numbers as a table):
each case builds a transformers config in code, runs the model family's own
rotary-embedding module and apply function on random q/k at arbitrary positions
(shuffled, repeated, up to 1e5; longrope both below and across its switch
point) and compares with ropepool through ``RopeSpec.from_hf_config(config)``.

Every rotated element must be within ``A * (dtheta + C)`` of transformers'
output, A the size of its pair (times attention_scaling) and dtheta the
difference between the two float32 angles, which comes only from transformers
computing its frequencies in float32 (held to (ln(base) + 8) float32 epsilons
apart, so it cannot hide a wrong frequency). ``C`` is the rounding both sides
are entitled to: float32 1e-6 each; bfloat16 transformers 3 * 2^-8 (it rounds
cos/sin, both products and the sum to bf16), ropepool 2^-8 (one rounding; 2^-7
under the Triton CPU interpreter, whose float32 -> bfloat16 cast truncates).
Each side is also held to its own bound against the exact float64 rotation at
its own angle, pass-through features must be bit-identical, and the spec read
from ``config.to_dict()`` must equal the one read from the config object.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


def _load():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_conformance.py"
    spec = importlib.util.spec_from_file_location("hf_conformance", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


hfc = _load()

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
    for case in hfc.CASES:
        for dt in DTYPES:
            out.append(pytest.param(case.name, dt, "torch", id=f"{case.name}-{dt}-torch"))
            if case.triton_cpu:
                out.append(pytest.param(case.name, dt, "triton-interp", id=f"{case.name}-{dt}-triton-interp",
                                        marks=pytest.mark.skipif(not INTERPRETER,
                                                                 reason="needs TRITON_INTERPRET=1 (no GPU)")))
            out.append(pytest.param(case.name, dt, "cuda", id=f"{case.name}-{dt}-cuda",
                                    marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")))
    return out


@pytest.mark.parametrize("name, dt, run", _params())
def test_matches_transformers(name, dt, run):
    # One fixed input set per case (run_case seeds from the case name): the bounds are tight enough
    # (float32: 0.999 of the bound at worst over a 12-seed sweep) that CI should not draw new ones.
    device, backend, hq, hkv, tokens = RUNS[run]
    res = hfc.run_case(name, device, DTYPES[dt], backend, num_tokens=tokens, num_heads=hq, num_kv_heads=hkv)
    assert res["interpreter"] == (run == "triton-interp")
    bad = hfc.check(res)
    assert not bad, f"{name} {dt} {res['backend']} on {device}: " + "; ".join(bad) + f"\n{res}"
    case = hfc.CASES_BY_NAME[name]
    if case.low_below is not None or name.endswith("-short"):  # longrope: which set the call used
        assert res["used_long"] == (res["max_position"] >= 4096), res


def test_float32_tight_where_the_angles_agree():
    """Where transformers' float32 frequency is ropepool's bit for bit, the rotations agree to float32 rounding."""
    res = hfc.run_case("qwen2-7b-theta1e6", "cpu", torch.float32, "torch", num_tokens=64)
    assert res["same_angle_rel"] <= 1e-6, res
    assert res["freq_ulps"] <= 1, res  # theta 1e6 over a 128-wide head: at most one ulp apart


def test_table_runs(capsys):
    assert hfc.main(["--quick", "--case", "gpt-j-6b-interleaved", "--case", "phi3-mini-longrope-long"]) == 0
    out = capsys.readouterr().out
    assert "gpt-j-6b-interleaved" in out and "conforms" in out
