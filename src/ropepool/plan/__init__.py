"""The plan of a call: the one record between the checked call and the backends.

The flow is one-way: ``validate`` checks a call and describes it (a frozen
``Call``), ``build`` turns that into a ``Plan``, ``make`` picks the backend
row whose declared support covers the plan's features (support.py)
and lets it prepare its launch state once, and ``Ready.bind`` gives the
function that runs calls of that layout. Tuning values (warps, the head split)
are an argument of ``make``, never module globals.

A ``Plan`` is framework-neutral and frozen. It holds:

- ``call``: the checked Call (geometry, rotation, norm);
- ``features``: the named features the call uses (``FEATURES``): a backend
  is picked only if it supports all of them;
- ``stores``: how each destination (k pool, v pool, q_out, k_out) stores its
  rows, one ``stores.Store`` each;
- ``fixed``: the extra arrays the kernels read besides the call's arrays, by
  name (``Extras``); those held weakly (``HELD``: an engine's table, the scale
  caches) are None there and read per call (``extras()``);
- ``key``: the one static key of what compiled code reads of the plan; the MLX
  graph cache and the Triton launchers are keyed by it.

The kernels' arguments are named once, in core/args.py (``Extras``, ``POINTERS``: the Triton kernel's order).

The layout cache's key is built before any check, from the public keywords
(``pool_key``, ``latent_key``; tests/test_plan.py proves each keyword of the
public signatures reaches it).

The layout cache that skips the checks for a layout already seen is ``cache``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .. import backends
from ..checks import validate
from ..core.args import ARRAYS, EXTRAS, POINTERS, Extras
from ..core.stores import DESTINATIONS, Stores, feature
from ..support import ALL as FEATURES  # every feature a plan may name
from .cache import entry, forget, indexer_key, latent_key, lookup, out_kind, pool_key, remember

HELD = ("table", "k_scale_cache", "v_scale_cache")  # read through weak references, per call


@dataclass(frozen=True, eq=False)
class Plan:
    call: validate.Call
    features: frozenset
    stores: Stores
    fixed: Extras
    key: tuple

    def extras(self) -> Extras:
        """``fixed`` with the weakly held arrays read now (None where the caller has dropped one)."""
        if self.call.rotation.table_ref is None and self.stores.k_pool.scale_ref is None:
            return self.fixed
        st = self.stores
        return self.fixed._replace(table=self.call.rotation.table, k_scale_cache=st.k_pool.scale_cache,
                                   v_scale_cache=st.v_pool.scale_cache)


def build(call: validate.Call) -> Plan:
    """The plan of a checked call."""
    rot, norm, st = call.rotation, call.norm, call.stores
    used = {"norm": norm is not None, "mrope": call.position_rows == 3, "table": rot.table_ref is not None,
            "longrope": rot.long_from is not None and rot.table_ref is None, "latent": call.latent,
            "autograd": call.autograd, "traced": call.traced, "layout.amx": call.pool.kv_layout == "amx"}
    features = frozenset([f for f, on in used.items() if on] +
                         [f for f in map(feature, DESTINATIONS, st) if f is not None])
    qw, kw = (None, None) if norm is None else norm.weights
    fixed = Extras(freqs=rot.freqs if rot.table_ref is None and rot.rotary_dim else None, q_weight=qw, k_weight=kw,
                   k_scale=st.k_pool.scale, v_scale=st.v_pool.scale, q_scale=st.q_out.scale,
                   k_out_scale=st.k_out.scale)
    table = rot.table
    # Every field of the Rotation record but its arrays (read as extras): a new field is in the key unlisted.
    rotation = tuple(getattr(rot, f.name) for f in dataclasses.fields(rot) if f.name not in ("freqs", "table_ref",
                                                                                               "rows"))
    rotation += (None if table is None else tuple(table.shape),)
    norm_key = None if norm is None else (norm.eps, norm.weight_offset, norm.after_rope, qw is None, kw is None)
    g = call.pool  # (plain values: torch.compile traces this, and cannot rebuild a dataclass it did not see made)
    pool = (g.layer, g.kv_layout, g.headed, g.num_layers, g.num_pages, g.page_size, g.num_heads, g.dim)
    key = (call.framework, call.dtype, call.pool_dtype, call.num_qo_heads, call.num_kv_heads, call.head_dim,
           call.v_head_dim, pool, call.position_rows, rotation, norm_key, tuple(s.key for s in st),
           tuple(sorted(features)))
    return Plan(call, features, st, fixed, key)


@dataclass(frozen=True)
class Tuning:
    """Every backend's settings, read when a plan is prepared (``make``), never from module globals.

    Triton: None picks the measured default for the call (docs/benchmarks.md). MLX (docs/mlx.md): calls of up
    to ``compile_tokens`` tokens run one ``mx.compile``d graph; larger ones on the CPU, in chunks of about
    ``chunk_features`` q features (1 MB of float32 temporaries). The torch CPU kernel (backends/torch_native.py):
    ropepool's cos/sin tables cover positions below ``table_positions`` (64 MB a rotation at rotary_dim 128),
    grown ``table_chunk`` rows at a time; past them cos/sin are computed per call."""

    num_warps: int | None = None
    head_split: int | None = None  # programs a token's heads are split over, at up to small_tokens tokens
    small_tokens: int = 64
    compile_tokens: int = 64
    chunk_features: int = 1 << 18
    table_positions: int = 1 << 17
    table_chunk: int = 1 << 12


DEFAULT_TUNING = Tuning()


class Ready:
    """A plan and the backend row that runs it, with that backend's launch state."""

    def __init__(self, plan: Plan, backend: backends.Backend, tuning: Tuning):
        self.plan, self.call, self.backend, self.tuning = plan, plan.call, backend, tuning
        fallback = None if backend.fallback is None else backends.load(backend.fallback).prepare(plan, tuning, None)
        self.prepared = backend.load().prepare(plan, tuning, fallback)

    def bind(self, *arrays) -> Callable:
        """The function running calls whose arrays are laid out like ``arrays``."""
        return self.prepared.bind(*arrays)


def make(call: validate.Call, q, backend: str | None = None, tuning: Tuning | None = None) -> Ready:
    # None, not a Tuning default: torch 2.11's dynamo cannot trace a frozen dataclass default argument.
    plan = build(call)
    return Ready(plan, backends.pick(call.framework, q, backend, plan.features), tuning or DEFAULT_TUNING)


__all__ = ["Plan", "build", "make", "Tuning", "Extras", "EXTRAS", "ARRAYS", "POINTERS", "FEATURES", "forget",
           "lookup", "entry", "remember", "pool_key", "latent_key", "indexer_key", "out_kind"]
