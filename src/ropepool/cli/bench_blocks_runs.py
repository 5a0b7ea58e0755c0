"""The blocks of single records: the runs of each history section of docs/benchmarks.md as recorded,
the ``ropepool demo`` table, the first call and vLLM's decode step.

``<!-- summary:run-table FILE VARIANT GEOMETRY [DTYPE] PROVIDER ... -->`` prints one record's µs per
token count and mode for the providers named, in that order. With a ``copy`` provider the first other
provider's cell also gives its % of copy (copy's time over its); without one, but with ``eager``, a
last column gives eager's time over the first provider's. ``DTYPE`` (bfloat16 by default) is given as
``dtype=float32``. ``<!-- summary:host-table FILE -->`` prints a host-cost run (``host_rows``).
``<!-- summary:soak-table FILE -->`` prints a ``benchmarks/soak.py`` run: calls/s and resident memory at
each tenth of it, then its start, middle and end. ``<!-- summary:test-memory FILE -->`` states a
``benchmarks/suite_memory.py`` run: the test suite's peak resident memory. ``<!-- summary:readme-time -->``
gives the README's command lines as ``benchmarks/readme_time.py`` timed them from a fresh clone.

``<!-- summary:demo-table DEVICE -->`` (transformers' continuous batching as shipped and through
ropepool) prints, from the newest demo record of each dtype on that device
(``docs/bench/*-demo-*.json``, written by ``ropepool demo --out``), each model's tokens/s as shipped and
through ropepool: the median and min-max of the record's interleaved runs, of process CPU time on a CPU
(wall time on a GPU), their ratio, and whether the tokens matched. The ratio of a record whose runs took
ABBA turns (its rows name the path that ran first in each pair) is the median and quartiles over the pairs
of neighbouring runs (paired.py); of an older record, the ratio of the two medians.
"""
from __future__ import annotations

import statistics

from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, fmt_num, sources, span
from ropepool.cli.paired import quartiles

_MODES = {"graph": 0, "eager": 1}


def _cells(recs: Records, file: str, **want) -> dict:
    """{(provider, mode, tokens): us} of one record's rows with these key fields."""
    return {(r.key.provider, r.key.mode, r.key.tokens): r.us for rs in recs.by_key.values() for r in rs
            if r.record.file == file and all(getattr(r.key, f) == v for f, v in want.items())}


def _record(recs: Records, file: str):
    return next(r.record for rs in recs.by_key.values() for r in rs if r.record.file == file)


@block("run-table")
def run_table(recs: Records, file: str, variant: str, geometry: str, *providers: str) -> str:
    dtype = "bfloat16"
    if providers and providers[0].startswith("dtype="):
        dtype, providers = providers[0].split("=", 1)[1], providers[1:]
    cells = _cells(recs, file, variant=variant, geometry=geometry, dtype=dtype)
    if not cells:
        raise KeyError(f"run-table: {file} has no rows for {variant} {geometry} {dtype}")
    subject = next(p for p in providers if p != "copy")
    ratio = "eager" in providers and "copy" not in providers
    head = "| T | mode | " + " | ".join(f"{p} µs" for p in providers) + (" | eager / " + subject if ratio else "")
    lines = [head + " |", "| ---: | --- |" + " ---: |" * (len(providers) + ratio)]
    for mode, t in sorted({(m, t) for _, m, t in cells}, key=lambda mt: (_MODES.get(mt[0], 2), mt[1])):
        row = []
        for p in providers:
            us = cells.get((p, mode, t))
            text = fmt_num(us) if us is not None else ""
            copy = cells.get(("copy", mode, t))
            if p == subject and us is not None and copy is not None:
                text = f"**{text}** ({100 * copy / us:.0f}%)"
            row.append(text)
        if ratio:
            mine, eager = cells.get((subject, mode, t)), cells.get(("eager", mode, t))
            row.append(f"{eager / mine:.2f}x" if mine and eager else "")
        lines.append(f"| {t:,} | {mode} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n\n" + sources([_record(recs, file)])


@block("host-table")
def host_table(recs: Records, file: str) -> str:
    """Per pinning: the bare launch, and before / after as µs and x the bare launch, per T."""
    rows = [r for rs in recs.by_key.values() for r in rs if r.record.file == file]
    pins = sorted({r.key.variant for r in rows}, key=lambda v: (v == "host none", v))
    tokens = sorted({r.key.tokens for r in rows if r.key.tokens})
    lines = ["| pinned to | bare launch µs | " + " | ".join(f"{w}, T = " + " / ".join(map(str, tokens))
                                                           for w in ("before", "after")) + " |",
             "| --- | ---: | --- | --- |"]
    for pin in pins:
        us = {(r.key.provider, r.key.tokens): r.us for r in rows if r.key.variant == pin}
        bare = us["bare", 0]
        cols = [" / ".join(f"{fmt_num(us[w, t])} ({us[w, t] / bare:.2f}x)" for t in tokens)
                for w in ("before", "after")]
        lines.append(f"| {pin.removeprefix('host ')} | {fmt_num(bare)} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n\n" + sources({r.record for r in rows})


@block("soak-table")
def soak_table(recs: Records, file: str) -> str:
    (rec, d), = recs.others(file)
    soak = d["soak"]
    samples = soak["samples"]
    lines = ["| t (s) | calls | calls/s | RSS MB |", "| ---: | ---: | ---: | ---: |"]
    for s in samples:
        rate = "" if s["calls_per_s"] is None else fmt_num(s["calls_per_s"])
        lines.append(f"| {s['t']:.1f} | {s['calls']:,} | {rate} | {s['rss_mb']:,.1f} |")
    start, mid, end = samples[0], samples[len(samples) // 2], samples[-1]
    by_fw = ", ".join(f"{fw} {n:,}" for fw, n in soak["calls_by_framework"].items())
    return ("\n".join(lines) + f"\n\n{soak['calls']:,} calls in {end['t']:.1f} s, {fmt_num(soak['calls'] / end['t'])} "
            f"calls/s ({by_fw}), after a warm-up of {soak['warm_up']['seconds']} s over every case. Resident "
            f"memory: {start['rss_mb']:,.1f} MB at the start, {mid['rss_mb']:,.1f} MB in the middle (t = "
            f"{mid['t']:.1f} s), {end['rss_mb']:,.1f} MB at the end.\n\n" + sources([rec]))


@block("test-memory")
def suite_memory(recs: Records, file: str) -> str:
    (rec, d), = recs.others(file)
    m = d["test_memory"]
    return (f"`{m['command']}` peaked at {m['max_rss_mb']:,.0f} MB resident in the pytest process (GNU "
            f"`/usr/bin/time -v`, its maximum resident set size) and at {m['group_peak_mb']:,.0f} MB summed over "
            f"its process group, child processes included ({m['group_processes_at_peak']} processes at the "
            f"peak, sampled every 0.25 s); it ran {m['wall_s'] / 60:.1f} minutes ({m['pytest']}).\n\n"
            + sources([rec]))


_LINE = {"demo": "the demo line", "test": "the test line", "quick": 'the quick subset (`-m "not slow"`)'}


@block("readme-time")
def readme_time(recs: Records) -> str:
    """The README's lines as timed from a fresh clone (``benchmarks/readme_time.py``): the newest run of each."""
    newest = {}
    for rec, d in sorted(recs.others("*-readme-time*.json"), key=lambda run: (run[0].date, run[0].file)):
        for r in d["readme_time"]:
            newest[r["line"]] = (rec, d["env"], r)
    if not newest:
        return "The README's lines: not timed."
    parts = []
    for line in ("demo", "test", "quick"):
        if line in newest:
            rec, env, r = newest[line]
            said = f"; {r['pytest']}" if r["pytest"] else ""
            failed = "" if r["rc"] == 0 else f", exit status {r['rc']}"
            parts.append(f"{_LINE[line]} {r['seconds'] / 60:.1f} minutes ({env['cores']} cores{failed}{said})")
    return ("Timed from a fresh clone, each venv made anew: " + "; ".join(parts) + ".\n\n"
            + sources({rec for rec, _, _ in newest.values()}))


# --- the demo and engine-step records ----------------------------------------
def _tok_s(row: dict, path: str, cpu: bool) -> list[float]:
    return [row["tokens"] / s for s in row[f"{path}_cpu_s" if cpu else f"{path}_s"]]


def _fmt(values) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def demo_rows(recs: Records, device: str = "cpu") -> dict:
    """{(dtype,) or, off the CPU, (dtype, requests): (record, its rows of that key)}: the newest demo record of each
    key on ``device`` (a record of ``ropepool demo`` holds each dtype it ran, by default float32 and bfloat16; a
    GPU run at a model's widths, demo_scale.py, names its request count)."""
    newest = {}
    # oldest code first (then by name): the last one wins
    for rec, d in sorted(recs.others("*-demo-*.json"), key=lambda run: run[0].order):
        if str(d["env"].get("device", "")).split(":")[0] == device:
            groups = {}
            for row in d.get("demo", []):
                key = (row["dtype"],) if device == "cpu" else (row["dtype"], row.get("requests"))
                groups.setdefault(key, []).append(row)
            newest.update({key: (rec, rows) for key, rows in groups.items()})
    return newest


def demo_paired(row: dict, cpu: bool) -> dict | None:
    """Median and quartiles over the pairs of neighbouring runs of ropepool's tokens/s over transformers' (None:
    a record from before the runs took ABBA turns)."""
    if "first" not in row:
        return None
    return quartiles(f / p for p, f in zip(_tok_s(row, "plain", cpu), _tok_s(row, "fused", cpu)))


def demo_ratio(row: dict, cpu: bool) -> float:
    """ropepool's tokens/s over transformers' in one model's runs: the median pair's (older records: the ratio of
    the medians)."""
    q = demo_paired(row, cpu)
    if q is not None:
        return q["ratio_median"]
    return statistics.median(_tok_s(row, "fused", cpu)) / statistics.median(_tok_s(row, "plain", cpu))


def _ratio(row: dict, cpu: bool) -> str:
    q = demo_paired(row, cpu)
    return f"{demo_ratio(row, cpu):.2f}x" + (f" ({q['ratio_q1']:.2f}-{q['ratio_q3']:.2f})" if q else "")


@block("demo-table")
def demo_table(recs: Records, device: str = "cpu") -> str:
    newest = demo_rows(recs, device)
    if not newest:
        raise KeyError(f"demo-table: no demo record on {device} under docs/bench/")
    cpu = device == "cpu"
    envs = {rec.file: recs.other[rec.file][1]["env"] for rec, _ in newest.values()}
    lines = ["| model | dtype | transformers tok/s | through ropepool | ropepool / transformers | tokens |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    if not cpu:
        lines = [line.replace("| dtype |", "| dtype | requests |").replace("| --- | --- |", "| --- | --- | ---: |", 1)
                 for line in lines]
    if cpu:  # the ratio in every record of the same code: how far one record's ratio moves on this machine
        lines = [lines[0][:-1] + "| each record of this code |", lines[1] + " --- |"]
    for key in sorted(newest):
        for row in newest[key][1]:
            plain, fused = _tok_s(row, "plain", cpu), _tok_s(row, "fused", cpu)
            match = "identical" if row["identical"] else "diverge at a near-tie" if row["ok"] else "MISMATCH"
            model = row["family"] if cpu else f"{row['family']}, {envs[newest[key][0].file].get('layers', '?')} layers"
            count = "" if cpu else f" {row['requests']} |"
            same = ", ".join(f"{demo_ratio(r, cpu):.2f}x" for _, rows in _same_code(recs, [newest[key]]) for r in rows
                             if (r["family"], r["dtype"]) == (row["family"], row["dtype"])) + " |"
            lines.append(f"| {model} | {key[0]} |{count} {_fmt(plain)} | {_fmt(fused)} | {_ratio(row, cpu)} "
                         f"| {match} |" + (f" {same}" if cpu else ""))
    runs = " or ".join(map(str, sorted({len(row["plain_s"]) for _, rows in newest.values() for row in rows})))
    clock = "process CPU time" if cpu else "wall time"
    requests = sorted({len(e.get("prompts", ())) for e in envs.values()})
    new_tokens = sorted({e.get("new_tokens", 16) for e in envs.values()})
    paired = {demo_paired(row, cpu) is not None for _, rows in newest.values() for row in rows}
    ratio = {True: "the paths took turns in ABBA order; ropepool / transformers is the median (quartiles) over the "
                   "pairs of neighbouring runs of ropepool's tokens/s over transformers'",
             False: "ropepool / transformers is the ratio of the two medians"}
    return (f"Tokens/s of {clock}, median (min-max) of {runs} interleaved runs of each path after an untimed "
            f"one; {' or '.join(map(str, requests))} requests x {' or '.join(map(str, new_tokens))} new tokens"
            f"{' a model' if cpu else ''}; " + "; in older records, ".join(ratio[p] for p in sorted(paired)[::-1])
            + ":\n\n" + "\n".join(lines) + "\n\n"
            + sources({rec for rec, _ in newest.values()} | {rec for rec, _ in _same_code(recs, newest.values())
                                                                 if cpu}))


def _same_code(recs: Records, newest) -> list:
    """(record, its rows) of every CPU demo record of the code of ``newest`` ((record, rows) pairs), by file name."""
    codes = {rec.code for rec, _ in newest}
    return [(rec, d.get("demo", [])) for rec, d in sorted(recs.others("*-demo-*.json"), key=lambda run: run[0].file)
            if rec.code in codes and d["env"].get("device") == "cpu"]


def _newest(runs: list, pattern: str, n: int = 3) -> tuple[list, str]:
    """The newest ``n`` of ``runs`` (oldest first), and a line naming where the older ones are (the history)."""
    older = len(runs) - n
    return runs[-n:], f"\n\n{older} older runs: the `{pattern}` records under docs/bench/." if older > 0 else ""


@block("first-call")
def first_call(recs: Records) -> str:
    """``import ropepool`` plus the first call of a fresh process (benchmarks/first_call.py), each record, in
    the order of the code they measured (the newest code last)."""
    runs = sorted(recs.others("*-first-call*.json"), key=lambda run: run[0].order)
    if not runs:
        return "The first call: not recorded."
    runs, older = _newest(runs, "*-first-call*.json")
    lines = []
    for rec, d in runs:
        first = [r["first_call_s"] for r in d["first_call"]]
        torch_s = [r["import_torch_s"] for r in d["first_call"]]
        lines.append(f"- code of {rec.stated_commit or 'an unrecorded commit'}: {statistics.median(first):.3f} s "
                     f"({min(first):.3f}-{max(first):.3f}, {len(first)} processes; `import torch` before it: "
                     f"{statistics.median(torch_s):.2f} s)")
    return ("`import ropepool` plus the first 5-token float32 call of a fresh process:\n\n" + "\n".join(lines)
            + older + "\n\n" + sources(rec for rec, _ in runs))


@block("vllm-step")
def vllm_step(recs: Records) -> str:
    """vLLM's decode step on its CPU build with ropepool's plugin and without (benchmarks/vllm_step.py),
    from the ``*-vllm-step*.json`` record of the newest code (records in the order of the code they measured, as
    the first-call block's)."""
    runs = sorted(recs.others("*-vllm-step*.json"), key=lambda run: run[0].order)
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
    shown, older = _newest(runs, "*-vllm-step*.json")
    earlier = "".join(f"\n\nEarlier, `{prev.file}`: {_one_line(pd['vllm_step'])}" for prev, pd in shown[:-1]) + older
    turns = (f"{r['rounds']} rounds of the same requests in each engine, the engines taking turns every "
             f"{r['chunk_steps']} engine steps (ABBA), each engine started first in half the rounds"
             if "chunk_steps" in r else f"{r['rounds']} turns of each engine interleaved")
    return (f"A {m['num_hidden_layers']}-layer {m['family']} (hidden {m['hidden_size']}, {m['num_attention_heads']}"
            f"/{m['num_key_value_heads']} heads, {m['dtype']}, random weights), {r['prompts']} requests decoding "
            f"{r['max_tokens']} tokens a turn, {turns}; a step is vLLM's "
            "`EngineCore.step` (schedule, forward, sample, update), wall time in the engine's process; tokens "
            f"{'identical' if r['tokens_match'] else 'DIFFERENT'} with and without ropepool. {verdict}\n\n"
            + "\n".join(lines) + _paired(r) + earlier + "\n\n" + sources(rec for rec, _ in shown))


def _paired(r: dict) -> str:
    """The paired ratio of a record that has one: the two engines' steps at the same index of the same round."""
    p = r.get("paired")
    if p is None:
        return ""
    by = "; ".join(f"{q['ratio_median']:.3f}x where {first} was started first ({q['pairs']} pairs)"
                   for first, q in p["by_started_first"].items())
    return (f"\n\nStep with ropepool / step without, at the same step index of the same round: median "
            f"{p['ratio_median']:.3f}x (IQR {p['ratio_q1']:.3f}-{p['ratio_q3']:.3f}, {p['pairs']} pairs); {by}.")


def _call_us(r: dict) -> float:
    """Median µs of one ropepool call in the decode steps of the engine with the plugin."""
    steps = [st for t in r["turns"]["vLLM + ropepool"] for st in t["steps"] if st[3] == st[4] and st[1]]
    return statistics.median(1e6 * st[2] / st[1] for st in steps)


def _one_line(r: dict) -> str:
    s = r["summary"]
    a, b = s["vLLM + ropepool"], s["vLLM alone"]
    return (f"{a['step_us_median']:,.0f} µs with the plugin loaded, {b['step_us_median']:,.0f} µs without "
            f"({a['step_us_median'] / b['step_us_median']:.3f}x), {a['ropepool_calls_per_layer_step']:.2f} ropepool "
            f"calls per layer and step, tokens {'identical' if r['tokens_match'] else 'DIFFERENT'}"
            + (f"; paired ratio {r['paired']['ratio_median']:.3f}x." if "paired" in r else "."))


# --- the README's headline ---------------------------------------------------
@block("headline")
def headline(recs: Records) -> str:
    """One line per machine and path, from the newest records: what the README shows before linking to
    docs/benchmarks.md. Ratios are a peer's time over ropepool's (below 1.00x ropepool is the slower)."""
    from ropepool.cli import bench_blocks as b  # the per-device figures (imported here: it registers its blocks)

    x = lambda v: f"{v:.2f}"  # noqa: E731
    lines = ["| machine | what | ropepool | beside it (a ratio below 1.00x: ropepool is the slower) |",
             "| --- | --- | --- | --- |"]
    used = set()
    plain = b.row(recs, b.OPS[0])  # plain RoPE + KV write, Llama-3-8B heads
    used |= plain.records
    lines.append(f"| NVIDIA {b.card(plain.records)}, bfloat16 | one call, Llama-3-8B heads (32 q, 8 KV, 128) | "
                 f"{plain.small[0]} µs at 1 token (CUDA graph); {plain.pct[1]} of a device copy's bandwidth at "
                 "65,536 tokens | "
                 f"{'; '.join(plain.peers[:1] + plain.peers[-2:])}: their time over ropepool's, over 1-65,536 "
                 "tokens |")
    host, host_used = b.host_cost(recs)
    used |= host_used
    lines.append(f"| NVIDIA {b.card(host_used)} | the host cost of an eager call from Python, 1-256 tokens | {host} a "
                 "bare Triton launch in the same process | a bare Triton launch |")
    for dtype in b.DTYPES:
        rs = {t: b.cpu_ratio(recs, t, dtype) for t in b.CPU_TOKENS}
        rs = {t: r for t, r in rs.items() if r}
        used |= {rec for r in rs.values() for rec in r.records}
        if rs:
            lines.append(f"| CPU, 1 thread, {dtype} | one call, Llama-3-8B heads, 1-4,096 tokens | "
                         f"1 token: eager PyTorch's time / ropepool's {rs[min(rs)].median:.2f}x | eager PyTorch "
                         f"(transformers-style RoPE + `index_copy_`): {span([r.median for r in rs.values()], x)}x "
                         "over 1-4,096 tokens |")
    devices = b.mlx_devices(recs)
    if devices:
        rs = b.mlx_ratios(recs, devices[0])
        used |= {rec for r in rs.values() for rec in r.records}
        lines.append(f"| MLX CPU backend | one call, 1-4,096 tokens, bfloat16 and float32 | "
                     f"{span([r.median for r in rs.values()], x)}x the time of the hand-written code | the "
                     "hand-written code (`mx.fast.rope` + slice updates) |")
    demo = demo_rows(recs, "cpu")
    if demo:
        ratios = [demo_ratio(r, True) for _, rows in demo.values() for r in rows]
        same = all(r["identical"] for r in demo.get(("float32",), (None, []))[1])
        used |= {rec for rec, _ in demo.values()}
        dtypes = ", ".join(sorted(k[0] for k in demo))
        lines.append(f"| CPU, `ropepool demo` | serving tiny models in transformers' continuous batching "
                     f"({dtypes}) | float32 tokens {'identical' if same else 'NOT identical'} | "
                     "transformers as shipped: ropepool's "
                     f"tokens/s / its {span(ratios, x)}x |")
    return "\n".join(lines) + "\n\n" + sources(used)
