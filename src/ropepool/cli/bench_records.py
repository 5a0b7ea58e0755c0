"""The benchmark records under ``docs/bench/``, read as cells of runs.

Every JSON record there is one run of one harness: ``ropepool bench`` / ``benchmarks/bench.py``
(``rows`` with a ``layout``), ``benchmarks/features.py`` (``rows`` with a ``feature``), the peers
harness kept outside the repository (docs/benchmarks.md says what it ran; ``config`` + ``rows`` with
``shape``/``impl``), its Qwen3 QK-norm anchor (``rows`` with ``shape``, no ``config``),
``ropepool bench --framework mlx`` (``records``) and the host-cost runs (``host_rows``). Each row becomes a
``Run`` under a ``Key``: (device, variant, geometry, provider, mode, tokens, dtype). Records of the
same cell join it, so a record added later (a new file, never an overwrite) is picked up without any
code change.

Which code a record measured: ``env.commit`` where the record carries it (and it is in this history), else
the commit ``docs/bench/provenance.json`` gives for it, else the last commit that wrote
the file; either is mapped to the last commit at or before it that touched the
device's code paths (``CODE_PATHS``). Two records measured the same code when those files' syntax
trees, docstrings left out, are equal (``code_id``). A cell reports the runs of the code of its
newest record (``Cell.runs``); runs on other code stay as history (``Cell.history``). A row whose
code differs in the working tree (``Record.later``) says so (†; ``git log <commit>..HEAD --
<CODE_PATHS>`` lists the changes).
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import hashlib
import json
import statistics
import subprocess
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "docs" / "bench"

# The code each device's figures depend on: the kernel and its launcher, the CPU path, the MLX path, each
# with the backend modules it computes with (the shared array math, the framework's array adapter, the
# quantized stores). A commit touching one of these makes older rows stale. (The shared host path,
# api/plan/validate, and the path counters are left out on purpose: their commits are mostly messages and
# docstrings, and would mark every row.)
CODE_PATHS = {
    "gpu": ["src/ropepool/backends/triton_kernel.py", "src/ropepool/backends/triton_op.py",
            "src/ropepool/backends/triton_launch.py", "src/ropepool/backends/triton_stores.py",
            "src/ropepool/backends/triton_native.py", "src/ropepool/native/triton_launch.cc",
            "src/ropepool/native/layout.h", "src/ropepool/core/args.py", "src/ropepool/backends/torch_arrays.py",
            "src/ropepool/backends/arraymath.py"],
    # (the torch_cpu*.py modules: the CPU path before the native kernel, listed so that records of their code
    # keep telling their commits apart)
    "cpu": ["src/ropepool/native/rope_kernel.h", "src/ropepool/native/convert.h", "src/ropepool/native/layout.h",
            "src/ropepool/native/rope_ffi.cc", "src/ropepool/native/rope_py.cc",
            "src/ropepool/backends/torch_native.py", "src/ropepool/backends/torch_eager.py",
            "src/ropepool/backends/torch_cpu.py", "src/ropepool/backends/torch_cpu_compiled.py",
            "src/ropepool/backends/torch_cpu_one_token.py", "src/ropepool/backends/torch_cpu_norm.py",
            "src/ropepool/backends/arraymath.py", "src/ropepool/backends/torch_arrays.py",
            "src/ropepool/backends/dsa_store.py", "src/ropepool/formats/nvfp4.py", "src/ropepool/formats/affine.py",
            "src/ropepool/formats/fp8_ds_mla.py", "src/ropepool/formats/indexer.py", "src/ropepool/formats/e4m3.py",
            "src/ropepool/formats/per_token_head.py"],
    # (backends/blockquant.py: the block formats' array math before formats/)
    "mlx": ["src/ropepool/backends/mlx.py", "src/ropepool/backends/arraymath.py",
            "src/ropepool/backends/mlx_arrays.py", "src/ropepool/backends/blockquant.py",
            "src/ropepool/formats/nvfp4.py", "src/ropepool/formats/affine.py"],
}
# A serving run (``ropepool demo``'s records) measures the device's path and the transformers integration
# that calls it in the serving step.
_TRANSFORMERS = [f"src/ropepool/integrations/transformers/{name}.py" for name in
                 ("__init__", "attention", "latent", "model", "paged")]
CODE_PATHS["serving"] = CODE_PATHS["cpu"] + _TRANSFORMERS
CODE_PATHS["gpu-serving"] = CODE_PATHS["gpu"] + _TRANSFORMERS

# Rows that a record holds but that must not be read, with the reason (docs/benchmarks.md says why).
EXCLUDED = {
    ("h200-2026-12-03-features.json", "mla"): "measured on MLA code with the output-stride bug, fixed after",
}

# The peers harness and its anchor name their rows differently from bench.py / features.py.
_PROVIDER = {"roofline": "copy", "fused_ropepool": "ropepool_norm", "unfused_ropepool": "rms_norm+ropepool",
             "hand-written": "hand"}
_MODE = {"loop": "eager"}


class Key(NamedTuple):
    device: str     # "NVIDIA H200", "cpu: <model>, 1 thread", "mlx-cpu: <machine>"
    variant: str    # pool layout ("flat", "NHD", "fp8") or feature ("table", "qknorm", "mla", ...)
    geometry: str
    provider: str   # "ropepool", "copy", "flashinfer", "eager", ...
    mode: str       # "graph" (CUDA-graph replay) or "eager" (back-to-back calls)
    tokens: int
    dtype: str


def _stripped(src: str) -> str:
    """The syntax tree of ``src`` without docstrings (comments are not in it)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:  # the kernel's C++: as text, without the trailing newline `git show` drops
        return src.strip()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.lru_cache(maxsize=None)
def code_id(commit: str | None, kind: str) -> str:
    """A digest of the ``kind`` device's CODE_PATHS at ``commit`` (None: the working tree), docstrings
    and comments left out."""
    parts = []
    for path in CODE_PATHS[kind]:
        if commit is None:
            src = (ROOT / path).read_text() if (ROOT / path).exists() else None
        else:
            src = _git("show", f"{commit}:{path}")
        parts.append("absent" if src is None else _stripped(src))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def _git(*args) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@dataclass(frozen=True)
class Record:
    file: str
    kind: str          # "gpu", "cpu", "mlx", "serving" or "gpu-serving": which CODE_PATHS apply
    device: str
    date: str
    versions: str
    note: str | None
    stated_commit: str | None = field(default=None, repr=False)

    @cached_property
    def commit(self) -> str | None:
        """The last commit to this device's code at or before the measured (or writing) commit."""
        at = self.stated_commit
        # Only a commit of this history counts (a branch's commit that was rebased away does not exist
        # in a clone, and the docs must read the same there).
        if at is None or _git("merge-base", "--is-ancestor", at, "HEAD") is None:
            # the last commit to the file: its content, where an earlier stop overwrote a record in place
            at = _git("log", "--format=%H", "-1", "--", f"docs/bench/{self.file}")
        if not at:
            return None
        return _git("log", "-1", "--format=%h", at, "--", *CODE_PATHS[self.kind]) or None

    @cached_property
    def order(self) -> int:
        """How far down the history the measured code lies (more is newer)."""
        n = _git("rev-list", "--count", self.commit) if self.commit else None
        return int(n) if n else -1

    @cached_property
    def code(self) -> str:
        """What the measured code is: its CODE_PATHS as syntax trees without docstrings (records whose
        code differs only in comments and docstrings measured the same code)."""
        return code_id(self.commit, self.kind) if self.commit else f"unknown: {self.file}"

    @property
    def later(self) -> bool:
        """Whether this device's code in the working tree differs from the measured code."""
        return self.code != code_id(None, self.kind)

    def source(self) -> str:
        """'file (date, code commit)', and whether that code was changed since."""
        commit = self.commit or "commit not known"
        # Whether, not how often: the text then changes only when a fresh record first goes stale.
        stale = "; its code changed since †" if self.later else ""
        return f"`{self.file}` ({self.date}, {commit}{stale})"


class Run(NamedTuple):
    record: Record
    key: Key
    us: float


def _versions(env, names) -> str:
    return ", ".join(f"{n} {env[n]}" for n in names if env.get(n))


def _provenance(root: Path) -> dict:
    path = root / "provenance.json"
    return json.loads(path.read_text())["records"] if path.exists() else {}


def _record(path: Path, env, kind, device, names) -> Record:
    date = env.get("date") or "-".join(path.stem.split("-")[1:4])
    commit, pinned = env.get("commit"), _provenance(path.parent).get(path.name, {}).get("commit")
    if pinned and (commit is None or _git("merge-base", "--is-ancestor", commit, "HEAD") is None):
        commit = pinned  # env.commit absent, or rebased away: the commit provenance.json gives
    return Record(path.name, kind, device, date, _versions(env, names), env.get("note"), commit)


_GPU_VERSIONS = ("torch", "triton", "flashinfer", "python")


def _bench_rows(path, d):
    env = d["env"]
    cuda = str(env.get("device", "")).startswith("cuda")
    if cuda:
        rec = _record(path, env, "gpu", env.get("gpu", "cuda"), _GPU_VERSIONS)
    else:
        rec = _record(path, env, "cpu", f"cpu: {env.get('cpu')}, {env.get('threads')} thread(s)",
                      ("torch", "python", "ropepool"))
    dtype = env.get("dtype") or "bfloat16"
    for r in d["rows"]:
        variant = r.get("feature") or r["layout"]
        yield rec, Key(rec.device, variant, r["geometry"], r["provider"], r["mode"], r["tokens"], dtype), r["us"]


def _peer_rows(path, d):
    env = dict(d["env"], flashinfer=d["env"].get("flashinfer"))
    rec = _record(path, env, "gpu", env["gpu"], _GPU_VERSIONS)
    variant = "flat" if "config" in d else "qknorm"
    for r in d["rows"]:
        if isinstance(r.get("check"), dict) and not r["check"].get("pass"):
            continue
        prov = _PROVIDER.get(r["impl"], r["impl"])
        yield rec, Key(rec.device, variant, r["shape"], prov, _MODE.get(r["mode"], r["mode"]), r["T"],
                       "bfloat16"), r["us"]


def _mlx_rows(path, d):
    env = d["env"]
    rec = _record(path, env, "mlx", f"mlx-cpu: {env['machine']}", ("mlx", "numpy", "python", "ropepool"))
    for r in d["records"]:
        prov = _PROVIDER.get(r["provider"], r["provider"])
        yield rec, Key(rec.device, f"pool {r['pool_rows']}", r["geometry"], prov, "eager", r["tokens"],
                       r["dtype"]), r["median_us"]


def _host_rows(path, d):
    env = d["env"]
    rec = _record(path, env, "gpu", env["gpu"], ("torch", "triton", "python"))
    for r in d["host_rows"]:
        yield rec, Key(rec.device, f"host {r['pinned']}", r["geometry"], r["provider"], "eager", r["tokens"],
                       "bfloat16"), r["us"]


def _rows(path: Path, d: dict):
    """The (record, key, µs) of a record of a known harness; none for any other record (a block reads
    those itself through ``Records.other``)."""
    if "host_rows" in d:
        return _host_rows(path, d)
    if "records" in d and "summary" in d:
        return _mlx_rows(path, d)
    if not d.get("rows") or not isinstance(d.get("env"), dict):
        return ()
    if "shape" in d["rows"][0]:
        return _peer_rows(path, d)
    return _bench_rows(path, d)


def describe(path: Path, d: dict) -> Record:
    """A record of any harness as a Record: its env's device (gpu, cpu or machine), versions, date,
    commit and note; kind "gpu" with a ``gpu`` field, "mlx" with an ``mlx`` version, "serving" for a CPU demo
    run (``demo`` rows; "gpu-serving" on a GPU), else "cpu"."""
    env = d.get("env", {})
    serving = "demo" in d
    if env.get("gpu"):
        kind = "gpu-serving" if serving else "gpu"
    else:
        kind = "mlx" if env.get("mlx") else "serving" if serving else "cpu"
    device = env.get("gpu") or env.get("machine") or env.get("cpu") or "device not recorded"
    return _record(path, env, kind, device, ("torch", "triton", "vllm", "sglang", "transformers", "mlx", "python"))


@dataclass
class Cell:
    """The runs of one key: those of the newest code measured on the newest record's device (a device
    prefix such as "NVIDIA H" matches two cards: a cell never mixes them), and the others as history."""
    runs: list[Run]
    history: list[Run]

    @property
    def us(self) -> float:
        return statistics.median(r.us for r in self.runs)

    @property
    def records(self) -> list[Record]:
        return sorted({r.record for r in self.runs}, key=lambda rec: rec.file)


class Records:
    """Every run under ``docs/bench`` (or ``root``), by key."""

    def __init__(self, root: Path = BENCH):
        self.root = Path(root)
        self.by_key: dict[Key, list[Run]] = {}
        self.other: dict[str, tuple[Record, dict]] = {}  # records of other harnesses, by file name
        for path in sorted(p for p in self.root.glob("*.json") if p.name != "provenance.json"):
            d = json.loads(path.read_text())
            rows = list(_rows(path, d))
            if not rows:
                self.other[path.name] = (describe(path, d), d)
            for rec, key, us in rows:
                if (rec.file, key.variant) in EXCLUDED:
                    continue
                self.by_key.setdefault(key, []).append(Run(rec, key, us))

    def others(self, pattern: str) -> list[tuple[Record, dict]]:
        """The records of other harnesses (engine runs, demos, soaks) whose file name matches the glob
        ``pattern``, oldest first: a block reads their JSON itself and cites the Records."""
        return [self.other[f] for f in sorted(self.other) if fnmatch.fnmatch(f, pattern)]

    def cell(self, **want) -> Cell | None:
        """The cell whose key has these fields (``device`` may be a prefix); None if never measured.
        Several keys match only when a field is left out: their runs join."""
        device = want.pop("device", "")
        runs = [r for k, rs in self.by_key.items() if k.device.startswith(device)
                and all(getattr(k, f) == v for f, v in want.items()) for r in rs]
        if not runs:
            return None
        newest = max(runs, key=lambda r: r.record.order).record
        now = [r for r in runs if (r.record.code, r.record.device) == (newest.code, newest.device)]
        return Cell(now, [r for r in runs if r not in now])

    def ratio(self, num: dict, den: dict) -> Ratios | None:
        """num / den of two cells, paired within each record of the newest code that holds both."""
        a, b = self.cell(**num), self.cell(**den)
        if a is None or b is None:
            return None
        bs = {}
        for r in b.runs + b.history:
            bs.setdefault(r.record, []).append(r.us)
        pairs = [(r.record, r.us / statistics.median(bs[r.record])) for r in a.runs + a.history if r.record in bs]
        if not pairs:
            return None
        newest = max(pairs, key=lambda p: p[0].order)[0]
        return Ratios([(rec, x) for rec, x in pairs if (rec.code, rec.device) == (newest.code, newest.device)])


@dataclass
class Ratios:
    pairs: list[tuple[Record, float]]

    @property
    def values(self) -> list[float]:
        return [x for _, x in self.pairs]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def records(self) -> list[Record]:
        return sorted({rec for rec, _ in self.pairs}, key=lambda rec: rec.file)
