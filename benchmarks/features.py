"""Feature benchmarks: ropepool's second-round features beside their peers, in one process.

Features (issues 16-19, 22): ``table`` (an engine's cos/sin table; a layer without RoPE),
``qknorm`` (Gemma 3's D = 256 per-head norm), ``mrope`` (Qwen2.5-VL, Qwen3-VL), ``mla``
(DeepSeek-V3's latent cache, bf16 and fp8), ``fp8q`` (fp8 q out beside an fp8 cache) and ``pth``
(per-token-head int8 / e4m3 caches: each row's scale computed and stored in the same launch).
Each provider is first checked against the float64 oracle on poisoned pools (every pool row
it should not write must keep its poison), then timed with ``ropepool.cli.bench_clock.Clock``: CUDA-graph
replay to 16384 tokens, back-to-back eager calls above. The method: docs/benchmarks_features.md.

    PYTHONPATH=src python benchmarks/features.py --out features/        # the GPU
    PYTHONPATH=src python benchmarks/features.py --cpu --out /tmp/fb    # the logic, tiny sizes
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import namedtuple
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

import ropepool
from ropepool import reference
from ropepool.cli.bench import environment, op_bytes
from ropepool.cli.bench_clock import Clock
from ropepool.cli.bench_providers import flashinfer_modules, hf_rope_pool

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
SCALE = 0.5  # fp8 caches and fp8 q hold value / 0.5 (FlashInfer multiplies: quant_scale = 1 / 0.5)
EPS = 1e-6
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
GRAPH_MAX = 16384  # graph replay up to here, eager calls above (as ropepool.cli.bench)
CHECK_TOKENS = 1024  # tokens compared with the oracle (tokens are independent)
LLAMA = ropepool.RopeSpec(head_dim=128, base=500000.0)
GEMMA3 = ropepool.RopeSpec(head_dim=256, base=1e6, scaling={"rope_type": "linear", "factor": 8.0})
DSV3 = ropepool.RopeSpec(head_dim=64, base=10000.0, style="gptj", max_position_embeddings=163840, scaling={
    "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


@dataclass(frozen=True)
class Geo:
    """A row set. heads: (Hq, Hkv, D), for MLA (H, kv_lora_rank, rope_dim); providers[0] is the subject."""
    heads: tuple
    spec: ropepool.RopeSpec
    providers: tuple
    mla: bool = False
    fp8: bool = False  # fp8 e4m3 pools (and fp8 q out for GQA)
    norm: bool = False
    pth: str | None = None  # per-token-head pools of this dtype, with float32 scale caches


def _mrope(base, section, interleaved):
    return ropepool.RopeSpec(head_dim=128, base=base, mrope_section=section, mrope_interleaved=interleaved)


MLA_PEERS = ("ropepool", "flashinfer", "vllm", "compiled")
FEATURES = {
    "table": {"llama3-8b": Geo((32, 8, 128), LLAMA, ("ropepool_table", "ropepool", "flashinfer")),
              "llama3-8b-nope": Geo((32, 8, 128), ropepool.RopeSpec(head_dim=128, rotary_dim=0), ("ropepool",))},
    "qknorm": {"gemma3-12b": Geo((16, 8, 256), GEMMA3, ("ropepool_norm", "ropepool", "rms_norm+ropepool",
                                                        "compiled"), norm=True)},
    "mrope": {"qwen2.5-vl-7b": Geo((28, 4, 128), _mrope(1e6, (16, 24, 24), False), ("ropepool", "vllm", "compiled")),
              "qwen3-vl-8b": Geo((32, 8, 128), _mrope(5e6, (24, 20, 20), True), ("ropepool", "vllm", "compiled"))},
    "mla": {f"dsv3{tp}-{dt}": Geo((h, 512, 64), DSV3, MLA_PEERS, mla=True, fp8=dt == "fp8")
            for dt in ("bf16", "fp8") for tp, h in (("", 128), ("-tp8", 16))},
    "fp8q": {"llama3-8b": Geo((32, 8, 128), LLAMA, ("ropepool", "flashinfer"), fp8=True)},
    "pth": {f"llama3-8b-{dt}": Geo((32, 8, 128), LLAMA, ("ropepool",), pth=dt) for dt in ("int8", "float8_e4m3fn")},
}


def gqa_bytes(T, Hq, Hkv, D, *, q_out=2, k_out=2, pool=2, pos_rows=1, table=0):
    """ropepool.cli.bench.op_bytes, generalised: read bf16 q, k, v, int32 positions (1 or 3 rows) and slots,
    ``table`` bytes of a cos/sin row per position row; write q_rot (q_out bytes an element), k_rot (0: not
    written) and the two pool rows."""
    return T * ((Hq + 2 * Hkv) * D * 2 + 4 * pos_rows + 4 + table * pos_rows
                + (Hq * q_out + Hkv * k_out + 2 * Hkv * pool) * D)


def mla_bytes(T, H, L, r, *, q_out=2, k_out=2, cache=2, table=0):
    """Read q_pe, k_pe, kv_c, positions, slots (and a table row); write q_pe_rot, k_pe_rot, the cache row."""
    return T * ((H * r + r + L) * 2 + 8 + table + H * r * q_out + r * k_out + (L + r) * cache)


# --- the peers' torch code ------------------------------------------------------
def _cache_write(pool, slots, rows, scale=None):
    if scale is None:
        pool.index_copy_(0, slots, rows)
    else:  # index_copy_ has no fp8 kernels: quantize saturating (vLLM's scaled_convert), copy the bytes
        q8 = (rows.float() / scale).clamp(-448.0, 448.0).to(pool.dtype)
        pool.view(torch.uint8).index_copy_(0, slots, q8.view(torch.uint8))


def _rotate(x, cos, sin, neox):
    """vLLM's apply_rotary_emb_torch: cos/sin [T, r/2] cast to x's dtype."""
    c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1) if neox else (x[..., ::2], x[..., 1::2])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    return torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def vllm_mrope(q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache, section, interleaved):
    """MRotaryEmbedding.forward_native ([3, T] positions), then index_copy_ into the pools."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [3, T, r/2]
    if interleaved:  # apply_interleaved_rope
        def pick(x):
            out = x[0].clone()
            out[..., 1:section[1] * 3:3] = x[1, ..., 1:section[1] * 3:3]
            out[..., 2:section[2] * 3:3] = x[2, ..., 2:section[2] * 3:3]
            return out
    else:
        def pick(x):
            return torch.cat([m[i] for i, m in enumerate(x.split(section, dim=-1))], dim=-1)
    cos, sin = pick(cos), pick(sin)
    q_rot, k_rot = _rotate(q, cos, sin, True), _rotate(k, cos, sin, True)
    k_pool.index_copy_(0, slots, k_rot)
    v_pool.index_copy_(0, slots, v)
    return q_rot


def vllm_mla(q_pe, k_pe, kv_c, positions, slots, cache, cos_sin_cache, scale):
    """DeepseekScalingRotaryEmbedding.forward_native (GPT-J pairs), then concat_and_cache_mla's write of
    [kv_c | k_pe_rot] into the combined [pool, 576] cache (fp8: value / scale)."""
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    q_rot = _rotate(q_pe, cos, sin, False)
    k_rot = _rotate(k_pe.unsqueeze(1), cos, sin, False).squeeze(1)
    _cache_write(cache, slots, torch.cat((kv_c, k_rot), dim=-1), scale)
    return q_rot


def hf_gemma3(q, k, v, positions, slots, k_pool, v_pool, inv_freq, wq, wk):
    """transformers' Gemma3RMSNorm on q and k (float32, (1 + w), cast back), then rotate_half + index_copy_."""
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).type_as(x)
    return hf_rope_pool(norm(q, wq), norm(k, wk), v, positions, slots, k_pool, v_pool, inv_freq)[0]


def _rows(t, i):
    """Rows i of t as float64 NumPy (fp8: times SCALE), and whether t is fp8 (fp8 has no index kernels)."""
    if t.element_size() == 1:
        return t.view(torch.uint8)[i].view(t.dtype).float().cpu().numpy().astype(np.float64) * SCALE, True
    return t[i].double().cpu().numpy(), False


# --- a geometry: its pools, tables, reference and providers ----------------------
Prov = namedtuple("Prov", "make nbytes ref", defaults=(None,))  # make(set) -> fn; fn() -> q out; ref: oracle variant


class Ctx:
    def __init__(self, geo, device, pool_size, cpu):
        self.geo, self.device, self.P, self.cpu = geo, device, pool_size, cpu
        self.max_pos = 4096 if cpu else 131072  # positions drawn in [0, max_pos); tables of max_pos rows
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.fi = flashinfer_modules() if device.type == "cuda" else None
        rot = geo.spec.rotation
        if rot.rotary_dim:
            freqs = torch.from_numpy(rot.freqs[0])
            ang = (torch.arange(self.max_pos, dtype=torch.float32)[:, None] * freqs).double()  # the float32 angle
            table = (torch.cat((ang.cos(), ang.sin()), dim=-1) * rot.attention_scaling).float()
            self.table = table.to(device)  # [max_pos, r] float32: FlashInfer's and CosSinCache's
            self.table16 = table.to(device, BF16)  # vLLM keeps its cache in the model's dtype
            self.inv_freq = freqs.to(device)

    def ints(self, shape, hi):
        return torch.randint(0, hi, shape, generator=self.gen, device=self.device, dtype=torch.int32)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=BF16)

    def set_(self, T, pos_shape, **tensors):
        pos, slots = self.ints(pos_shape, self.max_pos), torch.randperm(self.P, generator=self.gen,
                                                                        device=self.device)[:T].int()
        return dict(tensors, pos=pos, slots=slots, pos_l=pos.long(), slots_l=slots.long())

    def compile(self, fn):
        # On the CPU inductor's C++ build takes ~30 s a graph: there dynamo runs the traced code eagerly.
        return torch.compile(fn, backend="eager" if self.cpu else "inductor")

    def torch_peer(self, fn, names, *extra, compiled=False):
        """fn(*set[names], *pools, *extra), compiled with the token dim dynamic (T = 1 compiles static)."""
        fn = self.compile(fn) if compiled else fn

        def make(s):
            if compiled and s["slots"].shape[0] > 1:
                for n in names:
                    torch._dynamo.maybe_mark_dynamic(s[n], s[n].dim() - 1 if n == "pos_l" else 0)
            args = [s[n] for n in names] + list(self.pools) + list(extra)
            return lambda: fn(*args)
        return make

    def fi_indices(self, s):
        """Each token its own one-token request whose page is its slot (page_size 1): batch indices, page
        indptr, position in the request (0), last page length (1)."""
        T, kw = s["slots"].shape[0], dict(dtype=torch.int32, device=self.device)
        return torch.arange(T, **kw), torch.arange(T + 1, **kw), torch.zeros(T, **kw), torch.ones(T, **kw)


class GqaCtx(Ctx):
    def __init__(self, geo, device, pool_size, cpu):
        super().__init__(geo, device, pool_size, cpu)
        Hq, Hkv, D = geo.heads
        pool_dtype = getattr(torch, geo.pth) if geo.pth else E4M3 if geo.fp8 else BF16
        self.kp = torch.empty(pool_size, Hkv, D, dtype=pool_dtype, device=device)
        self.vp = torch.empty_like(self.kp)
        self.scales = tuple(torch.empty(pool_size, Hkv, device=device) for _ in "kv") if geo.pth else ()
        self.pools = (self.kp, self.vp, *self.scales)  # poisoned and checked untouched, scale caches too
        if geo.norm:
            g = torch.Generator().manual_seed(1)
            self.w = [(0.1 * torch.randn(D, generator=g)).to(device, BF16) for _ in "qk"]
            self.norm = ropepool.QKNorm(*self.w, eps=EPS, weight_offset=1.0)
            self.np_norm = ropepool.QKNorm(*(w.double().cpu().numpy() for w in self.w), eps=EPS, weight_offset=1.0)
            self.gains = [(1 + w.float()).to(BF16) for w in self.w]  # Gemma's (1 + w), folded at load time

    def make_set(self, T):
        Hq, Hkv, D = self.geo.heads
        # One fused QKV projection output; large values, so that a missing norm cannot pass the check.
        qkv = self.randn(T, (Hq + 2 * Hkv) * D) * (4 if self.geo.norm else 1)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return self.set_(T, (3, T) if self.geo.spec.mrope_section else (T,), q=q.view(T, Hq, D),
                         k=k.view(T, Hkv, D), v=v.view(T, Hkv, D))

    def reference(self, s, idx, variant):
        Hq, Hkv, D = self.geo.heads
        q, k, v = (s[n][idx].double().cpu().numpy() for n in "qkv")
        no = np.zeros((1, Hkv, D))
        ref = reference.rope_pool_fused(q, k, v, s["pos"][..., idx].cpu().numpy(), np.full(len(idx), -1), no, no,
                                        head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=self.geo.spec,
                                        qk_norm=None if variant == "no norm" else getattr(self, "np_norm", None))
        return {"q": ref[0], "k": ref[1], "v": v}

    def readback(self, s, q_out, idx):
        sl = s["slots_l"][idx]
        if self.geo.pth:  # each row times its own scale (_rows multiplied one-byte rows by SCALE)
            return {"q": _rows(q_out, idx), **{n: (_rows(p, sl)[0] / SCALE * sc[sl].double().cpu().numpy()[..., None],
                                                   True) for n, p, sc in zip("kv", (self.kp, self.vp), self.scales)}}
        return {"q": _rows(q_out, idx), "k": _rows(self.kp, sl), "v": _rows(self.vp, sl)}

    def providers(self):
        Hq, Hkv, D = self.geo.heads
        spec, fp8 = self.geo.spec, self.geo.fp8
        rows = 3 if spec.mrope_section else 1

        def nb(k_out=2, table=0):  # per-token-head: one-byte rows and a float32 scale per row written
            return lambda T: gqa_bytes(T, Hq, Hkv, D, q_out=1 if fp8 else 2, k_out=k_out,
                                       pool=1 if fp8 or self.geo.pth else 2, pos_rows=rows,
                                       table=table) + T * 2 * Hkv * 4 * bool(self.geo.pth)
        qkv = ("q", "k", "v", "pos_l", "slots_l")
        vllm = (vllm_mrope, qkv, getattr(self, "table16", None), list(spec.mrope_section or ()), spec.mrope_interleaved)
        every = {
            "ropepool": lambda: Prov(self.ropepool(spec), nb(), "no norm" if self.geo.norm else None),
            "ropepool_table": lambda: Prov(self.ropepool(ropepool.CosSinCache(self.table)), nb(table=4 * D)),
            "ropepool_norm": lambda: Prov(self.ropepool(spec, self.norm), nb()),
            "rms_norm+ropepool": lambda: Prov(self.ropepool(spec, pre=self.rms_norm), nb()),
            "flashinfer": lambda: Prov(self.flashinfer, nb(k_out=0 if fp8 else 2, table=4 * D)),
            "vllm": lambda: Prov(self.torch_peer(*vllm), nb(table=2 * D)),
            "compiled": lambda: Prov(self.torch_peer(*vllm, compiled=True), nb(table=2 * D)) if rows == 3 else
            Prov(self.torch_peer(hf_gemma3, qkv, self.inv_freq, *self.w, compiled=True), nb()),
        }
        return {n: every[n]() for n in self.geo.providers}

    def rms_norm(self, s):
        return tuple(F.rms_norm(s[n], (self.geo.heads[2],), g, EPS) for n, g in zip("qk", self.gains))

    def ropepool(self, rope, norm=None, pre=None):
        Hq, Hkv, D = self.geo.heads
        kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope, qk_norm=norm)
        if self.geo.fp8:
            kw.update(k_scale=SCALE, v_scale=SCALE, q_scale=SCALE)
        if self.geo.pth:
            kw.update(k_scale_cache=self.scales[0], v_scale_cache=self.scales[1])

        def make(s):
            q_out = torch.empty(s["q"].shape, dtype=E4M3, device=self.device) if self.geo.fp8 else None

            def fn():
                q, k = pre(s) if pre else (s["q"], s["k"])
                return ropepool.rope_pool_fused(q, k, s["v"], s["pos"], s["slots"], self.kp, self.vp, q_out=q_out,
                                                **kw)[0]
            return fn
        return make

    def flashinfer(self, s):
        """bf16: apply_rope_with_cos_sin_cache_inplace + append_paged_kv_cache (as ropepool.cli.bench);
        fp8: the single rope_quantize_fp8_append_paged_kv_cache (GQA mode)."""
        Hq, Hkv, D = self.geo.heads
        T = s["q"].shape[0]
        batch, indptr, zero, one = self.fi_indices(s)
        cache = (self.kp[:, None], self.vp[:, None])  # [pages, page_size 1, Hkv, D]
        if self.geo.fp8:
            q_out = torch.empty(T, Hq, D, dtype=E4M3, device=self.device)

            def fn():
                self.fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                    s["q"], s["k"], None, None, s["v"], self.table, s["pos_l"], cache, s["slots"], indptr, batch,
                    zero, is_neox=True, quantize_dtype=E4M3, quant_scale_q=1 / SCALE, quant_scale_kv=1 / SCALE,
                    page_size=1, kv_layout="NHD", q_rope_out=q_out)
                return q_out
            return fn
        q, k = s["q"].clone(), s["k"].clone()  # rotated in place

        def fn():
            self.fi.rope.apply_rope_with_cos_sin_cache_inplace(s["pos_l"], q.view(T, Hq * D), k.view(T, Hkv * D), D,
                                                               self.table, is_neox=True)
            self.fi.page.append_paged_kv_cache(k, s["v"], batch, zero, cache, s["slots"], indptr, one, kv_layout="NHD")
            return q
        return fn


class MlaCtx(Ctx):
    def __init__(self, geo, device, pool_size, cpu):
        super().__init__(geo, device, pool_size, cpu)
        H, L, r = geo.heads
        # vLLM's combined [pool, kv_lora_rank + rope_dim] rows; ropepool and FlashInfer write its column views.
        self.cache = torch.empty(pool_size, L + r, dtype=E4M3 if geo.fp8 else BF16, device=device)
        self.ckv, self.kpe = self.cache[:, :L], self.cache[:, L:]
        self.pools = (self.cache,)
        self.scale = SCALE if geo.fp8 else None

    def make_set(self, T):
        H, L, r = self.geo.heads
        latent = self.randn(T, L + r)  # kv_c and k_pe: views of one kv_a_proj output row, as DeepSeek has them
        return self.set_(T, (T,), q_pe=self.randn(T, H, r), kv_c=latent[:, :L], k_pe=latent[:, L:])

    def reference(self, s, idx, variant):
        H, L, r = self.geo.heads
        q, k, kv = (s[n][idx].double().cpu().numpy() for n in ("q_pe", "k_pe", "kv_c"))
        ref = reference.rope_latent_fused(q, k, kv, s["pos"][idx].cpu().numpy(), np.full(len(idx), -1),
                                          np.zeros((1, L)), np.zeros((1, r)), rope=self.geo.spec)
        return {"q": ref[0], "ckv": kv, "kpe": ref[1]}

    def readback(self, s, q_out, idx):
        L = self.geo.heads[1]
        rows, fp8 = _rows(self.cache, s["slots_l"][idx])
        return {"q": _rows(q_out, idx), "ckv": (rows[:, :L], fp8), "kpe": (rows[:, L:], fp8)}

    def providers(self):
        H, L, r = self.geo.heads
        nb = lambda **kw: (lambda T: mla_bytes(T, H, L, r, cache=1 if self.geo.fp8 else 2, **kw))
        peer = (vllm_mla, ("q_pe", "k_pe", "kv_c", "pos_l", "slots_l"), getattr(self, "table16", None), self.scale)
        every = {"ropepool": lambda: Prov(self.ropepool, nb()),
                 "flashinfer": lambda: Prov(self.flashinfer, nb(q_out=1, k_out=0, table=4 * r) if self.geo.fp8
                                            else nb(table=4 * r)),
                 "vllm": lambda: Prov(self.torch_peer(*peer), nb(table=2 * r)),
                 "compiled": lambda: Prov(self.torch_peer(*peer, compiled=True), nb(table=2 * r))}
        return {n: every[n]() for n in self.geo.providers}

    def ropepool(self, s):
        return lambda: ropepool.rope_latent_fused(s["q_pe"], s["k_pe"], s["kv_c"], s["pos"], s["slots"], self.ckv,
                                                  self.kpe, rope=self.geo.spec, scale=self.scale)[0]

    def flashinfer(self, s):
        """bf16: apply_rope_with_cos_sin_cache_inplace (GPT-J pairs) + append_paged_mla_kv_cache; fp8: the single
        rope_quantize_fp8_append_paged_kv_cache in its MLA mode. That op also quantizes a q_nope as wide as
        kv_c: it gets a zero-stride one (1 KB in, 512 B out), so its traffic stays the op's."""
        H, L, r = self.geo.heads
        T = s["q_pe"].shape[0]
        batch, indptr, zero, one = self.fi_indices(s)
        cache = (self.ckv[:, None], self.kpe[:, None])  # [pages, page_size 1, dim]
        if self.geo.fp8:
            q_out = torch.empty(T, H, r, dtype=E4M3, device=self.device)
            q_nope = torch.zeros(1, 1, L, dtype=BF16, device=self.device).expand(T, H, L)
            q_nope_out = torch.empty(1, 1, L, dtype=E4M3, device=self.device).expand(T, H, L)

            def fn():
                self.fi.rope.rope_quantize_fp8_append_paged_kv_cache(
                    s["q_pe"], s["k_pe"], q_nope, s["kv_c"], None, self.table, s["pos_l"], cache, s["slots"], indptr,
                    batch, zero, is_neox=False, quantize_dtype=E4M3, quant_scale_q=1 / SCALE,
                    quant_scale_kv=1 / SCALE, page_size=1, q_rope_out=q_out, q_nope_out=q_nope_out)
                return q_out
            return fn
        q, k = s["q_pe"].clone(), s["k_pe"].clone()  # rotated in place

        def fn():
            self.fi.rope.apply_rope_with_cos_sin_cache_inplace(s["pos_l"], q.view(T, H * r), k, r, self.table,
                                                               is_neox=False)
            self.fi.page.append_paged_mla_kv_cache(s["kv_c"], k, batch, zero, *cache, s["slots"], indptr, one)
            return q
        return fn


# --- checking and timing --------------------------------------------------------
@dataclass
class Row:
    feature: str
    geometry: str
    tokens: int
    provider: str
    mode: str
    us: float
    spread_pct: float
    bytes: int
    gbps: float
    pct_copy: float | None  # this row's bandwidth over the copy's, same run
    subject_speedup: float | None  # this row's time over the subject's (providers[0]): how much faster it is


def _untouched(pool, slots):
    """Every row not at ``slots`` still holds the poison (0xFF bytes: NaN in bf16 and e4m3)."""
    rows = pool.view(torch.uint8).reshape(pool.shape[0], -1)
    rows, poison = (rows.view(torch.int64), -1) if rows.shape[1] % 8 == 0 else (rows, 255)
    touched = (rows != poison).any(1)
    touched[slots] = False
    return not bool(touched.any())


def check(c, fn, s, ref, idx):
    """Poison the pools, one call, compare with the oracle: ("ok" or "failed", {quantity: rel. L2 error})."""
    for p in c.pools:
        p.view(torch.uint8).fill_(0xFF)
    got, errs, ok = c.readback(s, fn(), idx), {}, True
    for name, want in ref.items():
        g, fp8 = got[name]
        errs[name] = float(np.linalg.norm(g - want) / np.linalg.norm(want)) if np.isfinite(g).all() else float("inf")
        ok &= errs[name] <= (6e-2 if fp8 else 2e-2)  # bf16: a few roundings; e4m3: 3 mantissa bits
    errs["untouched"] = all(_untouched(p, s["slots_l"]) for p in c.pools)
    return ("ok" if ok and errs["untouched"] else "failed"), errs


def run_geometry(feature, gname, geo, a, device, clock, deadline, rows, checks, log, save):
    """Check and time every provider of one geometry at every token count; False once the budget is spent."""
    if time.time() > deadline:
        return False
    torch._dynamo.reset()  # no automatic-dynamic leakage of head counts between geometries
    c = (MlaCtx if geo.mla else GqaCtx)(geo, device, a.pool_size, a.cpu)
    provs, subject = c.providers(), geo.providers[0]
    if c.fi is None and "flashinfer" in provs:
        why = "no CUDA device" if device.type != "cuda" else "flashinfer did not import"
        log(f"  {feature} {gname} flashinfer: skipped ({why})")
        checks.append(dict(feature=feature, geometry=gname, tokens=None, provider="flashinfer", status="skipped",
                           detail=why))
        del provs["flashinfer"]
    for T in a.tokens:
        if time.time() > deadline:
            return False
        t0, nbytes = time.time(), provs[subject].nbytes(T)
        n = 2 if a.cpu else int(max(1, min(8, (256 << 20) // nbytes)))  # input sets: > 4x the L2 in all
        sets = [c.make_set(T) for _ in range(n)]
        idx = torch.randperm(T, generator=c.gen, device=device)[:CHECK_TOKENS].sort().values
        refs = {v: c.reference(sets[0], idx, v) for v in {p.ref for p in provs.values()}}
        bufs = [[torch.empty(nbytes // 2, dtype=torch.uint8, device=device) for _ in "sd"] for _ in sets]
        timed = {"copy": ([lambda s=s, d=d: d.copy_(s) for s, d in bufs], nbytes)}
        for name, p in provs.items():
            try:
                fns = [p.make(s) for s in sets]
                status, detail = check(c, fns[0], sets[0], refs[p.ref], idx)
            except Exception as e:  # a peer that cannot run this call is reported, not fatal
                status, detail = "error", f"{type(e).__name__}: {e}"[:400]
            checks.append(dict(feature=feature, geometry=gname, tokens=T, provider=name, status=status, detail=detail))
            if status == "ok":
                timed[name] = (fns, p.nbytes(T))
            else:
                log(f"  {feature} {gname} T={T} {name}: {status} {detail}; not timed")
        graph = device.type == "cuda" and T <= GRAPH_MAX
        res = {}
        for name, (fns, nb) in timed.items():
            if time.time() > deadline:
                break
            try:  # few repeats where one call is long: the whole run must fit a few minutes
                res[name] = (clock.graph(fns, reps=7 if T <= 4096 else 3) if graph else
                             clock.eager(fns, budget_s=0.002 if a.cpu else 0.03, reps=1 if a.cpu else 5)), nb
            except Exception as e:
                log(f"  {feature} {gname} T={T} {name}: timing failed: {type(e).__name__}: {e}"[:400])
        copy_bw = res["copy"][1] / res["copy"][0][0] if "copy" in res else None
        sub_us = res[subject][0][0] if subject in res else None
        for name, ((us, spread), nb) in res.items():
            rows.append(Row(feature, gname, T, name, "graph" if graph else "eager", us, spread, nb, nb / us / 1e3,
                            100 * nb / us / copy_bw if copy_bw else None,
                            us / sub_us if sub_us and name not in ("copy", subject) else None))
        log(f"  {feature} {gname} T={T}: {len(res)} timed in {time.time() - t0:.1f} s")
        save()  # after each token count: a run cut short keeps what it measured
    return True


# --- output ---------------------------------------------------------------------
def print_table(feature, rows, env):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{feature}: " + ", ".join(f"{k}={v}" for k, v in env.items() if v and k != "args"))
    for col in ("geometry", "T", "mode", "provider", "µs", "±%", "GB/s", "%copy", "subject faster by"):
        t.add_column(col, justify="right")
    for r in rows:
        pct, x = r["pct_copy"], r["subject_speedup"]
        t.add_row(r["geometry"], str(r["tokens"]), r["mode"], r["provider"], f"{r['us']:.2f}", f"{r['spread_pct']:.0f}",
                  f"{r['gbps']:.0f}", "" if pct is None else f"{pct:.0f}%", "" if x is None else f"{x:.2f}x")
    Console(width=140).print(t)


def plot(feature, rows, env, path):
    """µs and % of copy bandwidth against tokens, one column per geometry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geos, names = (list(dict.fromkeys(r[k] for r in rows)) for k in ("geometry", "provider"))
    fig, axes = plt.subplots(2, len(geos), figsize=(4.6 * len(geos), 7), squeeze=False)
    for col, g in enumerate(geos):
        for p in dict.fromkeys(r["provider"] for r in rows if r["geometry"] == g):
            pts = sorted((r["tokens"], r) for r in rows if (r["geometry"], r["provider"]) == (g, p))
            style = dict(marker="o", color="grey" if p == "copy" else f"C{names.index(p)}", label=p)
            axes[0][col].loglog([t for t, _ in pts], [r["us"] for _, r in pts], **style)
            if p != "copy":
                axes[1][col].semilogx([t for t, _ in pts], [r["pct_copy"] or 0 for _, r in pts], **style)
        axes[0][col].set_title(g)
        axes[0][col].set_ylabel(f"µs (graph replay to {GRAPH_MAX} tokens, eager above)")
        axes[1][col].set_ylabel("% of copy bandwidth")
        axes[1][col].set_xlabel("tokens")
        axes[1][col].axhline(90, color="grey", lw=0.5, ls="--")
        for ax in axes[:, col]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{feature}, {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, triton "
                 f"{env.get('triton')}, flashinfer {env.get('flashinfer')}, {env.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(records, out, log):
    """A table and a PNG per feature from the records (a table needs rich, a plot matplotlib)."""
    env = records["env"]
    for feature in dict.fromkeys(r["feature"] for r in records["rows"]):
        rows = [r for r in records["rows"] if r["feature"] == feature]
        for draw, extra in ((print_table, ()), (plot, (os.path.join(out, f"{feature}.png"),))):
            try:
                draw(feature, rows, env, *extra)
            except ImportError as e:  # the records stand; --replot draws them where the package is
                log(f"{feature}: {e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", default=",".join(FEATURES), help=f"comma-separated, of: {', '.join(FEATURES)}")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default: "
                   f"{','.join(map(str, TOKENS))}; with --cpu 1,16)")
    p.add_argument("--out", default="features", help="folder for features.json and one PNG per feature")
    p.add_argument("--cpu", action="store_true", help="check the logic on the CPU: tiny pool, trivial timing, "
                   "no FlashInfer, torch.compile through dynamo's eager backend")
    p.add_argument("--pool-size", type=int, default=None, help="pool slots (default 262144; with --cpu 2048)")
    p.add_argument("--budget-s", type=float, default=500, help="start no new token count after this many seconds, "
                   "keeping what was measured (default 500)")
    p.add_argument("--replot", default=None, help="only print the tables and draw the PNGs of this features.json")
    a = p.parse_args(argv)
    t_start = time.time()
    log = lambda msg: print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        with open(a.replot) as f:
            report(json.load(f), a.out, log)
        return 0
    assert gqa_bytes(7, 32, 8, 128) == op_bytes(7, 32, 8, 128, 2, 2), "gqa_bytes must count as op_bytes does"
    unknown = [f for f in a.features.split(",") if f not in FEATURES]
    if unknown:
        p.error(f"unknown features {unknown}; choose from {list(FEATURES)}")
    if not a.cpu and not torch.cuda.is_available():
        p.error("no CUDA device: --cpu checks the logic on the CPU")
    device = torch.device("cpu" if a.cpu else "cuda")
    if a.cpu:
        torch.set_num_threads(1)  # the logic, not speed: two threads spin against each other on a busy host
    a.tokens = [int(x) for x in a.tokens.split(",")] if a.tokens else ([1, 16] if a.cpu else list(TOKENS))
    a.pool_size = a.pool_size or (2048 if a.cpu else 262144)
    for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, attr):  # one compiled function serves all token counts of a geometry
            setattr(torch._dynamo.config, attr, 64)
    env = environment(device) | {"args": vars(a)}
    records, rows = {"env": env, "rows": [], "checks": []}, []
    clock, deadline, within = Clock(device), t_start + a.budget_s, True

    def save():
        records["rows"] = [asdict(r) for r in rows]
        with open(os.path.join(a.out, "features.json"), "w") as f:
            json.dump(records, f, indent=1)

    for feature in a.features.split(","):
        for gname, geo in FEATURES[feature].items():
            within = within and run_geometry(feature, gname, geo, a, device, clock, deadline, rows,
                                             records["checks"], log, save)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if within:
            log(f"{feature}: done")
    if not within:
        log(f"budget of {a.budget_s:.0f} s reached: the records hold what was measured")
    report(records, a.out, log)
    bad = [c for c in records["checks"] if c["status"] in ("failed", "error")]
    log(f"{len(rows)} rows, {len(bad)} failed checks; records in {os.path.join(a.out, 'features.json')}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
