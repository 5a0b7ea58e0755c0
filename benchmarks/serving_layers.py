"""Host cost per attention layer of ropepool's serving step in transformers' continuous batching, on CPU.

    OMP_NUM_THREADS=1 python3 benchmarks/serving_layers.py --side before=/tmp/before/src --side after=src
        [--dtype float32] [--rounds 3] [--runs 7] [--out docs/bench/cpu-<date>-serving-layers.json]

``ropepool demo``'s runs go through transformers' generation thread, whose steps cannot be timed apart
from the rest. Here one demo run (its models, prompts and step budget) is captured: the keyword arguments
of every forward of the model (one per step, tensors copied). Those steps are then replayed in the main
thread, as transformers' model runner calls them, ``--runs`` times as shipped and through ropepool
(``enable``), interleaved, each replay timed in process CPU time after two untimed ones. A family's
figure: the median over its runs of (fused - shipped) CPU time per step and attention layer, i.e. what
ropepool's layer path costs beyond the transformers ops it replaces (negative: it saves). Each round runs
one fresh process per side (``PYTHONPATH`` = that checkout's ``src``), the order rotating, so every side
sees the same periods of a shared machine. ``--out`` writes the record (a new file; an existing one is
refused).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import gc, json, logging, sys, time
import torch
from ropepool.cli import demo
from ropepool.integrations import transformers as rp

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
dtype, runs, families = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")

def copied(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(copied(y) for y in x)
    return {k: copied(v) for k, v in x.items()} if isinstance(x, dict) else x

out = {}
for family in families:
    model = demo.build_model(family, dtype=dtype)
    steps = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: steps.append(copied(kw)), with_kwargs=True)
    demo.run_batch(model, demo.make_prompts(model.config.vocab_size), 16)
    hook.remove()
    gc.freeze()  # as the demo does

    def replay():
        t = time.process_time()
        with torch.no_grad():
            for kw in steps:
                model(**kw)
        return time.process_time() - t

    plain, fused = [], []
    for i in range(runs + 2):
        p = replay()
        rp.enable(model)
        f = replay()
        rp.disable(model)
        if i >= 2:
            plain.append(p)
            fused.append(f)
    out[family] = {"steps": len(steps), "layers": model.config.num_hidden_layers, "plain_cpu_s": plain,
                   "fused_cpu_s": fused}
    gc.unfreeze()
print(json.dumps(out))
"""


def per_layer_us(r) -> list:
    """(fused - shipped) CPU time per step and layer, in us, one value per run."""
    n = r["steps"] * r["layers"]
    return [(f - p) / n * 1e6 for p, f in zip(r["plain_cpu_s"], r["fused_cpu_s"])]


def summary(record) -> str:
    lines = []
    for side, fams in record["sides"].items():
        for family, runs in fams.items():
            d = [x for r in runs for x in per_layer_us(r)]
            ratio = [p / f for r in runs for p, f in zip(r["plain_cpu_s"], r["fused_cpu_s"])]
            lines.append(f"{side:8s} {family:8s} {record['dtype']}: ropepool - transformers per layer and step "
                         f"{statistics.median(d):+7.1f} us ({min(d):+.0f} to {max(d):+.0f}); "
                         f"transformers / ropepool CPU time {statistics.median(ratio):.3f}")
    return "\n".join(lines)


def main():
    from ropepool.cli.demo import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", action="append", required=True, help="NAME=PATH of a checkout's src (repeatable)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out")
    p.add_argument("--note")
    a = p.parse_args()
    if a.out and os.path.exists(a.out):
        sys.exit(f"serving_layers: {a.out} exists; records are added, never overwritten. Fix: pass a new --out.")
    sides = dict(s.split("=", 1) for s in a.side)
    record = {"dtype": a.dtype, "sides": {name: {} for name in sides}}
    for i in range(a.rounds):
        order = list(sides)[i % len(sides):] + list(sides)[:i % len(sides)]
        for name in order:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(sides[name]), "OMP_NUM_THREADS": "1"}
            res = subprocess.run([sys.executable, "-c", CHILD, a.dtype, str(a.runs), a.families], env=env,
                                 capture_output=True, text=True, check=True)
            for family, r in json.loads(res.stdout.strip().splitlines()[-1]).items():
                record["sides"][name].setdefault(family, []).append(r)
    import torch
    import transformers

    commits = {}
    for name, src in sides.items():
        git = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True)
        commits[name] = git.stdout.strip() or None
    from ropepool.cli.bench_report import cpu_name

    record["env"] = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
                     "python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "commits": commits, "rounds": a.rounds,
                     "runs": a.runs, "note": a.note}
    print(summary(record))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
