"""q_rot/k_rot against transformers' own rotary modules and apply_rotary_pos_emb.

Each case is a real model configuration built in code. transformers computes
cos/sin with its rotary-embedding module (dynamic and longrope included: the
module picks its frequencies from the largest position, as ropepool's rule
does) and rotates with the model's own apply function; ropepool gets the same
config through ``RopeSpec.from_hf_config``.

float32: both take the angle as the float32 product of position and
inv_freq, but transformers computes inv_freq in float32 (``base ** x`` in
float32 is off by a few 1e-7 relative) while ropepool rounds its float64
value once. At position p the angles then differ by p * |Δinv_freq| (up to
~0.05 rad at p = 1e5), and that is the whole difference: the tests bound it by
the measured Δinv_freq, and check ropepool against the float64 oracle tightly.
bfloat16: transformers rounds cos/sin and every product to bf16, ropepool
rounds once; so each is compared with the float64 oracle, ropepool within
its bf16 tolerance, and ropepool must be no further from it than
transformers (plus one bf16 rounding).

``python -m tests.test_hf_conformance`` prints the max errors per case on
the default backend of the device present (the Triton kernel on CUDA).
"""
from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch
from transformers import GPTJConfig

import ropepool
from tests.test_spec import (LlamaConfig, PhiConfig, ROTARY_MODULES, dynamic_x2, llama31, neox20b,
                             phi3_longrope, qwen2)
from tests.util import TOL, oracle

CASES = {
    "llama3.1-llama3": (llama31, 100_000),
    "qwen2-theta1e6": (qwen2, 100_000),
    "qwen2.5-yarn-x4": (lambda: qwen2(max_position_embeddings=131072, rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=32768)), 100_000),
    "phi3-longrope-short": (phi3_longrope, 4000),  # largest position < original 4096: short factors
    "phi3-longrope-long": (phi3_longrope, 100_000),
    "linear-x2": (lambda: LlamaConfig(rope_scaling=dict(type="linear", factor=2.0)), 100_000),
    "dynamic-x2-long": (dynamic_x2, 10_000),
    "gpt-neox-partial-0.25": (neox20b, 100_000),
    "phi-2-partial-0.4": (lambda: PhiConfig(hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4),
                          100_000),
    "gptj-interleaved": (lambda: GPTJConfig(n_embd=1024, n_head=4, rotary_dim=64, n_positions=131072), 100_000),
    "head-dim-64": (lambda: LlamaConfig(hidden_size=2048, num_attention_heads=32), 100_000),
    "head-dim-256": (lambda: LlamaConfig(hidden_size=2048, num_attention_heads=8, head_dim=256), 100_000),
}
# Small enough for the Triton interpreter in CI.
TRITON_CASES = ("llama3.1-llama3", "qwen2.5-yarn-x4", "phi3-longrope-long", "gpt-neox-partial-0.25", "gptj-interleaved")
BF16_STEP = 2.0**-8


def transformers_rotate(config, q, k, positions):
    """transformers' rotation of q, k [T, H, D] at positions [T]."""
    pos = positions[None].long()
    if config.model_type == "gptj":
        from transformers.models.gptj.modeling_gptj import GPTJRotaryEmbedding, apply_rotary_pos_emb

        sin, cos = GPTJRotaryEmbedding(config).to(q.device)(q, pos)  # [1, T, rotary_dim / 2]
        r = config.rotary_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.int64) / r))  # as its table is built

        def rot(x):  # GPT-J lays x out as [B, T, H, D] and rotates its first rotary_dim features
            x = x[None]
            return torch.cat((apply_rotary_pos_emb(x[..., :r], sin, cos), x[..., r:]), dim=-1)[0]
        return rot(q), rot(k), inv_freq
    module = ROTARY_MODULES[config.model_type](config=config).to(q.device)
    apply = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    cos, sin = module(q, pos)
    # Partial rotary: the rotated features are the first cos.shape[-1], the rest pass through
    # (Phi's attention splits them itself before calling apply_rotary_pos_emb).
    r = cos.shape[-1]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    q_rot, k_rot = apply.apply_rotary_pos_emb(qh[..., :r], kh[..., :r], cos, sin)
    q_rot, k_rot = torch.cat((q_rot, qh[..., r:]), -1), torch.cat((k_rot, kh[..., r:]), -1)
    # The module's inv_freq after the call: dynamic and longrope switch it on the largest position.
    return q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1), module.inv_freq


def run_case(name, dtype, device, backend=None, T=48, seed=0):
    make, max_pos = CASES[name]
    config = make()
    spec = ropepool.RopeSpec.from_hf_config(config)
    if spec.rope_type == "dynamic":  # transformers uses the call's own length; ropepool is told it
        spec = spec.at_seq_len(max_pos)
    D = spec.head_dim
    Hq, Hkv = (4, 2) if backend != "triton" or device == "cuda" else (2, 1)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    v = torch.randn(T, Hkv, D, generator=gen).to(device, dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen)
    positions[0] = max_pos - 1  # the largest position decides longrope's and dynamic's frequencies
    positions = positions[torch.randperm(T, generator=gen)].to(device)
    slots = torch.full((T,), -1, device=device)
    pool = torch.zeros(1, Hkv, D, device=device, dtype=dtype)
    q_rp, k_rp, _, _ = ropepool.rope_pool_fused(q, k, v, positions, slots, pool, pool.clone(), head_dim=D,
                                                num_qo_heads=Hq, num_kv_heads=Hkv, rope=spec, backend=backend)
    q_hf, k_hf, inv_hf = transformers_rotate(config, q, k, positions)
    inv_rp = spec.long_inv_freq if spec.long_from is not None and max_pos - 1 >= spec.long_from else spec.inv_freq
    d_inv = np.abs(inv_hf.double().cpu().numpy() - inv_rp.astype(np.float32).astype(np.float64)).max()
    ref = oracle(q, k, v, positions, slots, pool, pool, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=spec)

    def rel(a, b):
        a = a.double().cpu().numpy()
        b = b.double().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
        return float((np.abs(a - b) / np.maximum(1.0, np.abs(b))).max())

    return dict(case=name, rope_type=spec.rope_type, style=spec.style, rotary_dim=spec.rotary_dim,
                head_dim=D, dtype=str(dtype).split(".")[-1], backend=backend or "default", device=device,
                vs_transformers=max(rel(q_rp, q_hf.float()), rel(k_rp, k_hf.float())),
                ropepool_vs_oracle=max(rel(q_rp, ref[0]), rel(k_rp, ref[1])),
                transformers_vs_oracle=max(rel(q_hf, ref[0]), rel(k_hf, ref[1])),
                # The largest angle difference the two frequency tables explain, and the largest
                # rotation difference it can make for these inputs (|pair| * angle).
                angle_bound=float(max_pos * d_inv),
                rotation_bound=float(max_pos * d_inv * 2 * max(q.abs().max(), k.abs().max()).item()))


def _params():
    out = []
    for name in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).split(".")[-1]
            out.append(pytest.param(name, dtype, "torch", id=f"{name}-{dt}-torch"))
            if name in TRITON_CASES:
                out.append(pytest.param(name, dtype, "triton", id=f"{name}-{dt}-triton"))
    return out


@pytest.mark.parametrize("name,dtype,backend", _params())
def test_matches_transformers(name, dtype, backend):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T = 48 if backend == "torch" or device == "cuda" else 8
    r = run_case(name, dtype, device, backend, T=T)
    if dtype == torch.float32:
        assert r["vs_transformers"] <= r["rotation_bound"] + 2e-5, r
        assert r["ropepool_vs_oracle"] < TOL[torch.float32], r
    else:
        assert r["ropepool_vs_oracle"] < TOL[torch.bfloat16], r
        assert r["ropepool_vs_oracle"] <= r["transformers_vs_oracle"] + BF16_STEP, r


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"ropepool {ropepool.__version__} vs transformers rotary modules on {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    print(f"{'case':26s} {'rope_type':9s} {'style':5s} {'rot/D':>7s} {'dtype':9s} "
          f"{'vs HF':>9s} {'bound':>9s} {'rp-exact':>9s} {'HF-exact':>9s}")
    for name in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            r = run_case(name, dtype, device, None, T=4096 if device == "cuda" else 48)
            print(f"{name:26s} {r['rope_type']:9s} {r['style']:5s} {r['rotary_dim']:>3d}/{r['head_dim']:<3d} "
                  f"{r['dtype']:9s} {r['vs_transformers']:9.2e} {r['rotation_bound']:9.2e} {r['ropepool_vs_oracle']:9.2e} "
                  f"{r['transformers_vs_oracle']:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
