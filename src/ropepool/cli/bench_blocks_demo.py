"""The ``ropepool demo`` table: transformers' continuous batching as shipped and through ropepool.

``<!-- summary:demo-table DEVICE -->`` prints, from the newest demo record of each dtype on that device
(``docs/bench/*-demo-*.json``, written by ``ropepool demo --out``), each model's tokens/s as shipped and
through ropepool: the median and min-max of the record's interleaved runs, of process CPU time on a CPU
(wall time on a GPU), their ratio, and whether the tokens matched.
"""
from __future__ import annotations

import statistics

from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, sources


def _tok_s(row: dict, path: str, cpu: bool) -> list[float]:
    return [row["tokens"] / s for s in row[f"{path}_cpu_s" if cpu else f"{path}_s"]]


def _fmt(values) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


@block("demo-table")
def demo_table(recs: Records, device: str = "cpu") -> str:
    newest = {}
    for rec, d in recs.others("*-demo-*.json"):
        if str(d["env"].get("device", "")).split(":")[0] == device and d.get("demo"):
            newest[d["demo"][0]["dtype"]] = (rec, d)  # oldest first: the last one wins
    if not newest:
        raise KeyError(f"demo-table: no demo record on {device} under docs/bench/")
    cpu = device == "cpu"
    lines = ["| model | dtype | transformers tok/s | through ropepool | ropepool / transformers | tokens |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for dtype in sorted(newest):
        for row in newest[dtype][1]["demo"]:
            plain, fused = _tok_s(row, "plain", cpu), _tok_s(row, "fused", cpu)
            ratio = statistics.median(fused) / statistics.median(plain)
            match = "identical" if row["identical"] else "diverge at a near-tie" if row["ok"] else "MISMATCH"
            lines.append(f"| {row['family']} | {dtype} | {_fmt(plain)} | {_fmt(fused)} | {ratio:.2f}x | {match} |")
    runs = len(next(iter(newest.values()))[1]["demo"][0]["plain_s"])
    clock = "process CPU time" if cpu else "wall time"
    return (f"Tokens/s of {clock}, median (min-max) of {runs} interleaved runs of each path after an untimed "
            "one; 8 requests x 16 new tokens a model:\n\n" + "\n".join(lines) + "\n\n"
            + sources(rec for rec, _ in newest.values()))


@block("first-call")
def first_call(recs: Records) -> str:
    """``import ropepool`` plus the first call of a fresh process (benchmarks/first_call.py), each record."""
    runs = recs.others("*-first-call*.json")
    if not runs:
        return "The first call: not recorded."
    lines = []
    for rec, d in runs:
        first = [r["first_call_s"] for r in d["first_call"]]
        torch_s = [r["import_torch_s"] for r in d["first_call"]]
        lines.append(f"- code of {rec.stated_commit or 'an unrecorded commit'}: {statistics.median(first):.3f} s "
                     f"({min(first):.3f}-{max(first):.3f}, {len(first)} processes; `import torch` before it: "
                     f"{statistics.median(torch_s):.2f} s)")
    return ("`import ropepool` plus the first 5-token float32 call of a fresh process:\n\n" + "\n".join(lines)
            + "\n\n" + sources(rec for rec, _ in runs))


@block("vllm-step")
def vllm_step(recs: Records) -> str:
    """vLLM's decode step on its CPU build with ropepool's plugin and without (benchmarks/vllm_step.py),
    from the newest ``*-vllm-step*.json`` record."""
    runs = recs.others("*-vllm-step*.json")
    if not runs:
        return "vLLM's decode step: not recorded."
    rec, d = runs[-1]
    r = d["vllm_step"]
    s = r["summary"]
    alone = s["vLLM alone"]["step_us_median"]
    lines = ["| engine | decode step, µs: median (IQR) | / vLLM alone | turn medians, µs | ropepool calls per "
             "layer and step | ropepool's share of the step |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    for label, v in s.items():
        turns = ", ".join(f"{t:,.0f}" for t in v["turn_medians_us"])
        lines.append(f"| {label} | {v['step_us_median']:,.0f} ({v['step_us_q1']:,.0f}-{v['step_us_q3']:,.0f}) | "
                     f"{v['step_us_median'] / alone:.3f}x | {turns} | {v['ropepool_calls_per_layer_step']:.2f} | "
                     f"{100 * v['ropepool_share_median']:.1f}% |")
    m = r["model"]
    calls = s["vLLM + ropepool"]["ropepool_calls_per_layer_step"]
    verdict = ("ropepool ran no call in this record: vLLM loaded its plugin, which routed nothing, so both "
               "engines ran vLLM's own RoPE and cache write: their difference is not ropepool's work (the same "
               "code in two processes of a shared machine)."
               if calls == 0 else f"ropepool did {calls:.2f} calls per layer and decode step (the RoPE + KV-cache "
               f"write of each attention layer), {_call_us(r):,.0f} µs a call (median); its share is the time "
               "inside those calls over the step's.")
    earlier = "".join(f"\n\nEarlier, `{prev.file}`: {_one_line(pd['vllm_step'])}" for prev, pd in runs[:-1])
    return (f"A {m['num_hidden_layers']}-layer {m['family']} (hidden {m['hidden_size']}, {m['num_attention_heads']}"
            f"/{m['num_key_value_heads']} heads, {m['dtype']}, random weights), {r['prompts']} requests decoding "
            f"{r['max_tokens']} tokens a turn, {r['rounds']} turns of each engine interleaved; a step is vLLM's "
            "`EngineCore.step` (schedule, forward, sample, update), wall time in the engine's process; tokens "
            f"{'identical' if r['tokens_match'] else 'DIFFERENT'} with and without ropepool. {verdict}\n\n"
            + "\n".join(lines) + earlier + "\n\n" + sources(rec for rec, _ in runs))


def _call_us(r: dict) -> float:
    """Median µs of one ropepool call in the decode steps of the engine with the plugin."""
    steps = [st for t in r["turns"]["vLLM + ropepool"] for st in t["steps"] if st[3] == st[4] and st[1]]
    return statistics.median(1e6 * st[2] / st[1] for st in steps)


def _one_line(r: dict) -> str:
    s = r["summary"]
    a, b = s["vLLM + ropepool"], s["vLLM alone"]
    return (f"{a['step_us_median']:,.0f} µs with the plugin loaded, {b['step_us_median']:,.0f} µs without "
            f"({a['step_us_median'] / b['step_us_median']:.3f}x), {a['ropepool_calls_per_layer_step']:.2f} ropepool "
            f"calls per layer and step, tokens {'identical' if r['tokens_match'] else 'DIFFERENT'}.")
