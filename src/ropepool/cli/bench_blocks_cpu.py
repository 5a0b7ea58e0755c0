"""The CPU (PyTorch) and MLX blocks, and the README's performance block that gathers every device.

CPU: ``ropepool bench`` records (process CPU time, one thread): eager PyTorch's time over ropepool's
per token count and dtype, paired within each run. MLX: ``ropepool bench --framework mlx`` records:
ropepool's time over the hand-written MLX code's, per geometry, dtype and token count.
"""
from __future__ import annotations

from ropepool.cli.bench_blocks import GPU, LEGEND, gpu_table, host_cost
from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, fmt_cell, fmt_x, sources, span

CPU_TOKENS = (1, 2, 4, 8, 16, 64, 256, 4096)
DTYPES = ("bfloat16", "float32")
MLX_GEOMETRIES = {"llama3-8b": "Llama-3-8B (32, 8, 128)", "llama70b-tp8": "(8, 1, 128)"}
MLX_TOKENS = (1, 16, 256, 4096)


def _cpu(provider, t, dtype) -> dict:
    return dict(device="cpu:", variant="flat", geometry="llama3-8b", provider=provider, mode="eager", tokens=t,
                dtype=dtype)


def cpu_ratio(recs: Records, t: int, dtype: str):
    return recs.ratio(_cpu("eager", t, dtype), _cpu("ropepool", t, dtype))


@block("cpu-summary")
def cpu_summary(recs: Records) -> str:
    lines = ["| T | " + " | ".join(f"{d}: ropepool µs | eager µs | eager / ropepool" for d in DTYPES) + " |",
             "| ---: |" + " ---: | ---: | ---: |" * len(DTYPES)]
    used = set()
    for t in CPU_TOKENS:
        cells = []
        for d in DTYPES:
            r = cpu_ratio(recs, t, d)
            cells += [fmt_cell(recs.cell(**_cpu(p, t, d))) for p in ("ropepool", "eager")] + [fmt_x(r)]
            used |= set(r.records) if r else set()
        lines.append(f"| {t:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + sources(used)


def _mlx(provider, g, t, dtype) -> dict:
    return dict(device="mlx-cpu:", variant="pool 65536", geometry=g, provider=provider, mode="eager", tokens=t,
                dtype=dtype)


def mlx_ratios(recs: Records, device: str):
    """{(geometry, dtype, T): Ratios} of ropepool over the hand-written code on one machine."""
    out = {}
    for g in MLX_GEOMETRIES:
        for d in DTYPES:
            for t in MLX_TOKENS:
                a, b = _mlx("ropepool", g, t, d), _mlx("hand", g, t, d)
                a["device"] = b["device"] = device
                r = recs.ratio(a, b)
                if r:
                    out[g, d, t] = r
    return out


def mlx_devices(recs: Records) -> list[str]:
    """MLX machines, the one with the newest record first."""
    newest = {}
    for k, runs in recs.by_key.items():
        if k.device.startswith("mlx-cpu:"):
            newest[k.device] = max(newest.get(k.device, ""), max(r.record.date for r in runs))
    return sorted(newest, key=lambda d: newest[d], reverse=True)


@block("mlx-summary")
def mlx_summary(recs: Records) -> str:
    """Per MLX machine: ropepool and the hand-written code per cell, and the T = 1 call's cost on a
    65,536-row pool over a 1,024-row pool (the donated pools: no copy of the pool)."""
    parts = []
    for device in mlx_devices(recs):
        rs = mlx_ratios(recs, device)
        lines = [f"{device.split(': ', 1)[1]}:", "",
                 "| geometry (Hq, Hkv, D) | dtype | T | ropepool µs | hand-written µs | ropepool / hand-written | "
                 "T = 1: 65,536 / 1,024 rows |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        used = {rec for r in rs.values() for rec in r.records}
        for g, label in MLX_GEOMETRIES.items():
            for d in DTYPES:
                for t in MLX_TOKENS:
                    mine, hand = (recs.cell(**dict(_mlx(p, g, t, d), device=device)) for p in ("ropepool", "hand"))
                    growth = recs.ratio(dict(_mlx("ropepool", g, t, d), device=device),
                                        dict(_mlx("ropepool", g, t, d), device=device, variant="pool 1024"))
                    lines.append(f"| {label} | {d} | {t:,} | {fmt_cell(mine)} | {fmt_cell(hand)} | "
                                 f"{fmt_x(rs.get((g, d, t)))} | {fmt_x(growth) if growth else ''} |")
        parts.append("\n".join(lines) + "\n\n" + sources(used))
    return "\n\n".join(parts)


def _mlx_line(recs: Records) -> str:
    devices = mlx_devices(recs)
    if not devices:
        return "MLX: not recorded."
    rs = mlx_ratios(recs, devices[0])
    used = {rec for r in rs.values() for rec in r.records}
    runs = max(len(r.values) for r in rs.values())
    return (f"On MLX's CPU backend ({devices[0].split(': ', 1)[1]}) a call takes "
            f"{span([r.median for r in rs.values()], lambda x: f'{x:.2f}')}x the time of the hand-written "
            f"`mx.fast.rope` code over {len(rs)} cells ({'one run' if runs == 1 else f'up to {runs} runs'}; "
            f"cells move by tens of percent between runs on this shared machine, so within ±20% is a tie; "
            f"[docs/mlx.md](docs/mlx.md)). {sources(used)}")


def _cpu_table(recs: Records) -> str:
    lines = ["| T | " + " | ".join(f"{d}: eager / ropepool" for d in DTYPES) + " |",
             "| ---: |" + " ---: |" * len(DTYPES)]
    used = set()
    for t in CPU_TOKENS:
        rs = [cpu_ratio(recs, t, d) for d in DTYPES]
        used |= {rec for r in rs if r for rec in r.records}
        lines.append(f"| {t:,} | " + " | ".join(fmt_x(r) for r in rs) + " |")
    return ("On a CPU (one thread, Llama-3-8B geometry, 65,536-row pool, process CPU time on a shared 2-core VM), "
            "eager PyTorch's time (transformers-style RoPE + `index_copy_`) over ropepool's, by tokens per call:\n\n"
            + "\n".join(lines) + "\n\n" + sources(used))


@block("readme-performance")
def readme_performance(recs: Records) -> str:
    table, used = gpu_table(recs)
    host, host_used = host_cost(recs)
    return "\n\n".join([
        f"Generated by `python -m ropepool.cli.bench_summary --write` from the records under docs/bench/ "
        f"([docs/benchmarks.md](docs/benchmarks.md) has the method and every table). {GPU}, bf16, pool of "
        f"262,144 slots:",
        table, LEGEND, sources(used),
        f"The host cost of an eager call from Python: {host} a bare Triton launch in the same process "
        f"(T = 1-256; the target was 1.2x). {sources(host_used)}",
        _mlx_line(recs), _cpu_table(recs)])


@block("cpu-layouts")
def cpu_layouts(recs: Records, dtype: str = "bfloat16") -> str:
    """ropepool beside eager PyTorch and torch.compile of the eager code, per pool layout (flat, fp8) and T:
    each time the median of the newest code's runs, each ratio paired within a run."""
    lines = ["| layout | T | ropepool µs | eager µs | torch.compile µs | eager / ropepool | torch.compile / ropepool |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    used = set()
    for layout in ("flat", "fp8"):
        for t in (1, 16, 256, 4096):
            key = {p: dict(_cpu(p, t, dtype), variant=layout) for p in ("ropepool", "eager", "compiled")}
            if recs.cell(**key["ropepool"]) is None:
                continue
            rs = [recs.ratio(key[p], key["ropepool"]) for p in ("eager", "compiled")]
            used |= {rec for r in rs if r for rec in r.records}
            lines.append(f"| {layout} | {t:,} | " + " | ".join(fmt_cell(recs.cell(**key[p])) for p in key) + " | "
                         + " | ".join(fmt_x(r) for r in rs) + " |")
    return "\n".join(lines) + "\n\n" + sources(used)
