"""Serve tiny random-weight checkpoints through vLLM (its CPU build) and save greedy tokens and ropepool's calls.

    python tests/engines/vllm_serve.py OUT.json --families llama,qwen3,llama@bfloat16,qwen3:80@bfloat16 [--tp 2]

(``name:80``: head_dim 80; ``@dtype``: float32 unless said; ``+CPU_MLA``: vLLM's attention backend, as
``attention_config={"backend": ...}`` selects it.)

Run as its own process (vLLM spawns workers: hence the ``__main__`` guard); the test runs it
with ropepool's entry point loaded as any install loads it, and with ``VLLM_PLUGINS=""``.
Each checkpoint is written with ``save_pretrained`` from a config in this file. With TP=1 the
engine and its worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor
"uni"), so several models are served one after another without a new process each.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
# initializer_range 0.2 (HF's default is 0.02): the next token then depends on the context, so a wrong
# rotation or cache row shows in the tokens.
# MLA (DeepSeek V2/V3 shaped): vLLM's CPU MLA takes kv_lora_rank + qk_rope_head_dim = 576 only; every layer dense
MLA = dict(SMALL, num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           n_shared_experts=1)
# DeepSeek V3's YaRN (factor 40 over 4096) scaled to this context: factor 4 over 128 positions; mscale and
# mscale_all_dim apart, so cos and sin carry yarn_get_mscale(4, 1) / yarn_get_mscale(4, 0.5) = 1.065
V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
# A vision-language model's special tokens, inside its vocabulary (512) and outside the prompts' tokens.
MM_TOKENS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
MULTIMODAL = ("qwen2_vl", "qwen3_vl")  # served text-only: no image or video per prompt, so vLLM builds no vision tower
LOGPROBS = 5  # the top log-probabilities kept per generated token (and the chosen token's)


def checkpoint(family: str, path: str) -> None:
    """A tiny random-weight model of ``family`` (``name`` or ``name:head_dim``) saved to ``path`` (seeded: the
    same weights in every process)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    family, _, head_dim = family.partition(":")
    dims = {"head_dim": int(head_dim)} if head_dim else {}
    if family == "llama":  # GQA, NeoX RoPE
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, **dims))
    elif family == "qwen3":  # per-head RMS norm of q and k before RoPE
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, **({"head_dim": 32} | dims)))
    elif family == "gptj":  # GPT-J pairs, partial rotary (32 of 64)
        model = tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=256, n_embd=128, n_layer=2, n_head=2, rotary_dim=32,
                                                 n_positions=512, initializer_range=0.2))
    elif family == "gemma3":  # per-layer RoPE base, one sliding-window layer (window 16) and one global
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, head_dim=32, sliding_window=16,
                                                         layer_types=["sliding_attention", "full_attention"]))
    elif family == "deepseek_v2":
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**MLA, q_lora_rank=None))
    elif family == "deepseek_v3":  # q through q_lora_rank, DeepSeek's YaRN (vLLM: DeepseekScalingRotaryEmbedding)
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**MLA, q_lora_rank=64, n_group=1, topk_group=1,
                                                             rope_parameters=V3_YARN))
    elif family == "qwen2_vl":  # MRoPE (vLLM's MRotaryEmbedding, [3, T] positions), served text-only
        model = tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
            text_config={**SMALL, **dims, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}},
            vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 1},
            **MM_TOKENS))
    elif family == "qwen3_vl":  # MRoPE interleaved, per-head q/k norms (Qwen3's), served text-only
        model = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config={**SMALL, "head_dim": 32, **dims, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5],
                                             "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                           "out_hidden_size": 128, "deepstack_visual_indexes": [0]},
            **MM_TOKENS))
    else:
        raise SystemExit(f"unknown family {family!r}")
    if family == "gemma3":  # Gemma scales embeddings by sqrt(hidden): at full size the last token's embedding
        model.model.embed_tokens.weight.data *= 0.1  # decides the next token whatever the context (measured)
    for name, w in model.named_parameters():  # q/k norm gains other than HF's 1 (0 for Gemma's 1 + w): a norm
        if name.endswith(("q_norm.weight", "k_norm.weight")):  # skipped or applied twice changes the tokens
            w.data += 0.5 * torch.randn_like(w)
    model.save_pretrained(path)


def prompts():
    """Two batches: the second's first prompt shares 64 tokens (two 32-token blocks) with the first batch's."""
    long = [(7 * i) % 251 + 1 for i in range(70)]
    first = [long, [5, 9, 2, 77, 13, 3, 8, 100, 42]]
    second = [long[:64] + [17, 19, 23], [(3 * i) % 200 + 2 for i in range(33)]]
    return first, second


def serve(family: str, dtype: str, tp: int, max_tokens: int, backend: str | None = None) -> dict:
    from vllm import LLM, SamplingParams

    path = tempfile.mkdtemp(prefix=f"ropepool-{family}-")
    checkpoint(family, path)
    t0 = time.perf_counter()
    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, enable_prefix_caching=True,
              block_size=32, max_model_len=256, max_num_seqs=4, seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp",
              attention_config={"backend": backend} if backend else None,
              **({"limit_mm_per_prompt": {"image": 0, "video": 0}} if family.partition(":")[0] in MULTIMODAL else {}))
    up = time.perf_counter() - t0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    tokens, cached, logprobs = [], [], []
    for batch in prompts():
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        cached += [o.num_cached_tokens or 0 for o in outs]
        logprobs += [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    shutil.rmtree(path, ignore_errors=True)
    return {"tokens": tokens, "cached": cached, "logprobs": logprobs, "startup_s": round(up, 1)}


def torchvision_stand_in() -> None:
    """Where torchvision is not importable, put standin/torchvision first on the path of this process and of the
    ones vLLM starts (its model inspection runs in a subprocess): vLLM's vision-language modules import it."""
    import importlib.util
    import sys

    if importlib.util.find_spec("torchvision") is None:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
        sys.path.insert(0, here)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--families", default="llama")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=6)
    a = p.parse_args()
    if a.tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if any(f.partition(":")[0].partition("@")[0] in MULTIMODAL for f in a.families.split(",")):
        torchvision_stand_in()
    calls = os.environ.get("ROPEPOOL_VLLM_CALLS")
    results = {}
    for family in a.families.split(","):  # name[@dtype][+BACKEND] (float32 unless said; vLLM picks the backend)
        spec, _, backend = family.partition("+")
        name, _, dtype = spec.partition("@")
        if calls:  # one file of ropepool's calls per family (the plugin reads the variable at each call)
            os.environ["ROPEPOOL_VLLM_CALLS"] = f"{calls}.{family}"
        try:
            results[family] = serve(name, dtype or "float32", a.tp, a.max_tokens, backend or None)
        except Exception as e:  # noqa: BLE001 - the test reports what vLLM said, per family
            results[family] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        if calls and os.path.exists(f"{calls}.{family}"):
            with open(f"{calls}.{family}") as f:
                results[family]["calls"] = [line.split() for line in f]
    with open(a.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
