"""Counters of the fast paths taken, so that a test can see the path it is named for run.

A result that matches the oracle says nothing about which code produced it:
a fast path that is silently bypassed (its condition never true, an
exception swallowed into a fallback) gives the same numbers. So each fast
path counts itself, and its tests assert the count.

In a backend, one line where the fast path runs, and nowhere else::

    from . import paths
    ...
    paths.took("mlx.compiled")  # one call ran the compiled decode graph

(or, where a call costs only microseconds, ``_calls = paths.cell("torch_native.call")`` once and
``_calls[0] += 1`` there.)

Count in plain Python, outside traced or compiled code (there it would run
once per trace, not once per call), and only after the point where a fallback
can no longer take over, so that the count means the path did the work.

In a test::

    from ropepool.backends import paths

    with paths.counting() as seen:
        ropepool.rope_pool_fused(...)
    assert seen["mlx.compiled"] == 1

``seen`` is filled when the block ends: how many times each path ran inside
it (paths that did not run read 0). ``count(path)`` is the running total of
the process. A count is one dict update per call (tens of nanoseconds), so it
is always on.

Paths counted now (keep this list in step):

- ``mlx.compiled``: an MLX call ran the ``mx.compile``d decode graph;
- ``mlx.traced``: the Python of MLX's graph function ran: at every eager
  call, and once per trace of the compiled graph (so a compiled call that
  really reuses its graph does not add one).
- ``mlx.block_store``: an MLX call wrote block-quantized (tuple) pools (NVFP4, affine);
- ``torch_native.call``: a CPU call ran in one call of the native kernel (backends/torch_native.py).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

_COUNTS: Counter = Counter()
_CELLS: dict = {}  # path -> [count]: the paths counted through ``cell``


def took(path: str, n: int = 1) -> None:
    """Count ``n`` runs of the fast path ``path`` (a dotted name, ``"<backend>.<path>"``)."""
    _COUNTS[path] += n


def cell(path: str) -> list:
    """A one-element list counting ``path``, for a path whose whole call costs a few microseconds: ``cell[0] += 1``
    costs ~0.03 us where ``took`` costs ~0.17 (a function call and a Counter's item). Counted as ``took``'s."""
    return _CELLS.setdefault(path, [0])


def _counts() -> Counter:
    return _COUNTS + Counter({path: c[0] for path, c in _CELLS.items()})


def count(path: str) -> int:
    """How many times ``path`` has run in this process."""
    return _COUNTS[path] + _CELLS.get(path, (0,))[0]


@contextmanager
def counting() -> Iterator[Counter]:
    """A Counter that, when the block ends, holds how many times each path ran inside the block."""
    start = _counts()
    seen: Counter = Counter()
    try:
        yield seen
    finally:
        seen.update(_counts() - start)
