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
