"""The hidden setups of the docs' code blocks (tests/test_doc_blocks.py).

A block that uses names defined elsewhere (a model, an engine's cache, the
step's q, k, v) is preceded in its markdown file by
``<!-- doc-test: setup=EXPR -->``; EXPR is evaluated here and returns the
names the block reads, which the block then runs with, as written. Models
are small ones built from transformers configs with random weights;
engine objects (vLLM's layer, sglang's forward batch) are plain stand-ins
holding real tensors in the layout the docs give for them. Every tensor is
on DEVICE, which is also what a block's ``device="cuda"`` means when no GPU
is present.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

import ropepool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, L, PAGE, BLOCKS = 5, 2, 16, 8
POOL = PAGE * BLOCKS


def _randn(*shape, dtype="float32"):
    return torch.randn(*shape, device=DEVICE).to(getattr(torch, dtype))


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def inputs(Hq, Hkv, D, dtype="float32"):
    """One step of T tokens for (Hq, Hkv, D) heads, the pools and caches the docs' blocks name, and the sizes."""
    slots = _ints([10, 11, 12, -1, 40])
    cache = dict(dtype=getattr(torch, dtype), device=DEVICE)
    return dict(
        T=T, Hq=Hq, Hkv=Hkv, D=D, L=L, i=1, pool_size=POOL, num_blocks=BLOCKS, num_pages=BLOCKS, block_size=PAGE,
        page_size=PAGE, q=_randn(T, Hq, D, dtype=dtype), k=_randn(T, Hkv, D, dtype=dtype),
        v=_randn(T, Hkv, D, dtype=dtype), positions=_ints([0, 1, 2, 17, 18]), slots=slots, slot_mapping=slots.long(),
        page_of_token=slots // PAGE, row_of_token=slots % PAGE,
        k_pool=torch.zeros(POOL, Hkv, D, **cache), v_pool=torch.zeros(POOL, Hkv, D, **cache),
        k_cache=torch.zeros(L, POOL, Hkv, D, **cache), v_cache=torch.zeros(L, POOL, Hkv, D, **cache),
        kv_all=torch.zeros(L, 2, BLOCKS, PAGE, Hkv, D, **cache),
        spec=ropepool.RopeSpec(head_dim=D, base=500000.0),
        k_scale_tensor=torch.tensor([0.5], device=DEVICE), v_scale_tensor=torch.tensor([0.25], device=DEVICE),
        q8=torch.empty(T, Hq, D, dtype=torch.float8_e4m3fn, device=DEVICE), q_scale=0.5)


def paged(Hkv, D):
    """k_cache / v_cache as one layer's paged NHD cache [num_blocks, block_size, Hkv, D]."""
    return dict(k_cache=torch.zeros(BLOCKS, PAGE, Hkv, D, device=DEVICE),
                v_cache=torch.zeros(BLOCKS, PAGE, Hkv, D, device=DEVICE))


def _table(D, rows=4096, base=500000.0):
    """A vLLM-format cos/sin table [rows, D]: cos of every frequency, then sin."""
    angles = np.arange(rows)[:, None] * ropepool.RopeSpec(head_dim=D, base=base).inv_freq[None]
    return torch.tensor(np.concatenate([np.cos(angles), np.sin(angles)], 1), dtype=torch.float32, device=DEVICE)


def engine(D, Hkv=8):
    """An engine's rotary module (its cos/sin table; also as the model's ``self.rotary_emb``) and vLLM's
    per-layer cache [2, num_blocks, 16, Hkv, D]."""
    table = _table(D)
    rotary_emb = SimpleNamespace(cos_sin_cache=table, is_neox_style=True)
    return dict(rotary_emb=rotary_emb, self=SimpleNamespace(rotary_emb=rotary_emb), cos_sin_cache=table,
                is_neox=True, kv=torch.zeros(2, BLOCKS, PAGE, Hkv, D, device=DEVICE))


def mrope_positions():
    """[3, T] position rows (time, height, width), as Qwen2-VL's get_rope_index gives for an image."""
    return dict(position_ids_3xT=torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 2, 2], [0, 1, 2, 1, 2]], device=DEVICE))


def _model(config):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()


def qwen3():
    """A 2-layer Qwen3 with Qwen3-8B's heads (32 q, 8 KV, head_dim 128), random weights."""
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
    return inputs(32, 8, 128) | dict(model=_model(cfg))


def gemma3():
    """A 2-layer Gemma 3 (a sliding layer, then a global one), 16 q heads, 8 KV heads of 256."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=32, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    model = _model(cfg)
    names = inputs(16, 8, 256)
    return names | dict(model=model, attn=model.model.layers[names["i"]].self_attn)


def mla(dtype="float32", paged=False):
    """DeepSeek V3's latent attention: its config (16 heads, rope_dim 64, kv_lora_rank 512), one step's q_pe,
    k_pe and kv_c, and the caches the docs name (ckv_cache / kpe_cache flat, or ``paged`` as FlashInfer's)."""
    import transformers

    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=16, num_key_value_heads=16,
                                           q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64,
                                           qk_nope_head_dim=128, v_head_dim=128)
    names = inputs(16, 16, 64, dtype)
    cache = dict(dtype=getattr(torch, dtype), device=DEVICE)
    pages = (BLOCKS, PAGE) if paged else (POOL,)
    return names | dict(
        config=config, q_pe=_randn(T, 16, 64, dtype=dtype), k_pe=_randn(T, 64, dtype=dtype),
        kv_c=_randn(T, 512, dtype=dtype), kv=torch.zeros(BLOCKS, PAGE, 576, **cache),
        ckv_cache=torch.zeros(*pages, 512, **cache), kpe_cache=torch.zeros(*pages, 64, **cache),
        kv_all=torch.zeros(L, BLOCKS, PAGE, 576, **cache), out_cache_loc=names["slots"], k_scale=0.5,
        spec=ropepool.RopeSpec.from_hf_config(config))


def fp8_caches(Hkv=8, D=128):
    """fp8 flat pools and a scale per KV head."""
    pool = dict(dtype=torch.float8_e4m3fn, device=DEVICE)
    return dict(k_cache8=torch.zeros(POOL, Hkv, D, **pool), v_cache8=torch.zeros(POOL, Hkv, D, **pool),
                k_scales_per_head=torch.full((Hkv,), 0.5, device=DEVICE),
                v_scales_per_head=torch.full((Hkv,), 0.25, device=DEVICE))


def vllm_layer(Hq=32, Hkv=8, D=128):
    """What vLLM's attention impl hands over: query/key/value, its cos/sin table, the layer's cache
    [2, num_blocks, block_size, Hkv, D] (FlashAttention's) and stand-ins for ``impl`` and ``layer``."""
    names = inputs(Hq, Hkv, D) | engine(D, Hkv)
    return names | dict(query=names["q"], key=names["k"], value=names["v"], kv_cache=names["kv"],
                        positions=names["positions"].long(), impl=SimpleNamespace(kv_cache_dtype="auto"),
                        layer=SimpleNamespace(_k_scale=torch.ones(1, device=DEVICE),
                                              _v_scale=torch.ones(1, device=DEVICE)))


def per_token_head(Hq=32, Hkv=8, D=128):
    """vLLM's int8_per_token_head cache as views: int8 data [num_blocks, block_size, Hkv, D] and float32 scales."""
    data = dict(dtype=torch.int8, device=DEVICE)
    return inputs(Hq, Hkv, D) | dict(
        k_data=torch.zeros(BLOCKS, PAGE, Hkv, D, **data), v_data=torch.zeros(BLOCKS, PAGE, Hkv, D, **data),
        k_scales=torch.zeros(BLOCKS, PAGE, Hkv, device=DEVICE), v_scales=torch.zeros(BLOCKS, PAGE, Hkv, device=DEVICE),
        rope_pool_fused=ropepool.rope_pool_fused)


class _SglangAttention:
    """sglang's RadixAttention as the model's forward sees it: a layer id, and a call after the KV write."""

    layer_id = 0

    def __call__(self, q, k, v, forward_batch, save_kv_cache=True):
        assert not save_kv_cache  # ropepool wrote the cache
        return q


def sglang(Hq=32, Hkv=8, D=128):
    """sglang's forward: flat q/k/v [T, heads * D], the token pool's per-layer buffers, out_cache_loc."""
    names = inputs(Hq, Hkv, D)
    k_buf, v_buf = torch.zeros(POOL, Hkv, D, device=DEVICE), torch.zeros(POOL, Hkv, D, device=DEVICE)
    pool = SimpleNamespace(get_key_buffer=lambda layer_id: k_buf, get_value_buffer=lambda layer_id: v_buf)
    table = _table(D)
    return names | dict(
        q=names["q"].reshape(T, -1), k=names["k"].reshape(T, -1), v=names["v"].reshape(T, -1), head_dim=D,
        forward_batch=SimpleNamespace(token_to_kv_pool=pool, out_cache_loc=names["slots"].long()),
        self=SimpleNamespace(attn=_SglangAttention(), rotary_emb=SimpleNamespace(cos_sin_cache=table,
                                                                                  is_neox_style=True)))


def flashinfer(Hq=32, Hkv=8, D=128):
    """One request of T tokens in FlashInfer's paged cache [num_pages, 2, page_size, Hkv, D]: its page table
    (kv_indices, kv_indptr), each token's request and position."""
    names = inputs(Hq, Hkv, D)
    return names | dict(
        kv_indices=_ints([5, 2, 7]), kv_indptr=_ints([0, 3]), batch_indices=_ints([0] * T),
        positions=_ints([0, 1, 2, 16, 17]), rope_positions=_ints([0, 1, 2, 16, 17]),
        cache=torch.zeros(BLOCKS, 2, PAGE, Hkv, D, device=DEVICE), cos_sin_cache=_table(D), interleave=False)


def tensor_parallel(Hq=32, Hkv=8, D=128, tp=2):
    """One rank's shard of a step: Hq / tp query heads, Hkv / tp KV heads, and its pools."""
    names = inputs(Hq // tp, Hkv // tp, D)
    return names | dict(Hq=Hq, Hkv=Hkv, tp=tp, q_shard=names["q"], k_shard=names["k"], v_shard=names["v"],
                        k_pool_shard=names["k_pool"], v_pool_shard=names["v_pool"],
                        norm=ropepool.QKNorm(torch.ones(D, device=DEVICE), torch.ones(D, device=DEVICE)))


def llama_config():
    """A model whose config is Llama 3.1's RoPE (llama3 scaling), for blocks that read ``model.config``."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=131072, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return dict(model=SimpleNamespace(config=cfg))


def qwen_vl():
    """Qwen2-VL's get_rope_index as the blocks call it: a stand-in returning [3, batch, T] rows for one image
    of 2 x 2 patches after one text token (the real one needs a vision tower)."""
    rows = mrope_positions()["position_ids_3xT"]
    get_rope_index = lambda input_ids, image_grid_thw=None, attention_mask=None: (rows[:, None], None)  # noqa: E731
    return inputs(28, 4, 128) | dict(
        model=SimpleNamespace(model=SimpleNamespace(get_rope_index=get_rope_index)),
        input_ids=torch.zeros(1, T, dtype=torch.long), grid=torch.tensor([[1, 2, 2]]), mask=torch.ones(1, T))
