"""Which rotation to apply, reduced to one kernel-facing record.

``RopeSpec`` describes a model's rotary embedding (base, partial rotary, pair
style, scaling type, MRoPE sections); ``CosSinCache`` wraps an engine's own
cos/sin table. Both reduce to a ``Rotation``: frequencies (or the table), the
pair style, ``rotary_dim``, the MRoPE row of each frequency and the attention
scaling. Every backend and the oracle read only that record; scaling types
are data (``scaling.ROPE_TYPES``), so no kernel knows the variant.
"""
from __future__ import annotations

import dataclasses
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..checks.arrays import as_float32
from ..core.dtypes import FLOAT_DTYPES, dtype_name, framework_of
from ..errors import RopePoolError
from .scaling import ROPE_TYPES, longrope_inv_freq, original_max

STYLES = ("neox", "gptj")


@dataclass(frozen=True, eq=False)
class Rotation:
    """What a kernel reads of a rotation. Made by ``RopeSpec`` and ``CosSinCache``, never by a backend.

    ``freqs``: float32 ``[sets, rotary_dim // 2]`` (None with a table); row 1
    holds longrope's long-factor frequencies, used by a whole call once its
    largest position reaches ``long_from``. ``table``: the engine's
    ``[max_position, rotary_dim]`` cos/sin cache (cos half, then sin half),
    an array of the call's framework, held weakly (``table_ref``): the
    ``CosSinCache`` the caller passes holds it, so no plan, graph or runner
    that keeps this record keeps the engine's table alive. ``rows``: for
    each frequency, which row of ``[3, T]`` MRoPE positions it takes (all 0
    without MRoPE).
    """

    rotary_dim: int  # 0: a layer without RoPE
    gptj: bool  # pairs (x[2i], x[2i+1]); else NeoX (x[i], x[i + rotary_dim/2])
    attention_scaling: float = 1.0
    freqs: np.ndarray | None = None
    long_from: int | None = None
    table_ref: Any = None  # weakref.ref to the table, or None
    mrope_section: tuple | None = None
    mrope_interleaved: bool = False
    rows: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "rows", mrope_rows(self.rotary_dim // 2, self.mrope_section, self.mrope_interleaved))

    @property
    def table(self):
        """The engine's table (None without one, or once the caller has dropped it)."""
        return None if self.table_ref is None else self.table_ref()


def mrope_rows(half: int, section, interleaved: bool) -> np.ndarray:
    """int ``[half]``: the position row (0 time, 1 height, 2 width) of each frequency (docs/api.md, RopeSpec: MRoPE)."""
    i = np.arange(half)
    if section is None:
        return np.zeros(half, dtype=np.int64)
    s_t, s_h, s_w = section
    if interleaved:
        return np.where((i % 3 == 1) & (i < 3 * s_h), 1, np.where((i % 3 == 2) & (i < 3 * s_w), 2, 0))
    return (i >= s_t).astype(np.int64) + (i >= s_t + s_h)


def _check_mrope(owner: str, section, interleaved, rotary_dim: int):
    if section is None:
        if interleaved:
            raise RopePoolError(f"{owner}.mrope_interleaved needs mrope_section; got mrope_section=None. "
                                "Fix: pass the model's mrope_section (e.g. (16, 24, 24)), or drop mrope_interleaved.")
        return None
    try:
        section = tuple(int(s) for s in section)
    except (TypeError, ValueError):
        section = None
    if section is None or len(section) != 3 or min(section) < 0 or sum(section) != rotary_dim // 2:
        raise RopePoolError(f"{owner}.mrope_section must be three ints >= 0 summing to rotary_dim // 2 = "
                            f"{rotary_dim // 2}; got {section!r}. Fix: copy mrope_section from the model's config "
                            "(Qwen2-VL: (16, 24, 24) for rotary_dim 128).")
    return section


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The rotary embedding of one model (or one layer).

    Parameters
    ----------
    head_dim : int
        Features per head.
    rotary_dim : int, optional
        How many leading features rotate (even, <= head_dim); the rest are
        copied unchanged. Defaults to ``head_dim``; 0 is a layer without RoPE.
    base : float
        The RoPE base (transformers' ``rope_theta``).
    style : {"neox", "gptj"}
        ``"neox"`` pairs ``(x[i], x[i + rotary_dim/2])``; ``"gptj"`` pairs
        ``(x[2i], x[2i+1])``.
    scaling : dict, optional
        A transformers ``rope_scaling`` / ``rope_parameters`` dict (``rope_type``
        or legacy ``type`` key): default, linear, dynamic, yarn, longrope, llama3.
    max_position_embeddings : int, optional
        The model's context length; dynamic needs it, and yarn, longrope and
        llama3 fall back on it for ``original_max_position_embeddings``.
    seq_len : int, optional
        Pins the sequence length for the types whose frequencies depend on it
        (``dynamic``, ``longrope``). See docs/rope.md.
    mrope_section : (int, int, int), optional
        Multimodal RoPE (Qwen2-VL and later): how many frequencies take the
        time, height and width rows of ``[3, num_tokens]`` positions; they sum
        to ``rotary_dim // 2``.
    mrope_interleaved : bool
        Qwen3-VL's interleaved assignment instead of contiguous chunks.

    Derived: ``inv_freq`` (float64 ``[rotary_dim // 2]``), ``attention_scaling``,
    for unpinned longrope ``long_inv_freq`` / ``long_from`` (None otherwise),
    and ``rotation``, the record every backend reads.

    Use ``RopeSpec.from_hf_config(config)`` to read all of this from a model's
    config, ``RopeSpec.for_layers(config)`` for one spec per decoder layer, and
    ``spec.at_seq_len(n)`` to pin the sequence length.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    style: str = "neox"
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    seq_len: int | None = None
    mrope_section: tuple | None = None
    mrope_interleaved: bool = False
    inv_freq: np.ndarray = field(init=False, repr=False)
    attention_scaling: float = field(init=False, repr=False)
    # longrope with no pinned seq_len: the frequencies a call switches to when
    # its largest position is >= long_from.
    long_inv_freq: np.ndarray | None = field(init=False, repr=False, default=None)
    long_from: int | None = field(init=False, repr=False, default=None)
    rotation: Rotation = field(init=False, repr=False, compare=False)
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        head_dim = _as_int(self.head_dim)
        if head_dim is None or head_dim <= 0 or head_dim % 2:
            raise RopePoolError(
                f"RopeSpec.head_dim must be a positive even int; got {self.head_dim!r}. "
                "Fix: pass the model's head_dim (e.g. 128)."
            )
        rotary_dim = head_dim if self.rotary_dim is None else _as_int(self.rotary_dim)
        if rotary_dim is None or rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise RopePoolError(
                f"RopeSpec.rotary_dim must be an even int in [0, head_dim={head_dim}]; "
                f"got {self.rotary_dim!r}. Fix: use head_dim * partial_rotary_factor, rounded to even "
                "(0: a layer without RoPE)."
            )
        if self.style not in STYLES:
            raise RopePoolError(
                f"RopeSpec.style must be one of {STYLES}; got {self.style!r}. "
                "Fix: 'neox' for rotate_half models (Llama), 'gptj' for interleaved pairs."
            )
        if not (float(self.base) > 0):
            raise RopePoolError(f"RopeSpec.base must be > 0; got {self.base!r}. Fix: pass rope_theta.")
        for name in ("max_position_embeddings", "seq_len"):
            value = getattr(self, name)
            if value is not None and (_as_int(value) is None or value <= 0):
                raise RopePoolError(
                    f"RopeSpec.{name} must be a positive int or None; got {value!r}. "
                    "Fix: pass a length in tokens (e.g. 4096), or leave it None."
                )
            if value is not None:
                object.__setattr__(self, name, int(value))
        section = _check_mrope("RopeSpec", self.mrope_section, self.mrope_interleaved, rotary_dim)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "rotary_dim", rotary_dim)
        object.__setattr__(self, "base", float(self.base))
        object.__setattr__(self, "mrope_section", section)
        object.__setattr__(self, "mrope_interleaved", bool(self.mrope_interleaved))
        scaling = dict(self.scaling) if self.scaling else {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        fn = ROPE_TYPES.get(rope_type)
        if fn is None:
            raise RopePoolError(
                f"RopeSpec.scaling['rope_type'] must be one of {sorted(ROPE_TYPES)}; got {rope_type!r}. "
                "Fix: use a supported rope type."
            )
        inv_freq, attention_scaling = fn(self, scaling) if rotary_dim else (np.zeros(0), 1.0)
        object.__setattr__(self, "inv_freq", np.asarray(inv_freq, dtype=np.float64))
        object.__setattr__(self, "attention_scaling", float(attention_scaling))
        if rope_type == "longrope" and self.seq_len is None and rotary_dim:
            object.__setattr__(self, "long_inv_freq", longrope_inv_freq(self, scaling, "long_factor"))
            object.__setattr__(self, "long_from", int(original_max(self, scaling, "longrope")))
        sets = [self.inv_freq] + ([] if self.long_inv_freq is None else [self.long_inv_freq])
        object.__setattr__(self, "rotation", Rotation(
            rotary_dim=rotary_dim, gptj=self.style == "gptj", attention_scaling=self.attention_scaling,
            freqs=np.stack(sets).astype(np.float32), long_from=self.long_from, mrope_section=section,
            mrope_interleaved=self.mrope_interleaved))
        object.__setattr__(self, "key", (
            head_dim, rotary_dim, self.base, self.style, _freeze(scaling),
            self.max_position_embeddings, self.seq_len, section, self.mrope_interleaved,
        ))

    def at_seq_len(self, seq_len: int | None) -> "RopeSpec":
        """This spec with ``seq_len`` pinned (None: unpinned)."""
        return dataclasses.replace(self, seq_len=seq_len)

    @classmethod
    def from_hf_config(cls, config, *, style: str | None = None, seq_len: int | None = None) -> "RopeSpec":
        """The RoPE of a transformers config (a ``PretrainedConfig`` or its dict form); see docs/models.md."""
        from .hf_config import spec_from_config

        return spec_from_config(cls, config, style=style, seq_len=seq_len)

    @classmethod
    def for_layers(cls, config, *, style: str | None = None, seq_len: int | None = None) -> "list[RopeSpec]":
        """One spec per decoder layer (Gemma 3's two RoPEs, per-layer-type parameters, NoPE layers)."""
        from .hf_config import specs_for_layers

        return specs_for_layers(cls, config, style=style, seq_len=seq_len)

    @property
    def rope_type(self) -> str:
        s = self.scaling or {}
        return s.get("rope_type", s.get("type", "default"))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, RopeSpec) and self.key == other.key


class TableKey(tuple):
    """A CosSinCache's key: (id of its table, is_neox, mrope_section, mrope_interleaved). A tuple's hash and
    equality (no Python call on the hot path); its own type, so that no other argument can equal it."""

    __slots__ = ()


class ScaleKey(tuple):
    """The per-token-head scale caches in a layout cache's key: (id of k_scale_cache, id of v_scale_cache).
    Like TableKey, the key holds ids, not the arrays; plan/cache.py drops it when either is freed."""

    __slots__ = ()


class CosSinCache:
    """An engine's own cos/sin table, used as it is (vLLM, sglang and FlashInfer format).

    Parameters
    ----------
    cos_sin_cache : [max_position, rotary_dim] array of q's framework and device
        Row ``p`` holds ``cos(p * f_0 .. f_{r/2-1})`` then ``sin(...)``, in
        float32, float16 or bfloat16. ``rotary_dim`` is its width (partial
        rotary when smaller than head_dim).
    is_neox : bool
        NeoX pairs ``(x[i], x[i + r/2])``; False: GPT-J pairs ``(x[2i], x[2i+1])``.
    mrope_section, mrope_interleaved
        As in RopeSpec: ``[3, T]`` positions pick each frequency's row.

    The kernel gathers row ``positions[t]`` instead of computing angles. A
    position outside ``[0, max_position)`` raises where checking needs no
    device sync; on CUDA that token is rotated by zero and its pool write is
    skipped (docs/rope.md).
    """

    def __init__(self, cos_sin_cache, is_neox: bool = True, mrope_section=None, mrope_interleaved: bool = False):
        fw = framework_of(cos_sin_cache)
        if fw is None:
            raise TypeError(f"CosSinCache expects cos_sin_cache as a torch.Tensor, mx.array or numpy.ndarray; got "
                            f"{type(cos_sin_cache).__name__}. Fix: pass the engine's [max_position, rotary_dim] table.")
        shape = tuple(cos_sin_cache.shape)
        if len(shape) != 2 or shape[1] % 2 or not shape[1] or not shape[0]:
            raise RopePoolError(f"CosSinCache expects cos_sin_cache of shape [max_position, rotary_dim] with an even "
                                f"rotary_dim > 0; got {list(shape)}. Fix: pass the engine's table (cos half, then sin "
                                "half), e.g. vLLM's rotary_emb.cos_sin_cache.")
        if dtype_name(cos_sin_cache) not in FLOAT_DTYPES:
            raise RopePoolError(f"CosSinCache expects a float32, float16 or bfloat16 table; got "
                                f"{dtype_name(cos_sin_cache)}. Fix: {as_float32(fw, 'cos_sin_cache')}.")
        if fw == "torch" and cos_sin_cache.stride(-1) != 1:
            raise RopePoolError(f"CosSinCache expects a table whose last dim is contiguous; got strides "
                                f"{list(cos_sin_cache.stride())}. Fix: cos_sin_cache.contiguous().")
        self._table = cos_sin_cache
        self.is_neox = bool(is_neox)
        self.max_position, self.rotary_dim = shape
        section = _check_mrope("CosSinCache", mrope_section, mrope_interleaved, self.rotary_dim)
        self.mrope_section, self.mrope_interleaved = section, bool(mrope_interleaved)
        self.rotation = Rotation(rotary_dim=self.rotary_dim, gptj=not self.is_neox,
                                 table_ref=weakref.ref(cos_sin_cache), mrope_section=section,
                                 mrope_interleaved=self.mrope_interleaved)
        # Equal to every CosSinCache over the same table object with the same pairs: a new one made per
        # call finds the layouts ropepool remembered for the last. The layout cache's keys hold this key,
        # not the object (plan/cache.py: a key goes when its table is freed, before the id can be reused).
        self.key = TableKey((id(cos_sin_cache), self.is_neox, section, self.mrope_interleaved))
        self._hash = hash(self.key)

    @property
    def cos_sin_cache(self):
        """The table (None once dropped, for one made by ``held_weakly``)."""
        return self._table if self._table is not None else self.rotation.table_ref()

    @classmethod
    def held_weakly(cls, cos_sin_cache, is_neox: bool = True) -> "CosSinCache":
        """A CosSinCache that does not keep its table alive: for a map of an engine's tables to their
        CosSinCache (integrations.vllm), which must not outlive them."""
        rope = cls(cos_sin_cache, is_neox=is_neox)
        rope._table = None
        return rope

    def __eq__(self, other):
        if type(other) is not CosSinCache:
            return NotImplemented
        return self.key == other.key and self.cos_sin_cache is other.cos_sin_cache

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return (f"CosSinCache([{self.max_position}, {self.rotary_dim}] {dtype_name(self.cos_sin_cache)}, "
                f"is_neox={self.is_neox}, mrope_section={self.mrope_section})")


def _as_int(value) -> int | None:
    """An int from an int or a NumPy integer; None for anything else (bools included)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return None


def _freeze(x):
    if isinstance(x, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x
