"""What ``ropepool demo`` prints of its comparisons (cli/demo.py): the table of its cells and, for each model
ropepool does not serve faster, that it does not and why."""
from __future__ import annotations

import statistics


def _tok_s(runs) -> str:
    values = [r.tok_s for r in runs]
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


# Why ropepool can lose a model here: what is measured is the whole serving step.
WHY_SLOWER = {
    "cpu": "these models are tiny (hidden size 64, 2-3 layers), so a step is host time: per layer, ropepool's "
           "one call (one native kernel call, the Python around it and the rows read back for attention) "
           "replaces transformers' eager RoPE and cache write, small ops of a few microseconds each, and a "
           "shared machine moves single runs by more than that difference (benchmarks/serving_layers.py measures "
           "it per layer and step)",
    "cuda": "on a GPU a step of few tokens is host-bound (the tiny models' steps always are): the layer's "
            "time is its Python and launches, and one ropepool call replaces a few small kernels there",
}


def render(results: list, device: str, clock: str):
    """The table of a demo run's cells (``clock``: what the seconds are, process CPU time or wall time)."""
    from rich.table import Table

    runs = len(results[0].plains) if results else 0
    table = Table(title=f"transformers continuous batching on {device}: as shipped vs through ropepool "
                        f"(tokens/s of {clock}: median and min-max of {runs} runs; the ratio: median and quartiles "
                        f"over the {runs} pairs of neighbouring runs, ABBA)")
    for col in ("model", "dtype", "tokens", "transformers tok/s", "ropepool tok/s", "ropepool / transformers",
                "tokens match", "max |Δ logprob|"):
        table.add_column(col, justify="left" if col in ("model", "dtype", "tokens match") else "right")
    for c in results:
        div = [d for d in c.diverged_at if d is not None]
        n = len(c.diverged_at)
        match = "identical" if not div else f"{n - len(div)}/{n} identical, first divergence at step {min(div)}"
        verdict = "[green]ok[/]" if c.ok else "[red]MISMATCH[/]"
        table.add_row(c.family, c.dtype, str(c.fused.generated), _tok_s(c.plains), _tok_s(c.fuseds),
                      f"{c.speedup:.2f}x ({c.paired['ratio_q1']:.2f}-{c.paired['ratio_q3']:.2f}, {c.verdict})",
                      f"{match} {verdict}", f"{c.max_logprob_diff:.1e}")
    return table


def losses(results: list, device: str) -> str | None:
    """A line naming each model ropepool served slower (and ties), and why; None where it won them all."""
    slower = [f"{c.family} {c.dtype} {c.speedup:.2f}x{' (within spread)' if 'spread' in c.verdict else ''}"
              for c in results if c.speedup < 1]
    if not slower:
        return None
    why = WHY_SLOWER.get(str(device).split(":")[0], "")
    return f"ropepool serves slower on {device} for {', '.join(slower)}" + (f": {why}." if why else ".")
