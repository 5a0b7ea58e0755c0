"""The first call of a fresh process: ``import ropepool`` and its first ``rope_pool_fused`` call on CPU.

    PYTHONPATH=src python3 benchmarks/first_call.py [--runs 7] [--out docs/bench/cpu-<date>-first-call.json]

Each run is a new Python process that imports torch (timed apart: the user's import, not ropepool's),
makes a 5-token float32 call's tensors (Llama-3-8B heads), then times ``import ropepool`` plus the first
call, and the second call; then the process CPU time of the first 200 calls of a bf16 one-token decode
layout (a new layout in the process) and of 200 steady calls of it (after 500 more). It prints the median
and min-max of the runs; ``--out`` writes the record (a new file; an existing one is refused).

The processes import ropepool from its bytecode caches, as a process after ``pip install`` does (pip
compiles them at install): two untimed runs first write them, with PYTHONDONTWRITEBYTECODE unset for the
children (set, every run would compile ropepool's sources again: 40-70 ms on a 2-core VM).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
T, Hq, Hkv, D = 5, 32, 8, 128
q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
kp, vp = torch.zeros(64, Hkv, D), torch.zeros(64, Hkv, D)
pos, slots = torch.arange(T), torch.arange(T)
t2 = time.perf_counter()
import ropepool
ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
t3 = time.perf_counter()
ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
t4 = time.perf_counter()
q, k, v = (x[:1].to(torch.bfloat16) for x in (q, k, v))
kp, vp = kp.to(torch.bfloat16), vp.to(torch.bfloat16)
def calls(n):
    t = time.process_time()
    for i in range(n):
        ropepool.rope_pool_fused(q, k, v, pos[:1], slots[:1], kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    return time.process_time() - t
first200 = calls(200)
calls(500)
print(json.dumps({"import_torch_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3,
                  "first_200_cpu_s": first200, "steady_200_cpu_s": calls(200)}))
"""


def native_isa():
    """Which build of the native CPU kernel runs (None: none, the general torch code)."""
    from ropepool import native

    kernel = native.kernel()
    return None if kernel is None else kernel.isa()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out", default=None)
    p.add_argument("--note", default=None)
    a = p.parse_args()
    if a.out and os.path.exists(a.out):
        sys.exit(f"{a.out} exists: records are added, never overwritten")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def run():
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    run(), run()  # (bytecode caches written)
    runs = [run() for _ in range(a.runs)]
    first = [r["first_call_s"] for r in runs]
    print(f"import ropepool + first call: median {statistics.median(first):.3f} s "
          f"({min(first):.3f}-{max(first):.3f}, {len(runs)} fresh processes)")
    ratio = [r["first_200_cpu_s"] / r["steady_200_cpu_s"] for r in runs]
    print(f"CPU time of the first 200 bf16 one-token calls / 200 steady ones: median {statistics.median(ratio):.2f} "
          f"({min(ratio):.2f}-{max(ratio):.2f})")
    if a.out:
        import torch

        import ropepool
        from ropepool.cli.bench_report import cpu_name

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
               "ropepool": ropepool.__version__, "device": "cpu", "cpu": cpu_name(),
               "native": native_isa(), "commit": commit.strip() or None}
        if a.note:
            env["note"] = a.note
        with open(a.out, "w") as f:
            json.dump({"env": env, "first_call": runs}, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
