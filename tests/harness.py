"""One test harness for every backend: NumPy inputs, the float64 oracle, bit-level checks of the pools.

Inputs are made in NumPy (float32 random numbers, then cast; bfloat16 and
fp8 through ml_dtypes) and converted to the backend's framework by a
``Backend`` adapter, which also converts results back, bits intact (NaN
payloads and -0.0 included). ``run_checked`` runs one call and checks
everything it returns and every byte of the cache:

- q_rot and k_rot against ``ropepool.reference`` (float64) within ``TOL``
  of the dtype, relative to ``max(1, |ref|)``; fp8 outputs with ``check_fp8``;
- each written pool row bit for bit the returned k_rot row and the given v
  row (fp8 pools: the oracle's quantized row, see ``check_fp8``), every
  other byte of the memory the pools live in untouched;
- q, k, v (and positions, slots) unchanged;
- aliasing: torch pools are updated in place and returned as the same
  objects; MLX pools are donated, the returned pools are the cache (the
  harness rebinds to them, as a caller does; the old arrays are not looked at).

Nothing here imports torch or mlx at module level: the MLX and oracle tests
run where torch is absent.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

import ropepool
from ropepool import CosSinCache, QKNorm, plan, reference
from ropepool.checks import validate

FLOATS = ("float16", "bfloat16", "float32")
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
# Max |out - ref| / max(1, |ref|) for plain RoPE: float32 arithmetic and cos/sin
# (a few ulp of the angle), then one rounding to the dtype (bf16 2^-8, f16 2^-11).
TOL = {"float32": 2e-6, "float16": 1.5e-3, "bfloat16": 1.2e-2}
# Unit roundoff of each dtype: what one rounding of a float32 result into it can add.
ROUNDING = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
HAS = {name: importlib.util.find_spec(name) is not None for name in ("torch", "triton", "mlx")}


def dtype_name(x) -> str:
    return str(x.dtype).rsplit(".", 1)[-1]


# --- NumPy inputs -----------------------------------------------------------------------------

def randn(rng, *shape, dtype="float32", scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(NP_DTYPES[dtype])


def make_slots(rng, T, pool_size, skip_every=3, idx="int64") -> np.ndarray:
    """Unique shuffled slots in [0, pool_size); every skip_every-th token a (varied) negative slot."""
    slots = rng.permutation(pool_size)[:T].astype(np.int64)
    if skip_every:
        negatives = np.array([-1, -2, -pool_size, np.iinfo(idx).min], dtype=np.int64)
        slots[::skip_every] = np.resize(negatives, len(slots[::skip_every]))
    return slots.astype(idx)


def make_positions(rng, T, high=1_000_000, idx="int64") -> np.ndarray:
    return rng.integers(0, high + 1, T).astype(idx)


def cos_sin_table(max_position, inv_freq, dtype="float32") -> np.ndarray:
    """An engine's [max_position, rotary_dim] table (vLLM's layout: cos half, then sin half)."""
    ang = np.arange(max_position, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(NP_DTYPES[dtype])


def bits(x: np.ndarray) -> np.ndarray:
    """Raw bits as unsigned ints of the same width: NaN payloads and -0.0 compare exactly."""
    x = np.ascontiguousarray(x)
    return x.view(_UNSIGNED[x.dtype.itemsize])


# --- frameworks -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """One backend of the op and the conversions to and from its framework."""

    name: str  # "torch", "triton" or "mlx"
    device: str | None = None  # torch's device

    @property
    def framework(self) -> str:
        return "mlx" if self.name == "mlx" else "torch"

    @property
    def interpreted(self) -> bool:
        """The Triton kernel under its CPU interpreter (fp8 rounding off by a step, triton#8322)."""
        return self.name == "triton" and self.device == "cpu"

    def array(self, x):
        """A NumPy array (or None, or a number) in this framework, bits intact."""
        if not isinstance(x, np.ndarray):
            return x
        x = np.ascontiguousarray(x)
        dt = dtype_name(x)
        if self.framework == "mlx":
            import mlx.core as mx

            if dt == "bfloat16":
                return mx.view(mx.array(x.view(np.uint16)), mx.bfloat16)
            if dt == "float8_e4m3fn":  # MLX keeps e4m3 in uint8 (mx.to_fp8)
                return mx.array(x.view(np.uint8))
            if dt.startswith("float8"):  # tests/params.py generates no such MLX case
                raise TypeError(f"MLX has no {dt} (its fp8 pools are e4m3 in uint8)")
            return mx.array(x)
        import torch

        special = dt == "bfloat16" or dt.startswith("float8")
        src = torch.from_numpy(bits(x).view({1: np.uint8, 2: np.int16}[x.itemsize]) if special else x)
        # Copied into a fresh tensor: NumPy gives empty arrays zero strides, torch.from_numpy keeps them.
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device).copy_(src)
        return out.view(getattr(torch, dt)) if special else out

    def numpy(self, x) -> np.ndarray:
        """A copy as NumPy, in the array's own dtype (bf16 and fp8 as ml_dtypes; MLX uint8 as e4m3)."""
        if self.framework == "mlx":
            import mlx.core as mx

            if x.dtype == mx.bfloat16:
                return np.array(mx.view(x, mx.uint16)).view(ml_dtypes.bfloat16)
            return np.array(x).view(ml_dtypes.float8_e4m3fn) if x.dtype == mx.uint8 else np.array(x)
        x = x.detach().cpu().contiguous()
        dt = dtype_name(x)
        if dt == "bfloat16" or dt.startswith("float8"):
            import torch

            return x.view({1: torch.uint8, 2: torch.int16}[x.element_size()]).numpy().view(NP_DTYPES[dt]).copy()
        return x.numpy().copy()

    def rope(self, rope):
        """A CosSinCache with a NumPy table as one of this framework (anything else as it is)."""
        if isinstance(rope, CosSinCache) and isinstance(rope.cos_sin_cache, np.ndarray):
            return CosSinCache(self.array(rope.cos_sin_cache), rope.is_neox, rope.mrope_section,
                               rope.mrope_interleaved)
        return rope

    def norm(self, norm):
        """A QKNorm with NumPy weights as one with weights of this framework."""
        if norm is None:
            return None
        return QKNorm(self.array(norm.q_weight), self.array(norm.k_weight), eps=norm.eps,
                      weight_offset=norm.weight_offset, after_rope=norm.after_rope)


def crossed(cases, dtypes=FLOATS):
    """pytest params of every (case, dtype) pair; the Triton interpreter runs one dtype per case
    (taking turns), the other pairs are marked big. ``cases``: pytest.param objects or plain values."""
    out = []
    for i, case in enumerate(cases):
        values, marks, name = (case.values, case.marks, case.id) if hasattr(case, "values") else \
            ((case,), (), str(case))
        for dt in dtypes:
            big = () if dt == dtypes[i % len(dtypes)] else (pytest.mark.big,)
            out.append(pytest.param(*values, dt, id=f"{name}-{dt}", marks=(*marks, *big)))
    return out


def backend_for(name: str, big: bool = False) -> Backend:
    """The Backend named, or a pytest skip saying why it cannot run here."""
    if name == "mlx":
        if not HAS["mlx"]:
            pytest.skip("mlx is not installed (pip install 'ropepool[mlx]')")
        return Backend("mlx")
    if not HAS["torch"]:
        pytest.skip("torch is not installed: the torch and triton backends are not tested here")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "triton":
        if not HAS["triton"]:
            pytest.skip("triton is not installed")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU, and TRITON_INTERPRET is not 1")
        if device == "cpu" and big:
            pytest.skip("too big for the Triton CPU interpreter (runs on CUDA)")
    return Backend(name, device)


# --- caches -----------------------------------------------------------------------------------

@dataclass
class Cache:
    """A KV cache: the arrays that own its memory and how the caller views them as two pools.

    ``views(owners) -> (first, second)`` must work on NumPy arrays and on
    torch tensors alike (indexing and slicing only): the harness applies it
    to the NumPy copies to find each row's bytes. ``first`` is k_pool
    (MLA: ckv_cache), ``second`` v_pool (MLA: kpe_cache).
    """

    owners: list
    kv_layout: str | None = None
    page_size: int = 1
    layer: int | None = None
    views: Callable = tuple
    headed: bool = True  # False: MLA's caches, rows with no head dim

    def pools(self):
        return self.views(self.owners)

    def rows(self, pool, slots, which=0):
        """The rows of ``slots`` in the written layer of ``pool`` (the slot formula, spelled out here);
        ``which``: 0 the k pool, 1 the v pool (their AMX packings differ)."""
        p = pool if self.layer is None else pool[self.layer]
        slots = np.asarray(slots, dtype=np.int64)
        if self.kv_layout is None:
            return p[slots]
        page, row = slots // self.page_size, slots % self.page_size
        if self.kv_layout == "amx":  # vLLM's AMX packing of each (block, head) run, as docs/engines.md gives it
            pages, heads, bs, dim = p.shape
            t, h, d = row[:, None, None], np.arange(heads)[None, :, None], np.arange(dim)[None, None, :]
            at = ((t // 16) * (dim // 2) + d // 2) * 32 + t % 16 * 2 + d % 2 if which == 0 else \
                ((d // 16) * (bs // 2) + t // 2) * 32 + d % 16 * 2 + t % 2
            return p.reshape(pages, heads, bs * dim)[page[:, None, None], h, at]
        return p[page, row] if self.kv_layout == "NHD" else p[page, :, row]

    @property
    def pool_size(self) -> int:
        first = self.views(self.owners)[0]
        shape = first.shape[1:] if self.layer is not None else first.shape
        return shape[0] * (1 if self.kv_layout is None else self.page_size)


def make_cache(rng, dtype, pool_size, heads, dim, *, kv_layout=None, page_size=1, layers=None, layer=None,
               v_dim=None, headed=True, scale=1.0) -> Cache:
    """Two random pools (NumPy) of one layout; ``layers`` adds a leading layer dim (written: ``layer``)."""
    pages = pool_size // page_size
    shapes = []
    for d in (dim, dim if v_dim is None else v_dim):
        one = {None: (pool_size,), "NHD": (pages, page_size), "HND": (pages,), "amx": (pages,)}[kv_layout]
        one += ((heads,) if headed else ()) + ((page_size,) if kv_layout in ("HND", "amx") else ()) + (d,)
        shapes.append(((layers,) if layers else ()) + one)
    return Cache([randn(rng, *s, dtype=dtype, scale=scale) for s in shapes], kv_layout, page_size,
                 layer if layers else None, headed=headed)


def poison(cache: Cache, slots, rng=None) -> Cache:
    """NaN in the rows about to be written; NaN/inf/-inf/-0.0 in unwritten rows around them
    (the rest of their pages, neighbouring rows, the same rows of the other layers), which must survive."""
    written = sorted({int(s) for s in np.asarray(slots) if 0 <= s < cache.pool_size})
    if not written:
        return cache
    dt = cache.owners[0].dtype
    specials = bits(np.array([np.nan, np.inf, -np.inf, -0.0], np.float32).astype(dt))
    near = set()
    for s in written:
        first = s - s % cache.page_size
        span = range(first - cache.page_size, first + 2 * cache.page_size) if cache.page_size > 1 else \
            range(s - 2, s + 3)
        near.update(r for r in span if 0 <= r < cache.pool_size)
    canaries = sorted(near - set(written))
    raw = [bits(o).reshape(-1).copy() for o in cache.owners]
    ids = element_ids(cache)
    for which, pool_ids in enumerate(cache.views(ids)):
        _set(raw, cache.rows(pool_ids, written, which), specials[:1])
        if canaries:
            _set(raw, cache.rows(pool_ids, canaries, which), specials)
        if cache.layer is not None:
            for other in range(pool_ids.shape[0]):
                if other != cache.layer % pool_ids.shape[0]:
                    _set(raw, dataclasses.replace(cache, layer=other).rows(pool_ids, written, which), specials)
    cache.owners = [r.view(o.dtype).reshape(o.shape) for r, o in zip(raw, cache.owners)]
    return cache


def element_ids(cache: Cache) -> list:
    """Arrays shaped like the owners holding each element's index in the owners' concatenation."""
    ids, start = [], 0
    for o in cache.owners:
        n = int(np.prod(o.shape))
        ids.append(np.arange(start, start + n).reshape(tuple(o.shape)))
        start += n
    return ids


def _set(raw, ids, patterns):
    ids = np.asarray(ids).reshape(-1)
    offsets = np.cumsum([0] + [len(r) for r in raw])
    values = np.resize(patterns, len(ids))
    for r, lo, hi in zip(raw, offsets, offsets[1:]):
        here = (ids >= lo) & (ids < hi)
        r[ids[here] - lo] = values[here]


# --- comparisons ------------------------------------------------------------------------------

def assert_close(name, got: np.ndarray, ref: np.ndarray, tol: float):
    g = np.asarray(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert g.shape == ref.shape, f"{name}: shape {g.shape} vs {ref.shape}"
    assert not np.isnan(g).any(), f"{name}: NaN (unwritten?) at {np.argwhere(np.isnan(g))[:5].tolist()}"
    err = np.abs(g - ref) / np.maximum(1.0, np.abs(ref))
    if err.size and err.max() > tol:
        bad = np.argwhere(err > tol)[:5].tolist()
        raise AssertionError(f"{name}: max rel err {err.max():.3g} > {tol}; first at {bad}")


def _torch_bits(x):
    """A torch tensor's raw bits as a NumPy int array (anything else as it is)."""
    if not hasattr(x, "detach"):
        return x
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.detach().cpu().contiguous().view(ints).numpy()


def assert_same_bits(name, got, want):
    """NumPy arrays (or torch tensors, compared as their raw bits) equal bit for bit."""
    got, want = np.asarray(_torch_bits(got)), np.asarray(_torch_bits(want))
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} vs {list(want.shape)}"
    g, w = bits(got), bits(want.astype(got.dtype) if want.dtype.kind == "f" else want)
    bad = np.argwhere(g != w)
    if len(bad):
        first = tuple(bad[0])
        raise AssertionError(f"{name}: {len(bad)} of {g.size} elements differ bit for bit; first at {list(first)}: "
                             f"got {got[first]!r}, want {want[first]!r}; mismatching indices {bad[:5].tolist()}")


def fp8_ordinal(x: np.ndarray) -> np.ndarray:
    """Each fp8 value's place on the number line (neighbours differ by 1; +-0 are 0): both formats
    are sign and magnitude, the magnitude's bits ordered like its value."""
    u = np.ascontiguousarray(x).view(np.uint8).astype(np.int32)
    return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)


def check_fp8(name, got: np.ndarray, ref, scale, slack, interpreted: bool = False):
    """fp8 values against the oracle's ``quantize(ref, scale)``, exactly, except where ``ref``'s
    error bound can cross a rounding boundary.

    ``slack``: the largest error of the float32 value the backend quantized
    (float32 arithmetic, and a rounding to q's dtype where the row is the
    returned k_rot). Any stored value in ``[quantize(ref - slack),
    quantize(ref + slack)]`` is right (quantize is monotone).

    ``interpreted``: the Triton CPU interpreter converts float32 to fp8
    wrongly (triton-lang/triton#8322): ties round away from zero and
    subnormals are truncated (one fp8 step, allowed), and a rounding up out
    of a full mantissa drops the carry (1.96 -> 1.0, not 2.0): where the
    right result is a power of two reached by rounding up, half of it is
    accepted too. On a GPU none of this is allowed. Never NaN or inf.
    """
    fp8 = got.dtype
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{name}: NaN/inf stored at {np.argwhere(~np.isfinite(g))[:5].tolist()}"
    ref = np.asarray(ref, np.float64)
    steps = int(interpreted)
    lo_val, hi_val = reference.quantize(ref - slack, scale, fp8), reference.quantize(ref + slack, scale, fp8)
    lo, hi, o = fp8_ordinal(lo_val) - steps, fp8_ordinal(hi_val) + steps, fp8_ordinal(got)
    bad = (o < lo) | (o > hi)
    if interpreted:
        for edge in (lo_val, hi_val):
            e = edge.astype(np.float64)
            carried = (e != 0) & (np.exp2(np.floor(np.log2(np.abs(np.where(e != 0, e, 1.0))))) == np.abs(e))
            bad &= ~(carried & (g == e / 2))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        want = reference.quantize(ref, scale, fp8)
        raise AssertionError(f"{name}: {int(bad.sum())} of {g.size} values off the oracle's quantize by more than "
                             f"the error bound; first at {list(i)}: got {g[i]}, want "
                             f"{float(want[i])}, value {ref[i]}")


def slack(ref, tol, dtype=None):
    """Error bound of a float32 result with ``tol`` (relative to max(1, |ref|)), then rounded to ``dtype``
    (None: not rounded), then divided by a scale in float32."""
    a = np.abs(np.asarray(ref, np.float64))
    return tol * np.maximum(1.0, a) + (ROUNDING[dtype] if dtype else 0.0) * a + 2.0**-22 * a


# --- the checked call -------------------------------------------------------------------------

@dataclass
class Result:
    q_rot: object  # as returned
    k_rot: object
    ref: tuple  # the oracle's (q_rot, k_rot, first pool, second pool)
    k_pool: object = None
    v_pool: object = None


def run_checked(backend: Backend, q, k, v, positions, slots, cache: Cache, *, rope=None, qk_norm=None,
                k_scale=None, v_scale=None, q_out=None, k_out=None, q_scale=None, k_out_scale=None,
                arith=TOL["float32"], bypass=False, **scalars) -> Result:
    """Run rope_pool_fused once and check all it returns and every byte of the cache (module docstring).

    Arrays may be NumPy (converted here) or of the backend's framework. The
    rope, norm and scales are given as the oracle takes them (NumPy). With
    ``arith`` bounds the float32 arithmetic's error (relative to max(1,
    |ref|)); a feature that needs a wider bound than plain RoPE's passes it
    (test_features derives each). q_rot / k_rot get that plus the dtype's
    rounding allowance (TOL[dtype] - TOL["float32"]). With
    ``bypass`` the call is checked on valid values and the runner gets these
    ones (on CUDA the public call itself, which reads no values): a slot outside the pool or a
    position outside the table writes nothing, and the oracle sees that
    token's slot as -1 and its position as 0 (table row 0 rotates by zero).
    """
    X = backend
    q, k, v, positions, slots = (X.array(a) for a in (q, k, v, positions, slots))
    arrays_np = {n: X.numpy(a) for n, a in zip(("q", "k", "v", "positions", "slots"), (q, k, v, positions, slots))}
    dt = dtype_name(arrays_np["q"])
    tol = TOL[dt] - TOL["float32"] + arith
    if isinstance(cache.owners[0], np.ndarray):
        cache.owners = [X.array(o) for o in cache.owners]
    before = [X.numpy(o) for o in cache.owners]
    k_pool, v_pool = cache.pools()
    kw = {"head_dim": q.shape[2], "num_qo_heads": q.shape[1], "num_kv_heads": k.shape[1], **scalars,
          "layer": cache.layer, "kv_layout": cache.kv_layout, "k_scale": k_scale, "v_scale": v_scale}
    fw_kw = dict(kw, rope=X.rope(rope), qk_norm=X.norm(qk_norm), k_scale=X.array(k_scale),
                 v_scale=X.array(v_scale))
    if q_out is not None or k_out is not None or q_scale is not None or k_out_scale is not None:
        fw_kw.update(q_out=q_out, k_out=k_out, q_scale=X.array(q_scale), k_out_scale=X.array(k_out_scale))
    pos_np, slots_np = arrays_np["positions"], arrays_np["slots"]
    writes = (slots_np >= 0) & (slots_np < cache.pool_size)
    if bypass:
        table = rope.cos_sin_cache if isinstance(rope, CosSinCache) else None
        inside = np.ones(len(slots_np), bool) if table is None else \
            ((pos_np >= 0) & (pos_np < len(table))).reshape(-1, len(slots_np)).all(0)
        if table is not None:
            assert_same_bits("table row 0 (rotates by zero)", table[0], np.r_[np.ones(table.shape[1] // 2),
                                                                              np.zeros(table.shape[1] // 2)])
        writes &= inside
        pos_np, slots_np = np.where(inside, pos_np, 0), np.where(writes, slots_np, -1)
    if bypass and X.device != "cuda":  # values are read here: check valid ones, run the plan on these
        call = validate.check(q, k, v, X.array(pos_np), X.array(slots_np), k_pool, v_pool, **fw_kw)
        run = plan.make(call, q, X.name).bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
        out = run(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    else:  # on CUDA the public call reads no values
        out = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, backend=X.name, **fw_kw)
    q_rot, k_rot, kp, vp = out
    _check_aliasing(X, out, (q, k, v), (k_pool, v_pool), q_out, k_out)
    if X.framework == "mlx":  # donated: the returned pools are the cache now
        cache.owners = [kp, vp]
    for name, a in zip(("q", "k", "v", "positions", "slots"), (q, k, v, positions, slots)):
        if not any(o is not None and _same_memory(X, a, o) for o in (q_out, k_out)):
            assert_same_bits(f"{name} after the call (inputs are never modified)", X.numpy(a), arrays_np[name])

    norm = qk_norm
    ref = reference.rope_pool_fused(arrays_np["q"], arrays_np["k"], arrays_np["v"], pos_np, slots_np,
                                    *cache.views(before), rope=rope, qk_norm=norm, **kw)
    got_q, got_k = X.numpy(q_rot), X.numpy(k_rot)
    for name, got, want, scale in (("q_rot", got_q, ref[0], q_scale), ("k_rot", got_k, ref[1], k_out_scale)):
        if dtype_name(got).startswith("float8"):
            check_fp8(name, got, want, scale, slack(want, arith), interpreted=X.interpreted)
        else:
            assert dtype_name(got) == dt, f"{name} dtype {dtype_name(got)}, want {dt}"
            assert_close(name, got, want, tol)

    tokens = np.flatnonzero(writes)
    k_rows = None if dtype_name(got_k) != dt else got_k[tokens]  # the returned k_rot in k's dtype
    k_write = (k_rows, ref[1][tokens], k_scale, slack(ref[1][tokens], arith, dt))
    v_write = (arrays_np["v"][tokens], arrays_np["v"][tokens].astype(np.float64), v_scale, slack(
        arrays_np["v"][tokens], 0.0))
    check_memory(X, cache, before, slots_np[tokens], (k_write, v_write), tol)
    return Result(q_rot, k_rot, ref, kp, vp)


def check_memory(X: Backend, cache: Cache, before, slots, writes, tol):
    """Every byte of the cache's memory: as ``before`` except the rows of ``slots`` in each pool.

    ``writes``: per pool, (exact rows or None, float64 rows, fp8 scale, fp8 slack).
    Exact rows must be stored bit for bit; fp8 pools are checked with
    check_fp8; None (k_out is fp8, so the pool's k_rot is not returned) within tol.
    """
    after = [X.numpy(o) for o in cache.owners]
    flat_before = np.concatenate([bits(b).reshape(-1) for b in before])
    flat_after = np.concatenate([bits(a).reshape(-1) for a in after])
    written = np.zeros(flat_before.size, bool)
    values = np.concatenate([a.reshape(-1) for a in after])
    fp8 = dtype_name(after[0]).startswith("float8")
    for which, (name, pool_ids, (exact, ref, scale, pad)) in enumerate(zip(
            ("first pool", "second pool"), cache.views(element_ids(cache)), writes)):
        ids = cache.rows(pool_ids, slots, which)
        assert not written[ids].any(), "the two pools share memory"
        written[ids] = True
        got = values[ids]
        if fp8:
            scale = scale if isinstance(scale, (float, int)) else np.asarray(scale)
            check_fp8(f"{name}'s written rows", got, ref.reshape(got.shape), scale, pad.reshape(got.shape),
                      interpreted=X.interpreted)
        elif exact is not None:
            assert_same_bits(f"{name}'s written rows == the returned k_rot / given v rows", got,
                             exact.reshape(got.shape))
        else:
            assert_close(f"{name}'s written rows", got, ref.reshape(got.shape), tol)
    assert_same_bits("cache memory outside the written rows (canaries, other pages, other layers)",
                     flat_after[~written], flat_before[~written])


def _same_memory(X, a, b) -> bool:
    return X.framework == "torch" and a.numel() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_aliasing(X, out, inputs, pools, q_out, k_out):
    q_rot, k_rot, kp, vp = out
    if X.framework == "torch":
        assert kp is pools[0] and vp is pools[1], "torch pools are updated in place and returned as the same objects"
        for name, got, x, given in (("q_rot", q_rot, inputs[0], q_out), ("k_rot", k_rot, inputs[1], k_out)):
            if given is not None:
                assert got is given, f"{name} must be the {name[0]}_out given"
            else:
                assert x.numel() == 0 or got.data_ptr() != x.data_ptr(), f"{name} must be a new tensor"
    else:
        import mlx.core as mx

        assert all(isinstance(o, mx.array) for o in out)
        for name, o, like in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out, inputs[:2] + pools):
            assert o.shape == like.shape and o.dtype == like.dtype, f"{name}: {o.shape} {o.dtype}"


def run_latent_checked(backend: Backend, q_pe, k_pe, kv_c, positions, slots, cache: Cache, *, rope, scale=None,
                       q_pe_out=None) -> Result:
    """Run rope_latent_fused once and check it as run_checked does; ``cache`` views to (ckv, kpe)."""
    X = backend
    q_pe, k_pe, kv_c, positions, slots = (X.array(a) for a in (q_pe, k_pe, kv_c, positions, slots))
    given = {n: X.numpy(a) for n, a in zip(("q_pe", "k_pe", "kv_c", "positions", "slots"),
                                            (q_pe, k_pe, kv_c, positions, slots))}
    dt = dtype_name(given["q_pe"])
    if isinstance(cache.owners[0], np.ndarray):
        cache.owners = [X.array(o) for o in cache.owners]
    before = [X.numpy(o) for o in cache.owners]
    ckv, kpe = cache.pools()
    kw = dict(rope=X.rope(rope), kv_layout=cache.kv_layout, layer=cache.layer, scale=X.array(scale))
    if q_pe_out is not None:
        kw["q_pe_out"] = q_pe_out
    out = ropepool.rope_latent_fused(q_pe, k_pe, kv_c, positions, slots, ckv, kpe, backend=X.name, **kw)
    q_rot, k_rot, ckv_out, kpe_out = out
    if X.framework == "torch":
        assert ckv_out is ckv and kpe_out is kpe, "torch caches are updated in place and returned as the same objects"
        assert q_rot is q_pe_out if q_pe_out is not None else q_rot.data_ptr() != q_pe.data_ptr()
    else:
        cache.owners = [ckv_out, kpe_out]
    assert tuple(k_rot.shape) == tuple(k_pe.shape), "k_pe_rot has the shape of the k_pe given"
    for name, a in zip(given, (q_pe, k_pe, kv_c, positions, slots)):
        if q_pe_out is None or not _same_memory(X, a, q_pe_out):
            assert_same_bits(f"{name} after the call (inputs are never modified)", X.numpy(a), given[name])
    ref = reference.rope_latent_fused(*given.values(), *cache.views(before), rope=rope, kv_layout=cache.kv_layout,
                                      layer=cache.layer, scale=scale)
    got_q, got_k = X.numpy(q_rot), X.numpy(k_rot)
    assert_close("q_pe_rot", got_q, ref[0], TOL[dt])
    assert_close("k_pe_rot", got_k, ref[1], TOL[dt])
    s = given["slots"]
    tokens = np.flatnonzero((s >= 0) & (s < cache.pool_size))
    kv_rows = given["kv_c"][tokens]
    writes = ((kv_rows, kv_rows.astype(np.float64), scale, slack(kv_rows, 0.0)),
              (got_k[tokens], ref[1][tokens], scale, slack(ref[1][tokens], TOL["float32"], dt)))
    check_memory(X, cache, before, s[tokens], writes, TOL[dt])
    return Result(q_rot, k_rot, ref, ckv_out, kpe_out)
