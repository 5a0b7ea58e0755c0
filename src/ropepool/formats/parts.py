"""Checks shared by the formats kept as a tuple of arrays (the block-quantized pools): each part's last dim
and dtype, named by its place in the tuple."""
from __future__ import annotations

from ..core.dtypes import dtype_name
from ..errors import RopePoolError


def last_dim(name, i, part, parts, want, fix):
    """``name[i]`` (``parts[i]``: what it holds) must have a last dim of ``want``."""
    if part.ndim == 0 or part.shape[-1] != want:
        got = part.shape[-1] if part.ndim else "a scalar"
        raise RopePoolError(f"{name}[{i}] ({parts[i]}) must have a last dim of {want}; got {got}. Fix: {fix}.")


def dtype(name, i, part, parts, want):
    if dtype_name(part) != want:
        raise RopePoolError(f"{name}[{i}] ({parts[i]}) must have dtype {want}; got {dtype_name(part)}. "
                            f"Fix: allocate it as {want} (docs/layouts.md).")
