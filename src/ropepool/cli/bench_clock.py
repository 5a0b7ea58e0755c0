"""The clock of ``ropepool bench`` and ``benchmarks/features.py``: CUDA-graph replay or back-to-back eager
calls, rotating over input sets; the median and spread (IQR over median) of the per-call time. On CUDA,
events time the GPU; on CPU, process CPU time is taken (wall time on a shared machine swings by tens of
percent).
"""
from __future__ import annotations

import time

import numpy as np
import torch


class Clock:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _time(self, run, n, reps):
        """Median and spread (IQR/median) of per-call time of ``run`` doing n calls."""
        out = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) * 1e3 / n)
            else:  # process CPU time: what the call costs, not what else the machine ran meanwhile
                t = time.process_time_ns()
                run()
                out.append((time.process_time_ns() - t) / 1e3 / n)
        q1, med, q3 = np.percentile(out, [25, 50, 75])
        return med, 100 * (q3 - q1) / med

    def eager(self, calls, budget_s=0.03, reps=5):
        """Back-to-back calls from Python, rotating over the input sets (on CPU, with more and longer
        repetitions: CPU time of small calls varies more than a GPU's)."""
        if not self.cuda:
            budget_s, reps = 0.2, 9
        for c in calls:
            c()
        self.sync()
        t = time.perf_counter()
        calls[0]()
        self.sync()
        n = int(min(2000, max(len(calls), budget_s / max(time.perf_counter() - t, 1e-7))))

        def run():
            for i in range(n):
                calls[i % len(calls)]()

        return self._time(run, n, reps)

    def graph(self, calls, reps=7):
        """One CUDA graph holding one call per input set, replayed."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        replays = max(1, 200 // len(calls))

        def run():
            for _ in range(replays):
                g.replay()

        run()
        return self._time(run, replays * len(calls), reps)

