"""Host cost of one eager call on CUDA, against a bare Triton launch measured in the same process.

    PYTHONPATH=src python3 benchmarks/host_latency.py [--rounds 7] [--out docs/bench/GPU-DATE-host.json]

The host's speed varies between periods (1.5x seen), so absolute µs do not
compare across runs: the figure that does is the ratio of a full
``rope_pool_fused`` call (validation cache, output allocation, launch) to a
bare Triton launch of a one-element kernel (``bump[(1,)](x)`` through the JIT, as the peer harness times it),
both timed round-robin in one process. Each figure is the median over rounds
of the best-of-5 per-call time of back-to-back calls (the GPU work of these
small calls is shorter than their host time, so the loop is host-bound).
Parts of a call (cache lookup, allocations, the launch, and the launch through
the custom op that compiled calls run) are timed the same way, for where the
time goes ("cache lookup": by the call's key alone, as a call finds a runner
that checks its own layout; "with guards": the layout compared in Python or by
dynamo's guards). Where the native launcher runs
(backends/triton_native.py), every call and the launch are timed again
through Triton's own launcher ("Triton's launcher": the native launcher
still compares the layout, then Triton launches), round-robin with the
rest. ``--out`` writes the figures as a record (``host_rows``: the bare
launch, "before" = Triton's launcher, "after" = the native one; a new
file, an existing one is refused).
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
import triton
import triton.language as tl

import ropepool
from ropepool import plan
from ropepool.checks import validate


@triton.jit
def bump(x):
    tl.store(x, tl.load(x) + 1)


def per_call_us(fn, calls=400):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def parts_of_a_call(T, args, kw):
    """The cache lookup, the output allocations and the launch of one call, timed alone; with the Launch
    object, whose native launcher the caller switches off for the rows marked so."""
    q, k = args[:2]
    ropepool.rope_pool_fused(*args, **kw)
    arrays = (*args, None, None)
    # api.rope_pool_fused's key (plan.pool_key's arguments: the keywords in the signature's order, then q, k)
    scalars = plan.pool_key(kw["head_dim"], kw["num_qo_heads"], kw["num_kv_heads"], kw["rope_base"], *(None,) * 13,
                            q, k)
    ropepool.rope_pool_fused(*args, **kw)  # (the second call: the runner's native launcher is made by the first)
    launch = plan.lookup(scalars, arrays, fast=False)  # this layout's runner, the one rope_pool_fused calls
    print("layout cache:", "hit" if launch is not None else "MISSED (every call checked in full)",
          "(key only)" if plan.lookup(scalars, arrays) is launch else "(guarded)")
    if launch is None:
        launch = plan.make(validate.check(*args, **kw), q, "triton").bind(*args)
    print("native launcher:", "yes" if launch.native is not None else "no (Triton's launcher)")
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    contiguous = torch.contiguous_format
    parts = {
        f"  cache lookup T={T}": lambda: plan.lookup(scalars, arrays),
        f"  cache lookup with guards T={T}": lambda: plan.lookup(scalars, arrays, fast=False),
        f"  two output allocations T={T}": lambda: (torch.empty_like(q, memory_format=contiguous),
                                                    torch.empty_like(k, memory_format=contiguous)),
        f"  launch, outputs given T={T}": lambda: launch(*args, qo, ko),
    }
    # The custom op that compiled calls run (backends/triton_op.py), called eagerly with the same arrays: what an
    # eager call would cost through it.
    prepared = plan.make(validate.check(*args, **kw), q, "triton").prepared
    op_args = (*args, qo, ko, None, *prepared.extras(q.device), *prepared.launcher.args())
    parts[f"  the custom op, outputs given T={T}"] = lambda: torch.ops.ropepool.rope_pool(*op_args)
    if launch.native is not None:
        parts[f"  launch, outputs given T={T}, Triton's launcher"] = parts[f"  launch, outputs given T={T}"]
    return launch, parts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="round-robin rounds; the median is reported")
    p.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts")
    p.add_argument("--out", help="write the record here (JSON)")
    p.add_argument("--note", default="", help="the record's note: the machine, its load, the command")
    p.add_argument("--commit", default=None, help="the record's commit: the code measured")
    a = p.parse_args()
    if a.out and os.path.exists(a.out):
        p.error(f"{a.out} exists: records are added, never overwritten")
    Hq, Hkv, D, P = 32, 8, 128, 262144
    dev, dt = "cuda", torch.bfloat16
    kp = torch.empty(P, Hkv, D, device=dev, dtype=dt)
    vp = torch.empty_like(kp)
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=5e5)
    x = torch.empty(16, device=dev)
    fns = {"bare Triton launch": lambda: bump[(1,)](x)}
    parts, launches = {}, []
    for T in map(int, a.tokens.split(",")):
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=dev, dtype=dt)
        q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
        pos = torch.randint(0, 100000, (T,), device=dev, dtype=torch.int32)
        sl = torch.randperm(P, device=dev)[:T].int()
        args = (q, k, v, pos, sl, kp, vp)
        fns[f"rope_pool_fused T={T}"] = lambda args=args: ropepool.rope_pool_fused(*args, **kw)
        if not parts:  # where the time goes, for the first token count
            parts = parts_of_a_call(T, args, kw)
        # Each token count's runner (a one-token view has other strides: its own layout), switched below.
        ropepool.rope_pool_fused(*args, **kw)
        launches.append(plan.lookup(plan.pool_key(D, Hq, Hkv, 5e5, *(None,) * 13, q, k), (*args, None, None),
                                    fast=False))
    launch, parts = parts
    launches.append(launch)
    natives = [(r, r.native) for r in launches if getattr(r, "native", None) is not None]
    if natives:
        fns.update({f"{name}, Triton's launcher": fn for name, fn in fns.items() if name.startswith("rope_pool")})
    fns.update(parts)
    results = {name: [] for name in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            for runner, native in natives:  # (the native launcher still compares the layout, then declines)
                runner.native = native if "Triton's launcher" not in name else \
                    lambda go, *arrays, native=native: native(False, *arrays)
            results[name].append(per_call_us(fn))
    bare = statistics.median(results["bare Triton launch"])
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'':50s} {'µs (median)':>12s} {'x bare launch':>14s}")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"{name:50s} {med:12.2f} {med / bare:14.2f}")
    if a.out:
        write_record(a, results)


def write_record(a, results):
    """host_rows as ropepool.cli.bench_records reads them: the bare launch (tokens 0), each call's "before"
    (Triton's launcher) and "after" (the native launcher)."""
    rows = [dict(pinned="none", geometry="llama3-8b", provider="bare", tokens=0,
                 us=round(statistics.median(results["bare Triton launch"]), 2))]
    for T in map(int, a.tokens.split(",")):
        for provider, name in (("before", f"rope_pool_fused T={T}, Triton's launcher"),
                               ("after", f"rope_pool_fused T={T}")):
            if name in results:
                rows.append(dict(pinned="none", geometry="llama3-8b", provider=provider, tokens=T,
                                 us=round(statistics.median(results[name]), 2)))
    env = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "commit": a.commit, "note": a.note}
    with open(a.out, "x") as f:
        json.dump({"env": env, "host_rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
