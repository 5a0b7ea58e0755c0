"""Sweep the launcher's two tuning choices on the GPU: warps per program and the head split.

    PYTHONPATH=src python3 benchmarks/tune.py --geometries llama70b-tp8 --tokens 16384,65536 --warps 1,2,4

Each variant is checked against the float64 oracle, then timed beside a copy
of the same bytes as ``ropepool bench`` times it (graph replay up to T =
16384, eager calls above). ``--max-position`` also shows what large angles
cost (libdevice's sin/cos take a slow, exact path past ~1e5 rad).
"""
import argparse

import torch

from ropepool import plan
from ropepool.checks import validate
from ropepool.cli import bench
from ropepool.cli.bench_clock import Clock
from ropepool.cli.bench_providers import BASE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--geometries", default="llama70b-tp8")
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--warps", default="1,2,4")
    p.add_argument("--splits", default="1")
    p.add_argument("--max-position", default="131072")
    a = p.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    clock = Clock(dev)
    print(f"{'geometry':>14} {'T':>6} {'max pos':>8} {'warps':>5} {'split':>5} {'µs':>8} {'copy µs':>8} {'% copy':>7}")
    for gname in a.geometries.split(","):
        Hq, Hkv, D = bench.GEOMETRIES[gname]
        kp = torch.empty(262144, Hkv, D, dtype=torch.bfloat16, device=dev)
        vp = torch.empty_like(kp)
        for T in map(int, a.tokens.split(",")):
            sets = bench.make_sets(T, Hq, Hkv, D, 262144, torch.bfloat16, dev, 256 << 20, gen)
            nbytes = bench.op_bytes(T, Hq, Hkv, D, 2, 2)
            bufs = [torch.empty(nbytes // 2, dtype=torch.uint8, device=dev) for _ in range(2 * len(sets))]
            time = clock.graph if T <= 16384 else clock.eager
            copy_us = time([lambda s=s, d=d: d.copy_(s) for s, d in zip(bufs[::2], bufs[1::2])])[0]
            for max_pos in map(int, a.max_position.split(",")):
                for s in sets:
                    s["positions"].random_(0, max_pos)
                ref = bench.reference(sets[0], Hq, Hkv, D)
                variants = [(w, s) for w in map(int, a.warps.split(",")) for s in map(int, a.splits.split(","))
                            if Hq % s == 0]
                for warps, split in variants:
                    # The split applies up to small_tokens tokens: here, to this T.
                    tuning = plan.Tuning(num_warps=warps, head_split=split, small_tokens=max(T, 64))
                    fns = [runner(s, kp, vp, Hq, Hkv, D, tuning) for s in sets]
                    err = bench.check(fns[0], sets[0], ref, kp, vp, Hkv, D, "flat")
                    if not err <= 2e-2:
                        print(f"{gname} T={T} warps={warps} split={split}: FAILED check ({err:.3g})")
                        continue
                    us = time(fns)[0]
                    print(f"{gname:>14} {T:>6} {max_pos:>8} {warps:>5} {split:>5} {us:8.2f} "
                          f"{copy_us:8.2f} {100 * copy_us / us:6.1f}%", flush=True)


def runner(s, kp, vp, Hq, Hkv, D, tuning):
    """One set's call, planned with ``tuning`` (validation in full once, then the plan's runner)."""
    arrays = (s["q"], s["k"], s["v"], s["positions"], s["slots"], kp, vp, None, None)
    call = validate.check(*arrays[:7], head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=BASE)
    run = plan.make(call, s["q"], "triton", tuning).bind(*arrays)
    return lambda: run(*arrays)


if __name__ == "__main__":
    main()
