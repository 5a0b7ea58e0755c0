"""Multi-head latent attention (DeepSeek V3) in transformers' continuous batching: one ``rope_latent_fused`` per step.

transformers' ``MLACacheAllocator`` keeps one row per token for an MLA layer,
``kv_c | k_rot`` (``kv_lora_rank + qk_rope_head_dim``), and DeepseekV3Attention
writes it through ``cache.update(kv_nope, k_rot, layer_idx, kwargs=...)``
before it expands the latents it gets back to heads with its own
``kv_b_proj``. Per MLA layer and continuous-batching step:

1. attention.py's forward of the module hands it an identity rotation and, in
   place of its ``cache``, a ``LatentStep`` (also passed on to attention);
2. forward hooks on the q projection and on ``kv_a_proj_with_mqa`` keep their
   outputs: q_pe and k_pe are views of them;
3. the module calls ``LatentStep.update``: ONE ``rope_latent_fused`` call
   rotates q_pe and k_pe and writes kv_c and the rotated k_pe into
   transformers' cache rows at its slots; the rows attention reads come back
   by transformers' own rule (every cached row of the request, after the write);
4. attention.py's wrapper puts the rotated q_pe into the query's rope features.

q_pe and k_pe are taken from the projections, not from the identity
rotation's output, because with ``rope_interleave`` transformers permutes each
head's rope features (evens, then odds) before rotating; ropepool rotates
pairs in place (``RopeSpec.from_hf_config``: GPT-J pairs) and stores them so,
as vLLM does. q and k share the layout, so every attention score is the same.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from ...api import rope_latent_fused
from ...errors import RopePoolError
from ...rotation.spec import RopeSpec

FAMILIES = ("deepseek_v3",)

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> its LatentStep in flight
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {layer: (ckv, kpe)}


@dataclass(frozen=True, eq=False)
class LatentLayer:
    """One MLA layer as ropepool runs it."""

    index: int
    rope: RopeSpec
    nope: int  # qk_nope_head_dim: each q head is nope features, then the rope features
    kv_lora_rank: int
    backend: str | None


def read_model(model, config, backend: str | None) -> dict:
    """``{attention module: LatentLayer}``; raises where transformers' batching has no latent cache."""
    import transformers
    from transformers.generation.continuous_batching import cache as cb_cache

    if not hasattr(cb_cache, "MLACacheAllocator"):
        raise RopePoolError(
            f"ropepool hosts {config.model_type} in continuous batching that caches MLA latents "
            f"(MLACacheAllocator); transformers {transformers.__version__} has none. Fix: pip install "
            "'transformers>=5.25,<6' (tests/test_integration_mla.py covers 5.25).")
    modules = sorted((m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")), key=lambda m: m.layer_idx)
    if len(modules) != config.num_hidden_layers:
        raise RopePoolError(
            f"cannot host this {config.model_type} model: config.num_hidden_layers is {config.num_hidden_layers} "
            f"but {len(modules)} attention modules were found. Fix: load the model from its own config.")
    spec = RopeSpec.from_hf_config(config)
    return {m: LatentLayer(m.layer_idx, spec, config.qk_nope_head_dim, config.kv_lora_rank, backend)
            for m in modules}


def attach(module) -> list:
    """Keep the module's q and kv_a projections' outputs while its step is in flight; returns the hook handles."""
    q_proj = module.q_proj if module.q_proj is not None else module.q_b_proj
    return [q_proj.register_forward_hook(_keep(module, "q")),
            module.kv_a_proj_with_mqa.register_forward_hook(_keep(module, "kv"))]


def enter(module, layer: LatentLayer, cache) -> LatentStep:
    step = _STEPS[module] = LatentStep(layer, cache)
    return step


def leave(module) -> None:
    _STEPS.pop(module, None)


def _keep(module, name):
    ref = weakref.ref(module)

    def hook(proj, args, output):
        step = _STEPS.get(ref())
        if step is not None:
            setattr(step, name, output)

    return hook


class LatentStep:
    """What one MLA layer's ``cache`` is during a fused step: ``update`` is the ropepool call."""

    def __init__(self, layer: LatentLayer, cache):
        self.layer, self.cache = layer, cache
        self.q = self.kv = self.q_pe_rot = None

    def update(self, kv_c, k_rot, layer_idx, kwargs):
        """``kv_c`` ``[1, 1, T, kv_lora_rank]`` (normalised); ``k_rot`` is the identity rotation's, not used.

        Returns the latents of every row attention reads, ``[1, 1, rows, ...]`` each, as transformers does."""
        layer, T = self.layer, kv_c.shape[2]
        if self.q is None or self.kv is None:
            raise RopePoolError(
                f"cannot host MLA layer {layer.index}: its q projection and kv_a_proj_with_mqa did not run as "
                "modules before cache.update. Fix: disable ropepool for this model; this transformers version "
                "computes MLA differently from the one tests/test_integration_mla.py covers.")
        ckv, kpe, slots, read_index = _latent_rows(self.cache, layer.index, kwargs)
        q_pe = self.q[0].view(T, -1, layer.nope + kpe.shape[-1])[..., layer.nope:]
        k_pe = self.kv[0, :, layer.kv_lora_rank:]
        self.q_pe_rot, k_pe_rot, _, _ = rope_latent_fused(
            q_pe, k_pe, kv_c[0, 0], kwargs["position_ids"][0], slots, ckv, kpe, rope=layer.rope,
            backend=layer.backend)
        if not read_index.numel():
            return kv_c, k_pe_rot[None, None]
        return ckv.index_select(0, read_index)[None, None], kpe.index_select(0, read_index)[None, None]

    def query(self, query):
        """transformers' query ``[1, heads, T, nope + rope]`` with the rotated q_pe as its rope features."""
        query[..., self.layer.nope:] = self.q_pe_rot.transpose(0, 1)
        return query


def _latent_rows(cache, layer: int, kwargs: dict):
    """The layer's cache columns, its slots (transformers' write trash -> -1: skipped) and the rows read."""
    alloc = cache.layer_to_allocator[layer]
    write = kwargs["write_index"][alloc.index]
    return (*columns(cache, layer), write.masked_fill(write == alloc.write_trash_index, -1),
            kwargs["read_index"][alloc.index])


def columns(cache, layer: int):
    """The layer's kv_c and k_pe columns of transformers' latent rows, ``[rows, kv_lora_rank]``, ``[rows, rope]``."""
    views = _VIEWS.setdefault(cache, {})
    if layer not in views:
        # Each layer's rows start tokens_per_page rows apart; all are cut to the rows any slot reaches (where
        # the group's last layer's view ends), so every layer has one cache shape.
        alloc = cache.layer_to_allocator[layer]
        rows = alloc._latent_token_views[alloc.layer_indices[-1]][0].shape[0]
        views[layer] = tuple(v[:rows] for v in alloc._latent_token_views[layer])
    return views[layer]
