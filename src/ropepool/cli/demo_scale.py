"""``ropepool demo --geometry llama3-8b``: the demo at a real model's widths, for a GPU.

The small models of ``demo.py`` make every step host time; this builds a
Llama with Llama-3-8B's widths (hidden 4096, 32 query heads, 8 KV heads of
128, MLP 14336, vocabulary 128256, rope_theta 500000; meta-llama/Meta-Llama-3-8B's
config.json) but only a few layers, with seeded random weights made on the
device (nothing is downloaded), and sends ``requests`` prompts through
transformers' continuous batching as shipped and through ropepool, with
``demo.compare``'s interleaved runs.
"""
from __future__ import annotations

GEOMETRIES = {
    "llama3-8b": ("LlamaConfig", {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                  "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                                  "tie_word_embeddings": False}),
}
PAGE_SIZE = 16
MAX_BATCH_TOKENS = 256  # tokens a step: prompts prefilled in chunks beside the decode tokens


def build(name: str, *, layers: int, dtype, device, seed: int = 0):
    """The model of geometry ``name`` with ``layers`` layers and random weights, made on ``device``."""
    import torch
    import transformers

    cls_name, widths = GEOMETRIES[name]
    config = getattr(transformers, cls_name)(**widths, num_hidden_layers=layers)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a CPU init of these widths takes long
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    g = model.generation_config
    g.eos_token_id, g.pad_token_id, g.bos_token_id, g.do_sample = None, 0, None, False
    return model


def prompt_lengths(requests: int, seed: int = 3) -> list:
    """``requests`` prompt lengths between 16 and 128 (seeded)."""
    import random

    rng = random.Random(seed)
    return [rng.randint(16, 128) for _ in range(requests)]


def batching(requests: int, lengths: list, new_tokens: int, max_batch_tokens: int):
    """A batching config with pages for every request at once (prefill chunks of ``max_batch_tokens``)."""
    from .demo import batching_config

    pages = sum(-(-(n + new_tokens) // PAGE_SIZE) for n in lengths) + requests
    return batching_config(page_size=PAGE_SIZE, num_blocks=pages, max_batch_tokens=max_batch_tokens)
