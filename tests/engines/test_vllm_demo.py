"""``ropepool demo --engine vllm`` in vLLM's CPU build (.ci/engines): it runs from the command line, both
engines serve the same tokens, and it reports ropepool's calls as they are: one per layer and step where the
plugin installs a route on this platform (``register()`` names it), and "ropepool ran NO calls" where it
installs none. Skipped where vLLM is not importable."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def test_demo_engine_vllm():
    from ropepool.cli.demo_vllm import CONFIG
    from ropepool.integrations.vllm import register

    routed = bool(register())  # what the plugin installs here (the engines' processes do the same)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "ropepool.cli", "demo", "--engine", "vllm", "--new-tokens", "8",
                           "--rounds", "2"], env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert re.search(r"vLLM \+ ropepool: ready in \d+ s", out) and re.search(r"vLLM alone: [\d.]+ tokens/s", out)
    assert "tokens match: yes" in out, out
    calls = re.search(r"ropepool calls: (\d+) in (\d+) engine steps x (\d+) layers = ([\d.]+) per layer", out)
    if routed:
        assert calls and int(calls[1]) == int(calls[2]) * CONFIG["num_hidden_layers"], out
    else:
        assert not calls and "ropepool ran NO calls" in out, out


def test_engine_steps_in_chunks_serve_the_tokens_of_a_whole_turn():
    """benchmarks/vllm_step.py's rounds: requests queued, then run a few engine steps at a time (``run_round``),
    give the tokens and the steps of one ``generate`` turn of the same requests, every step timed once."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from ropepool.cli.demo_vllm import CONFIG, Engine, write_checkpoint

    spec = importlib.util.spec_from_file_location("vllm_step", Path(__file__).parents[2] / "benchmarks/vllm_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path)
        engine = Engine(path, "vLLM + ropepool", True)
        try:
            engine.answer()
            engine.ask(max_tokens=6)  # vLLM's prefix cache filled, as it is for every later turn
            whole = engine.ask(max_tokens=6)
            chunked = bench.run_round({"vLLM + ropepool": engine}, 6, 3)["vLLM + ropepool"]
        finally:
            engine.close()
    assert chunked["tokens"] == whole["tokens"] and len(whole["tokens"]) == len(bench.PROMPT_LENGTHS)
    assert [s[3:] for s in chunked["steps"]] == [s[3:] for s in whole["steps"]]  # the same schedule, step by step
    assert chunked["calls"] == whole["calls"] == len(whole["steps"]) * CONFIG["num_hidden_layers"] * \
        whole["plugin_loaded"]
