"""Which implementation takes a call: a registry of rows, each declaring what it takes as data.

A row names the backend (``backend=`` picks rows by it; the CPU lane and the
general torch code are both ``"torch"``), its framework, the module that
prepares a plan (``prepare(plan, tuning, fallback)`` -> an object whose
``bind(*arrays)`` gives the runner), the features it supports
(``plan.Plan.features``), the device types it is picked for automatically,
and why it cannot run here (``why_not(q)``: not installed, no device). A
plan goes to the first row, in ``BACKENDS``' order, whose framework and
device fit and with ``plan.features <= row.supports``; a row's ``fallback``
(another row's module) takes what its runner declines at run time.
``ropepool env`` prints the reasons.

Features no row of a framework takes are refused while the call is checked,
with the row's own message (``refuse``), before anything is written.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

from ..checks.dtypes import FRAMEWORK_TYPES
from ..errors import RopePoolError

# Every feature a plan may use (plan.build): the rotation's, the stores' (stores.feature) and the torch call's.
ROTATION = frozenset({"norm", "mrope", "table", "longrope", "latent"})
STORES = frozenset({"pool.scaled", "pool.per_token_head", "q_out.scaled", "k_out.scaled"})
# Block-quantized (tuple) pools: the torch code, MLX and the Triton kernel, unless the call also has an fp8 k_out
# (the kernel quantizes k_rot as returned, read back from k_out) or is traced (the custom op has no tuples).
BLOCK = frozenset({"pool.nvfp4", "pool.affine", "pool.block.torch"})
DSA = frozenset({"pool.fp8_ds_mla", "pool.indexer", "pool.indexer_ue8m0", "pool.none"})  # DeepSeek V3.2's caches
TORCH = frozenset({"autograd", "traced"})  # q/k/v require grad; traced by torch.compile
LAYOUT = frozenset({"layout.amx"})  # tiled pools (checks/layout.py: TILED): vLLM's CPU AMX cache
ALL = ROTATION | STORES | BLOCK | DSA | TORCH | LAYOUT


def _functional(framework: str, feature: str, names: str = "", name: str = "") -> None:
    """The refusals of a functional framework (MLX; NumPy's oracle alike): what is written in place."""
    given = FRAMEWORK_TYPES[framework]
    if feature == "pool.per_token_head":
        raise TypeError(f"k_scale_cache/v_scale_cache are for torch tensors; got them with {given} inputs. Fix: drop "
                        "them (MLX calls are functional and return only the pools; per-token-head caches are a torch "
                        "feature, docs/mlx.md).")
    if feature == "out":
        raise TypeError(f"q_out/k_out are for torch tensors; got them with {given} inputs. Fix: drop {names} (MLX and "
                        "NumPy calls are functional).")
    if feature in LAYOUT:
        raise TypeError(f"kv_layout='amx' (vLLM's CPU AMX-packed cache) is for torch tensors; got {given} inputs. "
                        "Fix: pass torch tensors, or kv_layout='HND' for MLX pools (MLX has no strided views, "
                        "which the tiles are written through; docs/layouts.md).")
    if feature in DSA:
        raise TypeError(f"DeepSeek V3.2's caches (fp8_ds_mla rows, the indexer's keys) are for torch tensors; got "
                        f"{given} inputs. Fix: pass torch tensors (the formats are uint8 byte rows that the torch "
                        "backends write through views; MLX has no views, docs/layouts.md).")
    if feature in ("q_out.scaled", "k_out.scaled"):
        raise RopePoolError(f"{name} is for a float8 {name[0]}_out tensor; got {name} without one. Fix: drop {name} "
                            f"(fp8 outputs are torch tensors passed as {name[0]}_out).")


@dataclass(frozen=True)
class Backend:
    name: str  # what backend= names
    framework: str
    module: str
    supports: frozenset
    devices: tuple | None = None  # device types it is picked for automatically (None: any)
    why_not: Callable[[object], str | None] = lambda q: None  # given q (None: in this process); None: can run
    fallback: str | None = None  # module of the row that runs what this row's runner declines
    refuse: Callable | None = None  # (framework, feature, **names) raising a feature's message

    def load(self):
        """The backend's module, imported on first use."""
        return load(self.module)


def load(module: str):
    """A backend module (``.torch_eager``), imported on first use."""
    mod = _LOADED.get(module)
    if mod is None:
        mod = _LOADED[module] = importlib.import_module(module, __name__)
    return mod


_LOADED: dict = {}
_INSTALLED = {name: importlib.util.find_spec(name) is not None for name in ("triton", "mlx")}


def load_torch_backends() -> None:
    """Import the torch backends now, outside any traced code: torch.compile cannot trace an import,
    so a process whose first call is compiled needs them imported before (see ropepool/__init__.py)."""
    for b in BACKENDS:
        if b.framework == "torch" and b.why_not(None) is None:
            b.load()


def _triton_why_not(q) -> str | None:
    if not _INSTALLED["triton"]:
        return "triton is not installed (pip install 'ropepool[cuda]')"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if q is None:
        # Imported only where it can run (CUDA, or its CPU interpreter): importing triton costs ~0.8 s, most of
        # a CPU-only process's first call.
        import torch

        return None if torch.cuda.is_available() or interpret else "no CUDA device here"
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu" and interpret:
        return None
    return f"tensors are on {q.device}; the Triton kernel needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _native_why_not(q) -> str | None:
    if q is not None and q.device.type != "cpu":
        return f"tensors are on {q.device}, not the CPU"
    from .. import native  # (loads the kernel once: tvm-ffi, which imports torch)

    return native.why()


def _mlx_why_not(q) -> str | None:
    return None if _INSTALLED["mlx"] else "mlx is not installed (pip install 'ropepool[mlx]')"


# In order of preference within a framework.
BACKENDS = (
    Backend("triton", "torch", ".triton_op", ALL - {"pool.block.torch"}, ("cuda",), _triton_why_not),
    # torch on CPU tensors: one call of the compiled kernel (backends/torch_native.py, ropepool/native);
    # per-token-head caches, block-quantized and DeepSeek V3.2's caches, autograd and tracing stay on the
    # general torch code (its fallback too, for layouts it declines at bind time).
    Backend("torch", "torch", ".torch_native", ALL - {"pool.per_token_head"} - BLOCK - DSA - TORCH,
            ("cpu",), _native_why_not, fallback=".torch_eager"),
    Backend("torch", "torch", ".torch_eager", ALL),
    Backend("mlx", "mlx", ".mlx", ALL - {"pool.per_token_head", "q_out.scaled", "k_out.scaled"} - TORCH - DSA - LAYOUT,
            why_not=_mlx_why_not, refuse=_functional),
)
NAMES = sorted({b.name for b in BACKENDS})


def takes(framework: str, feature: str) -> bool:
    """Whether a row of ``framework`` takes ``feature`` (a framework without rows, NumPy's oracle: yes)."""
    rows = [b for b in BACKENDS if b.framework == framework]
    return not rows or any(feature in b.supports for b in rows)


def refuse(framework: str, feature: str, **names) -> None:
    """Raise the rows' message when no row of ``framework`` takes ``feature`` (``names``: the arguments'
    names for the message). NumPy's oracle is functional: outputs written in place are refused as MLX's are."""
    if not takes(framework, feature) or framework == "numpy" and feature in ("out", "q_out.scaled", "k_out.scaled"):
        for b in BACKENDS:
            if b.refuse is not None and (b.framework == framework or framework == "numpy"):
                b.refuse(framework, feature, **names)


def pick(framework: str, q, name: str | None = None, features: frozenset = frozenset()) -> Backend:
    """The row that runs a plan of ``features`` on arrays like ``q``: ``name``'s, or the first that fits."""
    if name is not None and name not in NAMES:
        raise RopePoolError(f"backend must be one of {NAMES} or None; got {name!r}. "
                            "Fix: leave backend=None to choose automatically.")
    rows = [b for b in BACKENDS if (name is None or b.name == name)]
    if name is not None and all(b.framework != framework for b in rows):
        raise RopePoolError(f"backend {name!r} takes {rows[0].framework} arrays; got {framework} arrays. "
                            "Fix: leave backend=None, or convert the arrays.")
    reasons = []
    for b in rows:
        if b.framework != framework or not features <= b.supports:
            continue
        # Automatically, only on the devices the row is for (the Triton interpreter is a correctness tool).
        if name is None and b.devices is not None and getattr(q, "device", None) is not None and \
                q.device.type not in b.devices:
            continue
        reason = b.why_not(q)
        if reason is None:
            return b
        reasons.append(reason)
    if name is not None:
        reason = reasons[0] if reasons else f"it does not take {sorted(features - rows[-1].supports)}"
        raise RopePoolError(f"backend {name!r} cannot run this call: {reason}. Fix: leave backend=None.")
    raise RopePoolError(f"no backend can run {framework} arrays here. Fix: see `ropepool env`.")
