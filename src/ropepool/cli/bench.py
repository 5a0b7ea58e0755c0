"""The benchmark: ropepool beside eager PyTorch, torch.compile, FlashInfer and a copy.

For each geometry and token count it checks every provider against the
float64 oracle, then times it: CUDA-graph replay (``graph``) for small and
mid sizes (to T = 16384, where small rows are still host-bound in eager
calls), back-to-back eager calls from Python (``eager``) for small and large
sizes. Inputs rotate over enough sets that they do not sit in L2.
Bandwidth is the op's own byte count over the median time; ``%copy``
compares it with a device-to-device copy of the same bytes timed in the
same run. On CPU calls are timed in process CPU time (wall time on a shared
machine swings by tens of percent), on the threads ``--threads`` gives torch,
and there is no copy row: an op that allocates its outputs has no memcpy
floor. ``benchmarks/bench.py`` runs it; ``ropepool bench`` too.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

import ropepool
from ropepool.cli.bench_clock import Clock
from ropepool.cli.bench_providers import BASE, LAYOUTS, PAGE_SIZE, flashinfer_modules, providers
from ropepool.cli.bench_report import cpu_name
from ropepool.reference import rope_pool_fused as oracle

GEOMETRIES = {"llama3-8b": (32, 8, 128), "llama70b-tp8": (8, 1, 128), "h64-kv8": (64, 8, 128)}
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass
class Row:
    geometry: str
    layout: str
    tokens: int
    provider: str
    mode: str
    us: float
    spread_pct: float
    gbps: float
    pct_copy: float | None  # None on CPU
    speedup_vs_eager: float | None = None


def op_bytes(T, Hq, Hkv, D, elt, pool_elt, idx_elt=4):
    """Fewest bytes: read q, k, v, positions, slots; write q_rot, k_rot and the two pool rows."""
    return T * ((Hq + 2 * Hkv) * D * elt + 2 * idx_elt + (Hq + Hkv) * D * elt + 2 * Hkv * D * pool_elt)


# --- inputs -------------------------------------------------------------------
def make_sets(T, Hq, Hkv, D, pool_size, dtype, device, rotate_bytes, gen):
    per_set = T * (2 * Hq + 4 * Hkv) * D * torch.finfo(dtype).bits // 8
    n = int(max(1, min(8, rotate_bytes // max(per_set, 1))))
    sets = []
    for _ in range(n):
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen, dtype=torch.float32).to(device, dtype)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        sets.append(dict(
            q=q.view(T, Hq, D), k=k.view(T, Hkv, D), v=v.view(T, Hkv, D),
            positions=torch.randint(0, 131072, (T,), generator=gen, dtype=torch.int32).to(device),
            slots=torch.randperm(pool_size, generator=gen)[:T].to(torch.int32).to(device),
        ))
    return sets


def reference(s, Hq, Hkv, D, max_tokens=4096):
    """The oracle's q_rot and k_rot on up to max_tokens tokens of a set (tokens are independent)."""
    T = s["q"].shape[0]
    idx = torch.randperm(T)[:max_tokens].sort().values
    pick = lambda x: x.detach().cpu()[idx]  # noqa: E731
    ref = oracle(*(pick(s[n]).double().numpy() for n in ("q", "k", "v")), pick(s["positions"]).numpy(),
                 np.full(len(idx), -1), np.zeros((1, Hkv, D)), np.zeros((1, Hkv, D)),
                 head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=BASE)
    return idx, ref[0], ref[1], pick(s["v"]).double().numpy()


def check(fn, s, ref, kp, vp, Hkv, D, layout):
    """Poisoned pools, one call, compare with the oracle; returns the largest relative L2 error."""
    scale = LAYOUTS[layout][2] or 1.0
    kp.view(torch.uint8).fill_(0x7F)  # NaN in bf16/f16; 448 in e4m3: either shows an unwritten row
    vp.view(torch.uint8).fill_(0x7F)
    q_rot, k_rot = fn()[:2]
    idx, q_ref, k_ref, v_ref = ref
    sl = s["slots"].long().cpu()[idx]
    got = [q_rot.cpu()[idx], k_rot.cpu()[idx], kp.view(-1, Hkv, D).cpu()[sl].double() * scale,
           vp.view(-1, Hkv, D).cpu()[sl].double() * scale]
    err = 0.0
    for g, w in zip(got, (q_ref, k_ref, k_ref, v_ref)):
        g = g.double().numpy()
        err = max(err, float(np.linalg.norm(g - w) / np.linalg.norm(w)) if np.isfinite(g).all() else float("inf"))
    return err


def run(geometries, tokens, device, pool_size=262144, dtype=torch.bfloat16, rotate_bytes=256 << 20,
        graph_max=16384, eager_max=256, eager_above=4096, layouts=("flat",), log=print, save=None,
        step=lambda what: None):
    """Measure; ``save(rows)`` is called after every token count, so a run cut short keeps its rows,
    and ``step(what)`` before each (a progress bar's hook).

    Eager calls are timed up to ``eager_max`` tokens (the host cost of a call)
    and above ``eager_above`` (where the GPU time outweighs it); graph replay
    up to ``graph_max``."""
    gen = torch.Generator().manual_seed(0)
    clock = Clock(device)
    cuda = device.type == "cuda"
    rows = []
    for gname in geometries:
        Hq, Hkv, D = GEOMETRIES[gname]
        for layout in layouts:
            kv_layout, pool_dtype, _ = LAYOUTS[layout]
            pool_shape = (pool_size, Hkv, D) if kv_layout is None else (pool_size // PAGE_SIZE, PAGE_SIZE, Hkv, D)
            kp = torch.empty(pool_shape, dtype=pool_dtype or dtype, device=device)
            vp = torch.empty_like(kp)
            provs = providers(Hq, Hkv, D, device, layout)
            for T in tokens:
                step(f"{gname} {layout} T={T}")
                sets = make_sets(T, Hq, Hkv, D, pool_size, dtype, device, rotate_bytes, gen)
                nbytes = op_bytes(T, Hq, Hkv, D, dtype.itemsize, kp.element_size())
                # The floor: a copy of the same bytes, rotating over as many
                # buffers as the inputs do so it is not served from L2 either.
                bufs = [(torch.empty(nbytes // 2, dtype=torch.uint8, device=device),
                         torch.empty(nbytes // 2, dtype=torch.uint8, device=device)) for _ in sets] if cuda else []
                timed = {"copy": [lambda s=s, d=d: d.copy_(s) for s, d in bufs]} if cuda else {}
                ref = reference(sets[0], Hq, Hkv, D)
                for name, make in provs.items():
                    fns = [make(s, kp, vp) for s in sets]
                    err = check(fns[0], sets[0], ref, kp, vp, Hkv, D, layout)
                    if not err <= (2e-2 if pool_dtype is None else 6e-2):
                        log(f"  {gname} T={T} {name}: FAILED check (rel err {err:.3g}); not timed")
                        continue
                    timed[name] = fns
                modes = []
                if cuda and T <= graph_max:
                    modes.append("graph")
                if T <= eager_max or not cuda or T > eager_above:
                    modes.append("eager")
                for mode in modes:
                    res = {}
                    for name, fns in timed.items():
                        try:
                            res[name] = clock.graph(fns) if mode == "graph" else clock.eager(fns)
                        except Exception as e:  # a provider that cannot be captured is reported, not fatal
                            log(f"  {gname} T={T} {name} {mode}: {type(e).__name__}: {e}")
                    copy_us = res["copy"][0] if "copy" in res else None
                    for name, (us, spread) in res.items():
                        eager_us = res.get("eager", (None,))[0] if name != "copy" else None
                        rows.append(Row(gname, layout, T, name, mode, us, spread, nbytes / us / 1e3,
                                        100 * copy_us / us if copy_us else None,
                                        eager_us / us if eager_us else None))
                del sets, bufs
                log(f"  {gname} {layout} T={T}: done")
                if save:
                    save(rows)
            del kp, vp
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def environment(device, dtype=None):
    """Versions, date and machine for a benchmark record (``dtype``: where one dtype runs throughout)."""
    env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
           "ropepool": ropepool.__version__, "device": str(device)}
    if dtype is not None:
        env["dtype"] = str(dtype).split(".")[-1]
    if device.type == "cuda":
        import triton

        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, triton=triton.__version__)
        fi = flashinfer_modules()
        env["flashinfer"] = getattr(fi, "__version__", None)
    else:
        env.update(cpu=cpu_name(), threads=torch.get_num_threads())
    return env


def main(argv=None):
    from rich.progress import Progress

    from . import Parser, alias, choosers, count, counts, names_of, out_file, out_paths, torch_device
    from .bench_report import plot, print_table, save_plot

    cuda_here = torch.cuda.is_available()
    p = Parser(prog="ropepool bench", description=__doc__.split("\n")[0])
    choosers(p, "bench")
    p.add_argument("--device", default="cuda" if cuda_here else "cpu", help="torch device (default: cuda if "
                   "available, else cpu)")
    p.add_argument("--geometries", type=names_of(GEOMETRIES, all_=True), default=None,
                   help="comma-separated from " + ", ".join(f"{k} ({q} q heads, {kv} KV heads, head_dim {d})"
                                                            for k, (q, kv, d) in GEOMETRIES.items()) +
                   ", or all (default: all on CUDA, llama3-8b on CPU)")
    p.add_argument("--tokens", type=counts, default=None, help="comma-separated tokens per call (default: "
                   f"{','.join(map(str, TOKENS))} on CUDA, 1,16,256,4096 on CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of q, k, v and the pools (default bfloat16)")
    p.add_argument("--threads", type=count, default=None,
                   help="torch CPU threads (default: 1 on CPU, as one decode worker; torch's own on CUDA)")
    p.add_argument("--pool-size", type=count, default=None, help="rows of each KV pool (default 262144 on CUDA, "
                   "65536 on CPU)")
    p.add_argument("--layouts", type=names_of(LAYOUTS), default="flat", help="comma-separated from flat, NHD "
                   "(paged, page_size 16), fp8 (flat float8_e4m3fn pool, scale 0.5)")
    alias(p, "--json", p.add_argument("--out", type=out_file, default=None,
                                      help="write the records to OUT.json and the plot beside them (OUT.png); OUT may "
                                           "end in .json"))
    a = p.parse_args(argv)
    device = torch_device(p, a.device)
    cuda = device.type == "cuda"
    if a.threads or not cuda:
        torch.set_num_threads(a.threads or 1)
    dtype = getattr(torch, a.dtype)
    geometries = a.geometries or (list(GEOMETRIES) if cuda else ["llama3-8b"])
    tokens = a.tokens or (TOKENS if cuda else (1, 16, 256, 4096))
    pool = a.pool_size or (262144 if cuda else 65536)
    if max(tokens) > pool:
        p.error(f"argument --tokens: {max(tokens)} tokens per call need a pool of at least as many rows; "
                f"--pool-size is {pool}")
    if "NHD" in a.layouts and pool % PAGE_SIZE:
        p.error(f"argument --pool-size: the NHD layout needs a multiple of its page size {PAGE_SIZE}; got {pool}")
    layouts = a.layouts
    json_path, png = out_paths(a.out) if a.out else (None, None)
    env = environment(device, dtype)

    def save(rows):
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)

    with Progress() as progress:
        task = progress.add_task("benchmarking", total=len(geometries) * len(layouts) * len(tokens))

        def step(what):
            if progress.tasks[0].description != "benchmarking":
                progress.advance(task)
            progress.update(task, description=what)

        rows = run(geometries, tokens, device, pool_size=pool, dtype=dtype, layouts=layouts, save=save, step=step,
                   log=progress.console.print, rotate_bytes=(256 << 20) if cuda else (8 << 20))
        progress.update(task, completed=len(geometries) * len(layouts) * len(tokens), description="done")
    print_table(rows, env)
    if json_path and rows:
        print(f"wrote {json_path}; {save_plot(plot, [asdict(r) for r in rows], env, png)}")
    return 0
