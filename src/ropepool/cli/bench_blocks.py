"""The performance blocks of the docs, one device after another: the GPU (H100 and H200 records), the CPU
(PyTorch) and MLX.

GPU: one row per op and geometry, from the newest record of either Hopper card (each row names its card). A
row gives the op's % of a device copy of its bytes at T = 16,384 and 65,536, its µs at T = 1, 16 and 64 under
CUDA-graph replay, and each peer's time over ropepool's across every T where both ran (below 1.00x the peer
was faster). Each figure is the median of the runs of the newest code that measured the cell; see
``bench_records`` for what a cell is.

CPU: ``ropepool bench`` records (process CPU time, one thread): eager PyTorch's time over ropepool's
per token count and dtype, paired within each run. MLX: ``ropepool bench --framework mlx`` records:
ropepool's time over the hand-written MLX code's, per geometry, dtype and token count. The README's
short table is ``bench_blocks_runs.headline``, built from these.
"""
from __future__ import annotations

from dataclasses import dataclass

from ropepool.cli.bench_records import Records
from ropepool.cli.bench_summary import block, fmt_cell, fmt_num, fmt_pct, fmt_x, sources, span

GPU = "NVIDIA H"  # either Hopper card, H100 or H200: a row names the card of its records
LARGE = (16384, 65536)
SMALL = (1, 16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Op:
    label: str
    variant: str
    geometry: str
    subject: str = "ropepool"
    peers: tuple[str, ...] = ()


NAMES = {"flashinfer": "FlashInfer", "flashinfer_fused": "FlashInfer fused", "flashinfer_fused_1req":
         "FlashInfer fused (one request)", "flashinfer_cake": "FlashInfer fused norm", "compiled": "torch.compile",
         "eager": "eager PyTorch", "vllm": "vLLM native", "rms_norm+ropepool": "rms_norm + ropepool",
         "ropepool": "the RopeSpec path"}
PLAIN_PEERS = ("flashinfer", "flashinfer_fused", "flashinfer_fused_1req", "compiled", "eager")
NORM_PEERS = ("flashinfer_cake", "rms_norm+ropepool", "compiled")
MLA_PEERS = ("flashinfer", "vllm", "compiled")
OPS = (
    Op("plain, Llama-3-8B (32, 8)", "flat", "llama3-8b", peers=PLAIN_PEERS),
    Op("plain, Llama-70B TP-8 (8, 1)", "flat", "llama70b-tp8", peers=PLAIN_PEERS),
    Op("plain, (64, 8)", "flat", "h64-kv8", peers=PLAIN_PEERS),
    Op("engine cos/sin table, Llama-3-8B", "table", "llama3-8b", "ropepool_table", ("flashinfer", "ropepool")),
    Op("no RoPE (rotary_dim 0), Llama-3-8B", "table", "llama3-8b-nope"),
    Op("MRoPE, Qwen2.5-VL-7B (28, 4)", "mrope", "qwen2.5-vl-7b", peers=("vllm", "compiled")),
    Op("MRoPE, Qwen3-VL-8B (32, 8)", "mrope", "qwen3-vl-8b", peers=("vllm", "compiled")),
    Op("QK-norm, Qwen3-32B TP-8 (8, 1)", "qknorm", "qwen3-32b-tp8", "ropepool_norm", NORM_PEERS),
    Op("QK-norm, Qwen3-8B (32, 8)", "qknorm", "qwen3-8b", "ropepool_norm", NORM_PEERS),
    Op("QK-norm, Qwen3-32B (64, 8)", "qknorm", "qwen3-32b", "ropepool_norm", NORM_PEERS),
    Op("QK-norm, Gemma 3 12B (16, 8, 256)", "qknorm", "gemma3-12b", "ropepool_norm", NORM_PEERS),
    Op("MLA latent, DeepSeek-V3 (128 heads), bf16", "mla", "dsv3-bf16", peers=MLA_PEERS),
    Op("MLA latent, DeepSeek-V3 TP-8 (16), bf16", "mla", "dsv3-tp8-bf16", peers=MLA_PEERS),
    Op("MLA latent, DeepSeek-V3 (128), fp8 cache", "mla", "dsv3-fp8", peers=MLA_PEERS),
    Op("MLA latent, DeepSeek-V3 TP-8 (16), fp8 cache", "mla", "dsv3-tp8-fp8", peers=MLA_PEERS),
    Op("fp8 q out + fp8 cache, Llama-3-8B", "fp8q", "llama3-8b", peers=("flashinfer",)),
    Op("per-token-head int8 cache, Llama-3-8B", "pth", "llama3-8b-int8"),
    Op("per-token-head fp8 cache, Llama-3-8B", "pth", "llama3-8b-float8_e4m3fn"),
)


def _key(op: Op, provider: str, mode: str, tokens: int) -> dict:
    return dict(device=GPU, variant=op.variant, geometry=op.geometry, provider=provider, mode=mode, tokens=tokens,
                dtype="bfloat16")


def mode_at(recs: Records, op: Op, tokens: int) -> str | None:
    """The mode to quote at ``tokens``: the one measured on the newest code; graph replay on a tie."""
    best = None
    for mode in ("graph", "eager"):
        cell = recs.cell(**_key(op, op.subject, mode, tokens))
        if cell is not None and (best is None or cell.runs[0].record.order > best[1]):
            best = (mode, cell.runs[0].record.order)
    return best and best[0]


@dataclass
class Row:
    op: Op
    pct: list[str]          # % of copy at LARGE
    small: list[str]        # µs under graph replay at SMALL
    peers: list[str]        # "peer a-bx"
    slower: list[str]       # "peer at T = n (0.97x)": where a peer was faster
    records: set


def row(recs: Records, op: Op) -> Row:
    used = set()
    pct = []
    for t in LARGE:
        mode = mode_at(recs, op, t)
        r = mode and recs.ratio(_key(op, "copy", mode, t), _key(op, op.subject, mode, t))
        pct.append(fmt_pct(r) + (" (eager)" if r and mode == "eager" else ""))
        used |= set(r.records) if r else set()
    small = []
    for t in SMALL:
        c = recs.cell(**_key(op, op.subject, "graph", t))
        small.append(fmt_num(c.us) if c else "-")
        used |= set(c.records) if c else set()
    peers, slower = [], []
    for peer in op.peers:
        xs = []
        for t in TOKENS:
            mode = mode_at(recs, op, t)
            r = mode and recs.ratio(_key(op, peer, mode, t), _key(op, op.subject, mode, t))
            if r:
                xs.append(r.median)
                used |= set(r.records)
                if r.median < 1 and not peer.startswith("ropepool"):
                    slower.append(f"{NAMES[peer]} at T = {t:,} ({r.median:.{3 if r.median > 0.995 else 2}f}x)")
        if xs:
            peers.append(f"{NAMES[peer]} {span(xs, lambda x: f'{x:.2f}')}x")
    return Row(op, pct, small, peers, slower, used)


def card(records) -> str:
    """The cards of these records, short ("H100", "H200")."""
    return " / ".join(sorted({r.device.removeprefix("NVIDIA ").split()[0] for r in records})) or "-"


def _measured(records) -> str:
    return ", ".join(sorted({f"{card([r])} {r.date} {r.commit or '?'}" + (" †" if r.later else "")
                             for r in records}))


def gpu_table(recs: Records) -> tuple[str, set]:
    lines = ["| op | % of copy, T = 16,384 / 65,536 | µs, T = 1 / 16 / 64 (graph) | peer's time / ropepool's, "
             "over T | measured (card, code) |",
             "| --- | --- | --- | --- | --- |"]
    used, slower = set(), []
    for op in OPS:
        r = row(recs, op)
        used |= r.records
        slower += [f"{op.label}: {s}" for s in r.slower]
        lines.append(f"| {op.label} | {' / '.join(r.pct)} | {' / '.join(r.small)} | {'; '.join(r.peers) or '-'} | "
                     f"{_measured(r.records)} |")
    text = "\n".join(lines)
    text += "\n\nA peer faster than ropepool: " + ("; ".join(slower) if slower else "none") + "."
    return text, used


LEGEND = ("Each figure is the median of the recorded runs of the newest code that measured it (min-max and run "
          "count where there are several). % of copy: a device-to-device copy of the op's bytes timed in the "
          "same run, over the op's time, under CUDA-graph replay unless marked eager (back-to-back calls; "
          "at T = 16,384 a small geometry's eager call can be host-bound). † the code was changed after "
          "the run (`git log <commit>..HEAD` over the device's code paths lists the changes).")


@block("gpu-summary")
def gpu_summary(recs: Records) -> str:
    table, used = gpu_table(recs)
    return f"{table}\n\n{LEGEND}\n\n{sources(used)}"


def host_cost(recs: Records) -> tuple[str, set]:
    """The eager call's host cost over a bare Triton launch, from the newest host run (its card and code: runs
    of other cards or code, pinned differently, are left out)."""
    pairs = []
    for pin in ("CPU 5", "CPU 9", "none"):
        for t in (1, 16, 64, 256):
            r = recs.ratio(dict(device=GPU, variant=f"host {pin}", provider="after", tokens=t),
                           dict(device=GPU, variant=f"host {pin}", provider="bare", tokens=0))
            pairs += r.pairs if r else []
    if not pairs:
        return "not recorded", set()
    newest = max(pairs, key=lambda p: p[0].order)[0]
    pairs = [(rec, x) for rec, x in pairs if (rec.device, rec.code) == (newest.device, newest.code)]
    return f"{span([x for _, x in pairs], lambda x: f'{x:.2f}')}x", {rec for rec, _ in pairs}


# --- CPU and MLX --------------------------------------------------------------
CPU_TOKENS = (1, 16, 256, 4096)  # the sizes the CPU records of the native kernel measure (prefill and decode)
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


@block("cpu-layouts")
def cpu_layouts(recs: Records, dtype: str = "bfloat16") -> str:
    """ropepool beside eager PyTorch and torch.compile of the eager code, per pool layout (flat, NHD, fp8) and T:
    each time the median of the newest code's runs, each ratio paired within a run."""
    lines = ["| layout | T | ropepool µs | eager µs | torch.compile µs | eager / ropepool | torch.compile / ropepool |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    used = set()
    for layout in ("flat", "NHD", "fp8"):
        for t in (1, 16, 256, 4096):
            key = {p: dict(_cpu(p, t, dtype), variant=layout) for p in ("ropepool", "eager", "compiled")}
            if recs.cell(**key["ropepool"]) is None:
                continue
            rs = [recs.ratio(key[p], key["ropepool"]) for p in ("eager", "compiled")]
            used |= {rec for r in rs if r for rec in r.records}
            lines.append(f"| {layout} | {t:,} | " + " | ".join(fmt_cell(recs.cell(**key[p])) for p in key) + " | "
                         + " | ".join(fmt_x(r) for r in rs) + " |")
    return "\n".join(lines) + "\n\n" + sources(used)
