"""The tables of single runs: each history section of docs/benchmarks.md shows its runs as recorded.

``<!-- summary:run-table FILE VARIANT GEOMETRY [DTYPE] PROVIDER ... -->`` prints one record's µs per
token count and mode for the providers named, in that order. With a ``copy`` provider the first other
provider's cell also gives its % of copy (copy's time over its); without one, but with ``eager``, a
last column gives eager's time over the first provider's. ``DTYPE`` (bfloat16 by default) is given as
``dtype=float32``. ``<!-- summary:host-table FILE -->`` prints a host-cost run (``host_rows``).
``<!-- summary:soak-table FILE -->`` prints a ``benchmarks/soak.py`` run: calls/s and resident memory at
each tenth of it, then its start, middle and end. ``<!-- summary:test-memory FILE -->`` states a
``benchmarks/suite_memory.py`` run: the test suite's peak resident memory.
"""
from __future__ import annotations

from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, fmt_num, sources

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
