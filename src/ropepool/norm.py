"""QKNorm: the per-head RMS norm of q and k that Qwen3, Gemma 3 and Llama 4 apply around RoPE.

A field of the call like the rotation: every backend normalises the row it
already holds, in float32, before (or after) rotating it; on CUDA it is the
same single kernel launch.
"""
from __future__ import annotations

import math
import numbers

from .dtypes import FRAMEWORK_TYPES, dtype_name, framework_of
from .errors import RopePoolError

_WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class QKNorm:
    """Per-head RMS normalisation of q and k, fused with RoPE and the pool write.

    Parameters
    ----------
    q_weight, k_weight : [head_dim] array or None
        Shared by all heads; of q's framework and device, any float dtype.
        None: no weight (Llama 4's ``L2Norm``).
    eps : float
        Added to the mean square, a finite float > 0.
    weight_offset : float
        The gain is ``weight_offset + weight``: 0.0 for Qwen3, 1.0 for
        Gemma 3, Qwen3-Next and Qwen3.5 (``1 + w`` norms).
    after_rope : bool
        False: normalise, then rotate (Qwen3, Gemma 3). True: rotate, then
        normalise (Llama 4).

    Each head of q and k is normalised over its whole head_dim in float32:
    ``y = x * rsqrt(mean(x**2) + eps) * g``; the pool holds the normalised
    and rotated k; v is never normalised; one cast to q's dtype at the end.
    Build it once per layer: calls are cached per QKNorm object.
    """

    def __init__(self, q_weight=None, k_weight=None, *, eps: float = 1e-6, weight_offset: float = 0.0,
                 after_rope: bool = False):
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps > 0):
            raise RopePoolError(f"QKNorm eps must be a finite float > 0; got {eps!r}. "
                                "Fix: pass the norm's eps (config.rms_norm_eps, e.g. 1e-6).")
        if isinstance(weight_offset, bool) or not isinstance(weight_offset, numbers.Real) \
                or not math.isfinite(weight_offset):
            raise RopePoolError(f"QKNorm weight_offset must be a finite float; got {weight_offset!r}. "
                                "Fix: 0.0 for Qwen3, 1.0 for Gemma 3 and Qwen3-Next ((1 + w) norms).")
        where = None
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w is None:
                continue
            fw = framework_of(w)
            if fw is None:
                raise TypeError(f"QKNorm expects {name} as a torch.Tensor, mx.array or numpy.ndarray (or None); "
                                f"got {type(w).__name__}. Fix: pass the norm module's weight.")
            if w.ndim != 1 or dtype_name(w) not in _WEIGHT_DTYPES:
                raise RopePoolError(f"QKNorm expects {name} as a 1-D float array [head_dim]; got "
                                    f"{list(w.shape)} {dtype_name(w)}. Fix: pass the per-head norm's weight "
                                    "(q_norm.weight), not a weight over all heads.")
            here = (fw, getattr(w, "device", None))
            if where is not None and here != where:
                raise TypeError(f"QKNorm expects q_weight and k_weight from one framework and device; got "
                                f"{FRAMEWORK_TYPES[where[0]]} on {where[1]} and {FRAMEWORK_TYPES[fw]} on {here[1]}. "
                                "Fix: move both next to q.")
            where = here
        if q_weight is not None and k_weight is not None and q_weight.shape[0] != k_weight.shape[0]:
            raise RopePoolError(f"QKNorm expects q_weight and k_weight of one size (head_dim); got "
                                f"{q_weight.shape[0]} and {k_weight.shape[0]}. Fix: a per-head norm has head_dim "
                                "weights for q and for k alike; weights of different sizes span all heads (heads x "
                                "head_dim, as OLMo 2 has them), another op: apply them to the projections before the "
                                "call, without qk_norm.")
        self.q_weight, self.k_weight = q_weight, k_weight
        self.eps, self.weight_offset, self.after_rope = float(eps), float(weight_offset), bool(after_rope)

    @property
    def weights(self):
        return self.q_weight, self.k_weight

    def __repr__(self):
        shape = lambda w: None if w is None else list(w.shape)  # noqa: E731
        return (f"QKNorm(q_weight={shape(self.q_weight)}, k_weight={shape(self.k_weight)}, eps={self.eps}, "
                f"weight_offset={self.weight_offset}, after_rope={self.after_rope})")

    @classmethod
    def from_hf_attention(cls, module):
        """The q/k norms of a transformers attention module; None if it has none (see docs/models.md)."""
        from .hf_norm import norm_from_attention

        return norm_from_attention(cls, module)
