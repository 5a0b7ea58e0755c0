"""``ropepool demo --framework mlx``: mlx-lm's own models, with and without ropepool's slot pools.

For each family (Llama, Mistral, Qwen2, Qwen3) a small mlx-lm model is built
from a config written here, with seeded random weights (nothing is
downloaded). The same prompts are decoded greedily by mlx-lm's own
``generate_step`` and by ``ropepool.integrations.mlx_lm.PooledModel``, where
every attention layer's RoPE (and Qwen3's q/k norms) and KV write is one
``rope_pool_fused`` call into a slot pool: both one prompt at a time (the
comparison), then ropepool with all prompts decoding together (what batching
adds on top). The demo prints tokens/s and whether the tokens match; it
exits non-zero on a mismatch (float32; in bfloat16 the two paths round
differently, and greedy decoding may part at a near-tie, which is reported,
not failed).
"""
from __future__ import annotations

import time

_BASE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 256, "tie_word_embeddings": True,
         "max_position_embeddings": 4096}
# Llama with llama3 scaling, Mistral with a head_dim of its own, Qwen2 with q/k/v biases, Qwen3 with q/k norms
# (tests/test_mlx_lm.py builds the same models).
CONFIGS = {
    "llama": {**_BASE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}},
    "mistral": {**_BASE, "model_type": "mistral", "rope_theta": 1e6, "head_dim": 32},
    "qwen2": {**_BASE, "model_type": "qwen2", "rope_theta": 1e6},
    "qwen3": {**_BASE, "model_type": "qwen3", "rope_theta": 1e6, "head_dim": 32},
}
PROMPT_LENGTHS = (5, 13, 2, 30, 9, 21)


def build(config: dict, dtype, seed: int = 0):
    """A small mlx-lm model of ``config`` (one of CONFIGS); weights scaled up x4 so the next token depends on
    the context and a wrong rotation shows in the tokens."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map_with_path(
        lambda path, w: w * 4 if path.endswith("weight") and "norm" not in path and w.ndim == 2 else w,
        model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def run_family(family: str, dtype, new_tokens: int, seed: int = 0) -> dict:
    """Greedy tokens and tokens/s of mlx-lm's own decode and of ropepool's slot pools, both one prompt at a
    time (like with like), and of ropepool with all prompts decoding together (what batching adds). Each
    path first runs once untimed, so no timing includes a first call's setup."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    from ..integrations.mlx_lm import PooledModel

    gen = np.random.default_rng(seed + 1)
    prompts = [gen.integers(0, _BASE["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    model = build(CONFIGS[family], dtype, seed)
    pooled = PooledModel(model, CONFIGS[family], pool_rows=1024)

    def mlx_lm(p):
        return [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=new_tokens,
                                                  sampler=lambda x: mx.argmax(x, axis=-1))]

    mlx_lm(prompts[0]), pooled.generate(prompts[:1], new_tokens)  # untimed
    t0 = time.perf_counter()
    shipped = [mlx_lm(p) for p in prompts]
    t1 = time.perf_counter()
    alone = [pooled.generate([p], new_tokens)[0] for p in prompts]
    t2 = time.perf_counter()
    batched = pooled.generate(prompts, new_tokens)
    t3 = time.perf_counter()
    first = next((i for i, (a, b, c) in enumerate(zip(shipped, alone, batched)) if not a == b == c), None)
    n = len(prompts) * new_tokens
    return {"family": family, "match": first is None, "first_mismatch": first,
            "mlx_lm_tok_s": n / (t1 - t0), "ropepool_tok_s": n / (t2 - t1), "batched_tok_s": n / (t3 - t2)}


def main(argv=None) -> int:
    from . import Parser, alias, choosers, count, names_of

    p = Parser(prog="ropepool demo --framework mlx", description=__doc__.split("\n")[0])
    choosers(p, "demo")
    alias(p, "--model", p.add_argument("--families", type=names_of(tuple(CONFIGS), all_=True), default="all",
                                       help=f"comma-separated from {', '.join(CONFIGS)}, or all (the default)"))
    p.add_argument("--dtype", type=names_of(("float32", "bfloat16")), default="float32,bfloat16",
                   help="the models' dtypes, comma-separated from float32, bfloat16 (default both; in float32 the "
                        "tokens must be identical)")
    p.add_argument("--new-tokens", type=count, default=16, help="greedy tokens generated per prompt (default 16)")
    a = p.parse_args(argv)
    import mlx.core as mx

    ok = True
    for dtype in a.dtype:
        print(f"{dtype}, {len(PROMPT_LENGTHS)} prompts x {a.new_tokens} tokens, {mx.default_device()}: tokens/s of "
              "mlx-lm's generate_step and of ropepool's slot pools, one prompt at a time; then ropepool with all "
              "prompts decoding together")
        for family in a.families:
            r = run_family(family, getattr(mx, dtype), a.new_tokens)
            verdict = "tokens identical" if r["match"] else f"tokens differ from prompt {r['first_mismatch']} on"
            print(f"  {family:<8} mlx-lm {r['mlx_lm_tok_s']:8.1f}   ropepool {r['ropepool_tok_s']:8.1f} "
                  f"({r['ropepool_tok_s'] / r['mlx_lm_tok_s']:.2f}x)   ropepool batched {r['batched_tok_s']:8.1f}   "
                  f"{verdict}")
            ok &= r["match"] or dtype != "float32"
    return 0 if ok else 1
