"""What ``ropepool bench`` times beside ropepool: the unfused op as transformers writes it (eager and
under torch.compile) and FlashInfer's rope + paged append, each as a maker of calls over one input set.

``LAYOUTS`` names the pools the benchmark writes; ``BASE`` is the rotary base of every geometry.
"""
from __future__ import annotations

import functools
import os

import torch

import ropepool

BASE = 500000.0


# --- the unfused baseline, as transformers writes it -------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rope_pool(q, k, v, positions, slots, k_pool, v_pool, inv_freq, scale=None):
    """LlamaRotaryEmbedding + apply_rotary_pos_emb + index_copy_ into flat [P, H, D] pool views
    (an fp8 pool stores value / scale, saturated)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]
    q_rot = q * cos + _rotate_half(q) * sin
    k_rot = k * cos + _rotate_half(k) * sin
    if scale is None:
        k_pool.index_copy_(0, slots, k_rot)
        v_pool.index_copy_(0, slots, v)
    else:
        # index_copy_ has no fp8 kernels: copy the bytes.
        for pool, x in ((k_pool, k_rot), (v_pool, v)):
            q8 = (x.float() / scale).clamp(-448.0, 448.0).to(pool.dtype)
            pool.view(torch.uint8).index_copy_(0, slots, q8.view(torch.uint8))
    return q_rot, k_rot


# name -> (kv_layout, pool dtype or None for q's, scale): the pools the benchmark writes.
LAYOUTS = {"flat": (None, None, None), "NHD": ("NHD", None, None), "fp8": (None, torch.float8_e4m3fn, 0.5)}
PAGE_SIZE = 16


@functools.lru_cache(maxsize=None)
def flashinfer_modules():
    """FlashInfer's rope and page modules, or None. With FI_PREBUILT set (a folder of
    prebuilt JIT modules, NAME.so) they are loaded from there instead of JIT-built."""
    try:
        import flashinfer
        import flashinfer.page  # noqa: F401
        import flashinfer.rope  # noqa: F401
    except Exception:
        return None
    pre = os.environ.get("FI_PREBUILT")
    if pre:
        from flashinfer.jit import core

        build = core.JitSpecNvcc.try_load

        def try_load(spec):
            path = os.path.join(pre, spec.name + ".so")
            return spec.load(path) if os.path.exists(path) else build(spec)

        core.JitSpecNvcc.try_load = try_load
    return flashinfer


def providers(Hq, Hkv, D, device, layout):
    kv_layout, _, scale = LAYOUTS[layout]
    inv_freq = torch.tensor(ropepool.RopeSpec(head_dim=D, base=BASE).inv_freq, dtype=torch.float32, device=device)
    flat = (lambda p: p) if kv_layout is None else (lambda p: p.view(-1, Hkv, D))  # contiguous NHD pages

    def rp(s, kp, vp):  # (keywords as written in code: no dict merged per call, ~0.5 us of a one-token call)
        return lambda: ropepool.rope_pool_fused(
            s["q"], s["k"], s["v"], s["positions"], s["slots"], kp, vp, head_dim=D, num_qo_heads=Hq,
            num_kv_heads=Hkv, rope_base=BASE, kv_layout=kv_layout, k_scale=scale, v_scale=scale)

    compiled = torch.compile(hf_rope_pool)

    def eager(s, kp, vp, fn=hf_rope_pool):
        sl = s["slots"].long()
        return lambda: fn(s["q"], s["k"], s["v"], s["positions"], sl, flat(kp), flat(vp), inv_freq, scale)

    out = {"ropepool": rp, "eager": eager, "compiled": lambda s, kp, vp: eager(s, kp, vp, compiled)}
    fi = flashinfer_modules() if device.type == "cuda" and scale is None else None
    if fi is not None:
        out["flashinfer"] = _flashinfer_provider(fi, Hq, Hkv, D, device, inv_freq, kv_layout)
    return out


def _flashinfer_provider(fi, Hq, Hkv, D, device, inv_freq, kv_layout):
    """FlashInfer's rope (cos/sin cache, in place) + append_paged_kv_cache. Each token is a
    one-token request whose page is its slot's page (page_size 1 for the flat pool)."""
    max_pos = 131072
    ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=-1)

    def make(s, kp, vp):
        T = s["q"].shape[0]
        q, k = s["q"].clone(), s["k"].clone()
        pos = s["positions"].long()
        ps = 1 if kv_layout is None else PAGE_SIZE
        pages, in_page = s["slots"] // ps, s["slots"] % ps
        batch = torch.arange(T, dtype=torch.int32, device=device)
        indptr = torch.arange(T + 1, dtype=torch.int32, device=device)
        last = (in_page + 1).to(torch.int32)
        qf, kf = q.view(T, Hq * D), k.view(T, Hkv * D)
        cache = (kp[:, None], vp[:, None]) if kv_layout is None else (kp, vp)

        def fn():
            fi.rope.apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, D, cos_sin, is_neox=True)
            fi.page.append_paged_kv_cache(k, s["v"], batch, in_page.to(torch.int32), cache, pages.to(torch.int32),
                                          indptr, last, kv_layout="NHD")
            return q, k
        return fn
    return make

