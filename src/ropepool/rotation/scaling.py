"""RoPE scaling types as data: ``ROPE_TYPES`` maps a transformers ``rope_type``
to the function that returns ``(inv_freq, attention_scaling)`` for a spec.

The formulas are transformers' (``modeling_rope_utils.py``), in float64; no
kernel knows which type produced the frequencies.
"""
from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..errors import RopePoolError

if TYPE_CHECKING:
    from .spec import RopeSpec


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


def original_max(spec: "RopeSpec", params: Mapping[str, Any], rope_type: str) -> float:
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
    original = original_max(spec, params, "yarn")
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


def longrope_inv_freq(spec: "RopeSpec", params: Mapping[str, Any], key: str) -> np.ndarray:
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
    original = original_max(spec, params, "longrope")
    factor = _factor_or_ratio(spec, params, "longrope", original)
    short = longrope_inv_freq(spec, params, "short_factor")
    long = longrope_inv_freq(spec, params, "long_factor")
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
    if high < low:
        raise RopePoolError(
            f"RopeSpec.scaling['high_freq_factor'] must be at least low_freq_factor={low}; got {high}. "
            "Fix: copy both from the model's config (Llama 3.1: low 1, high 4)."
        )
    original = original_max(spec, params, "llama3")
    inv_freq = _default_inv_freq(spec.base, spec.rotary_dim)
    # 0 where the wavelength exceeds original/low (divide by factor), 1 where it is below
    # original/high (keep), linear in original/wavelength between: transformers' three bands.
    # Llama 4 sets high == low: no band between, a step.
    ratio = original * inv_freq / (2 * math.pi)
    if high == low:
        smooth = (ratio > high).astype(np.float64)
    else:
        smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return inv_freq * (smooth + (1 - smooth) / factor), 1.0


# rope_type -> f(spec, params) -> (inv_freq float64 [rotary_dim // 2], attention_scaling)
ROPE_TYPES = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}
