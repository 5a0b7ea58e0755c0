"""What ``ropepool bench`` shows of its rows: the table it prints and the plot it saves.

``benchmarks/plot.py`` draws saved records with the same ``plot``. Rows are
``bench.Row`` records as dicts (as the JSON holds them). On CUDA the times are
CUDA-graph replay where measured, else back-to-back eager calls; on CPU they
are back-to-back calls timed in process CPU time, and there is no copy row
(a memcpy is no floor for an op that allocates its outputs, so %copy is left out).
"""
from __future__ import annotations

import platform
import textwrap

COLORS = {"copy": "grey", "ropepool": "tab:orange", "flashinfer": "tab:green", "compiled": "tab:red",
          "eager": "tab:purple"}


def save_plot(plot, *args) -> str:
    """Call ``plot(*args)`` (its last argument the PNG's path); what was written, in words. Without
    matplotlib (the ``bench`` extra) the records are still saved: say so instead of failing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'ropepool[bench]')"
    plot(*args)
    return f"the plot {args[-1]}"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _cuda(env) -> bool:
    return str(env.get("device", "")).startswith("cuda")


def describe(env) -> str:
    """One line: dtype, machine, versions, date, and how time was measured."""
    keys = ("dtype", "gpu", "cpu", "threads", "torch", "cuda", "triton", "flashinfer", "ropepool", "date")
    how = "CUDA events" if _cuda(env) else "process CPU time"
    return ", ".join(f"{k}={env[k]}" for k in keys if env.get(k)) + f"; {how}"


def print_table(rows, env):
    from rich.console import Console
    from rich.table import Table

    cuda = _cuda(env)
    t = Table(title=f"rope_pool_fused ({describe(env)})")
    cols = ["geometry", "layout", "T", "provider", "mode", "µs", "±%", "GB/s"] + (["%copy"] if cuda else []) + \
        ["x eager"]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        r = r if isinstance(r, dict) else vars(r)
        cells = [r["geometry"], r["layout"], str(r["tokens"]), r["provider"], r["mode"], f"{r['us']:.2f}",
                 f"{r['spread_pct']:.0f}", f"{r['gbps']:.1f}"]
        if cuda:
            cells.append(f"{r['pct_copy']:.0f}%" if r["pct_copy"] is not None else "")
        cells.append(f"{r['speedup_vs_eager']:.2f}x" if r["speedup_vs_eager"] else "")
        t.add_row(*cells)
    Console(width=160).print(t)


def plot(rows, env, path):
    """µs against tokens per provider, and ropepool's speed-up over eager (CPU) or % of copy bandwidth
    (CUDA), one column per geometry and layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cuda = _cuda(env)
    # Graph replay where it was measured, else eager calls: the numbers the targets speak of.
    best = {}
    for r in rows:
        key = (r["geometry"], r["layout"], r["provider"], r["tokens"])
        if key not in best or r["mode"] == "graph":
            best[key] = r
    panels = sorted({(g, lay) for g, lay, _, _ in best})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7), squeeze=False)
    for col, (g, lay) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        for prov, color in COLORS.items():
            pts = sorted((t, r) for (gg, ll, pp, t), r in best.items() if (gg, ll, pp) == (g, lay, prov))
            if not pts:
                continue
            ts = [t for t, _ in pts]
            top.loglog(ts, [r["us"] for _, r in pts], marker="o", color=color, label=prov)
            if cuda and prov != "copy":
                bottom.semilogx(ts, [r["pct_copy"] for _, r in pts], marker="o", color=color, label=prov)
            elif not cuda and prov not in ("copy", "eager"):
                bottom.semilogx(ts, [r["speedup_vs_eager"] for _, r in pts], marker="o", color=color, label=prov)
        top.set_title(f"{g} ({lay})")
        top.set_ylabel("µs per call (graph replay to 16384 tokens)" if cuda else "µs per call (process CPU time)")
        bottom.set_ylabel("% of copy bandwidth" if cuda else "x faster than eager (transformers-style)")
        bottom.axhline(90 if cuda else 1.0, color="grey", lw=0.5, ls="--")
        bottom.set_xlabel("tokens per call")
        for ax in (top, bottom):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(f"rope_pool_fused: {describe(env)}", 40 * len(panels) + 30), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
