"""The MLX benchmark: ropepool beside the code an MLX user writes by hand, on MLX's default device.

The hand-written code is ``mx.fast.rope`` on q and k (tokens as the batch,
each at its own offset) and ``k_pool[slots] = k_rot``, ``v_pool[slots] = v``.
Both providers are timed in one process, interleaved call by call so that they
see the same machine, each call evaluated (``mx.eval`` of all four outputs)
with the caller rebinding its pools, as a decode loop does: the median over
many calls after a warm-up. Each provider is first compared with the float64
oracle (the error column; ``mx.fast.rope`` rounds cos/sin to bf16 and rotates
in bf16, which the contract does not allow). A T = 1 row on a small pool shows
that a call costs time in proportion to its tokens, not to the pool.
``ropepool bench --framework mlx`` runs it.
"""
from __future__ import annotations

import json
import os
import platform
import time

import mlx.core as mx
import numpy as np

import ropepool
from ropepool.cli.bench_report import save_plot
from ropepool.reference import rope_pool_fused as oracle

GEOMETRIES = {"llama3-8b": (32, 8, 128), "llama70b-tp8": (8, 1, 128)}
DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}
TOKENS = (1, 16, 256, 4096)
BASE = 500000.0
TARGET_VS_HAND = 1.5  # ropepool / hand-written, at every T
TARGET_VS_SMALL_POOL = 2.0  # T = 1: large pool / small pool


def hand_written(q, k, v, positions, slots, k_pool, v_pool):
    """What an MLX user writes: mx.fast.rope per token (tokens as the batch), slice assignment into the pools."""
    T, Hq, D = q.shape
    rope = {"dims": D, "traditional": False, "base": BASE, "scale": 1.0, "offset": positions}
    q_rot = mx.fast.rope(q.reshape(T, Hq, 1, D), **rope).reshape(q.shape)
    k_rot = mx.fast.rope(k.reshape(T, k.shape[1], 1, D), **rope).reshape(k.shape)
    k_pool[slots] = k_rot
    v_pool[slots] = v
    return q_rot, k_rot, k_pool, v_pool


def ropepool_call(q, k, v, positions, slots, k_pool, v_pool):
    return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=q.shape[2],
                                    num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], rope_base=BASE)


PROVIDERS = {"ropepool": ropepool_call, "hand-written": hand_written}


class Caller:
    """One provider with its own pools, rebinding them after each call as a decode loop does."""

    def __init__(self, fn, inputs, pool_rows, Hkv, D, dtype):
        self.fn, self.inputs = fn, inputs
        self.pools = [mx.zeros((pool_rows, Hkv, D), dtype=dtype) for _ in range(2)]
        mx.eval(*self.pools)
        self.times = []

    def call(self, timed=True):
        t0 = time.perf_counter()
        out = self.fn(*self.inputs, *self.pools)
        self.pools = [out[2], out[3]]
        mx.eval(*out)
        if timed:
            self.times.append(time.perf_counter() - t0)
        return out


def make_inputs(T, Hq, Hkv, D, dtype, pool_rows, gen):
    def randn(*shape):
        return mx.array(gen.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = randn(T, Hq, D), randn(T, Hkv, D), randn(T, Hkv, D)
    positions = mx.array(gen.integers(0, 32768, T).astype(np.int32))
    slots = mx.array(gen.permutation(pool_rows)[:T].astype(np.int32))
    mx.eval(q, k, v, positions, slots)
    return q, k, v, positions, slots


def rel_error(caller, ref, slots):
    """Max |got - ref| / max(1, |ref|) over q_rot, k_rot and the written pool rows."""
    out = caller.call(timed=False)
    got = [out[0], out[1], out[2][slots], out[3][slots]]
    want = [ref[0], ref[1], ref[2][np.array(slots)], ref[3][np.array(slots)]]
    err = 0.0
    for g, w in zip(got, want):
        g = np.array(g.astype(mx.float32)).astype(np.float64)
        err = max(err, float((np.abs(g - w) / np.maximum(1.0, np.abs(w))).max()))
    return err


def measure_cell(geometry, dtype_name, T, pool_rows, small_pool, warmup, max_calls, max_seconds, gen):
    """Records for one geometry, dtype and token count: each provider, interleaved call by call."""
    Hq, Hkv, D = GEOMETRIES[geometry]
    dtype = DTYPES[dtype_name]
    small = small_pool if small_pool and T == 1 else 0
    inputs = make_inputs(T, Hq, Hkv, D, dtype, small or pool_rows, gen)  # slots valid in both pools
    callers = {(name, pool_rows): Caller(fn, inputs, pool_rows, Hkv, D, dtype) for name, fn in PROVIDERS.items()}
    if small:
        callers[("ropepool", small)] = Caller(ropepool_call, inputs, small, Hkv, D, dtype)
    # The oracle on the inputs, into zero pools as the callers' start (only the written rows are compared).
    np_inputs = [np.array(a.astype(mx.float32)).astype(np.float64) if i < 3 else np.array(a)
                 for i, a in enumerate(inputs)]
    zeros = np.zeros((int(np_inputs[4].max()) + 1, Hkv, D))
    ref = oracle(*np_inputs, zeros, zeros, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=BASE)
    errors = {key: rel_error(c, ref, inputs[4]) for key, c in callers.items()}
    for _ in range(warmup):
        for c in callers.values():
            c.call(timed=False)
    start, order = time.perf_counter(), list(callers.values())
    for i in range(max_calls):
        for c in order[i % len(order):] + order[: i % len(order)]:
            c.call()
        if i >= 4 and time.perf_counter() - start > max_seconds:
            break
    records = []
    for (name, rows), c in callers.items():
        us = np.array(c.times) * 1e6
        records.append({"geometry": geometry, "dtype": dtype_name, "tokens": T, "pool_rows": rows,
                        "provider": name, "median_us": float(np.median(us)), "q25_us": float(np.percentile(us, 25)),
                        "q75_us": float(np.percentile(us, 75)), "calls": len(us), "rel_error": errors[(name, rows)]})
    return records


def environment():
    import importlib.metadata as md

    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {_cpu_name()}",
            "cores": os.cpu_count(), "device": str(mx.default_device()), "python": platform.python_version(),
            "mlx": md.version("mlx"), "numpy": np.__version__, "ropepool": ropepool.__version__}


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def summary(records):
    """Rows of (geometry, dtype, T, ropepool µs, hand µs, ratio, small-pool µs, big/small, ok)."""
    by = {(r["geometry"], r["dtype"], r["tokens"], r["provider"], r["pool_rows"]): r for r in records}
    rows = []
    for (g, d, T, prov, pool), r in by.items():
        if prov != "hand-written":
            continue
        rp = by[(g, d, T, "ropepool", pool)]
        small = next((s for (g2, d2, T2, p2, rows2), s in by.items()
                      if (g2, d2, T2, p2) == (g, d, T, "ropepool") and rows2 != pool), None)
        ratio = rp["median_us"] / r["median_us"]
        growth = rp["median_us"] / small["median_us"] if small else None
        ok = ratio <= TARGET_VS_HAND and (growth is None or growth <= TARGET_VS_SMALL_POOL)
        rows.append({"geometry": g, "dtype": d, "tokens": T, "pool_rows": pool, "ropepool_us": rp["median_us"],
                     "hand_us": r["median_us"], "ratio": ratio, "small_pool_us": small and small["median_us"],
                     "growth": growth, "ropepool_err": rp["rel_error"], "hand_err": r["rel_error"], "ok": ok})
    return rows


def print_table(rows, env):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="rope_pool_fused on MLX ({})".format(", ".join(f"{k}={v}" for k, v in env.items())))
    for col in ("geometry", "dtype", "T", "ropepool µs", "hand µs", "ratio", "T=1 small pool µs", "large/small",
                "ropepool err", "hand err", "targets"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["geometry"], r["dtype"], str(r["tokens"]), f"{r['ropepool_us']:.0f}", f"{r['hand_us']:.0f}",
                  f"{r['ratio']:.2f}x", f"{r['small_pool_us']:.0f}" if r["small_pool_us"] else "",
                  f"{r['growth']:.2f}x" if r["growth"] else "", f"{r['ropepool_err']:.1e}",
                  f"{r['hand_err']:.1e}", "met" if r["ok"] else "MISSED")
    Console(width=180).print(t)


def plot(records, env, path):
    """µs per call against T, one panel per geometry and dtype, from the records alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["geometry"], r["dtype"]) for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (g, d) in zip(axes[0], panels):
        pool = max(r["pool_rows"] for r in records)
        for prov, style in (("ropepool", "o-"), ("hand-written", "s--")):
            pts = sorted((r["tokens"], r["median_us"]) for r in records
                         if (r["geometry"], r["dtype"], r["provider"], r["pool_rows"]) == (g, d, prov, pool))
            if pts:
                ax.loglog(*zip(*pts), style, label=f"{prov}, pool {pool}")
        small = [(r["tokens"], r["median_us"]) for r in records
                 if (r["geometry"], r["dtype"], r["provider"]) == (g, d, "ropepool") and r["pool_rows"] != pool]
        if small:
            ax.loglog(*zip(*small), "^", label=f"ropepool, pool {small and min(r['pool_rows'] for r in records)}")
        ax.set(title=f"{g} {d}", xlabel="tokens per call", ylabel="µs per call (evaluated)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"MLX {env['mlx']} on {env['device']}, {env['machine']}, {env['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from . import Parser, alias, choosers, count, counts, names_of, out_file, out_paths, positive

    p = Parser(prog="ropepool bench --framework mlx", description=__doc__.split("\n")[0])
    choosers(p, "bench")
    p.add_argument("--geometries", type=names_of(GEOMETRIES, all_=True), default="all",
                   help=f"comma-separated from {', '.join(GEOMETRIES)} (q heads, KV heads, head_dim: "
                        f"{', '.join(f'{k}={v}' for k, v in GEOMETRIES.items())}), or all (the default)")
    p.add_argument("--dtype", type=names_of(DTYPES), default=",".join(DTYPES),
                   help=f"comma-separated from {', '.join(DTYPES)} (default all)")
    p.add_argument("--tokens", type=counts, default=",".join(map(str, TOKENS)), help="comma-separated tokens per call")
    alias(p, "--pool-rows", p.add_argument("--pool-size", dest="pool_rows", metavar="N", type=count, default=65536,
                                           help="rows (slots) of each KV pool"))
    alias(p, "--small-pool-rows", p.add_argument(
        "--small-pool-size", dest="small_pool_rows", metavar="N", type=lambda t: count(t, 0), default=1024,
        help="rows of the small pool timed at T = 1 beside the large one (0: skip)"))
    p.add_argument("--warmup", type=lambda t: count(t, 0), default=5,
                   help="untimed calls of each provider before timing")
    p.add_argument("--calls", type=count, default=200, help="timed calls of each provider, at most")
    p.add_argument("--seconds", type=positive, default=20.0,
                   help="stop timing a cell after this long (at least 5 calls each)")
    alias(p, "--json", p.add_argument("--out", type=out_file, default=None,
                                      help="write the records to OUT.json and the plot beside them (OUT.png); OUT may "
                                           "end in .json; default: print only"))
    a = p.parse_args(argv)
    if max(a.tokens) > a.pool_rows:
        p.error(f"argument --tokens: {max(a.tokens)} tokens per call need a pool of at least as many rows; "
                f"--pool-size is {a.pool_rows}")
    json_path, png = out_paths(a.out) if a.out else (None, None)
    from rich.progress import Progress

    env = environment()
    cells = [(g, d, T) for g in a.geometries for d in a.dtype for T in a.tokens]
    gen, records = np.random.default_rng(0), []
    with Progress() as progress:
        task = progress.add_task("benchmarking", total=len(cells))
        for g, d, T in cells:
            progress.update(task, description=f"{g} {d} T={T}")
            records += measure_cell(g, d, T, a.pool_rows, a.small_pool_rows, a.warmup, a.calls, a.seconds, gen)
            progress.advance(task)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump({"env": env, "records": records, "summary": summary(records)}, f, indent=1)
    rows = summary(records)
    print_table(rows, env)
    if json_path:
        print(f"wrote {json_path}; {save_plot(plot, records, env, png)}")
    return 0 if all(r["ok"] for r in rows) else 1
