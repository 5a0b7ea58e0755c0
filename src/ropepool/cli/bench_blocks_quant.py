"""The block-quantized pools' benchmark block: ropepool's one call beside the unfused steps (benchmarks/blockquant.py).

Each record is one run of the harness (``cpu-*-blockquant*.json``); the block tabulates the newest
record, per framework, format and token count: both providers' median µs with their interquartile
range, and the unfused time over ropepool's (above 1: ropepool is faster).
"""
from __future__ import annotations

from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, fmt_num, sources


def _us(row) -> str:
    return f"{fmt_num(row['median_us'])} ({fmt_num(row['q25_us'])}-{fmt_num(row['q75_us'])})"


@block("blockquant")
def blockquant(recs: Records) -> str:
    runs = recs.others("cpu-*-blockquant*.json")
    if not runs:
        raise KeyError("blockquant: no record docs/bench/cpu-*-blockquant*.json")
    record, data = runs[-1]
    rows = data["blockquant_rows"]
    by = {(r["framework"], r["format"], r["tokens"], r["provider"]): r for r in rows}
    lines = ["| framework | format | T | ropepool µs (IQR) | unfused µs (IQR) | unfused / ropepool | V bytes equal |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for fw, fmt, t in sorted({k[:3] for k in by}, key=lambda k: (k[0], k[1], k[2])):
        mine, theirs = by[(fw, fmt, t, "ropepool")], by[(fw, fmt, t, "unfused")]
        equal = {True: "yes", False: "NO", None: "other quantizer"}[mine["v_pool_equal"]]
        lines.append(f"| {fw} | {fmt} | {t:,} | {_us(mine)} | {_us(theirs)} | "
                     f"{theirs['median_us'] / mine['median_us']:.2f}x | {equal} |")
    env = data["env"]
    about = (f"Heads {env['geometry'][0]} q / {env['geometry'][1]} KV, head_dim {env['geometry'][2]}, "
             f"{env['dtype']}, a pool of {env['pool_rows']:,} slots, {env['threads']} thread(s); medians of "
             "interleaved calls, each complete (MLX: evaluated).")
    return "\n".join(lines) + "\n\n" + about + " " + sources([record])
