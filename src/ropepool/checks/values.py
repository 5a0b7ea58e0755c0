"""Slot and position values: checked where that costs no device synchronisation.

On CPU tensors and MLX arrays every call checks them (a call that the CPU
kernel runs after its layout's first is checked by the kernel, which raises
through this module's messages: plan/cache.py); on CUDA only ``validate_slots``, called
explicitly, does (the kernel never writes outside the pool whatever they hold).
"""
from __future__ import annotations

import warnings

import numpy as np

from ..core.dtypes import INDEX_DTYPES, dtype_name, framework_of
from ..core.step import STEP
from ..errors import RopePoolError
from .arrays import check_ints

_PRECISE_POSITIONS = 2**24  # float32 holds every integer up to here: the precision promise's end
_FEW = 64  # up to here values are checked as Python ints (16 tokens: 3.5 us, NumPy 17); above, NumPy is faster


def _few_fine(positions, slots, pool_size: int, max_position: int | None) -> bool:
    """True when a few values pass every check (False: the full check below finds what is wrong).

    ``tolist`` reads a CPU tensor, an MLX or NumPy array without a conversion to NumPy
    (which, for a torch tensor, costs more than the check itself).
    """
    pos, slt = positions.tolist(), slots.tolist()
    if pos and isinstance(pos[0], list):  # [3, T] MRoPE positions
        pos = [p for row in pos for p in row]
    top = _PRECISE_POSITIONS if max_position is None else min(max_position - 1, _PRECISE_POSITIONS)
    if pos and (min(pos) < 0 or max(pos) > top):
        return False
    used = [s for s in slt if s >= 0]
    return not used or (max(used) < pool_size and len(set(used)) == len(used))


def check_values(positions, slots, pool_size: int, max_position: int | None = None) -> None:
    """Slots in ``[0, pool_size)`` or negative (skip), no slot twice, positions >= 0 (and in the table)."""
    step = STEP.holds(positions, slots) and ("checked", id(positions), id(slots), pool_size, max_position)
    if step and step in STEP.memo:
        return
    _check_values(positions, slots, pool_size, max_position)
    if step:
        STEP.memo[step] = True


def _check_values(positions, slots, pool_size: int, max_position: int | None = None) -> None:
    if slots.shape == (1,) and positions.shape == (1,):  # a decode call: two ints (1 us; _few_fine 3)
        (p,), (s,) = positions.tolist(), slots.tolist()
        if 0 <= p <= (_PRECISE_POSITIONS if max_position is None else min(max_position - 1, _PRECISE_POSITIONS)) \
                and s < pool_size:
            return
    elif slots.shape[-1] <= _FEW and _few_fine(positions, slots, pool_size, max_position):
        return
    pos = np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
    slt = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots)
    if pos.size and pos.min() < 0:
        t = np.unravel_index(int(np.argmax(pos < 0)), pos.shape)
        raise RopePoolError(f"positions must be >= 0; got positions[{_index(t)}] = {int(pos[t])}. "
                            "Fix: pass each token's position in its sequence (padding tokens: 0 and slot -1).")
    if max_position is not None and pos.size and pos.max() >= max_position:
        t = np.unravel_index(int(np.argmax(pos >= max_position)), pos.shape)
        raise RopePoolError(f"positions must be < the cos/sin table's max_position ({max_position}); got "
                            f"positions[{_index(t)}] = {int(pos[t])}. "
                            "Fix: build the table for the longest context served.")
    if pos.size and pos.max() > _PRECISE_POSITIONS:
        warnings.warn(f"positions above 2^24 = {_PRECISE_POSITIONS} (the largest given: {int(pos.max())}): "
                      "float32 no longer holds every position exactly, "
                      "so RoPE's precision promise ends there (docs/precision.md).", RuntimeWarning, stacklevel=3)
    used = slt[slt >= 0]
    if used.size and used.max() >= pool_size:
        t = int(np.argmax(slt >= pool_size))
        raise RopePoolError(f"slots must be < pool_size ({pool_size}); got slots[{t}] = {int(slt[t])}. "
                            "Fix: allocate slots inside the pool, or pass -1 to skip a token.")
    if used.size < 2:  # a decode step of one token: nothing to repeat (np.unique costs ~20 us)
        return
    uniq, counts = np.unique(used, return_counts=True)
    if uniq.size != used.size:
        s = int(uniq[counts > 1][0])
        raise RopePoolError(f"slots must be unique within a call; got slot {s} {int(counts[counts > 1][0])} times. "
                            "Fix: give each token its own slot (two tokens in one row race).")


def _index(t) -> str:
    """``3`` for [T] positions, ``1, 3`` for [3, T] ones: what goes between the brackets of a message."""
    return ", ".join(str(int(i)) for i in t)


def validate_slots(slots, pool_size: int, positions=None) -> None:
    """Check slot (and position) values on any device; synchronises with it.

    The CUDA fast path skips this check (it would wait for the GPU) and masks
    out-of-range slots instead; call this where a bad slot is a bug to catch.
    """
    (pool_size,) = check_ints(pool_size=pool_size)
    for name, x in (("slots", slots), ("positions", positions)):
        if x is None:
            continue
        if framework_of(x) is None:
            raise TypeError(f"validate_slots expects {name} as a torch.Tensor, mx.array or numpy.ndarray; got "
                            f"{type(x).__name__}. Fix: convert it.")
        if dtype_name(x) not in INDEX_DTYPES or x.ndim != 1 + (name == "positions" and x.ndim == 2):
            raise RopePoolError(f"validate_slots expects {name} as a 1-D int32 or int64 array; got "
                                f"{x.ndim}-D {dtype_name(x)}. Fix: pass the {name} given to rope_pool_fused.")
    check_values(slots[:0] if positions is None else positions, slots, pool_size)
