"""The paired turn method of the serving comparisons (``ropepool demo`` on CPU, benchmarks/vllm_step.py).

A shared machine's speed drifts between runs by more than the difference measured, so two paths are not
compared by the median of each over all its runs: they take turns in ABBA order (A B, B A, A B, ...), each run
of one path sits beside a run of the other, and the result is the median over those pairs of one's figure
over the other's, with the quartiles of the pair ratios as its spread. Neighbours see the same machine; the
ABBA order gives each path the first and the second place equally often.
"""
from __future__ import annotations

import statistics


def turn(i: int, *paths) -> tuple:
    """The order of the paths in turn ``i``: as given in even turns, reversed in odd ones (two paths: ABBA). One
    path (a test of a single engine) keeps its place."""
    return paths if i % 2 == 0 else paths[::-1]


def quartiles(ratios) -> dict:
    """Median and quartiles of per-pair ratios: ``{"pairs", "ratio_median", "ratio_q1", "ratio_q3"}``."""
    xs = sorted(ratios)
    n = len(xs)
    return {"pairs": n, "ratio_median": statistics.median(xs), "ratio_q1": xs[n // 4], "ratio_q3": xs[3 * n // 4]}
