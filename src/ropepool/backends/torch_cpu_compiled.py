"""The CPU path's rotation as C++ that inductor (torch.compile) generates: one pass over x.

``torch_cpu`` rotates a block of tokens with five torch ops; inductor fuses the
same formula (upcast, ``x * cos + swap(x) * (-sin, sin)``, one rounding, the
store into the output) into one loop for q and k, 3-6x faster than the ops
from 256 tokens on (docs/benchmarks.md, CPU section), with the same results
bit for bit: each product is rounded, then the sum, as in the ops. It is
compiled once per process and dtype, dynamic in the token count (the first
call of a dtype costs a few seconds of compiling), and used from
``MIN_TOKENS`` tokens: below, the compiled call's own overhead (~50 us
measured) costs more than it saves.

``ROPEPOOL_CPU_COMPILE=off`` turns it off. Where compiling fails (no working
C++ compiler) the failure is reported once as a warning and the eager ops run.
"""
from __future__ import annotations

import os
import warnings

import torch

MIN_TOKENS = 16
_state = {"fn": None, "failed": False}


def _rotate(q, k, cos, sin, pair_dim: int, q_out, k_out):
    for x, out in ((q, q_out), (k, k_out)):
        xf = x.float()
        out.copy_(xf * cos + xf.flip(pair_dim) * sin)


def enabled() -> bool:
    return os.environ.get("ROPEPOOL_CPU_COMPILE", "on").lower() not in ("off", "0", "false") and not _state["failed"]


def rotate(q, k, cos, sin, pair_dim: int, q_out, k_out) -> bool:
    """``out = x * cos + swap(x) * sin`` for q and k (torch_cpu's shapes) in one compiled call; False where
    it cannot run (too few tokens, turned off, or compiling failed): the outputs are then the caller's."""
    if q.shape[0] < MIN_TOKENS or not enabled():
        return False
    try:
        if _state["fn"] is None:
            _state["fn"] = torch.compile(_rotate, dynamic=True)
        _state["fn"](q, k, cos, sin, pair_dim, q_out, k_out)
        return True
    except Exception as e:  # no compiler, a broken toolchain: the eager ops give the same numbers
        _state["failed"] = True
        warnings.warn(f"ropepool: inductor could not compile the CPU rotation ({type(e).__name__}: {e}); using "
                      "torch ops instead (slower from 256 tokens on). Set ROPEPOOL_CPU_COMPILE=off to skip "
                      "compiling.", RuntimeWarning, stacklevel=4)
        return False
