"""What ropepool needs to know of a transformers model: its attention layers, each one's RoPE and q/k norm.

The families are data: a model type is hosted when its attention modules
follow the transformers decoder pattern (``q_proj``/``k_proj``/``v_proj``,
a ``layer_idx``, RoPE from ``position_embeddings`` through
``apply_rotary_pos_emb``, per-head ``q_norm``/``k_norm`` before RoPE where
the family has them). Every layer gets its own ``RopeSpec`` (Gemma 3's
sliding and full layers rotate with different bases) and ``QKNorm``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import RopePoolError
from ...norm import QKNorm
from ...spec import RopeSpec

# model_type -> the gain convention of its q/k norms (None: the family has none). Verified on
# transformers 5.17 and 5.25 by tests/test_integration.py.
FAMILIES = {
    "llama": None,
    "mistral": None,
    "qwen2": None,
    "qwen3": 0.0,  # Qwen3RMSNorm: w * x
    "gemma3_text": 1.0,  # Gemma3RMSNorm: (1 + w) * x
}


@dataclass(frozen=True, eq=False)
class Layer:
    """One attention layer as ropepool runs it."""

    index: int
    rope: RopeSpec
    norm: QKNorm | None
    backend: str | None


def attention_layers(model) -> list:
    """The model's attention modules, in layer order."""
    found = [m for m in model.modules()
             if isinstance(getattr(m, "layer_idx", None), int) and all(hasattr(m, p) for p in ("q_proj", "k_proj",
                                                                                                 "v_proj"))]
    return sorted(found, key=lambda m: m.layer_idx)


def read_model(model, backend: str | None) -> dict:
    """``{attention module: Layer}`` for every attention layer of ``model``; raises for a model it cannot host."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise RopePoolError(
            f"ropepool.integrations.transformers hosts model types {sorted(FAMILIES)}; got {model_type!r} "
            f"({type(model).__name__}). Fix: use one of those; a family whose attention follows Llama's "
            "(q/k/v projections, apply_rotary_pos_emb, paged cache through the attention kwargs) can be added to "
            "FAMILIES once tests/test_integration.py covers it.")
    modules = attention_layers(model)
    if len(modules) != config.num_hidden_layers:
        raise RopePoolError(
            f"cannot host this {model_type} model: config.num_hidden_layers is {config.num_hidden_layers} but "
            f"{len(modules)} attention modules were found. Fix: load the model from its own config.")
    specs = _layer_specs(config)
    return {m: Layer(m.layer_idx, specs[m.layer_idx], _qk_norm(m, FAMILIES[model_type]), backend)
            for m in modules}


def _layer_specs(config) -> list:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params and all(isinstance(p, Mapping) for p in params.values()):
        # RoPE per layer type (Gemma 3: sliding layers base 1e4, full layers 1e6 and their scaling).
        # TODO(for_layers): RopeSpec.for_layers reads these once the model-config issue lands; use it then.
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        by_type = {t: RopeSpec.from_hf_config({"model_type": config.model_type, "head_dim": head_dim,
                                               "max_position_embeddings": config.max_position_embeddings,
                                               "rope_parameters": dict(p)})
                   for t, p in params.items()}
        return [by_type[t] for t in config.layer_types]
    return RopeSpec.for_layers(config)


def _qk_norm(attn, weight_offset) -> QKNorm | None:
    if weight_offset is None:
        return None
    try:
        return QKNorm.from_hf_attention(attn)
    except ModuleNotFoundError:
        # TODO(hf_norm): QKNorm.from_hf_attention (src/ropepool/hf_norm.py) is being written; drop this then.
        q, k = attn.q_norm, attn.k_norm
        eps = getattr(q, "variance_epsilon", getattr(q, "eps", None))
        return QKNorm(q.weight, k.weight, eps=eps, weight_offset=weight_offset)
