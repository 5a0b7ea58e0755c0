"""Host time of small calls (CPU torch, MLX) on checkouts of ropepool, interleaved: before / after a change.

    OMP_NUM_THREADS=1 python3 benchmarks/host_ab.py --side before=/tmp/before/src --side after=src
        [--rounds 9] [--out docs/bench/cpu-mlx-<date>-host-ab.json]

Each round runs one fresh process per checkout (``PYTHONPATH`` = that checkout's ``src``), the order
rotating from round to round, so all see the same periods of a shared machine. A process times each
case after a warm-up: ``LOOPS`` loops of ``CALLS`` back-to-back calls with the same arrays (the layout
cache's hit path: what a decode step pays per layer), each loop's per-call µs a sample. A case's figure is
the median of its samples over all rounds, with the 10th-90th percentile spread. Each side's ratio to the
first side is also taken round by round (the medians of one round, whose processes ran minutes apart at most):
the median of those ratios and their 10th-90th percentile spread, which a load that comes and goes between
rounds moves less than the pooled samples. ``--out`` writes the record (a new file; an existing one is refused).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
which = sys.argv[1].split(",")
CALLS, LOOPS = 200, 7
T_GEOM = (32, 8, 128)  # Llama-3-8B's heads
out = {}

def timed(fn):
    for _ in range(100):
        fn()
    samples = []
    for _ in range(LOOPS):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - t) / CALLS * 1e6)
    return samples

import ropepool
if any(c.startswith("torch") for c in which):
    import torch
    Hq, Hkv, D = T_GEOM
    for T in (1, 16):
        for norm in (False, True):
            name = f"torch-cpu-T{T}" + ("-qknorm" if norm else "")
            if name not in which:
                continue
            q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
            if T == 1 and not norm and "torch-cpu-T1-fused" in which:  # q, k, v as views of one QKV row
                qkv = torch.randn(T, (Hq + 2 * Hkv) * D)
                qf, kf, vf = (x.view(T, -1, D) for x in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
                kpf, vpf = torch.zeros(256, Hkv, D), torch.zeros(256, Hkv, D)
                pf, sf = torch.arange(T) + 100, torch.arange(T) * 3
                out["torch-cpu-T1-fused"] = timed(lambda: ropepool.rope_pool_fused(
                    qf, kf, vf, pf, sf, kpf, vpf, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv))
            kp, vp = torch.zeros(256, Hkv, D), torch.zeros(256, Hkv, D)
            pos, slots = torch.arange(T) + 100, torch.arange(T) * 3
            kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
            if norm:
                kw["qk_norm"] = ropepool.QKNorm(torch.ones(D), torch.ones(D), eps=1e-6)
            out[name] = timed(lambda: ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, **kw))
for T in (1, 16):  # bfloat16 at Llama-3-8B's geometry over a 65,536-row flat pool ("ropepool bench"'s)
    name = f"torch-cpu-bf16-T{T}-pool64k"
    if name in which:
        import torch
        Hq, Hkv, D = T_GEOM
        q, k, v = (torch.randn(T, h, D, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        kp, vp = (torch.zeros(1 << 16, Hkv, D, dtype=torch.bfloat16) for _ in range(2))
        pos, slots = torch.arange(T) + 100, torch.arange(T) * 3
        out[name] = timed(lambda: ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                                           num_kv_heads=Hkv))
if any(c.startswith("mlx") for c in which):
    import mlx.core as mx
    Hq, Hkv, D = T_GEOM
    for T in (1, 16):
        name = f"mlx-cpu-T{T}"
        if name not in which:
            continue
        q, k, v = (mx.random.normal((T, h, D)) for h in (Hq, Hkv, Hkv))
        pools = [mx.zeros((256, Hkv, D)), mx.zeros((256, Hkv, D))]
        pos, slots = mx.arange(T) + 100, mx.arange(T) * 3
        kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)

        def call():  # the pools donated and rebound, as a model does; evaluated per call
            qr, kr, pools[0], pools[1] = ropepool.rope_pool_fused(q, k, v, pos, slots, *pools, **kw)
            mx.eval(qr, kr, pools[0], pools[1])
        out[name] = timed(call)
print(json.dumps({"ropepool": ropepool.__file__, "samples": out}))
"""

CASES = ("torch-cpu-T1-fused", "torch-cpu-T1", "torch-cpu-T1-qknorm", "torch-cpu-T16", "torch-cpu-T16-qknorm",
         "torch-cpu-bf16-T1-pool64k", "torch-cpu-bf16-T16-pool64k", "mlx-cpu-T1", "mlx-cpu-T16")


def run(src: str, cases) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, ",".join(cases)], env=env, capture_output=True, text=True,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["ropepool"].startswith(os.path.abspath(src)), got["ropepool"]
    return got["samples"]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", action="append", required=True, help="NAME=SRC: a checkout's src folder (2 or more)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--note", default="")
    p.add_argument("--out")
    a = p.parse_args()
    if a.out and os.path.exists(a.out):
        p.error(f"{a.out} exists: records are added, never overwritten")
    cases = a.cases.split(",")
    sides = dict(s.split("=", 1) for s in a.side)
    names = list(sides)
    samples = {side: {c: [] for c in cases} for side in names}
    rounds = {side: {c: [] for c in cases} for side in names}  # each round's median
    for r in range(a.rounds):
        for side in names[r % len(names):] + names[:r % len(names)]:
            for c, xs in run(sides[side], cases).items():
                samples[side][c].extend(xs)
                rounds[side][c].append(statistics.median(xs))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    rows = []
    for c in cases:
        for side in names:
            xs = samples[side][c]
            ratios = [x / y for x, y in zip(rounds[side][c], rounds[names[0]][c])]
            rows.append({"case": c, "side": side, "src": sides[side], "median_us": round(statistics.median(xs), 3),
                         "p10_us": round(pct(xs, 0.1), 3), "p90_us": round(pct(xs, 0.9), 3), "samples": len(xs),
                         "round_ratio": round(statistics.median(ratios), 4),
                         "round_ratio_p10": round(pct(ratios, 0.1), 4), "round_ratio_p90": round(pct(ratios, 0.9), 4)})
        print(f"{c:<22} " + "   ".join(f"{r['side']} {r['median_us']:8.2f} us ({r['round_ratio']:.3f}x, "
                                         f"{r['round_ratio_p10']:.3f}-{r['round_ratio_p90']:.3f})"
                                         for r in rows[-len(names):]))
    if a.out:
        import numpy

        from ropepool.cli.bench_report import cpu_name
        versions = {"python": platform.python_version(), "numpy": numpy.__version__}
        for mod in ("torch", "mlx"):
            try:
                from importlib.metadata import version
                versions[mod] = version(mod)
            except Exception:
                pass
        env = {"date": __import__("datetime").date.today().isoformat(), "machine": platform.machine(),
               "cpu": cpu_name(), **versions,
               "sides": {n: {"src": src, "commit": subprocess.run(
                   ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=src).stdout.strip()}
                   for n, src in sides.items()},
               "threads": 1, "rounds": a.rounds, "note": a.note}
        with open(a.out, "x") as f:
            json.dump({"env": env, "ab_rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
