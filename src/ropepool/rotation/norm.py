"""QKNorm: the per-head RMS norm of q and k that Qwen3, Gemma 3 and Llama 4 apply around RoPE.

A field of the call like the rotation: every backend normalises the row it
already holds, in float32, before (or after) rotating it; on CUDA it is the
same single kernel launch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import re

from ..core.dtypes import FRAMEWORK_TYPES, dtype_name, framework_of
from ..errors import RopePoolError

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
        return norm_from_attention(cls, module)


# --- QKNorm.from_hf_attention: the per-head q/k norms of a transformers attention module.
#
# The families are data: a table of verified attention classes (transformers
# 5.17 to 5.25) saying which attributes hold the norms, which norm classes they
# must be, where each keeps its eps, the gain convention and the order:
#
# | attention class | norms | gain | order |
# | --- | --- | --- | --- |
# | Qwen3, Qwen3-MoE, Qwen3-VL (text), Qwen3-VL-MoE (text) | ``q_norm``, ``k_norm`` | ``w`` | before RoPE |
# | Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Gemma 3 | ``q_norm``, ``k_norm`` | ``1 + w`` | before RoPE |
# | Llama 4 (text) | ``qk_norm`` (one, no weight) | 1 | after RoPE |
#
# A class not in the table is read only when it has nothing that looks like a
# q/k norm (Llama, Mistral, ...): then there is no norm and the answer is None.
# Anything else raises with the fix, never guesses: a norm class replaced by a
# patch (Liger, ...) may compute another formula, and the families that
# normalise q and k over all heads at once (OLMo 2/3, MiniMax M2: ``q_norm``
# over ``num_heads * head_dim``) are a different op.
#
# The weights are the module's own tensors (no copy): the call reads them where
# the module lives, and a later in-place weight update is seen.


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers attention class normalises q and k."""

    norms: tuple  # ("q_norm", "k_norm"), or ("qk_norm",): one module for both
    classes: dict  # norm class name -> the attribute holding its eps
    weight_offset: float = 0.0  # the gain is weight_offset + weight
    after_rope: bool = False
    weighted: bool = True
    optional: bool = False  # the norm may be absent (Llama 4: layers without RoPE or without qk norm)


def _qwen3(norm_class: str) -> Family:
    return Family(("q_norm", "k_norm"), {norm_class: "variance_epsilon"})


def _one_plus_w(norm_class: str) -> Family:
    # (x * (1 + w)).to(dtype): Gemma's convention
    return Family(("q_norm", "k_norm"), {norm_class: "eps"}, weight_offset=1.0)


FAMILIES = {
    "Qwen3Attention": _qwen3("Qwen3RMSNorm"),
    "Qwen3MoeAttention": _qwen3("Qwen3MoeRMSNorm"),
    "Qwen3VLTextAttention": _qwen3("Qwen3VLTextRMSNorm"),
    "Qwen3VLMoeTextAttention": _qwen3("Qwen3VLMoeTextRMSNorm"),
    "Qwen3NextAttention": _one_plus_w("Qwen3NextRMSNorm"),
    "Qwen3_5Attention": _one_plus_w("Qwen3_5RMSNorm"),
    "Qwen3_5MoeAttention": _one_plus_w("Qwen3_5MoeRMSNorm"),
    "Gemma3Attention": _one_plus_w("Gemma3RMSNorm"),
    # transformers <= 5.2x: Llama4TextL2Norm with .eps; later Llama4TextWeightlessRMSNorm
    # (Llama4TextL2Norm kept as an alias) with .variance_epsilon.
    "Llama4TextAttention": Family(("qk_norm",), {"Llama4TextL2Norm": "eps",
                                                 "Llama4TextWeightlessRMSNorm": "variance_epsilon"},
                                  after_rope=True, weighted=False, optional=True),
}

# Children of an unknown attention class that look like q/k norms (q_norm, qk_layernorm, query_layernorm, ...).
_NORM_NAME = re.compile(r"^(q|k|v|qk|query|key)_(norm|layernorm|layer_norm|layer_norms|ln)$")


def norm_from_attention(cls, module):
    """``cls`` (QKNorm) of ``module``'s q/k norms, or None if it has none; see the module docstring."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"QKNorm.from_hf_attention expects a transformers attention module (a torch.nn.Module); "
                        f"got {type(module).__name__}. Fix: pass model.model.layers[i].self_attn.")
    name = type(module).__name__
    if isinstance(getattr(module, "self_attn", None), torch.nn.Module):
        raise TypeError(f"QKNorm.from_hf_attention expects the attention module, not the decoder layer; got "
                        f"{name}. Fix: pass its .self_attn.")
    family = FAMILIES.get(name)
    if family is None:
        _check_unknown(module, name)
        return None
    found = [getattr(module, attr, None) for attr in family.norms]
    if family.optional and all(n is None for n in found):
        return None
    eps, weights = [], []
    for attr, norm in zip(family.norms, found):
        kind, where = type(norm).__name__, f"{name}.{attr}"
        if kind not in family.classes:
            raise RopePoolError(f"QKNorm.from_hf_attention expects {where} to be one of "
                                f"{sorted(family.classes)}, as transformers builds it; got "
                                f"{'nothing' if norm is None else kind}. Fix: a patched norm (Liger, ...) may "
                                f"compute another formula: build ropepool.QKNorm(q_weight, k_weight, eps=..., "
                                f"weight_offset={family.weight_offset}, after_rope={family.after_rope}) by hand.")
        eps_at = f"{where}.{family.classes[kind]}"
        value = getattr(norm, family.classes[kind], None)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RopePoolError(f"QKNorm.from_hf_attention expects a finite float eps in {eps_at}; got "
                                f"{value!r}. Fix: build ropepool.QKNorm(..., eps=config.rms_norm_eps) by hand.")
        eps.append(float(value))
        weights.append(norm.weight if family.weighted else None)
    if len(set(eps)) > 1:
        raise RopePoolError(f"QKNorm.from_hf_attention needs one eps for q and k; got {name}.q_norm eps {eps[0]} "
                            f"and k_norm eps {eps[1]}. Fix: transformers builds both from config.rms_norm_eps; "
                            "set both norms' eps to it.")
    q_weight, k_weight = weights if len(weights) == 2 else weights * 2  # qk_norm: one module for both
    return cls(q_weight, k_weight, eps=eps[0], weight_offset=family.weight_offset, after_rope=family.after_rope)


def _check_unknown(module, name):
    """An attention class outside the table: fine without q/k norms, else raise with the reason."""
    import torch

    norms = {n: m for n, m in module.named_children()
             if _NORM_NAME.match(n) and not isinstance(m, torch.nn.Identity)}
    if not norms:
        return
    head_dim = getattr(module, "head_dim", None)
    for n, m in norms.items():
        w = getattr(m, "weight", None)
        if isinstance(head_dim, int) and isinstance(w, torch.Tensor) and w.ndim == 1 and w.shape[0] != head_dim:
            raise RopePoolError(f"QKNorm.from_hf_attention reads per-head q/k norms only; got {name}.{n} over "
                                f"{w.shape[0]} features with head_dim {head_dim}: a norm over all heads at once "
                                "(OLMo 2/3, MiniMax M2), which is a different op. Fix: apply the module's q_norm / "
                                "k_norm to the projections first, then call rope_pool_fused without qk_norm.")
    raise RopePoolError(f"QKNorm.from_hf_attention does not know the attention class {name}; got norms "
                        f"{sorted(norms)}. Fix: build ropepool.QKNorm(q_weight, k_weight, eps=..., weight_offset=0.0 "
                        "(w) or 1.0 (1 + w), after_rope=...) from the model's code; verified classes: "
                        f"{', '.join(sorted(FAMILIES))}.")

