"""RopeSpec: which rotation to apply, reduced to frequencies.

Every backend sees only what this module derives from a spec: ``inv_freq``
(float64, ``[rotary_dim // 2]``), ``attention_scaling`` (cos and sin are
multiplied by it), ``rotary_dim``, ``style`` and, for unpinned longrope,
``long_inv_freq`` / ``long_from`` (docs/rope.md). Scaled variants are data:
``_ROPE_TYPES`` maps a transformers ``rope_type`` to the function that
returns ``(inv_freq, attention_scaling)``; no kernel knows the variant.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .errors import RopePoolError

STYLES = ("neox", "gptj")


def _default_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def _is_positive(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def _required(params: Mapping[str, Any], key: str, rope_type: str, unless: str = ""):
    value = params.get(key)
    if value is None:
        raise RopePoolError(
            f"RopeSpec.scaling[{key!r}] is required for rope_type {rope_type!r}{unless}; "
            f"got no {key!r} key. Fix: copy {key!r} from the model's rope_scaling / rope_parameters."
        )
    return value


def _positive(params: Mapping[str, Any], key: str, rope_type: str, unless: str = "") -> float:
    value = _required(params, key, rope_type, unless)
    if not _is_positive(value):
        raise RopePoolError(
            f"RopeSpec.scaling[{key!r}] must be a number > 0 for rope_type {rope_type!r}; got {value!r}. "
            f"Fix: copy {key!r} from the model's rope_scaling / rope_parameters."
        )
    return float(value)


def _original_max(spec: "RopeSpec", params: Mapping[str, Any], rope_type: str) -> float:
    # transformers fills a missing original_max_position_embeddings with max_position_embeddings
    key = "original_max_position_embeddings"
    if params.get(key) is None and spec.max_position_embeddings is not None:
        return float(spec.max_position_embeddings)
    return _positive(params, key, rope_type, unless=" unless RopeSpec.max_position_embeddings is set")


def _factor_or_ratio(spec: "RopeSpec", params: Mapping[str, Any], rope_type: str, original: float) -> float:
    # Phi-3 and DeepSeek-V3 leave factor out: transformers then uses the context-length ratio
    if params.get("factor") is None and spec.max_position_embeddings is not None:
        return spec.max_position_embeddings / original
    return _positive(params, "factor", rope_type, unless=" unless RopeSpec.max_position_embeddings is set")


def _default(spec: "RopeSpec", params: Mapping[str, Any]):
    return _default_inv_freq(spec.base, spec.rotary_dim), 1.0


def _linear(spec: "RopeSpec", params: Mapping[str, Any]):
    return _default_inv_freq(spec.base, spec.rotary_dim) / _positive(params, "factor", "linear"), 1.0


def _dynamic(spec: "RopeSpec", params: Mapping[str, Any]):
    factor = _positive(params, "factor", "dynamic")
    max_len = spec.max_position_embeddings
    if max_len is None:
        raise RopePoolError(
            "RopeSpec.max_position_embeddings is required for rope_type 'dynamic'; got None. "
            "Fix: pass the model's max_position_embeddings (dynamic NTK scales the base beyond it)."
        )
    dim = spec.rotary_dim
    if dim == 2:
        raise RopePoolError(
            "RopeSpec.rotary_dim must be > 2 for rope_type 'dynamic'; got 2. "
            "Fix: dynamic NTK raises the base to dim / (dim - 2), so rotate at least 4 features."
        )
    # Shorter than max_position_embeddings (or unpinned) the ratio is 1: the unscaled frequencies.
    seq_len = max(spec.seq_len or max_len, max_len)
    base = spec.base * (factor * seq_len / max_len - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim), 1.0


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(spec: "RopeSpec", params: Mapping[str, Any]):
    original = _original_max(spec, params, "yarn")
    factor = _factor_or_ratio(spec, params, "yarn", original)
    dim, base = spec.rotary_dim, spec.base
    if params.get("attention_factor") is not None:
        attention = _positive(params, "attention_factor", "yarn")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = _yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"])
    else:
        attention = _yarn_mscale(factor, 1.0)
    # transformers treats 0 like a missing value here (`or`)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        # the pair index whose wavelength fits `rotations` times into the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv_freq = _default_inv_freq(base, dim)
    # ramp 0 (fast pairs) keeps the frequency, ramp 1 (slow pairs) interpolates it by factor
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, attention


def _longrope_inv_freq(spec: "RopeSpec", params: Mapping[str, Any], key: str) -> np.ndarray:
    n = spec.rotary_dim // 2
    value = _required(params, key, "longrope")
    if np.ndim(value) != 1 or len(value) != n:
        raise RopePoolError(
            f"RopeSpec.scaling[{key!r}] must have rotary_dim // 2 = {n} entries for rope_type 'longrope'; "
            f"got shape {np.shape(value)}. Fix: copy {key!r} from the model's config and check rotary_dim "
            "(head_dim * partial_rotary_factor)."
        )
    bad = [f for f in value if not _is_positive(f)]
    if bad:
        raise RopePoolError(
            f"RopeSpec.scaling[{key!r}] must hold numbers > 0 for rope_type 'longrope'; got {bad[:3]!r}. "
            f"Fix: copy {key!r} from the model's config."
        )
    return _default_inv_freq(spec.base, spec.rotary_dim) / np.asarray(value, dtype=np.float64)


def _longrope(spec: "RopeSpec", params: Mapping[str, Any]):
    original = _original_max(spec, params, "longrope")
    factor = _factor_or_ratio(spec, params, "longrope", original)
    short = _longrope_inv_freq(spec, params, "short_factor")
    long = _longrope_inv_freq(spec, params, "long_factor")
    if params.get("attention_factor") is not None:
        attention = _positive(params, "attention_factor", "longrope")
    elif factor <= 1:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(original))
    pinned_long = spec.seq_len is not None and spec.seq_len > original
    return (long if pinned_long else short), attention


def _llama3(spec: "RopeSpec", params: Mapping[str, Any]):
    factor = _positive(params, "factor", "llama3")
    low = _positive(params, "low_freq_factor", "llama3")
    high = _positive(params, "high_freq_factor", "llama3")
    if high <= low:
        raise RopePoolError(
            f"RopeSpec.scaling['high_freq_factor'] must be greater than low_freq_factor={low}; got {high}. "
            "Fix: copy both from the model's config (Llama 3.1: low 1, high 4)."
        )
    original = _original_max(spec, params, "llama3")
    inv_freq = _default_inv_freq(spec.base, spec.rotary_dim)
    # 0 where the wavelength exceeds original/low (divide by factor), 1 where it is below
    # original/high (keep), linear in original/wavelength between: transformers' three bands.
    smooth = np.clip((original * inv_freq / (2 * math.pi) - low) / (high - low), 0.0, 1.0)
    return inv_freq * (smooth + (1 - smooth) / factor), 1.0


# rope_type -> f(spec, params) -> (inv_freq float64 [rotary_dim // 2], attention_scaling)
_ROPE_TYPES = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}


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
        A transformers ``rope_scaling`` / ``rope_parameters`` dict (``rope_type``
        or legacy ``type`` key): default, linear, dynamic, yarn, longrope, llama3.
    max_position_embeddings : int, optional
        The model's context length; dynamic needs it, and yarn, longrope and
        llama3 fall back on it for ``original_max_position_embeddings``.
    seq_len : int, optional
        Pins the sequence length for the types whose frequencies depend on it
        (``dynamic``, ``longrope``). See docs/rope.md.

    Derived, what backends read: ``inv_freq`` (float64 ``[rotary_dim // 2]``),
    ``attention_scaling``, and for unpinned longrope ``long_inv_freq`` /
    ``long_from`` (None otherwise).

    Use ``RopeSpec.from_hf_config(config)`` to read all of this from a model's
    config, and ``spec.at_seq_len(n)`` to pin the sequence length.
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
        for name in ("max_position_embeddings", "seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise RopePoolError(
                    f"RopeSpec.{name} must be a positive int or None; got {value!r}. "
                    "Fix: pass a length in tokens (e.g. 4096), or leave it None."
                )
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
        if rope_type == "longrope" and self.seq_len is None:
            object.__setattr__(self, "long_inv_freq", _longrope_inv_freq(self, scaling, "long_factor"))
            object.__setattr__(self, "long_from", int(_original_max(self, scaling, "longrope")))
        object.__setattr__(self, "key", (
            head_dim, rotary_dim, self.base, self.style, _freeze(scaling),
            self.max_position_embeddings, self.seq_len,
        ))

    def at_seq_len(self, seq_len: int | None) -> "RopeSpec":
        """This spec with ``seq_len`` pinned (None: unpinned)."""
        return dataclasses.replace(self, seq_len=seq_len)

    @classmethod
    def from_hf_config(cls, config, *, seq_len: int | None = None) -> "RopeSpec":
        """The RoPE of a transformers config: a ``PretrainedConfig`` or its dict (config.json) form.

        Reads both spellings: transformers 5 keeps ``rope_theta``,
        ``partial_rotary_factor`` and the scaling keys in ``rope_parameters``;
        older configs keep ``rope_theta`` at the top level next to
        ``rope_scaling``. GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct`` and
        GPT-J's ``rotary_dim`` (interleaved, style "gptj") are read too.
        """
        get = config.get if isinstance(config, Mapping) else (lambda name: getattr(config, name, None))

        def first(*values):
            return next((v for v in values if v is not None), None)

        # transformers lets rope_scaling win when a config carries both spellings
        params = dict(first(get("rope_scaling"), get("rope_parameters")) or {})
        if any(isinstance(v, Mapping) for v in params.values()):
            raise RopePoolError(
                f"RopeSpec.from_hf_config reads one RoPE per model; got rope_parameters per layer type "
                f"{sorted(params)}. Fix: build one RopeSpec per layer type from "
                "config.rope_parameters[layer_type] with RopeSpec(head_dim=..., base=..., scaling=...)."
            )
        base = first(params.pop("rope_theta", None), get("rope_theta"), get("rotary_emb_base"), 10000.0)
        partial = first(params.pop("partial_rotary_factor", None), get("partial_rotary_factor"), get("rotary_pct"), 1.0)
        params.setdefault("rope_type", first(params.pop("type", None), "default"))
        if params["rope_type"] in ("llama3", "yarn", "longrope") and get("original_max_position_embeddings"):
            # Phi-3 keeps it at the top level; transformers prefers that over the dict's
            params["original_max_position_embeddings"] = get("original_max_position_embeddings")

        hidden, heads = first(get("hidden_size"), get("n_embd")), first(get("num_attention_heads"), get("n_head"))
        head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
        if head_dim is None:
            raise RopePoolError(
                "RopeSpec.from_hf_config needs head_dim, or hidden_size and num_attention_heads, in the config; "
                f"got head_dim=None, hidden_size={hidden!r}, num_attention_heads={heads!r}. "
                "Fix: pass the model's full config, or build RopeSpec(head_dim=...) directly."
            )
        if get("model_type") == "gptj":
            style, rotary_dim = "gptj", get("rotary_dim") or head_dim
        else:
            style, rotary_dim = "neox", int(head_dim * partial)
        return cls(
            head_dim=head_dim, rotary_dim=rotary_dim, base=base, style=style,
            scaling=params if params["rope_type"] != "default" else None,
            max_position_embeddings=first(get("max_position_embeddings"), get("n_positions")), seq_len=seq_len,
        )

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
