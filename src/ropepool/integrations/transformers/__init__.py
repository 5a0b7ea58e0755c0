"""ropepool inside transformers' own continuous batching (``generate_batch``, ``ContinuousBatchingManager``).

``enable(model)`` is all a user calls: afterwards every attention layer's
q/k norm (where the family has one), RoPE and paged-cache write in a
continuous-batching step are ONE ``rope_pool_fused`` call, on transformers'
own ``PagedAttentionCache`` tensors at its own slots (DeepSeek V3's latent
attention: one ``rope_latent_fused`` call on its latent cache, latent.py),
while the scheduler, the cache allocator and the attention itself stay
transformers'. How it hooks in, what runs where and which families are
hosted: docs/integration.md.

Example
-------
>>> import torch, transformers
>>> from transformers.generation import ContinuousBatchingConfig
>>> from ropepool.integrations import transformers as rp
>>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
>>> model = rp.enable(model)
>>> out = model.generate_batch([[1, 5, 9], [7, 3]], max_new_tokens=4, do_sample=False,
...                            continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32))
>>> [len(r.generated_tokens) for r in out.values()]
[4, 4]
"""
from __future__ import annotations

import weakref

from packaging.version import Version

from ...errors import RopePoolError
from . import attention
from .model import FAMILIES, read_model

_ENABLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (layers, hook handles)


def enable(model, *, backend: str | None = None):
    """Run ``model``'s continuous batching through ``rope_pool_fused`` (MLA: ``rope_latent_fused``); returns ``model``.

    Parameters
    ----------
    model : a transformers ``*ForCausalLM`` of a family in ``FAMILIES``
        Loaded with ``attn_implementation="sdpa"`` or ``"eager"`` (continuous
        batching runs them as transformers' paged sdpa / eager attention).
    backend : str, optional
        Passed to ``rope_pool_fused`` (None: the fastest that can run).

    Only continuous-batching steps change: ``model.generate`` and plain
    forwards run exactly as before. Calling it again replaces the settings.

    Raises
    ------
    ropepool.RopePoolError
        transformers older than 5.17 (for DeepSeek V3: one whose batching has no
        latent cache), a family ropepool cannot host, a model
        whose layers do not match its config, or an attention implementation
        other than sdpa / eager (flash attention writes the cache in its own
        kernel).
    """
    import transformers

    if Version(transformers.__version__).release < (5, 17):
        raise RopePoolError(
            f"ropepool hosts the continuous batching of transformers 5.17 and later 5.x; got transformers "
            f"{transformers.__version__}. Fix: pip install 'transformers>=5.17,<6'.")
    disable(model)
    layers = read_model(model, backend)
    attention.install_attention_functions()
    implementation = model.config._attn_implementation
    if implementation != "eager" and not attention.hosted(implementation):
        raise RopePoolError(
            f"ropepool hosts transformers' continuous batching with sdpa or eager attention; this model is set to "
            f"{implementation!r}. Fix: load it with attn_implementation='sdpa' (or call "
            "model.set_attn_implementation('sdpa')) before enable(model).")
    _ENABLED[model] = (layers, attention.attach(model, layers))
    return model


def disable(model):
    """Undo ``enable``: transformers' own RoPE and cache write again; returns ``model``."""
    layers, handles = _ENABLED.pop(model, (None, None))
    if layers is not None:
        attention.detach(layers, handles)
    return model


def is_enabled(model) -> bool:
    return model in _ENABLED


__all__ = ["FAMILIES", "disable", "enable", "is_enabled"]
