"""What ropepool needs to know of a transformers model: its attention layers, each one's RoPE and q/k norm.

The families are data: a model type is hosted when its attention modules
follow the transformers decoder pattern (``q_proj``/``k_proj``/``v_proj``,
a ``layer_idx``, RoPE from ``position_embeddings`` through
``apply_rotary_pos_emb``, per-head ``q_norm``/``k_norm`` before RoPE where
the family has them). Every layer gets its own ``RopeSpec`` (Gemma 3's
sliding and full layers rotate with different bases) and ``QKNorm``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import RopePoolError
from ...rotation.norm import QKNorm
from ...rotation.spec import RopeSpec
from . import latent

# The model types hosted, verified on transformers 5.17 and 5.25 by tests/test_integration.py. Their
# RoPE comes from RopeSpec.for_layers and their q/k norms from QKNorm.from_hf_attention.
# deepseek_v3 (multi-head latent attention) is hosted through latent.py.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", *latent.FAMILIES)


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
    if model_type in latent.FAMILIES:
        return latent.read_model(model, config, backend)
    modules = attention_layers(model)
    if len(modules) != config.num_hidden_layers:
        raise RopePoolError(
            f"cannot host this {model_type} model: config.num_hidden_layers is {config.num_hidden_layers} but "
            f"{len(modules)} attention modules were found. Fix: load the model from its own config.")
    specs = RopeSpec.for_layers(config)  # Gemma 3's sliding and full layers rotate with different bases
    return {m: Layer(m.layer_idx, specs[m.layer_idx], QKNorm.from_hf_attention(m), backend) for m in modules}
