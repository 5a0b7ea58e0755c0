"""Which implementation takes a call: a registry of rows, each declaring what it takes as data.

A row names the backend (``backend=`` picks rows by it; the CPU lane and the
general torch code are both ``"torch"``), its framework, the module that
prepares a plan (``prepare(plan, tuning, fallback)`` -> an object whose
``bind(*arrays)`` gives the runner), the features it supports
(``plan.Plan.features``, declared in support.py), the device types it
is picked for automatically, and why it cannot run here (``why_not(q)``: not
installed, no device). A plan goes to the first row, in ``BACKENDS``' order,
whose framework and device fit and that ``fits`` the plan's features; a
row's ``fallback`` (another row's module) takes what its runner declines at
run time. ``ropepool env`` prints the reasons.

Features no row of a framework takes are refused while the call is checked
(checks/refusals.py), before anything is written.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

from ..errors import RopePoolError
from ..support import SUPPORT


@dataclass(frozen=True)
class Backend:
    name: str  # what backend= names
    framework: str
    module: str
    supports: frozenset
    apart: tuple = ()  # sets of features it does not take together
    devices: tuple | None = None  # device types it is picked for automatically (None: any)
    why_not: Callable[[object], str | None] = lambda q: None  # given q (None: in this process); None: can run
    fallback: str | None = None  # module of the row that runs what this row's runner declines

    def fits(self, features: frozenset) -> bool:
        """Whether the row takes a plan of ``features``: all of them, and no set it does not take together."""
        return features <= self.supports and not any(a <= features for a in self.apart)

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


def _row(name: str, module: str, **how) -> Backend:
    """A row whose framework and features are those ``support.SUPPORT`` declares for its module."""
    sup = SUPPORT[module]
    return Backend(name, sup.framework, module, sup.features, sup.apart, **how)


# In order of preference within a framework; what each takes: support.py.
BACKENDS = (
    _row("triton", ".triton_op", devices=("cuda",), why_not=_triton_why_not),
    # torch on CPU tensors: one call of the compiled kernel (backends/torch_native.py, ropepool/native); the
    # general torch code runs what it does not take (its fallback too, for layouts it declines at bind time).
    _row("torch", ".torch_native", devices=("cpu",), why_not=_native_why_not, fallback=".torch_eager"),
    _row("torch", ".torch_eager"),
    _row("mlx", ".mlx", why_not=_mlx_why_not),
)
NAMES = sorted({b.name for b in BACKENDS})


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
        if b.framework != framework or not b.fits(features):
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
        reason = reasons[0] if reasons else _not_taken(rows[-1], features)
        raise RopePoolError(f"backend {name!r} cannot run this call: {reason}. Fix: leave backend=None.")
    raise RopePoolError(f"no backend can run {framework} arrays here. Fix: see `ropepool env`.")


def _not_taken(b: Backend, features: frozenset) -> str:
    missing = features - b.supports
    if missing:
        return f"it does not take {sorted(missing)}"
    return f"it does not take {sorted(next(a for a in b.apart if a <= features))} together"
