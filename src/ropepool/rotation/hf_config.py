"""RopeSpecs read from transformers configs: the model families as data.

``FAMILIES`` maps a ``model_type`` to how transformers' own modeling code for
that family rotates (read from ``models/<family>/modeling_*.py`` and checked
by tests/test_hf_conformance.py against those modules): the pair style, the
default partial-rotary factor its config class sets, where the rotary width
comes from, which layers rotate and with which parameters, and MRoPE.
docs/models.md is the table in words. A ``model_type`` missing from the table
raises unless ``style=`` is given: a wrong pair style is a silent wrong answer.
A plain dict without ``model_type`` is read as NeoX (rotate_half), as documented.

Both config spellings are read: transformers 5 keeps ``rope_theta``,
``partial_rotary_factor`` and the scaling keys in ``rope_parameters``
(per layer type for Gemma 3 and others); older configs keep ``rope_theta`` at
the top level next to ``rope_scaling``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import RopePoolError


@dataclass(frozen=True)
class Family:
    """How one transformers model family rotates (see the module docstring)."""

    # "neox" (rotate_half), "gptj" (interleaved pairs: rotate_every_two, an interleaved
    # rotate_half, complex multiplication), or "flag": GPT-J when config.rope_interleave
    # (transformers' default True) else NeoX (DeepSeek V3 and its MLA descendants).
    style: str = "neox"
    partial: float = 1.0  # the partial_rotary_factor the config class sets when a config has none
    # "partial": int(head_dim * partial_rotary_factor); "rotary_dim": config.rotary_dim
    # (GPT-J); "mla": the rope part of MLA heads, qk_rope_head_dim, is the whole head.
    rotary: str = "partial"
    # Which layers have no RoPE: None; "no_rope_layers" (0 marks one; Llama 4, SmolLM3);
    # "full" (full-attention layers; Cohere 2); "full_if_sliding" (full-attention layers
    # of a model with a sliding window; EXAONE 4).
    nope: str | None = None
    # layer_types when a config has none, as the config class derives them: (config key of n, its
    # default, the type of every n-th layer, the type of the others)
    pattern: tuple | None = None
    theta: float = 10000.0  # the config class's rope_theta default (its default_theta)
    local_base: float | None = None  # Gemma 3: sliding layers use rope_local_base_freq (this default), no scaling
    mrope: tuple | None = None  # the mrope_section the modeling code falls back on: the family always uses MRoPE
    mrope_interleaved: bool = False  # the modeling code interleaves (whatever the config's flag says)


NEOX = Family()
_MLA = {"rotary": "mla"}
_QWEN3_VL = Family(mrope=(24, 20, 20), mrope_interleaved=True, theta=5e5)
_QWEN2_VL = Family(mrope=(16, 24, 24), theta=1e6)
_SLIDING = ("sliding_window_pattern", 4, "full_attention", "sliding_attention")
_LINEAR = ("full_attention_interval", 4, "full_attention", "linear_attention")
_QWEN3_5 = Family(partial=0.25, mrope=(11, 11, 10), mrope_interleaved=True, pattern=_LINEAR)
_GEMMA3 = Family(pattern=("sliding_window_pattern", 6, "full_attention", "sliding_attention"), local_base=10000.0,
                 theta=1e6)
_LLAMA4 = Family(style="gptj", nope="no_rope_layers", theta=5e5)

# model_type -> Family. Composite (multimodal) configs are read through their
# text_config; their own model_type is listed where the text config may lack one.
FAMILIES: dict[str, Family] = {
    **dict.fromkeys([
        "llama", "mistral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
        "granite", "granitemoe", "granitemoeshared", "olmo", "olmo2", "olmoe", "starcoder2", "phi3",
        "seed_oss", "arcee",
    ], NEOX),
    **{t: Family(theta=theta) for t, theta in (("mixtral", 1e6), ("phimoe", 1e6), ("gpt_oss", 150000.0),
                                             ("apertus", 1.2e7), ("bitnet", 5e5), ("olmo3", 5e5))},
    "qwen3_next": Family(partial=0.25, pattern=_LINEAR),
    "minimax": Family(pattern=(None, 2, "linear_attention", "full_attention"), theta=1e6),
    "phi": Family(partial=0.5),
    "persimmon": Family(partial=0.5),
    "nemotron": Family(partial=0.5),
    "glm4_moe": Family(partial=0.5),  # NeoX, unlike GLM-4
    "stablelm": Family(partial=0.25),
    "gpt_neox": Family(partial=0.25),  # rotary_pct
    "smollm3": Family(nope="no_rope_layers", theta=2e6),
    "exaone4": Family(nope="full_if_sliding", pattern=_SLIDING),
    "gemma3_text": _GEMMA3, "gemma3": _GEMMA3,
    "qwen2_vl_text": _QWEN2_VL, "qwen2_vl": _QWEN2_VL, "qwen2_5_vl_text": _QWEN2_VL, "qwen2_5_vl": _QWEN2_VL,
    **dict.fromkeys(["qwen3_vl_text", "qwen3_vl", "qwen3_vl_moe_text", "qwen3_vl_moe"], _QWEN3_VL),
    **dict.fromkeys(["qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"], _QWEN3_5),
    # interleaved pairs
    **dict.fromkeys(["cohere", "ernie4_5", "ernie4_5_moe"], Family(style="gptj", theta=5e5)),
    "helium": Family(style="gptj", theta=1e5),
    "cohere2": Family(style="gptj", nope="full", pattern=_SLIDING),
    "glm": Family(style="gptj", partial=0.5),
    "glm4": Family(style="gptj", partial=0.5),
    "gptj": Family(style="gptj", rotary="rotary_dim"),
    "llama4_text": _LLAMA4, "llama4": _LLAMA4,
    "deepseek_v2": Family(style="gptj", **_MLA),
    **dict.fromkeys(["deepseek_v3", "glm4_moe_lite", "youtu"], Family(style="flag", **_MLA)),
}

# layer types that hold no softmax attention (linear attention, state-space, convolution):
# for_layers gives them a no-RoPE spec; from_hf_config looks past them.
NOT_ATTENTION = ("linear_attention", "mamba", "conv")
# keys of rope_parameters / rope_scaling that are not scaling parameters
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "type", "mrope_section", "mrope_interleaved",
                "llama_4_scaling_beta")


def _getter(config):
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


def _first(*values):
    return next((v for v in values if v is not None), None)


def _family(model_type, style):
    if model_type is None:
        return NEOX  # a plain dict: documented as NeoX
    family = FAMILIES.get(model_type)
    if family is None:
        if style is None:
            raise RopePoolError(
                f"RopeSpec.from_hf_config has no verified pair style for model_type {model_type!r}; got a config "
                "of that type, and reading it as NeoX could silently rotate the wrong pairs. Fix: check the "
                "model's apply_rotary_pos_emb and pass style='neox' (rotate_half) or style='gptj' (interleaved "
                "pairs), e.g. RopeSpec.from_hf_config(config, style='neox'); docs/models.md lists the known types."
            )
        return NEOX
    return family


def _layer_types(get, family: Family, n_layers: int):
    types = get("layer_types")
    if types:
        return list(types)
    if family.pattern is None or (family.nope == "full_if_sliding" and get("sliding_window") is None):
        return ["full_attention"] * n_layers
    key, n, every, others = family.pattern
    n = (get(key) if key else None) or n
    if isinstance(n, str):  # EXAONE 4: "LLLG"
        return ["sliding_attention" if n[i % len(n)] == "L" else "full_attention" for i in range(n_layers)]
    return [others if (i + 1) % n else every for i in range(n_layers)]


def _has_rope(get, family: Family, n_layers: int, types) -> list[bool]:
    if family.nope == "no_rope_layers":
        flags = get("no_rope_layers")
        if not flags:  # transformers' default: every no_rope_layer_interval-th layer without RoPE
            interval = get("no_rope_layer_interval") or 4
            flags = [(i + 1) % interval != 0 for i in range(n_layers)]
        return [bool(f) for f in flags]
    if family.nope == "full" or (family.nope == "full_if_sliding" and get("sliding_window") is not None):
        return [t == "sliding_attention" for t in types]
    return [True] * n_layers


def _params_by_type(get, family: Family) -> dict:
    """rope_parameters (theta and scaling) for each layer type; key None: every layer."""
    # transformers lets rope_scaling win when a config carries both spellings
    params = _first(get("rope_scaling"), get("rope_parameters")) or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        local = family.local_base or family.theta
        return {k: {"rope_theta": local if k == "sliding_attention" else family.theta} | dict(v)
                for k, v in params.items()}
    params = dict(params)
    params["rope_theta"] = _first(params.get("rope_theta"), get("rope_theta"), get("rotary_emb_base"), family.theta)
    if family.local_base is None:
        return {None: params}
    # Gemma 3's older spelling: rope_theta and rope_scaling on global layers, rope_local_base_freq on sliding ones
    local = {"rope_type": "default", "rope_theta": _first(get("rope_local_base_freq"), family.local_base)}
    return {"full_attention": params, "sliding_attention": local}


def _spec(cls, get, family: Family, params: Mapping, style, seq_len):
    params = dict(params)
    base = params["rope_theta"]
    partial = _first(params.get("partial_rotary_factor"), get("partial_rotary_factor"), get("rotary_pct"),
                     family.partial)
    section = _first(params.get("mrope_section"), get("mrope_section"), family.mrope)
    interleaved = family.mrope_interleaved if family.mrope else bool(params.get("mrope_interleaved"))
    rope_type = _first(params.get("rope_type"), params.get("type"), "default")
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    # Qwen2-VL's legacy {"type": "mrope", "mrope_section": ...} is plain RoPE with sections
    scaling["rope_type"] = "default" if rope_type == "mrope" else rope_type
    if scaling["rope_type"] in ("llama3", "yarn", "longrope") and get("original_max_position_embeddings"):
        # Phi-3 keeps it at the top level; transformers prefers that over the dict's
        scaling["original_max_position_embeddings"] = get("original_max_position_embeddings")

    if family.rotary == "mla":
        head_dim = rotary_dim = get("qk_rope_head_dim")
    else:
        hidden = _first(get("hidden_size"), get("n_embd"))
        heads = _first(get("num_attention_heads"), get("n_head"))
        head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
        rotary_dim = None
    if head_dim is None:
        raise RopePoolError(
            "RopeSpec.from_hf_config needs head_dim, or hidden_size and num_attention_heads, in the config; "
            f"got head_dim=None, hidden_size={get('hidden_size')!r}, num_attention_heads="
            f"{get('num_attention_heads')!r}. Fix: pass the model's full config (for a multimodal model the "
            "config itself, or its text_config), or build RopeSpec(head_dim=...) directly."
        )
    if rotary_dim is None:
        rotary_dim = (get("rotary_dim") or head_dim) if family.rotary == "rotary_dim" else int(head_dim * partial)
    if style is None:
        style = family.style if family.style != "flag" else ("gptj" if _first(get("rope_interleave"), True) else "neox")
    return cls(
        head_dim=head_dim, rotary_dim=rotary_dim, base=base, style=style,
        scaling=scaling if scaling["rope_type"] != "default" else None,
        max_position_embeddings=_first(get("max_position_embeddings"), get("n_positions")), seq_len=seq_len,
        mrope_section=section, mrope_interleaved=interleaved and section is not None,
    )


def _text_config(config):
    """A multimodal config's text_config (with the parent's model_type if it has none), else the config."""
    get = _getter(config)
    text = get("text_config")
    if text is None:
        return config, get("model_type")
    return text, _first(_getter(text)("model_type"), get("model_type"))


def _read(cls, config, style, seq_len, per_layer):
    """(one spec per decoder layer, the layer types); without a layer count (from_hf_config only):
    one spec per rope_parameters entry, types None."""
    config, model_type = _text_config(config)
    get = _getter(config)
    family = _family(model_type, style)
    by_type = _params_by_type(get, family)
    made = {key: _spec(cls, get, family, params, style, seq_len) for key, params in by_type.items()}
    n_layers = _first(get("num_hidden_layers"), get("n_layer"), len(get("layer_types") or ()) or None)
    if n_layers is None:
        if not per_layer and family.nope is None:
            return list(made.values()), [None] * len(made)
        raise RopePoolError(
            "RopeSpec.for_layers needs num_hidden_layers in the config; got none (and no layer_types). "
            "Fix: pass the model's full config, or RopeSpec.from_hf_config(config) for a model whose layers agree."
        )
    types = _layer_types(get, family, n_layers)
    nope = cls(head_dim=next(iter(made.values())).head_dim, rotary_dim=0)
    specs = []
    for i, (kind, rotates) in enumerate(zip(types, _has_rope(get, family, n_layers, types))):
        key = None if None in made else kind
        if not rotates or kind in NOT_ATTENTION:
            specs.append(nope)
        elif key in made:
            specs.append(made[key])
        else:
            raise RopePoolError(
                f"RopeSpec.for_layers found no rope_parameters for layer {i} of type {key!r}; got rope_parameters "
                f"for {sorted(map(str, made))}. Fix: give rope_parameters an entry for every layer type, as "
                "transformers' config class does."
            )
    return specs, types


def spec_from_config(cls, config, *, style=None, seq_len=None):
    specs, types = _read(cls, config, style, seq_len, per_layer=False)
    distinct = list(dict.fromkeys(s for s, t in zip(specs, types) if t not in NOT_ATTENTION))
    if len(distinct) > 1:
        kinds = sorted({f"rotary_dim={s.rotary_dim} base={s.base:g} {s.rope_type}" if s.rotary_dim else "no RoPE"
                        for s in distinct})
        raise RopePoolError(
            f"RopeSpec.from_hf_config reads one RoPE per model; got layers whose RoPE differs ({'; '.join(kinds)}). "
            "Fix: RopeSpec.for_layers(config) gives one spec per decoder layer."
        )
    return distinct[0]


def specs_for_layers(cls, config, *, style=None, seq_len=None):
    return _read(cls, config, style, seq_len, per_layer=True)[0]
