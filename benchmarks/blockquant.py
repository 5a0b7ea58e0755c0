"""Block-quantized KV pools (NVFP4, mlx-lm's affine 4/8-bit): ropepool's one call beside the unfused steps.

    OMP_NUM_THREADS=1 flock /tmp/heavy.lock python benchmarks/blockquant.py --out docs/bench/cpu-DATE-blockquant.json

One process, both frameworks on the CPU, Llama-3-8B's heads (32 q, 8 KV, head_dim 128), bfloat16, a pool
of 4096 slots. Per cell the providers are timed interleaved call by call (the order rotating), each call
complete (MLX: ``mx.eval`` of every output, pools rebound as a decode loop does), the median and quartiles
over the calls after a warm-up:

- ``ropepool``: ``rope_pool_fused`` with tuple pools (docs/layouts.md).
- ``unfused``, what an engine runs today: on MLX, ``mx.fast.rope`` on q and k (tokens as the batch, each at
  its own offset) then the engine's own quantizer and a scatter of each array: ``mx.quantize`` (affine, what
  mlx-lm's ``QuantizedKVCache`` calls) or ``mx.quantize(mode="nvfp4")`` (MLX's own NVFP4: another byte
  layout, the same work), ``pool[slots] = part``; on torch, RoPE in torch ops (transformers'
  ``rotate_half`` form) then the same quantizer math as separate torch ops and ``index_put_`` per array
  (no engine ships a CPU writer for these formats: this is the unfused form of the same work).

Every cell is first checked: ropepool's V pool equals the unfused provider's bytes where the quantizers
are the same (affine on MLX, both formats on torch; K differs where the rotations round differently).
Timings were taken on the shared 2-core VM.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np

import ropepool

HQ, HKV, D, POOL, BASE = 32, 8, 128, 4096, 500000.0
FORMATS = {"nvfp4": None, "affine4": 4, "affine8": 8}
GROUP = 64
GLOBAL_SCALE = 0.05


# --- MLX -------------------------------------------------------------------------------------------------

def mlx_pools(fmt, mx):
    shape = (POOL, HKV)
    if fmt == "nvfp4":
        return (mx.zeros((*shape, D // 2), dtype=mx.uint8), mx.zeros((*shape, D // 16), dtype=mx.uint8))
    bits = FORMATS[fmt]
    return (mx.zeros((*shape, D * bits // 32), dtype=mx.uint32), mx.zeros((*shape, D // GROUP), dtype=mx.bfloat16),
            mx.zeros((*shape, D // GROUP), dtype=mx.bfloat16))


def mlx_unfused(fmt, mx):
    def quantize(x):
        T = x.shape[0]
        if fmt == "nvfp4":  # MLX's own NVFP4 (its layout: uint32 words, e4m3 scales in uint8)
            w, s = mx.quantize(x.reshape(T * HKV, D), group_size=16, bits=4, mode="nvfp4")
            return w.reshape(T, HKV, -1), s.reshape(T, HKV, -1)
        return tuple(p.reshape(T, HKV, -1) for p in mx.quantize(x.reshape(T * HKV, D), group_size=GROUP,
                                                                  bits=FORMATS[fmt]))

    def run(q, k, v, positions, slots, k_pool, v_pool):
        T = q.shape[0]
        rope = {"dims": D, "traditional": False, "base": BASE, "scale": 1.0, "offset": positions}
        q_rot = mx.fast.rope(q.reshape(T, HQ, 1, D), **rope).reshape(q.shape)
        k_rot = mx.fast.rope(k.reshape(T, HKV, 1, D), **rope).reshape(k.shape)
        k_pool, v_pool = list(k_pool), list(v_pool)
        for pool, parts in ((k_pool, quantize(k_rot)), (v_pool, quantize(v))):
            for i, part in enumerate(parts):
                pool[i][slots] = part
        return q_rot, k_rot, tuple(k_pool), tuple(v_pool)

    return run


def mlx_unfused_pools(fmt, mx):
    if fmt != "nvfp4":
        return mlx_pools(fmt, mx)
    return (mx.zeros((POOL, HKV, D // 8), dtype=mx.uint32), mx.zeros((POOL, HKV, D // 16), dtype=mx.uint8))


# --- torch -----------------------------------------------------------------------------------------------

def torch_pools(fmt, torch):
    shape = (POOL, HKV)
    if fmt == "nvfp4":
        return (torch.zeros(*shape, D // 2, dtype=torch.uint8), torch.zeros(*shape, D // 16,
                                                                             dtype=torch.float8_e4m3fn))
    bits = FORMATS[fmt]
    return (torch.zeros(*shape, D * bits // 32, dtype=torch.uint32),
            torch.zeros(*shape, D // GROUP, dtype=torch.bfloat16), torch.zeros(*shape, D // GROUP,
                                                                               dtype=torch.bfloat16))


def torch_unfused(fmt, torch):
    from ropepool.backends.torch_arrays import TorchOps
    from ropepool.formats import affine, nvfp4

    inv_freq = torch.tensor(BASE ** (-np.arange(0, D, 2) / D), dtype=torch.float32)
    scale = torch.tensor(GLOBAL_SCALE)

    def rotate(x, cos, sin):
        x32 = x.float()
        half = torch.cat((-x32[..., D // 2:], x32[..., : D // 2]), -1)
        return (x32 * cos + half * sin).to(x.dtype)

    def quantize(x):
        x32 = x.float()
        if fmt == "nvfp4":
            return nvfp4.nvfp4(x32, scale, TorchOps)
        return affine.torch_quantize(x32, FORMATS[fmt], GROUP, x.dtype)

    def run(q, k, v, positions, slots, k_pool, v_pool):
        ang = positions.float()[:, None] * inv_freq[None]
        cos, sin = (torch.cat((f, f), -1)[:, None] for f in (ang.cos(), ang.sin()))
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        idx = slots.long()
        for pool, parts in ((k_pool, quantize(k_rot)), (v_pool, quantize(v))):
            for part, stored in zip(pool, parts):
                part.view(stored.dtype).index_put_((idx,), stored)
        return q_rot, k_rot, k_pool, v_pool

    return run


# --- timing ----------------------------------------------------------------------------------------------

def ropepool_call(fmt):
    scales = {"k_scale": GLOBAL_SCALE, "v_scale": GLOBAL_SCALE} if fmt == "nvfp4" else {}

    def run(q, k, v, positions, slots, k_pool, v_pool):
        return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=HQ,
                                        num_kv_heads=HKV, rope_base=BASE, **scales)

    return run


class Caller:
    def __init__(self, fn, inputs, pools, done):
        self.fn, self.inputs, self.pools, self.done, self.times = fn, inputs, pools, done, []

    def call(self, timed=True):
        t0 = time.perf_counter()
        out = self.fn(*self.inputs, *self.pools)
        self.pools = (out[2], out[3])
        self.done(out)
        if timed:
            self.times.append(time.perf_counter() - t0)
        return out


def cell(framework, fmt, T, gen, warmup, calls, seconds):
    if framework == "mlx":
        import mlx.core as mx

        def arr(x):
            return mx.array(x).astype(mx.bfloat16) if x.dtype == np.float32 else mx.array(x)

        def done(out):
            mx.eval(out)

        fused_pools = (mlx_pools(fmt, mx), mlx_pools(fmt, mx))
        unfused, unfused_pools = mlx_unfused(fmt, mx), (mlx_unfused_pools(fmt, mx), mlx_unfused_pools(fmt, mx))
    else:
        import torch

        def arr(x):
            t = torch.from_numpy(x)
            return t.to(torch.bfloat16) if x.dtype == np.float32 else t

        def done(out):
            pass

        fused_pools = (torch_pools(fmt, torch), torch_pools(fmt, torch))
        unfused, unfused_pools = torch_unfused(fmt, torch), (torch_pools(fmt, torch), torch_pools(fmt, torch))
    inputs = [arr(gen.standard_normal((T, h, D)).astype(np.float32)) for h in (HQ, HKV, HKV)]
    inputs += [arr(gen.integers(0, 32768, T).astype(np.int32)), arr(gen.permutation(POOL)[:T].astype(np.int32))]
    callers = {"ropepool": Caller(ropepool_call(fmt), inputs, fused_pools, done),
               "unfused": Caller(unfused, inputs, unfused_pools, done)}
    same = None
    if framework == "torch" or fmt != "nvfp4":  # the same quantizer on both sides: the V pools must agree
        a, b = (c.call(timed=False) for c in callers.values())
        same = all(np.array_equal(_bytes(x), _bytes(y)) for x, y in zip(a[3], b[3]))
    for _ in range(warmup):
        for c in callers.values():
            c.call(timed=False)
    order, start = list(callers.values()), time.perf_counter()
    for i in range(calls):
        for c in order[i % 2:] + order[: i % 2]:
            c.call()
        if i >= 4 and time.perf_counter() - start > seconds:
            break
    rows = []
    for name, c in callers.items():
        us = sorted(1e6 * t for t in c.times)
        rows.append({"framework": framework, "format": fmt, "tokens": T, "provider": name,
                     "median_us": statistics.median(us), "q25_us": us[len(us) // 4],
                     "q75_us": us[3 * len(us) // 4], "calls": len(us), "v_pool_equal": same})
    return rows


def _bytes(x):
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        return np.array(mx.view(x, mx.uint8))
    return x.contiguous().view(-1).view(__import__("torch").uint8).numpy()


def environment(note):
    import importlib.metadata as md

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "cores": os.cpu_count(),
            "threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
            "torch": md.version("torch"), "mlx": md.version("mlx"), "ropepool": ropepool.__version__,
            "commit": commit or None, "geometry": [HQ, HKV, D], "dtype": "bfloat16", "pool_rows": POOL,
            "note": note}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the record to write (a new file under docs/bench/)")
    p.add_argument("--tokens", default="1,16,256")
    p.add_argument("--frameworks", default="torch,mlx")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--note", default="shared 2-core VM (other sessions' jobs may run beside it)")
    a = p.parse_args(argv)
    if os.path.exists(a.out):
        p.error(f"{a.out} exists: records are added, never overwritten")
    gen, rows = np.random.default_rng(0), []
    for fw in a.frameworks.split(","):
        for fmt in FORMATS:
            for T in map(int, a.tokens.split(",")):
                rows += cell(fw, fmt, T, gen, a.warmup, a.calls, a.seconds)
                r, u = rows[-2], rows[-1]
                print(f"{fw:5} {fmt:7} T={T:4}: ropepool {r['median_us']:8.1f} us, unfused {u['median_us']:8.1f} us "
                      f"({u['median_us'] / r['median_us']:.2f}x), V pools equal: {r['v_pool_equal']}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"env": environment(a.note), "blockquant_rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
