"""The ``ropepool demo`` table: transformers' continuous batching as shipped and through ropepool.

``<!-- summary:demo-table DEVICE -->`` prints, from the newest demo record of each dtype on that device
(``docs/bench/*-demo-*.json``, written by ``ropepool demo --out``), each model's tokens/s as shipped and
through ropepool: the median and min-max of the record's interleaved runs, of process CPU time on a CPU
(wall time on a GPU), their ratio, and whether the tokens matched.
"""
from __future__ import annotations

import statistics

from ropepool.bench_records import Records
from ropepool.bench_summary import block, sources


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
