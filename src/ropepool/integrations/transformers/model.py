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

import torch

from ...backends import pick
from ...backends.torch_native import cos_sin_rows
from ...errors import RopePoolError
from ...rotation.norm import QKNorm
from ...rotation.spec import CosSinCache, RopeSpec
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
    fuse = norm_fused(model, backend)
    return {m: Layer(m.layer_idx, specs[m.layer_idx], QKNorm.from_hf_attention(m) if fuse else None, backend)
            for m in modules}


def norm_fused(model, backend: str | None) -> bool:
    """Whether ropepool's call also takes the layers' q/k norm on the model's device and dtype: only where the row
    that runs the call without it (``backends.pick``) takes it too. Where the norm would move the call to another
    row (the CPU kernel without a norm: to the general torch code, several times its cost), transformers' own
    ``q_norm``/``k_norm`` run as shipped and ropepool's call is RoPE and the write."""
    weight = next(model.parameters())
    x = torch.empty(0, dtype=weight.dtype, device=weight.device)
    try:
        return pick("torch", x, backend, frozenset({"norm"})) is pick("torch", x, backend)
    except RopePoolError:  # no row runs here (a backend named for another device): the first call says so
        return True


_TABLES: dict = {}  # RopeSpec -> CosSinCache: its float32 cos|sin rows (CPU), shared by equal rotations
_TABLE_ROWS = 4096  # the first table's positions; then doubled past the largest position a step reaches


def cpu_table(spec: RopeSpec, top: int):
    """``spec``'s rotation as a CPU cos/sin table (vLLM's format: ``[positions, rotary_dim]``, cos then sin) with
    rows for positions up to at least ``top``, or ``spec`` itself where a table cannot stand for it (no RoPE,
    longrope's switch between frequency sets, MRoPE).

    A CPU layer's call then gathers its rows (the engine-table path) instead of computing cos/sin for its
    tokens: the step's positions are the same for every layer, so computing them per layer repeats work
    (for rotary_dim // 2 below 32, ~20 us a layer on the dev VM, four times the kernel's own call).
    The rows are ropepool's own rotation, float32(p) * inv_freq then cos and sin in float32 and the attention
    scaling, as the general torch code computes them per call (docs/precision.md: within its bounds, not its
    bits). Grown by doubling, so a model's table is at most twice the positions it served: 64 MB at 131,072
    positions of rotary_dim 128, as the CPU kernel's own tables."""
    rot = spec.rotation
    if not rot.rotary_dim or rot.long_from is not None or rot.mrope_section is not None:
        return spec
    have = _TABLES.get(spec)
    if have is not None and have.max_position > top:
        return have
    rows = _TABLE_ROWS
    while rows <= top:
        rows *= 2
    # (the CPU kernel's own tables' recipe, one frequency set)
    table = _TABLES[spec] = CosSinCache(cos_sin_rows(torch.from_numpy(rot.freqs[:1]), rot.attention_scaling, 0, rows),
                                        is_neox=not rot.gptj)
    return table
