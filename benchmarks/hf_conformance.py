"""ropepool against transformers itself: q_rot / k_rot of real model configurations.

For each named case a transformers config is built in code (nothing is
downloaded), the model family's own rotary-embedding module computes cos/sin
for arbitrary positions (shuffled, repeated, up to 100000) and that family's
own apply function rotates random q/k laid out as transformers wants them.
ropepool rotates the same q/k, laid out ``[T, H, D]``, with
``RopeSpec.from_hf_config(config)``. ``run_case`` returns the errors;
``main()`` prints one row per case, dtype and backend:

    python benchmarks/hf_conformance.py            # CUDA: the default (Triton) and torch backends
    python benchmarks/hf_conformance.py --quick    # fewer tokens

On a machine without CUDA it runs the torch backend on every case and the
Triton kernel under its CPU interpreter (TRITON_INTERPRET=1, set below before
triton can be imported) on a subset, with 16 tokens.

What is compared, and why the tolerances are what they are
----------------------------------------------------------
Both sides compute the angle as a float32 product ``float32(p) * inv_freq32``
(transformers: ``position_ids[..., None].float() * self.inv_freq``, GPT-J: the
same product in its sin/cos table). They differ in ``inv_freq32``: transformers
computes the frequencies in float32 (``base ** (arange / dim)``, the yarn/llama3
blends, in float32) and lands up to a few ulps from the correctly rounded value;
ropepool computes them in float64 and rounds once (docs/rope.md). A 1-ulp
frequency difference is ~6e-8 relative, but the angle is ``p * f``: at
p = 1e5 and f ~ 0.9 that is 5e-3 rad, and the rotated pair moves by that much
times its length. No float32 RoPE is more accurate than that at such
positions (the float32 angle itself is only good to half an ulp of 1e5, 4e-3
rad), so "agree within 1e-5 relative" cannot hold there for any
implementation whose frequencies are not bit-identical to transformers'.

So every rotated element is held to a bound built from its own pair
``(x1, x2)``: ``A = attention_scaling * (|x1| + |x2|)`` (no output of the pair
can be larger) and ``dtheta = |theta_ropepool - theta_transformers|``, both
float32 angles recomputed exactly as each side computes them (checked against
transformers' own cos/sin: ``angle_replica_err``; 0 with transformers 5.24,
which forms the angle as a broadcast product, not a matmul, so no other
rounding enters). By the triangle inequality
through the exact (float64) rotations at each side's own angle:

    |ropepool - transformers| <= |ropepool - exact(theta_rp)|          rp_exact_tol
                               + |exact(theta_rp) - exact(theta_tf)|  <= A * dtheta
                               + |exact(theta_tf) - transformers|     tf_exact_tol

- ``A * dtheta``: rotating a 2-vector of length <= A by two angles moves it by
  at most ``A * dtheta``. Where the frequencies agree bit for bit dtheta is 0
  and only the rounding terms remain: that is the tight float32 check
  (``same_angle_rel`` reports it: 0 with the torch backend, which is the same
  torch cos/sin on the same float32 angle, ~1.5e-7 with the Triton kernel).
- float32: each side's cos/sin (<= 1-2 ulps), two products and a sum;
  1e-6 A each (~17 ulps of u = 2^-24; measured <= 2e-7).
- bfloat16, transformers: cos and sin rounded to bfloat16 (u = 2^-8 of each
  term), each product (u) and the sum (u of the result): 3u(1 + 3u) A.
  ropepool computes in float32 and rounds once: u A, 2u A under the Triton
  CPU interpreter, whose float32 -> bfloat16 cast truncates (compiled CUDA
  kernels round to nearest).

Frequencies are held separately, so dtheta cannot hide a wrong frequency (a
wrong longrope set, a missing scaling factor): the largest relative difference
between the float32 frequencies ropepool and transformers used must be within
``freq_rel_tol(base) = (ln(base) + 8) * 2^-24`` (transformers' float32
exponent k/dim, amplified by ln(base) in base ** (k/dim), plus a few
roundings; measured <= 4 ulps, Phi-3's longrope factors on a 96-wide head).

``rp_vs_exact`` and ``tf_vs_exact`` report each side against its exact
rotation, ``max_rel_err`` is ``max |ropepool - transformers| / A`` (relative
to the pair being rotated: elementwise relative error is meaningless at
outputs near 0), ``bound_ratio`` the largest error over its bound (<= 1
conforms). Pass-through features (partial rotary) must be bit-identical to the
input on both sides (``pass_exact``); ``RopeSpec.from_hf_config`` of the
config's ``to_dict()`` must give the same spec as of the config object.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import zlib
from typing import Callable

import torch

if not torch.cuda.is_available():
    # The Triton kernel on CPU tensors runs under its interpreter; it must be
    # set before triton is imported (tests/conftest.py does the same).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import transformers  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.phi import modeling_phi  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

import ropepool  # noqa: E402
from ropepool import RopeSpec  # noqa: E402

# Tolerances, in units of A per rotated element (see the module docstring).
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}  # unit roundoff: half an ulp, relative
F32_SLACK = 1e-6  # float32 cos/sin, products and sums: measured <= 2e-7 A, ~17 float32 ulps allowed


def rp_exact_tol(dtype, interpreter: bool = False) -> float:
    """ropepool against the exact rotation at its own angle: one rounding to the dtype.

    The Triton CPU interpreter converts float32 to bfloat16 by truncation (its
    cast passes no rounding mode), up to one whole ulp (2u) instead of half;
    compiled kernels on CUDA round to nearest.
    """
    if dtype == torch.float32:
        return F32_SLACK
    return (2 if interpreter else 1) * U[dtype] + F32_SLACK


def tf_exact_tol(dtype) -> float:
    """transformers against the exact rotation at its own angle.

    bfloat16: cos and sin rounded to the dtype (u of each term), each product
    (u) and the sum (u of the result): 3u(1 + 3u) A, first and second order.
    """
    if dtype == torch.float32:
        return F32_SLACK
    return 3 * U[dtype] * (1 + 3 * U[dtype]) + F32_SLACK


def arith_tol(dtype, interpreter: bool = False) -> float:
    """|ropepool - transformers| beyond A * dtheta, by the triangle inequality through the two exact rotations."""
    return rp_exact_tol(dtype, interpreter) + tf_exact_tol(dtype)


def freq_rel_tol(base: float) -> float:
    """Largest relative difference allowed between ropepool's and transformers' float32 frequencies.

    transformers rounds the exponent k / dim to float32 (relative error <= 2^-24,
    exact when dim is a power of two) and base ** it amplifies that by ln(base);
    pow, the division and the scaled types' products and blends (llama3, yarn,
    longrope factors) add a few roundings more: (ln(base) + 8) * 2^-24. That is
    <= 1.6e-6 for base 1e6; a wrong frequency set (longrope short vs long,
    a missing scaling factor) is off by percents.
    """
    return (np.log(base) + 8) * 2.0 ** -24


# transformers' cos/sin against our recomputation of its angle (same float32 product,
# same torch cos/sin): identical in practice; an angle off by one ulp at 1e5 would show as ~1e-2.
ANGLE_REPLICA_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers model family rotates: its module class and how to call its apply function."""

    rotary: type
    apply: Callable  # (module, q, k, position_ids) -> q_embed, k_embed, cos-like output for the replica check


def _neox_apply(modeling, partial_in_attention=False):
    """Llama-style families: module(x, position_ids) -> (cos, sin) [B, T, rot]; q/k [B, H, T, D]."""

    def apply(module, q, k, position_ids):
        cos, sin = module(q, position_ids)
        if partial_in_attention:
            # Phi slices the rotary features in its attention layer and applies on that slice.
            r = cos.shape[-1]
            qr, kr = modeling.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
            q_embed, k_embed = torch.cat((qr, q[..., r:]), -1), torch.cat((kr, k[..., r:]), -1)
        else:
            q_embed, k_embed = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        return q_embed, k_embed, cos[..., : cos.shape[-1] // 2]  # NeoX: emb = cat(freqs, freqs)

    return apply


def _gptj_apply(module, q, k, position_ids):
    """GPT-J: module(x, position_ids) -> (sin, cos) [B, T, rot/2] from its table; q/k [B, T, H, D]."""
    sin, cos = module(q, position_ids)
    r = 2 * cos.shape[-1]
    out = []
    for x in (q.transpose(1, 2), k.transpose(1, 2)):  # GPT-J rotates before its transpose to [B, H, T, D]
        rot = modeling_gptj.apply_rotary_pos_emb(x[..., :r], sin, cos)
        out.append(torch.cat((rot, x[..., r:]), -1).transpose(1, 2))
    return out[0], out[1], cos


class _GPTJTable(torch.nn.Module):
    """GPT-J's rotary table as transformers builds it (``create_sinusoidal_positions``), for
    releases that keep it inside the attention layer (no GPTJRotaryEmbedding before ~5.2x)."""

    def __init__(self, config):
        super().__init__()
        table = modeling_gptj.create_sinusoidal_positions(config.max_position_embeddings,
                                                          config.rotary_dim or config.hidden_size)
        self.register_buffer("embed_positions", table, persistent=False)

    def forward(self, x, position_ids):
        sincos = self.embed_positions[position_ids].to(x.dtype)
        return torch.split(sincos, sincos.shape[-1] // 2, dim=-1)


FAMILIES = {
    "llama": Family(modeling_llama.LlamaRotaryEmbedding, _neox_apply(modeling_llama)),
    "qwen2": Family(modeling_qwen2.Qwen2RotaryEmbedding, _neox_apply(modeling_qwen2)),
    "mistral": Family(modeling_mistral.MistralRotaryEmbedding, _neox_apply(modeling_mistral)),
    "phi3": Family(modeling_phi3.Phi3RotaryEmbedding, _neox_apply(modeling_phi3)),
    "gpt_neox": Family(modeling_gpt_neox.GPTNeoXRotaryEmbedding, _neox_apply(modeling_gpt_neox)),
    "phi": Family(modeling_phi.PhiRotaryEmbedding, _neox_apply(modeling_phi, partial_in_attention=True)),
    "gptj": Family(getattr(modeling_gptj, "GPTJRotaryEmbedding", _GPTJTable), _gptj_apply),
}


# --- configurations ---------------------------------------------------------------------------

LLAMA31 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
# Phi-3 style factors (48 per set: rotary_dim 96); made up but distinct per pair, so a
# swapped or misaligned list shows. The long set reaches Phi-3-mini-128k's ~40x.
SHORT_FACTOR = [round(1.0 + 0.25 * i / 47, 6) for i in range(48)]
LONG_FACTOR = [round(1.0 + 39.0 * (i / 47) ** 2, 6) for i in range(48)]


def _phi3(**kw):
    kw = dict(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072,
              original_max_position_embeddings=4096,
              rope_scaling=dict(type="longrope", short_factor=SHORT_FACTOR, long_factor=LONG_FACTOR)) | kw
    return transformers.Phi3Config(**kw)


def _dynamic():
    return transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                                    rope_scaling=dict(rope_type="dynamic", factor=2.0))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    make_config: Callable
    max_position: int  # the largest position of the call (always present)
    min_position: int = 0
    # longrope calls that switch to the long factors: also put positions below this in the call
    low_below: int | None = None
    # dynamic: pin spec.seq_len to largest position + 1, transformers' rule for one forward
    pin_seq_len: bool = False
    triton_cpu: bool = False  # also run the Triton interpreter on CPU (kept small)


CASES = [
    Case("llama3.1-8b", "llama", lambda: transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters=dict(LLAMA31)), 100000, triton_cpu=True),
    Case("llama3.2-1b-head64", "llama", lambda: transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters=dict(LLAMA31, factor=32.0)), 100000),
    Case("qwen2-7b-theta1e6", "qwen2", lambda: transformers.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
        max_position_embeddings=131072), 100000),
    Case("qwen2.5-7b-yarn-x4", "qwen2", lambda: transformers.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
        max_position_embeddings=131072,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32768)), 100000,
        triton_cpu=True),
    Case("phi3-mini-longrope-short", "phi3", _phi3, 4095),
    Case("phi3-mini-longrope-long", "phi3", _phi3, 100000, low_below=4096, triton_cpu=True),
    Case("phi3-mini-longrope-long-edge", "phi3", _phi3, 4096, low_below=4096, triton_cpu=True),
    Case("phi4-mini-longrope-partial-0.75", "phi3", lambda: _phi3(
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75), 100000, low_below=4096),
    Case("mistral-7b-linear-x4", "mistral", lambda: transformers.MistralConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_theta=1e6,
        max_position_embeddings=131072, rope_scaling=dict(type="linear", factor=4.0)), 100000),
    Case("llama-dynamic-x2-beyond", "llama", _dynamic, 20000, pin_seq_len=True, triton_cpu=True),
    Case("llama-dynamic-x2-within", "llama", _dynamic, 4095, pin_seq_len=True),
    Case("gpt-neox-20b-partial-0.25", "gpt_neox", lambda: transformers.GPTNeoXConfig(
        hidden_size=6144, num_attention_heads=64, rotary_pct=0.25, max_position_embeddings=131072), 100000,
        triton_cpu=True),
    Case("phi-2-partial-0.4", "phi", lambda: transformers.PhiConfig(
        hidden_size=2560, num_attention_heads=32, partial_rotary_factor=0.4, max_position_embeddings=131072),
        100000, triton_cpu=True),
    # GPT-J precomputes a sin/cos table of n_positions rows (2048 for GPT-J 6B); a longer
    # table lets positions reach 1e5 like the other cases.
    Case("gpt-j-6b-interleaved", "gptj", lambda: transformers.GPTJConfig(
        n_embd=4096, n_head=16, rotary_dim=64, n_positions=100001), 100000, triton_cpu=True),
    Case("llama-head256", "llama", lambda: transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072), 100000),
]
CASES_BY_NAME = {c.name: c for c in CASES}


# --- one case ---------------------------------------------------------------------------------

def positions_for(case: Case, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [num_tokens]: random in range, the largest always present, some repeated, shuffled."""
    lo, hi = case.min_position, case.max_position
    pos = torch.randint(lo, hi + 1, (num_tokens,), generator=gen)
    if case.low_below is not None:  # half of the call below the longrope switch point
        half = num_tokens // 2
        pos[:half] = torch.randint(lo, case.low_below, (half,), generator=gen)
    pos[0] = hi
    if num_tokens >= 4:
        pos[1] = lo
        pos[2: 2 + num_tokens // 4] = pos[num_tokens - 1]  # a repeated position
    return pos[torch.randperm(num_tokens, generator=gen)]


def _pairs(x: torch.Tensor, r: int, style: str):
    """The (x1, x2) of each rotated pair of x[..., :r], float64, and how to scatter pair values back."""
    xr = x[..., :r].double()
    if style == "neox":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]

        def back(a, b):
            return torch.cat((a, b), -1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]

        def back(a, b):
            return torch.stack((a, b), -1).flatten(-2)
    return x1, x2, back


def _exact(x: torch.Tensor, theta: torch.Tensor, scaling: float, r: int, style: str) -> torch.Tensor:
    """float64 rotation of x [T, H, D] by float64(theta) [T, r/2], times scaling; pass-through copied."""
    x1, x2, back = _pairs(x, r, style)
    c, s = (theta.cos() * scaling)[:, None, :], (theta.sin() * scaling)[:, None, :]
    return torch.cat((back(x1 * c - x2 * s, x1 * s + x2 * c), x[..., r:].double()), -1)


def _pair_size(x: torch.Tensor, scaling: float, r: int, style: str) -> torch.Tensor:
    """A = scaling * (|x1| + |x2|) per rotated element, float64 [T, H, r]."""
    x1, x2, back = _pairs(x, r, style)
    a = scaling * (x1.abs() + x2.abs())
    return back(a, a)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference in float32 ulps between two positive float32 tensors (bit-pattern distance)."""
    ia = a.detach().cpu().contiguous().view(torch.int32).long()
    ib = b.detach().cpu().contiguous().view(torch.int32).long()
    return int((ia - ib).abs().max())


def run_case(case: Case | str, device="cpu", dtype=torch.float32, backend=None, *, num_tokens=64,
             num_heads=4, num_kv_heads=2, seed=None) -> dict:
    """Rotate random q/k with ropepool and with transformers; return the errors (see the module docstring).

    q [T, num_heads, D] and k [T, num_kv_heads, D] (the head counts do not change the rotation; the
    config's head_dim, rotary_dim and frequencies come from the model configuration).
    """
    case = CASES_BY_NAME[case] if isinstance(case, str) else case
    device = torch.device(device)
    seed = zlib.crc32(case.name.encode()) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    family = FAMILIES[case.family]
    config = case.make_config()

    positions = positions_for(case, num_tokens, gen)
    seq_len = int(positions.max()) + 1 if case.pin_seq_len else None
    spec = RopeSpec.from_hf_config(config, seq_len=seq_len)
    spec_from_dict = RopeSpec.from_hf_config(config.to_dict(), seq_len=seq_len)
    D, r, s = spec.head_dim, spec.rotary_dim, spec.attention_scaling

    q = torch.randn(num_tokens, num_heads, D, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, D, generator=gen).to(dtype)

    # --- ropepool, [T, H, D]; slots -1: no pool writes, a one-row pool.
    qd, kd, pd = q.to(device), k.to(device), positions.to(device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    pool = torch.zeros(1, num_kv_heads, D, dtype=dtype, device=device)
    t0 = time.perf_counter()
    q_rp, k_rp, _, _ = ropepool.rope_pool_fused(
        qd, kd, kd, pd, slots, pool, pool.clone(), head_dim=D, num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads, rope=spec, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rp_s = time.perf_counter() - t0
    resolved = backend or ropepool.backends.pick("torch", qd).name
    interpreter = resolved == "triton" and device.type == "cpu"

    # --- transformers: its module and apply function, [B=1, H, T, D].
    module = family.rotary(config=config).to(device)
    position_ids = positions[None].to(device)
    with torch.no_grad():
        q_tf, k_tf, cos_tf = family.apply(module, qd.transpose(0, 1)[None], kd.transpose(0, 1)[None], position_ids)
    q_tf, k_tf = q_tf[0].transpose(0, 1), k_tf[0].transpose(0, 1)
    cos_tf = cos_tf[0].float()

    # --- the frequencies and float32 angles each side used, recomputed as each computes them.
    p32 = positions.to(device).float()
    if case.family == "gptj":
        # GPT-J's create_sinusoidal_positions: float32 frequencies, then int positions .float() * them
        f_tf = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.int64) / r))
        f_tf = f_tf.to(device)
    else:
        f_tf = module.inv_freq.float()  # after forward: what dynamic / longrope switched to
    use_long = spec.long_from is not None and int(positions.max()) >= spec.long_from
    f_rp = torch.from_numpy(spec.long_inv_freq if use_long else spec.inv_freq).float().to(device)
    theta_tf = p32[:, None] * f_tf[None, :]
    theta_rp = p32[:, None] * f_rp[None, :]
    replica_cos = (theta_tf.cos() * (1.0 if case.family == "gptj" else module.attention_scaling)).to(dtype).float()
    angle_replica_err = float((replica_cos - cos_tf).abs().max())
    dtheta = (theta_rp.double() - theta_tf.double()).abs().cpu()

    # --- errors, on the CPU in float64
    x_in = {"q": q, "k": k}
    got = {"q": (q_rp.cpu(), q_tf.cpu()), "k": (k_rp.cpu(), k_tf.cpu())}
    m = dict(max_abs_err=0.0, max_rel_err=0.0, same_angle_rel=0.0, bound_ratio=0.0, rp_vs_exact=0.0,
             tf_vs_exact=0.0, pass_exact=True, worst_at=None)
    for name, x in x_in.items():
        rp, tf = got[name]
        assert rp.shape == tf.shape == x.shape and rp.dtype == tf.dtype == dtype, (name, rp.shape, tf.shape)
        a = _pair_size(x, s, r, spec.style)
        d = (rp[..., :r].double() - tf[..., :r].double()).abs()
        # the angle difference of each element's pair, [T, 1, r]
        if spec.style == "neox":
            dth = torch.cat((dtheta, dtheta), -1)[:, None, :]
        else:
            dth = dtheta.repeat_interleave(2, -1)[:, None, :]
        allowed = a * (dth + arith_tol(dtype, interpreter))
        m["max_abs_err"] = max(m["max_abs_err"], float(d.max()))
        m["max_rel_err"] = max(m["max_rel_err"], float((d / a).max()))
        same = (dth == 0).expand_as(d)
        if same.any():
            m["same_angle_rel"] = max(m["same_angle_rel"], float((d / a)[same].max()))
        ratio = d / allowed
        if float(ratio.max()) >= m["bound_ratio"]:
            m["bound_ratio"] = float(ratio.max())
            t, h, i = (int(j) for j in np.unravel_index(int(ratio.argmax()), tuple(ratio.shape)))
            m["worst_at"] = dict(tensor=name, token=t, head=h, feature=i, position=int(positions[t]),
                                 ropepool=float(rp[t, h, i]), transformers=float(tf[t, h, i]))
        ex_rp = _exact(x, theta_rp.cpu().double(), s, r, spec.style)[..., :r]
        ex_tf = _exact(x, theta_tf.cpu().double(), s, r, spec.style)[..., :r]
        m["rp_vs_exact"] = max(m["rp_vs_exact"], float(((rp[..., :r].double() - ex_rp).abs() / a).max()))
        m["tf_vs_exact"] = max(m["tf_vs_exact"], float(((tf[..., :r].double() - ex_tf).abs() / a).max()))
        m["pass_exact"] &= bool(torch.equal(rp[..., r:], x[..., r:]) and torch.equal(tf[..., r:], x[..., r:]))

    return dict(
        case=case.name, rope_type=spec.rope_type, style=spec.style, head_dim=D, rotary_dim=r,
        dtype=str(dtype).removeprefix("torch."), backend=resolved, device=device.type, num_tokens=num_tokens,
        max_position=int(positions.max()), used_long=use_long, base=spec.base, interpreter=interpreter,
        freq_ulps=_ulps(f_rp, f_tf), freq_rel=float(((f_rp.double() - f_tf.double()).abs() / f_rp.double()).max()),
        max_dtheta=float(dtheta.max()), angle_replica_err=angle_replica_err, ropepool_s=rp_s,
        spec_dict_matches=bool(spec == spec_from_dict or (
            np.array_equal(spec.inv_freq, spec_from_dict.inv_freq)
            and spec.attention_scaling == spec_from_dict.attention_scaling
            and (spec.rotary_dim, spec.style) == (spec_from_dict.rotary_dim, spec_from_dict.style))),
        **m)


def check(result: dict) -> list[str]:
    """The failed conditions of one run_case result (empty: conforms)."""
    dtype, interp = getattr(torch, result["dtype"]), result["interpreter"]
    bad = []
    if result["bound_ratio"] > 1:
        bad.append(f"error {result['max_rel_err']:.3g} A over its bound A*(dtheta + {arith_tol(dtype, interp):.3g}) "
                   f"(ratio {result['bound_ratio']:.3g})")
    if result["freq_rel"] > freq_rel_tol(result["base"]):
        bad.append(f"frequencies {result['freq_rel']:.3g} relative ({result['freq_ulps']} float32 ulps) from "
                   f"transformers' (> {freq_rel_tol(result['base']):.3g})")
    if result["rp_vs_exact"] > rp_exact_tol(dtype, interp):
        bad.append(f"ropepool {result['rp_vs_exact']:.3g} A from the exact rotation (> {rp_exact_tol(dtype, interp):.3g})")
    if result["tf_vs_exact"] > tf_exact_tol(dtype):
        bad.append(f"transformers {result['tf_vs_exact']:.3g} A from the exact rotation "
                   f"(> {tf_exact_tol(dtype):.3g}): the bound's premise is wrong")
    if result["angle_replica_err"] > ANGLE_REPLICA_TOL:
        bad.append(f"our recomputation of transformers' angle is off ({result['angle_replica_err']:.3g})")
    if not result["pass_exact"]:
        bad.append("pass-through features are not the input's")
    if not result["spec_dict_matches"]:
        bad.append("from_hf_config(config.to_dict()) differs from from_hf_config(config)")
    return bad


# --- the table --------------------------------------------------------------------------------

COLUMNS = [("case", "{:<32}"), ("rope_type", "{:<9}"), ("dtype", "{:<8}"), ("backend", "{:<7}"),
           ("device", "{:<6}"), ("max_position", "{:>7}"), ("freq_ulps", "{:>4}"), ("max_abs_err", "{:>9.2e}"),
           ("max_rel_err", "{:>9.2e}"), ("same_angle_rel", "{:>9.2e}"), ("rp_vs_exact", "{:>9.2e}"),
           ("tf_vs_exact", "{:>9.2e}"), ("bound_ratio", "{:>6.3f}")]
HEADERS = ["case", "rope", "dtype", "backend", "device", "max_pos", "ulps", "abs_err", "rel_err", "same_ang",
           "rp_exact", "tf_exact", "bound"]


def plan(device: torch.device, quick: bool):
    """(case, backend, shapes) to run on this device."""
    if device.type == "cuda":
        big = dict(num_tokens=64 if quick else 512, num_heads=32, num_kv_heads=8)
        for case in CASES:
            for backend in (None, "torch"):  # None: the default, the Triton kernel on CUDA
                yield case, backend, big
    else:
        for case in CASES:
            yield case, "torch", dict(num_tokens=64 if quick else 256, num_heads=8, num_kv_heads=2)
        if os.environ.get("TRITON_INTERPRET") == "1":
            for case in CASES:
                if case.triton_cpu:
                    yield case, "triton", dict(num_tokens=16, num_heads=2, num_kv_heads=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--case", action="append", help="only these cases (repeatable)")
    args = ap.parse_args(argv)
    transformers.logging.set_verbosity_error()  # Phi-3's "set factor instead" advice, once per config
    device = torch.device(args.device)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + (", TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""))
    print("errors in units of A = attention_scaling * (|x1| + |x2|) of each rotated pair; "
          "bound = max err / (A * (dtheta + C)), <= 1 conforms")
    widths = [int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit())) for _, fmt in COLUMNS]
    print("  ".join(f"{h:<{w}}" for h, w in zip(HEADERS, widths)))
    failures = 0
    t0 = time.perf_counter()
    worst: dict = {}
    for case, backend, shape in plan(device, args.quick):
        if args.case and case.name not in args.case:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            res = run_case(case, device, dtype, backend, **shape)
            bad = check(res)
            failures += bool(bad)
            row = "  ".join(fmt.format(res[key]) for key, fmt in COLUMNS)
            print(row + ("" if not bad else "  FAIL: " + "; ".join(bad) + f"; worst at {res['worst_at']}"))
            key = (res["rope_type"], res["dtype"], res["backend"])
            worst[key] = max(worst.get(key, 0.0), res["max_rel_err"])
    print(f"\nworst max_rel_err per rope type (units of A), {time.perf_counter() - t0:.1f} s:")
    for (rope_type, dtype, backend), err in sorted(worst.items()):
        print(f"  {rope_type:<9} {dtype:<8} {backend:<7} {err:.2e}")
    print("conforms" if not failures else f"{failures} runs FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
