"""Every published performance figure, generated from the records under ``docs/bench/``.

The docs hold generated blocks between markers::

    <!-- summary:NAME ARG ... -->
    ...generated markdown, never edited by hand...
    <!-- /summary:NAME -->

``python -m ropepool.cli.bench_summary --write`` rewrites every block of ``DOCS`` in place from the
records; ``--check`` exits 1 naming each block whose text differs (``tests/test_bench_summary.py``
runs it in CI); without an option it prints the blocks.

A block is a function of the records (and the marker's arguments) returning markdown, registered
under its name::

    from ropepool.cli.bench_summary import block

    @block("engine-step")
    def engine_step(recs: Records, *args: str) -> str:
        cell = recs.cell(device="NVIDIA H200", variant="flat", geometry="llama3-8b", provider="ropepool",
                         mode="graph", tokens=64, dtype="bfloat16")
        return f"... {fmt_cell(cell)} ... {sources(cell.records)}"

A record of another harness (an engine's step time, a demo, a soak run: any JSON with an ``env``
that the cells do not read) is kept whole; its block reads it::

    @block("engine-step")
    def engine_step(recs: Records) -> str:
        runs = recs.others("engine-step-*.json")          # [(Record, dict)], oldest first
        ms = [d["step_ms"] for _, d in runs]
        return f"... {fmt_num(statistics.median(ms))} ms {span(ms, fmt_num)} ... {sources(r for r, _ in runs)}"

Put the function in a module listed in ``BLOCK_MODULES`` (or in ``bench_blocks*.py``) and the
marker in the doc. A cell reports the median of the runs of the newest code that measured it, with
their min-max and count (``fmt_cell``); a block states its records, device, versions, date and
code commit (``sources``).
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from ropepool.cli.bench_records import ROOT, Cell, Ratios, Record, Records

DOCS = ("README.md", "docs/benchmarks.md", "docs/benchmarks_features.md", "docs/mlx.md")
BLOCK_MODULES = ("ropepool.cli.bench_blocks", "ropepool.cli.bench_blocks_runs", "ropepool.cli.bench_blocks_quant")

BLOCKS: dict[str, Callable[..., str]] = {}
MARKER = re.compile(r"<!-- summary:(?P<name>[\w-]+)(?P<args>[^>]*?) -->\n(?P<body>.*?)<!-- /summary:(?P=name) -->",
                    re.S)


def block(name: str):
    """Register ``fn(recs: Records, *args: str) -> str`` as the block ``name``."""
    def register(fn):
        if name in BLOCKS:
            raise ValueError(f"block {name!r} is registered twice ({BLOCKS[name].__module__}, {fn.__module__})")
        BLOCKS[name] = fn
        return fn
    return register


# --- formatting shared by the blocks -----------------------------------------
def fmt_num(x: float) -> str:
    """2.68, 27.5, 448.9, 1,043: three or four significant digits, as the tables print them."""
    if x < 10:
        return f"{x:.2f}"
    if x < 1000:
        return f"{x:.1f}"
    return f"{x:,.0f}"


def _spread(values, fmt) -> str:
    return f" ({fmt(min(values))}-{fmt(max(values))}, {len(values)} runs)" if len(values) > 1 else ""


def fmt_cell(cell: Cell | None) -> str:
    """The median µs of the newest code's runs, with their min-max where there are several."""
    if cell is None:
        return "not recorded"
    values = [r.us for r in cell.runs]
    return fmt_num(cell.us) + _spread(values, fmt_num)


def fmt_pct(r: Ratios | None) -> str:
    """A ratio of times as a percentage (copy / op: % of copy bandwidth), median and min-max."""
    if r is None:
        return "not recorded"
    return f"{100 * r.median:.0f}%" + _spread([100 * v for v in r.values], lambda v: f"{v:.0f}%")


def fmt_x(r: Ratios | None) -> str:
    if r is None:
        return "not recorded"
    return f"{r.median:.2f}x" + _spread(r.values, lambda v: f"{v:.2f}x")


def span(values, fmt) -> str:
    """'a-b' of several figures, or the one figure."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def sources(records) -> str:
    """Each record as 'file (date, commit; later commits)', with its device and versions once. The records'
    notes (machine load, command) stay in the records, which the docs link to: generated text stays short."""
    records = sorted(set(records), key=lambda r: r.file)
    parts = [r.source() for r in records]
    about = sorted({f"{r.device}; {r.versions}" for r in records})
    return "Records: " + ", ".join(parts) + ". " + " / ".join(about) + "."


def stale(records) -> bool:
    return any(r.later for r in records)


# --- the docs ----------------------------------------------------------------
def _load_blocks():
    for mod in BLOCK_MODULES:
        importlib.import_module(mod)


def render(text: str, recs: Records) -> str:
    """``text`` with every block regenerated."""
    _load_blocks()

    def one(m):
        name, args = m["name"], m["args"].split()
        if name not in BLOCKS:
            raise KeyError(f"no block named {name!r} is registered (markers name one of: {', '.join(sorted(BLOCKS))})")
        body = BLOCKS[name](recs, *args).strip("\n")
        return f"<!-- summary:{name}{m['args']} -->\n{body}\n<!-- /summary:{name} -->"

    return MARKER.sub(one, text)


def differing(recs: Records | None = None, root: Path = ROOT) -> list[str]:
    """'doc: block' for each generated block whose text is not what the records give."""
    recs = recs or Records()
    out = []
    for doc in DOCS:
        text = (root / doc).read_text()
        new = render(text, recs)
        if new != text:
            old_blocks = {m.group(0) for m in MARKER.finditer(text)}
            out += [f"{doc}: {m['name']}{m['args']}" for m in MARKER.finditer(new) if m.group(0) not in old_blocks]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ropepool.cli.bench_summary", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the generated blocks of the docs in place")
    p.add_argument("--check", action="store_true", help="exit 1 if a generated block differs from the records")
    a = p.parse_args(argv)
    recs = Records()
    if a.check:
        bad = differing(recs)
        for b in bad:
            print(f"differs from the records: {b}", file=sys.stderr)
        if bad:
            print("run: python -m ropepool.cli.bench_summary --write", file=sys.stderr)
        return 1 if bad else 0
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        new = render(text, recs)
        if a.write and new != text:
            path.write_text(new)
            print(f"rewrote {doc}")
        elif not a.write:
            for m in MARKER.finditer(new):
                print(f"## {doc}: {m['name']}{m['args']}\n{m['body']}")
    return 0


if __name__ == "__main__":
    # Run as a script this file is ``__main__``; the blocks register in ``ropepool.cli.bench_summary``.
    from ropepool.cli.bench_summary import main as _main

    sys.exit(_main())


__all__ = ["BLOCKS", "Cell", "Ratios", "Record", "Records", "block", "fmt_cell", "fmt_num", "fmt_pct", "fmt_x",
           "sources", "span", "stale"]
