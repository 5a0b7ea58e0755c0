"""Soak: a minute of mixed calls, torch CPU and MLX, with the process's resident memory along the way.

    PYTHONPATH=src python3 benchmarks/soak.py [--seconds 60] [--out docs/bench/soak-<date>.json]

Each call draws at random (seeded) a framework (torch on the CPU, MLX where installed), a token count
(1-64, decode-sized mostly), a geometry, a pool layout (flat, a layer of a stacked cache, NHD and HND
pages), a dtype and a rotation: RopeSpecs (plain, partial, GPT-J, YaRN, per-layer bases), the engine
table of a CosSinCache kept by the caller, a new CosSinCache per call over a kept table, and a new
table per call (the pattern that kept every table alive before issue 33). Arrays are made once per
case, so what grows is what ropepool keeps. After a warm-up pass over every case (compilations
included), it prints calls/s and resident memory (VmRSS) for each tenth of the run; ``--out`` writes
the record (a new file; an existing one is refused).
"""
import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ropepool

try:
    import mlx.core as mx
except ImportError:
    mx = None

TOKENS = (1, 1, 1, 2, 3, 4, 5, 8, 16, 64)
GEOMETRIES = ((8, 2, 64), (4, 1, 128), (16, 4, 64))  # (q heads, kv heads, head_dim)
LAYOUTS = ("flat", "layer", "NHD", "HND")
SPECS = {"plain": dict(), "partial": dict(rotary_dim=32), "gptj": dict(style="gptj"),
         "yarn": dict(scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048)),
         "base1e6": dict(base=1e6)}
ROPES = (*SPECS, "table kept", "table new object", "table new")
POOL, PAGE, LAYERS, MAX_POS = 512, 16, 4, 4096


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Case:
    """The arrays of one (framework, tokens, geometry, layout, dtype), made once."""

    def __init__(self, fw, T, geom, layout, dtype, rng):
        Hq, Hkv, D = geom
        self.fw, self.T, self.D, self.layout = fw, T, D, layout
        shape = {"flat": (POOL, Hkv, D), "layer": (LAYERS, POOL, Hkv, D), "NHD": (POOL // PAGE, PAGE, Hkv, D),
                 "HND": (POOL // PAGE, Hkv, PAGE, D)}[layout]
        arrays = [rng.standard_normal((T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv)]
        arrays += [rng.integers(0, MAX_POS, T), rng.permutation(POOL)[:T]]
        pools = [np.zeros(shape, np.float32), np.zeros(shape, np.float32)]
        if fw == "torch":
            dt = getattr(torch, dtype)
            self.arrays = [torch.from_numpy(a).to(dt) for a in arrays[:3]] + [torch.from_numpy(a) for a in arrays[3:]]
            self.pools = [torch.from_numpy(p).to(dt) for p in pools]
        else:
            dt = getattr(mx, dtype)
            self.arrays = [mx.array(a).astype(dt) for a in arrays[:3]] + [mx.array(a) for a in arrays[3:]]
            self.pools = [mx.array(p).astype(dt) for p in pools]
        self.kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, layer=1 if layout == "layer" else None,
                       kv_layout=layout if layout in ("NHD", "HND") else None)


class Tables:
    """The caller's tables and specs, per (framework, head_dim)."""

    def __init__(self):
        self.kept, self.specs = {}, {}

    def rope(self, kind, fw, D):
        if kind in SPECS:
            key = (kind, D)
            if key not in self.specs:
                self.specs[key] = ropepool.RopeSpec(head_dim=D, **SPECS[kind])
            return self.specs[key]
        if kind == "table new":
            return ropepool.CosSinCache(self.table(fw, D))
        if (fw, D) not in self.kept:
            self.kept[fw, D] = self.table(fw, D)
            self.kept[fw, D, "cache"] = ropepool.CosSinCache(self.kept[fw, D])
        return self.kept[fw, D, "cache"] if kind == "table kept" else ropepool.CosSinCache(self.kept[fw, D])

    @staticmethod
    def table(fw, D):
        t = np.random.default_rng(D).standard_normal((MAX_POS, D)).astype(np.float32)
        return torch.from_numpy(t) if fw == "torch" else mx.array(t)


def call(case, rope):
    out = ropepool.rope_pool_fused(*case.arrays, *case.pools, rope=rope, **case.kw)
    if case.fw == "mlx":
        mx.eval(*out)
        case.pools = list(out[2:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the measured run (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the record here (a new JSON file under docs/bench/)")
    p.add_argument("--note", default="", help="a note for the record (where it ran)")
    args = p.parse_args(argv)
    if args.out and Path(args.out).exists():
        sys.exit(f"soak: --out {args.out} exists; records are added, never overwritten. Fix: a new file name.")
    rng, pick = np.random.default_rng(args.seed), random.Random(args.seed)
    frameworks = ("torch",) + (("mlx",) if mx is not None else ())
    cases = [Case(fw, T, g, lay, dt, rng) for fw in frameworks for T in sorted(set(TOKENS)) for g in GEOMETRIES
             for lay in LAYOUTS for dt in ("float32", "bfloat16")]
    tables = Tables()
    t0, rss0 = time.perf_counter(), rss_mb()
    for case in cases:  # warm-up: every case and rotation once (compilations, tables)
        for kind in ROPES:
            call(case, tables.rope(kind, case.fw, case.D))
    warm = dict(seconds=round(time.perf_counter() - t0, 1), rss_before_mb=round(rss0, 1))
    print(f"warm-up: {len(cases)} cases x {len(ROPES)} rotations in {warm['seconds']} s, "
          f"RSS {rss0:.0f} -> {rss_mb():.0f} MB")
    by_T = {T: [c for c in cases if c.T == T] for T in set(TOKENS)}
    samples, counts = [], {fw: 0 for fw in frameworks}
    start = time.perf_counter()
    tenth, n, last, last_n = args.seconds / 10, 0, start, 0
    samples.append(dict(t=0.0, calls=0, calls_per_s=None, rss_mb=round(rss_mb(), 1)))
    print(f"{'t (s)':>6} {'calls':>8} {'calls/s':>8} {'RSS MB':>8}")
    print(f"{0.0:6.1f} {0:8d} {'':>8} {samples[0]['rss_mb']:8.1f}")
    while (now := time.perf_counter()) - start < args.seconds:
        case = pick.choice(by_T[pick.choice(TOKENS)])
        call(case, tables.rope(pick.choice(ROPES), case.fw, case.D))
        counts[case.fw] += 1
        n += 1
        if now - last >= tenth:
            s = dict(t=round(now - start, 1), calls=n, calls_per_s=round((n - last_n) / (now - last), 1),
                     rss_mb=round(rss_mb(), 1))
            samples.append(s)
            print(f"{s['t']:6.1f} {n:8d} {s['calls_per_s']:8.1f} {s['rss_mb']:8.1f}")
            last, last_n = now, n
    end = dict(t=round(now - start, 1), calls=n, calls_per_s=round((n - last_n) / (now - last), 1),
               rss_mb=round(rss_mb(), 1))
    samples.append(end)
    mid = samples[len(samples) // 2]
    print(f"calls/s {n / (now - start):.1f} overall ({counts}); RSS start {samples[0]['rss_mb']} MB, "
          f"middle {mid['rss_mb']} MB (t = {mid['t']} s), end {end['rss_mb']} MB")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
               "ropepool": ropepool.__version__, "mlx": getattr(mx, "__version__", None),
               "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "commit": commit.strip(),
               "note": args.note}
        record = dict(env=env, soak=dict(seconds=args.seconds, seed=args.seed, warm_up=warm, calls=n,
                                         calls_by_framework=counts, samples=samples))
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
