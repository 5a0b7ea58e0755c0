"""RopeSpecs read from transformers configs (a ``PretrainedConfig`` or its dict form).

Reads both spellings: transformers 5 keeps ``rope_theta``,
``partial_rotary_factor`` and the scaling keys in ``rope_parameters``; older
configs keep ``rope_theta`` at the top level next to ``rope_scaling``.
GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct`` and GPT-J's ``rotary_dim``
are read too.
"""
from __future__ import annotations

from typing import Mapping

from .errors import RopePoolError


def _getter(config):
    return config.get if isinstance(config, Mapping) else (lambda name: getattr(config, name, None))


def _first(*values):
    return next((v for v in values if v is not None), None)


def spec_from_config(cls, config, *, style=None, seq_len=None):
    get = _getter(config)
    # transformers lets rope_scaling win when a config carries both spellings
    params = dict(_first(get("rope_scaling"), get("rope_parameters")) or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise RopePoolError(
            f"RopeSpec.from_hf_config reads one RoPE per model; got rope_parameters per layer type "
            f"{sorted(params)}. Fix: RopeSpec.for_layers(config) gives one spec per decoder layer."
        )
    base = _first(params.pop("rope_theta", None), get("rope_theta"), get("rotary_emb_base"), 10000.0)
    partial = _first(params.pop("partial_rotary_factor", None), get("partial_rotary_factor"), get("rotary_pct"), 1.0)
    params.setdefault("rope_type", _first(params.pop("type", None), "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope") and get("original_max_position_embeddings"):
        # Phi-3 keeps it at the top level; transformers prefers that over the dict's
        params["original_max_position_embeddings"] = get("original_max_position_embeddings")

    hidden, heads = _first(get("hidden_size"), get("n_embd")), _first(get("num_attention_heads"), get("n_head"))
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    if head_dim is None:
        raise RopePoolError(
            "RopeSpec.from_hf_config needs head_dim, or hidden_size and num_attention_heads, in the config; "
            f"got head_dim=None, hidden_size={hidden!r}, num_attention_heads={heads!r}. "
            "Fix: pass the model's full config, or build RopeSpec(head_dim=...) directly."
        )
    if get("model_type") == "gptj":
        found, rotary_dim = "gptj", get("rotary_dim") or head_dim
    else:
        found, rotary_dim = "neox", int(head_dim * partial)
    return cls(
        head_dim=head_dim, rotary_dim=rotary_dim, base=base, style=style or found,
        scaling=params if params["rope_type"] != "default" else None,
        max_position_embeddings=_first(get("max_position_embeddings"), get("n_positions")), seq_len=seq_len,
    )


def specs_for_layers(cls, config, *, style=None, seq_len=None):
    get = _getter(config)
    spec = spec_from_config(cls, config, style=style, seq_len=seq_len)
    return [spec] * int(get("num_hidden_layers") or get("n_layer"))
