"""RopeSpec: which rotation to apply, reduced to frequencies.

Every backend sees only what this module derives from a spec: ``inv_freq``
(float64, ``[rotary_dim // 2]``), ``attention_scaling`` (cos and sin are
multiplied by it), ``rotary_dim`` and ``style``. Scaled variants are data:
``_ROPE_TYPES`` maps a transformers ``rope_type`` to the function that
returns ``(inv_freq, attention_scaling)``; no kernel knows the variant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import RopePoolError

STYLES = ("neox", "gptj")


def _default_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def _default(spec: "RopeSpec", params: Mapping[str, Any]):
    return _default_inv_freq(spec.base, spec.rotary_dim), 1.0


# rope_type -> f(spec, params) -> (inv_freq float64 [rotary_dim // 2], attention_scaling)
_ROPE_TYPES = {"default": _default}


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The rotary embedding of one model.

    Parameters
    ----------
    head_dim : int
        Features per head.
    rotary_dim : int, optional
        How many leading features rotate (even, <= head_dim); the rest are
        copied unchanged. Defaults to ``head_dim``.
    base : float
        The RoPE base (transformers' ``rope_theta``).
    style : {"neox", "gptj"}
        ``"neox"`` pairs ``(x[i], x[i + rotary_dim/2])``; ``"gptj"`` pairs
        ``(x[2i], x[2i+1])``.
    scaling : dict, optional
        A transformers ``rope_scaling`` dict (``rope_type`` or ``type`` key).
    max_position_embeddings : int, optional
        The model's context length, needed by some scaling types.
    seq_len : int, optional
        Pins the sequence length for the types whose frequencies depend on it
        (``dynamic``, ``longrope``). See docs/rope.md.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    style: str = "neox"
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None
    seq_len: int | None = None
    inv_freq: np.ndarray = field(init=False, repr=False)
    attention_scaling: float = field(init=False, repr=False)
    # longrope with no pinned seq_len: the frequencies a call switches to when
    # its largest position is >= long_from.
    long_inv_freq: np.ndarray | None = field(init=False, repr=False, default=None)
    long_from: int | None = field(init=False, repr=False, default=None)
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        head_dim = self.head_dim
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise RopePoolError(
                f"RopeSpec.head_dim must be a positive even int; got {head_dim!r}. "
                "Fix: pass the model's head_dim (e.g. 128)."
            )
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise RopePoolError(
                f"RopeSpec.rotary_dim must be an even int in [2, head_dim={head_dim}]; "
                f"got {self.rotary_dim!r}. Fix: use head_dim * partial_rotary_factor, rounded to even."
            )
        if self.style not in STYLES:
            raise RopePoolError(
                f"RopeSpec.style must be one of {STYLES}; got {self.style!r}. "
                "Fix: 'neox' for rotate_half models (Llama), 'gptj' for interleaved pairs."
            )
        if not (float(self.base) > 0):
            raise RopePoolError(f"RopeSpec.base must be > 0; got {self.base!r}. Fix: pass rope_theta.")
        object.__setattr__(self, "rotary_dim", rotary_dim)
        object.__setattr__(self, "base", float(self.base))
        scaling = dict(self.scaling) if self.scaling else {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        fn = _ROPE_TYPES.get(rope_type)
        if fn is None:
            raise RopePoolError(
                f"RopeSpec.scaling['rope_type'] must be one of {sorted(_ROPE_TYPES)}; got {rope_type!r}. "
                "Fix: use a supported rope type."
            )
        inv_freq, attention_scaling = fn(self, scaling)
        object.__setattr__(self, "inv_freq", np.asarray(inv_freq, dtype=np.float64))
        object.__setattr__(self, "attention_scaling", float(attention_scaling))
        object.__setattr__(self, "key", (
            head_dim, rotary_dim, self.base, self.style, _freeze(scaling),
            self.max_position_embeddings, self.seq_len,
        ))

    @property
    def rope_type(self) -> str:
        s = self.scaling or {}
        return s.get("rope_type", s.get("type", "default"))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, RopeSpec) and self.key == other.key


def _freeze(x):
    if isinstance(x, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x
