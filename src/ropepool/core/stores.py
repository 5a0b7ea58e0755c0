"""How each destination of a call stores its rows: one ``Store`` record per destination.

A call writes four destinations (``DESTINATIONS``): the k pool, the v pool, q_out and k_out. Each is
described by one ``Store``: its ``format`` (an entry of ``FORMATS``, or the ``NAME`` of a format
module under formats/), the element it holds, the saturation bound of a quantized format and the
scale it reads (a float or array, or a per-token-head scale cache held weakly). Validation makes the
stores (``checks.validate.Call.stores``); the plan turns each non-plain one into a feature
(``"pool.scaled"``, ``"q_out.scaled"``, ...) that a backend must declare to be picked
(``backends.BACKENDS``); the backends read ``store.qmax``, ``store.scale``, ``store.scale_cache``
instead of per-format fields.

A cache format is one module, formats/<name>.py (formats/__init__.py says
what it names: what it means, the backend rows that write it, its check, its
oracle rows, its array-op store), plus its pieces of the kernels' stores
(backends/triton_stores.py) where the Triton row is among its ``BACKENDS``.
The formats below are the older ones, still checked and written in place by
checks/pools.py and each backend.

No argument order changes anywhere else: the MLX graph cache is keyed by
``plan.Plan.key``, which reads each store's ``key``, and the Triton kernel's
variants by the constexprs the launcher derives from the plan's features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

DESTINATIONS = ("k_pool", "v_pool", "q_out", "k_out")

# format -> what a destination of that format stores (docs/layouts.md has the layouts).
FORMATS = {
    "plain": "the rows in the destination's dtype (q's, or a new array of it)",
    "scaled": "row / scale, saturated to +-qmax (fp8 pools and outputs; scale a float, one element or one per head)",
    "none": "nothing: the call has no such destination (the indexer's key has no value)",
}


@dataclass(frozen=True, eq=False)
class Store:
    """One destination's storage. ``element``: the quantized element's name ("float8_e4m3fn", "int8"; MLX's
    uint8 pools hold e4m3) or None for plain; ``qmax``: its saturation bound (0.0 for plain)."""

    format: str = "plain"
    element: str | None = None
    qmax: float = 0.0
    scale: Any = None  # "scaled": a float, or an array of one element or one per KV head
    scale_ref: Any = None  # "per_token_head": weakref.ref to the scale cache
    bits: int = 0  # "nvfp4", "affine": the width of a code
    group: int = 0  # "nvfp4", "affine": values per scale (NVFP4's block of 16; the affine group size)

    @property
    def quantized(self) -> bool:
        return self.format != "plain"

    @property
    def integer(self) -> bool:
        """Whether stored values are truncated toward zero (int8 elements)."""
        return self.element == "int8"

    @property
    def scale_cache(self):
        """The caller's per-token-head scale cache (None without one, or once the caller dropped it)."""
        return None if self.scale_ref is None else self.scale_ref()

    @property
    def key(self) -> tuple:
        """What compiled code reads of this store: a float scale by value, an array scale by its size."""
        s = self.scale
        scale = s if s is None or isinstance(s, float) else ("array", tuple(s.shape))
        return (self.format, self.element, self.qmax, scale, self.scale_ref is not None, self.bits, self.group)


PLAIN = Store()


class Stores(NamedTuple):
    """The four destinations, in ``DESTINATIONS`` order. No defaults: torch 2.11's dynamo fills a
    NamedTuple's missing fields from its defaults without a source, and cannot build a Store that way
    ("Unexpected type in sourceless builder"), so every field is passed (``PLAIN``, a module global, traces)."""

    k_pool: Store
    v_pool: Store
    q_out: Store
    k_out: Store


def feature(destination: str, store: Store) -> str | None:
    """The feature a store adds to a plan (the pools share one name): None for plain."""
    if not store.quantized:
        return None
    return f"{'pool' if destination.endswith('_pool') else destination}.{store.format}"
