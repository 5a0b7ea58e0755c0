"""Which implementation takes a call: a small registry of data.

Each backend names its framework and can say why it cannot take a call
(``why_not``). ``pick`` chooses automatically (the fastest that can run) or
honours an explicit ``backend=`` and raises with the reason when it cannot.
``ropepool env`` prints the reasons.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

from ..errors import RopePoolError


@dataclass(frozen=True)
class Backend:
    name: str
    framework: str
    module: str  # holds prepare(call, tuning) -> an object whose bind(*arrays) gives the runner
    why_not: Callable[[object], str | None]  # given q; None when it can run

    def load(self):
        """The backend's module, imported on first use."""
        mod = _LOADED.get(self.module)
        if mod is None:
            mod = _LOADED[self.module] = importlib.import_module(self.module, __name__)
        return mod


_LOADED: dict = {}
_INSTALLED = {name: importlib.util.find_spec(name) is not None for name in ("triton", "mlx")}


def load_torch_backends() -> None:
    """Import the torch backends now, outside any traced code: torch.compile cannot trace an import,
    so a process whose first call is compiled needs them imported before (see ropepool/__init__.py)."""
    import torch

    # Triton only where it can run (CUDA, or its CPU interpreter): importing it costs ~0.8 s, most of a
    # CPU-only process's first call.
    triton = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    for b in BACKENDS:
        if b.framework == "torch" and b.why_not(None) is None and (triton or b.name != "triton"):
            b.load()


def _triton_why_not(q) -> str | None:
    if not _INSTALLED["triton"]:
        return "triton is not installed (pip install 'ropepool[cuda]')"
    if q is None or q.device.type == "cuda":
        return None
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"tensors are on {q.device}; the Triton kernel needs CUDA (or CPU with TRITON_INTERPRET=1)"


def _mlx_why_not(q) -> str | None:
    return None if _INSTALLED["mlx"] else "mlx is not installed (pip install 'ropepool[mlx]')"


# In order of preference within a framework.
BACKENDS = (
    Backend("triton", "torch", ".triton_op", _triton_why_not),
    Backend("torch", "torch", ".torch_eager", lambda q: None),
    Backend("mlx", "mlx", ".mlx", _mlx_why_not),
)
_BY_NAME = {b.name: b for b in BACKENDS}


def pick(framework: str, q, name: str | None = None) -> Backend:
    if name is not None:
        b = _BY_NAME.get(name)
        if b is None:
            raise RopePoolError(f"backend must be one of {sorted(_BY_NAME)} or None; got {name!r}. "
                                "Fix: leave backend=None to choose automatically.")
        if b.framework != framework:
            raise RopePoolError(f"backend {name!r} takes {b.framework} arrays; got {framework} arrays. "
                                "Fix: leave backend=None, or convert the arrays.")
        reason = b.why_not(q)
        if reason:
            raise RopePoolError(f"backend {name!r} cannot run this call: {reason}. Fix: leave backend=None.")
        return b
    for b in BACKENDS:
        # The interpreter is a correctness tool, never an automatic choice.
        if b.framework == framework and b.why_not(q) is None and not (b.name == "triton" and q.device.type != "cuda"):
            return b
    raise RopePoolError(f"no backend can run {framework} arrays here. Fix: see `ropepool env`.")
