"""ropepool against transformers itself: q_rot / k_rot of every verified model family.

For each named case a transformers config is built in code (nothing is
downloaded). The family's own rotary-embedding module (found in its
``modeling_<family>.py``) computes cos/sin for arbitrary positions (shuffled,
repeated, up to 1e5; ``[3, T]`` rows for MRoPE) and the family's own apply
function rotates random q/k laid out as transformers wants them. ropepool
rotates the same q/k, laid out ``[T, H, D]``, with
``RopeSpec.from_hf_config(config)`` (or ``RopeSpec.for_layers(config)[layer]``
for a model whose layers differ). ``run_case`` returns the errors; ``main()``
prints one row per case, dtype and backend:

    python -m tests.hf_conformance             # CUDA: the default (Triton) and torch backends
    python -m tests.hf_conformance --quick     # fewer tokens
    python -m tests.hf_conformance --families  # one row per family (docs/models.md)

Without CUDA it runs the torch backend on every case and the Triton kernel
under its CPU interpreter (TRITON_INTERPRET=1, set below before triton can be
imported) on a subset, with 16 tokens.

How transformers is called (``KINDS``): ``apply_rotary_pos_emb(q, k, cos, sin)``
(rotate_half, interleaved rotate_half, GLM's repeat_interleave, GPT-OSS's
chunks), DeepSeek's ``apply_rotary_pos_emb_interleave``, the complex
multiplication of Llama 4 and DeepSeek V2 (``apply_rotary_emb``), and GPT-J's
``rotate_every_two`` on its sin/cos table. DeepSeek's interleave returns GPT-J
pairs with each head's rotated features permuted (the rotated evens, then the
rotated odds); ropepool keeps the pairs in place, as vLLM and FlashInfer store
them, so its output is compared with transformers' un-permuted back. A layer
without RoPE (Llama 4, SmolLM3, Cohere 2, EXAONE 4) is checked against the
family's own attention module (``use_rope`` / its sliding window): it must not
rotate there, and ropepool must return q and k bit for bit.

What is compared, and why the bounds are what they are
------------------------------------------------------
Both sides compute the angle as a float32 product ``float32(p) * inv_freq32``.
They differ in ``inv_freq32``: transformers computes the frequencies in
float32 and lands up to a few ulps from the correctly rounded value; ropepool
computes them in float64 and rounds once (docs/rope.md). At p = 1e5 a 1-ulp
frequency difference moves the angle by up to ~5e-3 rad; no float32 RoPE is
closer than that there (the float32 angle itself is only good to half an ulp
of 1e5, 4e-3 rad). So every rotated element is held to a bound built from its
own pair ``(x1, x2)``: ``A = attention_scaling * (|x1| + |x2|)`` (no output of
the pair can be larger) and ``dtheta = |theta_ropepool - theta_transformers|``,
both float32 angles recomputed exactly as each side computes them (checked
against transformers' own cos: ``angle_replica_err``). By the triangle
inequality through the exact (float64) rotations at each side's own angle:

    |ropepool - transformers| <= |ropepool - exact(theta_rp)|          rp_exact_tol
                               + |exact(theta_rp) - exact(theta_tf)|  <= A * dtheta
                               + |exact(theta_tf) - transformers|     tf_exact_tol

- float32: each side's cos/sin (<= 1-2 ulps), two products and a sum: 1e-6 A
  each (~17 ulps of u = 2^-24; measured <= 2e-7).
- bfloat16, transformers: cos and sin rounded to bfloat16 (u = 2^-8 of each
  term), each product (u) and the sum (u of the result): 3u(1 + 3u) A (the
  complex and float32-upcast families round fewer times; the bound holds).
  ropepool computes in float32 and rounds once: u A, 2u A under the Triton
  CPU interpreter, whose float32 -> bfloat16 cast truncates (compiled CUDA
  kernels round to nearest).

A wrong pair style or a wrong rotary width moves elements by O(A), orders of
magnitude past these bounds (tests/test_hf_conformance.py checks that it
fails). Frequencies are held separately, so dtheta cannot hide a wrong
frequency: ropepool's and transformers' float32 frequencies may differ by at
most ``freq_rel_tol(base) = (ln(base) + 8) * 2^-24`` relative (transformers'
float32 exponent k/dim amplified by ln(base), plus a few roundings).
Pass-through features (partial rotary) must be bit-identical to the input on
both sides; the spec read from ``config.to_dict()`` must equal the one read
from the config object.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import time
import zlib

import torch

if not torch.cuda.is_available():
    # The Triton kernel on CPU tensors runs under its interpreter; it must be
    # set before triton is imported (tests/conftest.py does the same).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import transformers

import ropepool
from ropepool import RopeSpec
from tests.hf_cases import CASES, CASES_BY_NAME, Case

# Tolerances, in units of A per rotated element (see the module docstring).
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}  # unit roundoff: half an ulp, relative
F32_SLACK = 1e-6  # float32 cos/sin, products and sums: measured <= 2e-7 A, ~17 float32 ulps allowed
# transformers' cos against our recomputation of its angle: identical in practice; an angle
# off by one ulp at 1e5 would show as ~1e-2.
ANGLE_REPLICA_TOL = 1e-6


def rp_exact_tol(dtype, interpreter: bool = False) -> float:
    """ropepool against the exact rotation at its own angle: one rounding to the dtype (truncation, 2u,
    under the Triton CPU interpreter)."""
    if dtype == torch.float32:
        return F32_SLACK
    return (2 if interpreter else 1) * U[dtype] + F32_SLACK


def tf_exact_tol(dtype) -> float:
    """transformers against the exact rotation at its own angle: 3u(1 + 3u) in bfloat16 (cos/sin, products, sum)."""
    if dtype == torch.float32:
        return F32_SLACK
    return 3 * U[dtype] * (1 + 3 * U[dtype]) + F32_SLACK


def arith_tol(dtype, interpreter: bool = False) -> float:
    """|ropepool - transformers| beyond A * dtheta, by the triangle inequality through the two exact rotations."""
    return rp_exact_tol(dtype, interpreter) + tf_exact_tol(dtype)


def freq_rel_tol(base: float) -> float:
    """Largest relative difference allowed between ropepool's and transformers' float32 frequencies:
    (ln(base) + 8) * 2^-24, <= 1.6e-6 at base 1e6; a wrong frequency set is off by percents."""
    return (np.log(base) + 8) * 2.0 ** -24


# --- transformers' own code, per family ---------------------------------------------------------

# model_type -> how its apply function is called (default "cos_sin"); "flag": DeepSeek V3's
# rope_interleave picks "interleave" or "cos_sin".
KINDS = {"llama4_text": "complex_bthd", "deepseek_v2": "complex", "deepseek_v3": "flag", "glm4_moe_lite": "flag",
         "youtu": "flag", "gptj": "gptj"}
# model_type -> (attention class, does layer i rotate there): the families with layers without RoPE
NOPE_RULES = {
    "llama4_text": ("Llama4TextAttention", lambda attn: bool(attn.use_rope)),
    "smollm3": ("SmolLM3Attention", lambda attn: bool(attn.use_rope)),
    "cohere2": ("Cohere2Attention", lambda attn: attn.sliding_window is not None),
    "exaone4": ("Exaone4Attention", lambda attn: attn.sliding_window is None or attn.is_sliding),
}


def modeling(model_type: str):
    package = model_type.removesuffix("_text")
    return importlib.import_module(f"transformers.models.{package}.modeling_{package}")


class _GPTJTable(torch.nn.Module):
    """GPT-J's rotary table as transformers builds it, for releases without GPTJRotaryEmbedding (< ~5.2x)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.gptj import modeling_gptj

        table = modeling_gptj.create_sinusoidal_positions(config.max_position_embeddings,
                                                          config.rotary_dim or config.hidden_size)
        self.register_buffer("embed_positions", table, persistent=False)

    def forward(self, x, position_ids):
        sincos = self.embed_positions[position_ids].to(x.dtype)
        return torch.split(sincos, sincos.shape[-1] // 2, dim=-1)


def rotary_module(mod, text):
    """The family's text rotary-embedding class (one per modeling file, besides vision ones), built from the config."""
    found = [c for n, c in vars(mod).items() if n.endswith("RotaryEmbedding") and "Vision" not in n
             and isinstance(c, type) and c.__module__ == mod.__name__]
    cls = found[0] if found else _GPTJTable
    return cls(config=text)


def _half_cos(cos: torch.Tensor, r: int) -> torch.Tensor:
    """[T, r/2] per-frequency cos from a module's cos: already half (GPT-OSS), cat(f, f), or interleaved (Cohere)."""
    if cos.shape[-1] == r // 2:
        return cos
    h = cos.shape[-1] // 2
    return cos[..., :h] if torch.equal(cos[..., :h], cos[..., h:]) else cos[..., ::2]


def transformers_rotate(text, q, k, positions, layer_type, r):
    """q_tf, k_tf [T, H, D], the per-frequency cos transformers multiplied by [T, r/2] (in the dtype it was
    used in), its float32 frequencies."""
    mod = modeling(text.model_type)
    kind = KINDS.get(text.model_type, "cos_sin")
    if kind == "flag":
        kind = "interleave" if text.rope_interleave else "cos_sin"
    module = rotary_module(mod, text).to(q.device)
    pos_ids = positions[None] if positions.ndim == 1 else positions[:, None]  # [1, T] or [3, 1, T]
    extra = (layer_type,) if "layer_type" in inspect.signature(module.forward).parameters else ()
    qb, kb = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, T, D]
    with torch.no_grad():
        emb = module(qb, pos_ids, *extra)
        if kind.startswith("complex"):
            if kind == "complex_bthd":  # Llama 4 rotates [B, T, H, D]
                qo, ko = (x[0] for x in mod.apply_rotary_emb(q[None], k[None], emb))
            else:
                qo, ko = (x[0].transpose(0, 1) for x in mod.apply_rotary_emb(qb, kb, emb))
            return qo, ko, emb.real[0], module.inv_freq.float()  # complex64: cos stays float32
        if kind == "gptj":
            sin, cos = emb
            out = [torch.cat((mod.apply_rotary_pos_emb(x[None, ..., :r], sin, cos)[0], x[..., r:]), -1) for x in (q, k)]
            exponent = torch.arange(0, r, 2, dtype=torch.int64) / r  # create_sinusoidal_positions' frequencies
            return out[0], out[1], cos[0], (1.0 / (10000 ** exponent)).float().to(q.device)
        cos, sin = emb
        apply = mod.apply_rotary_pos_emb_interleave if kind == "interleave" else mod.apply_rotary_pos_emb
        try:
            qo, ko = apply(qb, kb, cos, sin)  # GLM, Phi-3, GPT-NeoX, ... slice the rotary features themselves
        except RuntimeError:
            if r == q.shape[-1]:
                raise
            # the attention layer slices them (Phi, StableLM, Persimmon): cos does not broadcast over the head
            qr, kr = apply(qb[..., :r], kb[..., :r], cos, sin)
            qo, ko = torch.cat((qr, qb[..., r:]), -1), torch.cat((kr, kb[..., r:]), -1)
        qo, ko = qo[0].transpose(0, 1), ko[0].transpose(0, 1)
        if kind == "interleave":  # rotated evens then rotated odds -> the pairs back in place
            qo, ko = (torch.cat((torch.stack((x[..., : r // 2], x[..., r // 2: r]), -1).flatten(-2), x[..., r:]), -1)
                      for x in (qo, ko))
        f = getattr(module, f"{layer_type}_inv_freq") if extra else module.inv_freq
        return qo, ko, _half_cos(cos[0], r), f.float()


def layer_rotates(text, layer: int) -> bool | None:
    """Whether the family's own attention module of this layer applies RoPE (None: the family always does)."""
    rule = NOPE_RULES.get(text.model_type)
    if rule is None:
        return None
    return rule[1](getattr(modeling(text.model_type), rule[0])(text, layer))


# --- one case ---------------------------------------------------------------------------------

def positions_for(case: Case, num_tokens: int, gen: torch.Generator, rows: int) -> torch.Tensor:
    """int64 [num_tokens] (or [3, num_tokens]): random in range, the largest present, some repeated, shuffled."""
    lo, hi = case.min_position, case.max_position
    pos = torch.randint(lo, hi + 1, (rows, num_tokens), generator=gen)
    if case.low_below is not None:  # half of the call below the longrope switch point
        half = num_tokens // 2
        pos[:, :half] = torch.randint(lo, case.low_below, (rows, half), generator=gen)
    pos[:, 0] = hi
    if num_tokens >= 4:
        pos[:, 1] = lo
        pos[:, 2: 2 + num_tokens // 4] = pos[:, num_tokens - 1: num_tokens]  # a repeated position
    pos = pos[:, torch.randperm(num_tokens, generator=gen)]
    return pos[0] if rows == 1 else pos


def _pairs(x: torch.Tensor, r: int, style: str):
    """The (x1, x2) of each rotated pair of x[..., :r], float64, and how to scatter pair values back."""
    xr = x[..., :r].double()
    if style == "neox":
        return xr[..., : r // 2], xr[..., r // 2:], lambda a, b: torch.cat((a, b), -1)
    return xr[..., 0::2], xr[..., 1::2], lambda a, b: torch.stack((a, b), -1).flatten(-2)


def _exact(x: torch.Tensor, theta: torch.Tensor, scaling: float, r: int, style: str) -> torch.Tensor:
    """float64 rotation of x[..., :r] ([T, H, D]) by theta [T, r/2], times scaling."""
    x1, x2, back = _pairs(x, r, style)
    c, s = (theta.cos() * scaling)[:, None, :], (theta.sin() * scaling)[:, None, :]
    return back(x1 * c - x2 * s, x1 * s + x2 * c)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest difference in float32 ulps between two positive float32 tensors (bit-pattern distance)."""
    ia = a.detach().cpu().contiguous().view(torch.int32).long()
    ib = b.detach().cpu().contiguous().view(torch.int32).long()
    return int((ia - ib).abs().max()) if ia.numel() else 0


def case_specs(case: Case, config, seq_len):
    """The spec of the case's layer, read from the config object and from its dict form."""
    if case.layer is None:
        return RopeSpec.from_hf_config(config, seq_len=seq_len), RopeSpec.from_hf_config(config.to_dict(),
                                                                                         seq_len=seq_len)
    return (RopeSpec.for_layers(config, seq_len=seq_len)[case.layer],
            RopeSpec.for_layers(config.to_dict(), seq_len=seq_len)[case.layer])


def run_case(case: Case | str, device="cpu", dtype=torch.float32, backend=None, *, num_tokens=64,
             num_heads=4, num_kv_heads=2, seed=None, rope=None) -> dict:
    """Rotate random q/k with ropepool and with transformers; return the errors (see the module docstring).

    ``rope`` replaces the spec ropepool is called with (the negative checks: a wrong style or width);
    the bounds still come from the config's spec.
    """
    case = CASES_BY_NAME[case] if isinstance(case, str) else case
    device = torch.device(device)
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) if seed is None else seed)
    config = case.make_config()
    text = getattr(config, "text_config", None) or config
    probe, _ = case_specs(case, config, None)
    positions = positions_for(case, num_tokens, gen, 3 if probe.mrope_section else 1)
    seq_len = int(positions.max()) + 1 if case.pin_seq_len else None
    spec, spec_from_dict = case_specs(case, config, seq_len)
    D, r, s = spec.head_dim, spec.rotary_dim, spec.attention_scaling

    q = torch.randn(num_tokens, num_heads, D, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, D, generator=gen).to(dtype)
    qd, kd, pd = q.to(device), k.to(device), positions.to(device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)  # no pool writes
    pool = torch.zeros(1, num_kv_heads, D, dtype=dtype, device=device)
    t0 = time.perf_counter()
    q_rp, k_rp, _, _ = ropepool.rope_pool_fused(
        qd, kd, kd, pd, slots, pool, pool.clone(), head_dim=D, num_qo_heads=num_heads,
        num_kv_heads=num_kv_heads, rope=rope or spec, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rp_s = time.perf_counter() - t0
    resolved = backend or ropepool.backends.pick("torch", qd).name
    interpreter = resolved == "triton" and device.type == "cpu"
    layer = case.layer or 0
    res = {"case": case.name, "family": text.model_type, "rope_type": spec.rope_type, "style": spec.style,
           "head_dim": D, "rotary_dim": r, "mrope": spec.mrope_section is not None,
           "dtype": str(dtype).removeprefix("torch."), "backend": resolved, "device": device.type,
           "num_tokens": num_tokens, "max_position": int(positions.max()), "base": spec.base,
           "interpreter": interpreter, "ropepool_s": rp_s, "attention_rotates": layer_rotates(text, layer),
           "spec_dict_matches": bool(spec == spec_from_dict), "used_long": False, "freq_ulps": 0, "freq_rel": 0.0,
           "max_dtheta": 0.0, "angle_replica_err": 0.0, "max_abs_err": 0.0, "max_rel_err": 0.0,
           "same_angle_rel": 0.0, "bound_ratio": 0.0, "rp_vs_exact": 0.0, "tf_vs_exact": 0.0, "worst_at": None}
    if r == 0:  # a layer without RoPE: transformers' attention leaves q and k as they are
        res["pass_exact"] = bool(torch.equal(q_rp.cpu(), q) and torch.equal(k_rp.cpu(), k))
        return res

    layer_type = text.layer_types[layer] if getattr(text, "layer_types", None) else None
    q_tf, k_tf, cos_tf, f_tf = transformers_rotate(text, qd, kd, pd, layer_type, r)

    # --- the float32 angles each side used, recomputed as each computes them
    rows = torch.from_numpy(spec.rotation.rows).to(device)
    p32 = (pd.float()[:, None] if pd.ndim == 1 else pd.float()[rows, :].T)  # [T, 1] or [T, r/2]
    use_long = spec.long_from is not None and int(positions.max()) >= spec.long_from
    f_rp = torch.from_numpy(spec.long_inv_freq if use_long else spec.inv_freq).float().to(device)
    theta_tf, theta_rp = p32 * f_tf[None, :], p32 * f_rp[None, :]
    replica = (theta_tf.cos() * (1.0 if KINDS.get(text.model_type) == "gptj" else s)).to(cos_tf.dtype)
    dtheta = (theta_rp.double() - theta_tf.double()).abs().cpu()
    res.update(used_long=use_long, freq_ulps=_ulps(f_rp, f_tf), max_dtheta=float(dtheta.max()),
               freq_rel=float(((f_rp.double() - f_tf.double()).abs() / f_rp.double()).max()),
               angle_replica_err=float((replica.float() - cos_tf.float()).abs().max()), pass_exact=True)

    # --- errors, on the CPU in float64
    for name, x, rp, tf in (("q", q, q_rp.cpu(), q_tf.cpu()), ("k", k, k_rp.cpu(), k_tf.cpu())):
        assert rp.shape == tf.shape == x.shape and rp.dtype == tf.dtype == dtype, (name, rp.shape, tf.shape)
        x1, x2, back = _pairs(x, r, spec.style)
        a = back(s * (x1.abs() + x2.abs()), s * (x1.abs() + x2.abs()))  # A per rotated element
        dth = back(dtheta, dtheta)[:, None, :]  # each element's pair's angle difference
        d = (rp[..., :r].double() - tf[..., :r].double()).abs()
        ratio = d / (a * (dth + arith_tol(dtype, interpreter)))
        res["max_abs_err"] = max(res["max_abs_err"], float(d.max()))
        res["max_rel_err"] = max(res["max_rel_err"], float((d / a).max()))
        same = (dth == 0).expand_as(d)
        if same.any():
            res["same_angle_rel"] = max(res["same_angle_rel"], float((d / a)[same].max()))
        if float(ratio.max()) >= res["bound_ratio"]:
            res["bound_ratio"] = float(ratio.max())
            t, h, i = (int(j) for j in np.unravel_index(int(ratio.argmax()), tuple(ratio.shape)))
            res["worst_at"] = {"tensor": name, "token": t, "head": h, "feature": i, "ropepool": float(rp[t, h, i]),
                                   "transformers": float(tf[t, h, i])}
        ex_rp = _exact(x, theta_rp.cpu().double(), s, r, spec.style)
        ex_tf = _exact(x, theta_tf.cpu().double(), s, r, spec.style)
        res["rp_vs_exact"] = max(res["rp_vs_exact"], float(((rp[..., :r].double() - ex_rp).abs() / a).max()))
        res["tf_vs_exact"] = max(res["tf_vs_exact"], float(((tf[..., :r].double() - ex_tf).abs() / a).max()))
        res["pass_exact"] &= bool(torch.equal(rp[..., r:], x[..., r:]) and torch.equal(tf[..., r:], x[..., r:]))
    return res


def check(res: dict) -> list[str]:
    """The failed conditions of one run_case result (empty: conforms)."""
    dtype, interp = getattr(torch, res["dtype"]), res["interpreter"]
    bad = []
    if res["attention_rotates"] is not None and res["attention_rotates"] != (res["rotary_dim"] > 0):
        bad.append(f"transformers' attention {'rotates' if res['attention_rotates'] else 'does not rotate'} this "
                   f"layer; the spec has rotary_dim={res['rotary_dim']}")
    if res["bound_ratio"] > 1:
        bad.append(f"error {res['max_rel_err']:.3g} A over its bound A*(dtheta + {arith_tol(dtype, interp):.3g}) "
                   f"(ratio {res['bound_ratio']:.3g})")
    if res["freq_rel"] > freq_rel_tol(res["base"]):
        bad.append(f"frequencies {res['freq_rel']:.3g} relative ({res['freq_ulps']} float32 ulps) from "
                   f"transformers' (> {freq_rel_tol(res['base']):.3g})")
    if res["rp_vs_exact"] > rp_exact_tol(dtype, interp):
        bad.append(f"ropepool {res['rp_vs_exact']:.3g} A from the exact rotation (> {rp_exact_tol(dtype, interp):.3g})")
    if res["tf_vs_exact"] > tf_exact_tol(dtype):
        bad.append(f"transformers {res['tf_vs_exact']:.3g} A from the exact rotation "
                   f"(> {tf_exact_tol(dtype):.3g}): the bound's premise is wrong")
    if res["angle_replica_err"] > ANGLE_REPLICA_TOL:
        bad.append(f"our recomputation of transformers' angle is off ({res['angle_replica_err']:.3g})")
    if not res["pass_exact"]:
        bad.append("pass-through features (or a layer without RoPE) are not the input's")
    if not res["spec_dict_matches"]:
        bad.append("the spec read from config.to_dict() differs from the one read from the config")
    return bad


# --- the table --------------------------------------------------------------------------------

COLUMNS = [("case", "{:<30}"), ("family", "{:<14}"), ("style", "{:<5}"), ("partial", "{:<8}"), ("rope_type", "{:<9}"),
           ("dtype", "{:<8}"), ("backend", "{:<7}"), ("max_position", "{:>7}"), ("freq_ulps", "{:>4}"),
           ("rp_vs_exact", "{:>9.2e}"), ("tf_vs_exact", "{:>9.2e}"), ("max_rel_err", "{:>9.2e}"),
           ("bound_ratio", "{:>6.3f}")]
HEADERS = ["case", "family", "style", "r/D", "scaling", "dtype", "backend", "max_pos", "ulps", "rp_exact",
           "tf_exact", "vs_tf", "bound"]


def plan(device: torch.device, quick: bool):
    """(case, backend, shapes) to run on this device."""
    if device.type == "cuda":
        big = {"num_tokens": 64 if quick else 512, "num_heads": 32, "num_kv_heads": 8}
        for case in CASES:
            for backend in (None, "torch"):  # None: the default, the Triton kernel on CUDA
                yield case, backend, big
        return
    for case in CASES:
        yield case, "torch", {"num_tokens": 64 if quick else 256, "num_heads": 8, "num_kv_heads": 2}
    if os.environ.get("TRITON_INTERPRET") == "1":
        for case in CASES:
            if case.triton_cpu:
                yield case, "triton", {"num_tokens": 16, "num_heads": 2, "num_kv_heads": 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--case", action="append", help="only these cases (repeatable)")
    ap.add_argument("--families", action="store_true", help="also print one markdown row per family")
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
    failures, t0, worst = 0, time.perf_counter(), {}
    for case, backend, shape in plan(device, args.quick):
        if args.case and case.name not in args.case:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            res = run_case(case, device, dtype, backend, **shape)
            res["partial"] = f"{res['rotary_dim']}/{res['head_dim']}"
            bad = check(res)
            failures += bool(bad)
            print("  ".join(fmt.format(res[key]) for key, fmt in COLUMNS)
                  + ("" if not bad else "  FAIL: " + "; ".join(bad) + f"; worst at {res['worst_at']}"))
            row = worst.setdefault(res["family"], {"style": set(), "partial": set(), "scaling": set()})
            row["partial"].add(res["partial"])
            if res["rotary_dim"]:  # a layer without RoPE has no pair style or scaling
                row["style"].add(res["style"])
                row["scaling"].add(res["rope_type"] + (" mrope" if res["mrope"] else ""))
            for key in ("rp_vs_exact", "max_rel_err"):
                slot = (key, res["dtype"])
                row[slot] = max(row.get(slot, 0.0), res[key])
    print(f"\n{time.perf_counter() - t0:.1f} s; " + ("conforms" if not failures else f"{failures} runs FAILED"))
    if args.families:
        print("\n| family | style | r/D | scaling | vs exact f32 | vs transformers f32 | vs exact bf16 | "
              "vs transformers bf16 |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
        for fam, row in worst.items():
            cells = [", ".join(sorted(row[k])) for k in ("style", "partial", "scaling")]
            cells += [f"{row.get((k, dt), 0.0):.1e}" for dt in ("float32", "bfloat16") for k in ("rp_vs_exact",
                                                                                               "max_rel_err")]
            print(f"| {fam} | " + " | ".join(cells) + " |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
