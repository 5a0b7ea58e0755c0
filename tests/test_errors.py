"""Every rejected input: the error type, a message that names the argument and the fix, no write.

Each case changes one thing in a valid call (``valid_call``), expects
ValueError (ropepool.RopePoolError) or TypeError with a message matching a
pattern, and checks that every array of the call is bit for bit as it was.
Cases run on PyTorch (the default backend and the Triton one) and on MLX
where they apply; ``<view>`` in a pattern is the framework's no-copy reshape
(``view`` / ``reshape``). The last tests keep docs/errors.md in step with
the ``raise`` statements of src/ropepool.
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import re

import numpy as np
import pytest

import ropepool
from ropepool import CosSinCache, QKNorm, RopeSpec, plan
from tests.harness import HAS, NP_DTYPES, Backend, assert_same_bits, backend_for, cos_sin_table
from tests.params import framework, on_backends

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ropepool"
DOCS = ROOT / "docs" / "errors.md"
ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
T, HQ, HKV, D, P, LAYERS = 4, 4, 2, 16, 12, 3
TORCH = "torch"  # a case only torch tensors can express (strides, devices, views, q_out)
# The array types a message offers: those of the frameworks installed (the MLX job has no torch).
ARRAY_TYPES = " or ".join(t for t, fw in ((r"torch\.Tensor", "torch"), (r"mx\.array", "mlx")) if HAS[fw])


def randn(*shape, dtype=np.float32):
    return np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32).astype(dtype)


def valid_call(X):
    a = {n: X.array(x) for n, x in zip(ARRAYS, (randn(T, HQ, D), randn(T, HKV, D), randn(T, HKV, D),
                                                np.array([0, 5, 9, 1000]), np.array([3, -1, 7, 0]),
                                                randn(P, HKV, D), randn(P, HKV, D)))}
    return dict(a, head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV)


def call(args, op=ropepool.rope_pool_fused, names=ARRAYS):
    args = dict(args)
    return op(*[args.pop(n) for n in names], **args)


def change(**changes):
    """Set arguments; a function value is called with the arguments and the backend (X)."""
    def apply(a, X):
        for key, value in changes.items():
            a[key] = value(a, X) if callable(value) and not isinstance(value, type) else value
    return apply


def both(*fns):
    def apply(a, X):
        for fn in fns:
            fn(a, X)
    return apply


def pools(shape, dtype="float32", device=None):
    def make(a, X):
        x = X.array(randn(*shape, dtype=NP_DTYPES[dtype]))
        return x if device is None else x.to(device)
    return change(k_pool=make, v_pool=make)


def fp8(**scales):
    return both(pools((P, HKV, D), "float8_e4m3fn"), change(**scales))


def pth(pool="int8", **given):
    """int8 / float8 pools (torch) and the per-token-head arguments ``given`` (values as change() takes them)."""
    make = torch_(lambda t, a: t.zeros(P, HKV, D).to(getattr(t, pool)))
    return both(change(k_pool=make, v_pool=make), change(**given))


def arr(x, dtype=None):
    """An array of the call's framework, made from NumPy when the case runs."""
    return lambda a, X: X.array(np.asarray(x) if dtype is None else np.asarray(x, dtype))


def torch_(expr):
    """A torch-only value: ``expr(torch, a)`` evaluated when the case runs."""
    def make(a, X):
        import torch

        return expr(torch, a)
    return make


def on_its_frameworks(argnames, cases):
    """Each case (``only`` its 4th value) on the backends of its framework, as the X fixture."""
    return on_backends(argnames, cases, can=lambda b, *case: case[3] in (None, framework(b)), fixture="X")


def C(id, bad, exc, match, only=None, marks=(), prime=True):
    """A case: ``bad(args, X)`` makes a valid call invalid; ``only``: the one framework it applies to;
    ``prime``: a valid call of the layout is made first (see test_rejected_before_any_write)."""
    return pytest.param(bad, exc, match, only, prime, id=id, marks=marks)




SCALES = torch_(lambda t, a: t.ones(P, HKV))  # a per-token-head scale cache of the flat pools
TABLE = cos_sin_table(64, RopeSpec(head_dim=D).inv_freq)
MROPE = RopeSpec(head_dim=D, mrope_section=(2, 3, 3))

CASES = [
    # pools: rank and layout
    C("4d-pool-without-layer", pools((LAYERS, P, HKV, D)), ValueError,
      r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool and v_pool of shape \[3, 12, 2, 16\] \(4-D\)\. "
      r"Fix: pass layer=<index> or index the layer dimension first"),
    C("2d-flattened-pool", pools((P, HKV * D)), ValueError,
      r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool and v_pool of shape \[12, 32\] \(2-D\)\. "
      r"Fix: reshape to \[pool_size, num_kv_heads, head_dim\]: k_pool\.<view>\(-1, 2, 16\)"),
    C("1xPxHxD-pool", pools((1, P, HKV, D)), ValueError,
      r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool and v_pool of shape \[1, 12, 2, 16\] \(4-D\)\. "
      r"Fix: squeeze the extra leading dim of size 1 \(k_pool\[0\]"),
    C("5d-pool-without-layer", pools((LAYERS, P, 2, HKV, D)), ValueError,
      r"^rope_pool_fused expects pool tensors to be 3-D; .*\(5-D\).*pass layer=<index> and kv_layout="),
    C("v_pool-4d", change(v_pool=lambda a, X: a["v_pool"][None]), ValueError,
      r"^rope_pool_fused expects pool tensors to be 3-D; got v_pool of shape \[1, 12, 2, 16\]"),
    C("layer-with-3d-pool", change(layer=0), ValueError,
      r"^rope_pool_fused expects pool tensors to be 4-D with layer= \(a leading layer dim\); got k_pool "
      r"and v_pool of shape \[12, 2, 16\] \(3-D\)\. Fix: drop layer= for a single-layer pool"),
    C("layer-past-end", both(pools((LAYERS, P, HKV, D)), change(layer=3)), ValueError,
      r"^layer must be in \[-3, 3\) for a pool of 3 layers; got 3"),
    C("layer-before-start", both(pools((LAYERS, P, HKV, D)), change(layer=-4)), ValueError,
      r"^layer must be in \[-3, 3\) for a pool of 3 layers; got -4"),
    C("layer-float", both(pools((LAYERS, P, HKV, D)), change(layer=1.0)), TypeError,
      r"^layer must be an int; got float"),
    C("kv_layout-unknown", change(kv_layout="nhd"), ValueError,
      r"^kv_layout must be None, 'NHD', 'HND' or 'amx'; got 'nhd'"),
    # vLLM's CPU AMX cache: a valid call is pools((1, HKV, 16, D)) with kv_layout="amx" (tests/test_amx_layout.py)
    C("amx-page-size-8", both(pools((2, HKV, 8, D)), change(kv_layout="amx")), ValueError,
      r"^kv_layout='amx' stores tiles of 16 x 2 \(keys\) and 2 x 16 \(values\) tokens x features, so page_size "
      r"must be a multiple of 16 and head_dim of 16; got page_size 8, head_dim 16"),
    C("amx-head-dim-8", both(pools((1, HKV, 16, 8)), change(kv_layout="amx", head_dim=8, q=lambda a, X: a["q"][..., :8],
                                                           k=lambda a, X: a["k"][..., :8],
                                                           v=lambda a, X: a["v"][..., :8])), ValueError,
      r"^kv_layout='amx' stores tiles .*; got page_size 16, head_dim 8"),
    C("amx-transposed-blocks", both(change(kv_layout="amx"), change(
        k_pool=torch_(lambda t, a: t.zeros(1, HKV, D, 16).transpose(-1, -2)),
        v_pool=torch_(lambda t, a: t.zeros(1, HKV, 16, D)))), ValueError,
      r"^kv_layout='amx' needs each \(page, head\) block of k_pool to be one contiguous page_size x head_dim run "
      r"\(strides \[\.\.\., 16, 1\]\); got strides \[512, 256, 1, 16\]", TORCH),
    C("amx-fp8", both(pools((1, HKV, 16, D), "float8_e4m3fn"), change(kv_layout="amx", k_scale=1.0, v_scale=1.0)),
      ValueError, r"^kv_layout='amx' takes pools in q's dtype; got scaled pools \(float8_e4m3fn\)", TORCH),
    C("amx-with-mlx", both(pools((1, HKV, 16, D)), change(kv_layout="amx")), TypeError,
      r"^kv_layout='amx' \(vLLM's CPU AMX-packed cache\) is for torch tensors; got mx\.array inputs", "mlx"),
    C("kv_layout-with-flat-pool", change(kv_layout="NHD"), ValueError,
      r"^rope_pool_fused expects pool tensors to be 4-D with kv_layout='NHD'; got k_pool and v_pool of "
      r"shape \[12, 2, 16\] \(3-D\)\. Fix: drop kv_layout="),
    C("kv_layout-5d-pool-without-layer", both(pools((LAYERS, 3, 4, HKV, D)), change(kv_layout="HND")), ValueError,
      r"^rope_pool_fused expects pool tensors to be 4-D with kv_layout='HND'; .*pass layer=<index>"),
    C("NHD-wrong-heads", both(pools((3, 4, HKV + 1, D)), change(kv_layout="NHD")), ValueError,
      r"^k_pool has incompatible shape \[3, 4, 3, 16\]: expected \[num_pages, page_size, num_kv_heads, head_dim\] "
      r"with num_kv_heads=2"),
    C("paged-v-the-HND-transpose", both(change(k_pool=arr(randn(3, 4, HKV, D)), v_pool=arr(randn(3, HKV, 4, D))),
                                        change(kv_layout="NHD")), ValueError, r"^v_pool shape must match k_pool shape"),
    C("pool-head-count", pools((P, HKV + 1, D)), ValueError,
      r"^k_pool has incompatible shape \[12, 3, 16\]: expected \[pool_size, num_kv_heads, head_dim\] "
      r"with num_kv_heads=2, head_dim=16"),
    C("pool-shapes-differ", change(v_pool=arr(randn(P + 1, HKV, D))), ValueError,
      r"^v_pool shape must match k_pool shape, got v_pool \[13, 2, 16\] vs k_pool \[12, 2, 16\]"),
    C("pool-dtypes-differ", change(v_pool=arr(randn(P, HKV, D, dtype=NP_DTYPES["float8_e4m3fn"]))), ValueError,
      r"^pool dtypes must match each other; got k_pool float32, v_pool (float8_e4m3fn|uint8)"),
    C("pool-dtype-not-q", pools((P, HKV, D), "float16"), ValueError,
      r"^pool dtypes must match q/k/v dtype; got k_pool and v_pool float16, q float32\. "
      r"Fix: allocate k_pool and v_pool in q's dtype"),
    C("k_pool-is-v_pool", change(v_pool=lambda a, X: a["k_pool"]), ValueError,
      r"^k_pool and v_pool are the same memory", TORCH),
    C("k_pool-and-v_pool-views-of-one-tensor", change(v_pool=lambda a, X: a["k_pool"][:]), ValueError,
      r"^k_pool and v_pool are the same memory", TORCH),
    # q, k, v
    C("q-2d", change(q=lambda a, X: a["q"].reshape(T, HQ * D)), ValueError,
      r"^rope_pool_fused expects q/k/v to be 3-D; got q \[4, 64\], k \[4, 2, 16\].*"
      r"q\.<view>\(num_tokens, num_qo_heads"),
    C("k-4d", change(k=lambda a, X: a["k"][None]), ValueError,
      r"^rope_pool_fused expects q/k/v to be 3-D; .* k \[1, 4, 2, 16\]"),
    C("v-1d", change(v=lambda a, X: a["v"].reshape(-1)), ValueError,
      r"^rope_pool_fused expects q/k/v to be 3-D; .* v \[128\]"),
    C("num_qo_heads-wrong", change(num_qo_heads=8), ValueError,
      r"^q shape must be \[num_tokens, num_qo_heads, head_dim\] = \[4, 8, 16\], got \[4, 4, 16\]"),
    C("k-head-count", change(k=lambda a, X: a["k"][:, :1], v=lambda a, X: a["v"][:, :1]), ValueError,
      r"^k shape must be \[num_tokens, num_kv_heads, head_dim\] = \[4, 2, 16\], got \[4, 1, 16\]"),
    C("k-token-count", change(k=lambda a, X: a["k"][:3]), ValueError,
      r"^k shape must be .* = \[4, 2, 16\], got \[3, 2, 16\]"),
    C("v-shape", change(v=lambda a, X: a["v"][:, :, :8]), ValueError,
      r"^v shape must match k shape, got \[4, 2, 8\] vs \[4, 2, 16\]"),
    C("head_dim-odd", change(head_dim=15), ValueError, r"^head_dim must be even \(RoPE rotates pairs\); got 15"),
    C("head_dim-wrong", change(head_dim=32), ValueError, r"^q shape must be .* = \[4, 4, 32\], got \[4, 4, 16\]"),
    C("head_dim-str", change(head_dim="16"), TypeError, r"^head_dim must be an int; got str '16'"),
    C("num_qo_heads-bool", change(num_qo_heads=True), TypeError, r"^num_qo_heads must be an int; got bool"),
    C("num_kv_heads-0", change(num_kv_heads=0), ValueError, r"^num_kv_heads must be positive; got 0"),
    C("k-dtype", change(k=arr(randn(T, HKV, D, dtype=np.float16))), ValueError,
      r"^q/k/v dtypes must match; got q float32, k float16, v float32"),
    C("float64-on-torch", change(**{n: torch_(lambda t, a, n=n: a[n].double()) for n in ("q", "k", "v", "k_pool",
                                                                                          "v_pool")}),
      ValueError, r"^q dtype must be one of \('float16', 'bfloat16', 'float32'\); got float64", TORCH),
    C("q-strided-last-dim", change(q=torch_(lambda t, a: t.randn(T, HQ, 2 * D)[..., ::2])), ValueError,
      r"^q must have a contiguous last dim \(stride 1\); got strides \[128, 32, 2\]\. "
      r"Fix: pass a view whose last dim is contiguous", TORCH),
    C("v-transposed", change(v=lambda a, X: a["v"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
      r"^v must have a contiguous last dim", TORCH),
    # positions and slots
    C("positions-int16", change(positions=arr([0, 5, 9, 10], np.int16)), ValueError,
      r"^positions dtype must be int32 or int64; got int16"),
    C("slots-float32", change(slots=arr([3, -1, 7, 0], np.float32)), ValueError,
      r"^slots dtype must be int32 or int64; got float32"),
    C("positions-2d", change(positions=lambda a, X: a["positions"][:, None]), ValueError,
      r"^rope_pool_fused expects positions/slots to be 1-D; got positions \[4, 1\], slots \[4\]"),
    C("mrope-positions-without-mrope-spec", change(positions=arr(np.zeros((3, T), np.int64))), ValueError,
      r"^rope_pool_fused expects positions/slots to be 1-D; got positions \[3, 4\], slots \[4\]\. Fix: flatten "
      r"them to \[num_tokens\]; \[3, num_tokens\] MRoPE positions need a spec with mrope_section"),
    C("mrope-positions-2-rows", change(rope=MROPE, positions=arr(np.zeros((2, T), np.int64))), ValueError,
      r"^positions/slots must have one entry per token \(4\); got positions \[2, 4\], slots \[4\]"),
    C("slots-too-few", change(slots=lambda a, X: a["slots"][:3]), ValueError,
      r"^positions/slots must have one entry per token \(4\); got positions \[4\], slots \[3\]"),
    C("positions-strided", change(positions=torch_(lambda t, a: t.arange(2 * T)[::2])), ValueError,
      r"^positions must have a contiguous last dim \(stride 1\); got strides \[2\]\. Fix: positions\.contiguous\(\)",
      TORCH),
    C("slot-past-pool", change(slots=arr([3, -1, 12, 0])), ValueError,
      r"^slots must be < pool_size \(12\); got slots\[2\] = 12"),
    C("slot-repeated", change(slots=arr([3, -1, 3, 0], np.int32)), ValueError,
      r"^slots must be unique within a call; got slot 3 2 times"),
    C("position-negative", change(positions=arr([0, -5, 2, 3])), ValueError,
      r"^positions must be >= 0; got positions\[1\] = -5"),
    C("mrope-position-negative", change(rope=MROPE, positions=arr([[0, 1, 2, 3], [0, 1, -2, 3], [0] * 4])),
      ValueError, r"^positions must be >= 0; got positions\[1, 2\] = -2"),
    # types, frameworks, devices
    C("q-list", change(q=lambda a, X: a["q"].tolist()), TypeError,
      rf"^rope_pool_fused expects q to be a {ARRAY_TYPES}; got builtins\.list"),
    C("numpy-arrays", change(**{n: lambda a, X, n=n: X.numpy(a[n]) for n in ARRAYS}), TypeError,
      rf"^rope_pool_fused expects q to be a {ARRAY_TYPES}; got numpy\.ndarray\. Fix: convert it"),
    C("positions-numpy", change(positions=lambda a, X: X.numpy(a["positions"])), TypeError,
      rf"^rope_pool_fused expects positions to be a {ARRAY_TYPES}; got numpy\.ndarray"),
    C("pool-on-another-device", pools((P, HKV, D), device="meta"), TypeError,
      r"^rope_pool_fused expects every tensor on one device; got q on cpu and k_pool on meta\. "
      r"Fix: move k_pool with \.to\('cpu'\)", TORCH),
    C("q_out-on-another-device", change(q_out=torch_(lambda t, a: t.empty(T, HQ, D, device="meta"))), TypeError,
      r"^rope_pool_fused expects every tensor on one device; got q on cpu and q_out on meta", TORCH),
    # rope, rope_base
    C("rope_base-and-rope", change(rope=RopeSpec(head_dim=D), rope_base=500000.0), ValueError,
      r"^rope_base conflicts with rope\.base; got rope_base=500000\.0, rope\.base=10000\.0"),
    C("rope-dict", change(rope={"rope_theta": 10000.0}), TypeError,
      r"^rope must be a ropepool\.RopeSpec or ropepool\.CosSinCache; got dict"),
    C("rope-head_dim", change(rope=RopeSpec(head_dim=2 * D)), ValueError,
      r"^rope\.head_dim must equal head_dim; got rope\.head_dim=32, head_dim=16"),
    C("rope_base-0", change(rope_base=0.0), ValueError, r"^rope_base must be a float > 0; got 0\.0"),
    C("rope_base-str", change(rope_base="1e4"), ValueError, r"^rope_base must be a float > 0; got '1e4'"),
    # the engine's cos/sin table
    C("table-wider-than-head", change(rope=lambda a, X: CosSinCache(X.array(cos_sin_table(64, np.ones(D))))),
      ValueError, r"^rope\.cos_sin_cache must be at most head_dim \(16\) wide; got rotary_dim 32"),
    C("table-of-another-framework", change(rope=CosSinCache(TABLE)), TypeError,
      r"^rope\.cos_sin_cache as a tensor must come from q's framework and device; got numpy\.ndarray"),
    C("table-on-another-device", change(rope=torch_(lambda t, a: CosSinCache(t.zeros(64, D, device="meta")))),
      TypeError, r"^rope\.cos_sin_cache as a tensor must come from q's framework and device; got torch\.Tensor on "
                 r"meta", TORCH),
    C("position-past-the-table", change(rope=lambda a, X: CosSinCache(X.array(TABLE)), positions=arr([0, 1, 64, 2])),
      ValueError, r"^positions must be < the cos/sin table's max_position \(64\); got positions\[2\] = 64"),
    # norms
    C("norm-weight-size", change(qk_norm=lambda a, X: QKNorm(X.array(np.ones(D - 2, np.float32)), None)), ValueError,
      r"^qk_norm\.q_weight must have head_dim \(16\) entries; got 14"),
    C("norm-weight-of-another-framework", change(qk_norm=QKNorm(None, np.ones(D, np.float32))), TypeError,
      r"^qk_norm\.k_weight as a tensor must come from q's framework and device; got numpy\.ndarray"),
    C("norm-weight-on-another-device", change(qk_norm=torch_(lambda t, a: QKNorm(t.ones(D, device="meta"), None))),
      TypeError, r"^qk_norm\.q_weight as a tensor must come from q's framework and device; got torch\.Tensor on meta",
      TORCH),
    C("qk_norm-not-a-QKNorm", change(qk_norm={"eps": 1e-6}), TypeError,
      r"^qk_norm must be a ropepool\.QKNorm; got dict"),
    # fp8 pools and their scales
    C("scales-without-fp8", change(k_scale=1.0, v_scale=1.0), ValueError,
      r"^k_scale/v_scale are for float8 pools; got k_scale/v_scale with a float32 pool"),
    C("fp8-without-scales", fp8(), ValueError,
      r"^a float8_e4m3fn pool needs k_scale= and v_scale= .*; got no k_scale and v_scale"),
    C("fp8-without-v_scale", fp8(k_scale=0.5), ValueError, r"^a float8_e4m3fn pool needs .*; got no v_scale\."),
    C("fp8-negative-scale", fp8(k_scale=-1.0, v_scale=1.0), ValueError,
      r"^k_scale must be a finite float > 0; got -1\.0"),
    C("fp8-nan-scale", fp8(k_scale=1.0, v_scale=float("nan")), ValueError, r"^v_scale must be a finite float > 0"),
    # Read on the CPU only (MLX would have to evaluate it: the call stays lazy).
    C("fp8-zero-tensor-scale", fp8(k_scale=arr([0.0], np.float32), v_scale=1.0), ValueError,
      r"^k_scale must be a finite float > 0; got a tensor holding \[0\.0\]", TORCH),
    C("fp8-scale-str", fp8(k_scale=1.0, v_scale="1"), TypeError,
      r"^v_scale must be a float, a one-element float32 tensor or one per KV head \(\[2\]\); got str"),
    C("fp8-per-head-scale-wrong-size", fp8(k_scale=arr(np.ones(3), np.float32), v_scale=1.0), TypeError,
      r"^k_scale must be a float, a one-element float32 tensor or one per KV head \(\[2\]\); got shape \[3\]\. "
      r"Fix: pass float\(scale\) or a tensor of shape \[1\] or \[2\]"),
    C("fp8-scale-float16-tensor", fp8(k_scale=arr([1.0], np.float16), v_scale=1.0), ValueError,
      r"^k_scale as a tensor must be float32; got float16"),
    C("fp8-scale-numpy-array", fp8(k_scale=np.ones(1, np.float32), v_scale=1.0), TypeError,
      r"^k_scale as a tensor must come from q's framework and device; got numpy\.ndarray"),
    C("fp8-scale-on-another-device", fp8(k_scale=1.0, v_scale=torch_(lambda t, a: t.ones(1, device="meta"))),
      TypeError, r"^v_scale as a tensor must come from q's framework and device; got torch\.Tensor on meta", TORCH),
    # q_out, k_out and their fp8 scales
    C("q_out-shape", change(q_out=torch_(lambda t, a: t.empty(T, HQ, D + 2))), ValueError,
      r"^q_out must have the shape and dtype of q: \[4, 4, 16\] float32; got \[4, 4, 18\] float32", TORCH),
    C("k_out-dtype", change(k_out=torch_(lambda t, a: t.empty(T, HKV, D, dtype=t.float16))), ValueError,
      r"^k_out must have the shape and dtype of k: \[4, 2, 16\] float32; got \[4, 2, 16\] float16", TORCH),
    C("q_out-strided-last-dim", change(q_out=torch_(lambda t, a: t.empty(T, HQ, 2 * D)[..., ::2])), ValueError,
      r"^q_out must have a contiguous last dim", TORCH),
    C("q_out-numpy", change(q_out=np.empty((T, HQ, D), np.float32)), TypeError,
      r"^rope_pool_fused expects q_out to be a torch\.Tensor like q; got ndarray", TORCH),
    C("fp8-q_out-without-q_scale", change(q_out=torch_(lambda t, a: t.empty(T, HQ, D, dtype=t.float8_e4m3fn))),
      ValueError, r"^a float8_e4m3fn q_out needs q_scale= \(it stores q_rot / q_scale\); got no q_scale", TORCH),
    C("fp8-k_out-without-k_out_scale", change(k_out=torch_(lambda t, a: t.empty(T, HKV, D, dtype=t.float8_e5m2))),
      ValueError, r"^a float8_e5m2 k_out needs k_out_scale= .*; got no k_out_scale", TORCH),
    C("q_scale-without-q_out", change(q_scale=0.5), ValueError,
      r"^q_scale is for a float8 q_out; got q_scale with no q_out", TORCH),
    C("k_out_scale-with-float-k_out", change(k_out=torch_(lambda t, a: t.empty(T, HKV, D)), k_out_scale=0.5),
      ValueError, r"^k_out_scale is for a float8 k_out; got k_out_scale with a float32 k_out", TORCH),
    C("q_scale-per-head", change(q_out=torch_(lambda t, a: t.empty(T, HQ, D, dtype=t.float8_e4m3fn)),
                                 q_scale=torch_(lambda t, a: t.ones(HQ))), TypeError,
      r"^q_scale must be a float or a one-element float32 tensor; got shape \[4\]", TORCH),
    C("q_out-with-mlx", change(q_out=lambda a, X: a["q"]), TypeError,
      r"^q_out/k_out are for torch tensors; got them with mx\.array inputs", "mlx"),
    C("q_scale-with-mlx", change(q_scale=0.5), ValueError,
      r"^q_scale is for a float8 q_out tensor; got q_scale without one\. Fix: drop q_scale", "mlx"),
    # per-token-head scale caches
    C("int8-pool-without-scale-caches", pth(), ValueError,
      r"^an int8 pool needs per-token-head scales; got k_pool and v_pool int8 without k_scale_cache/v_scale_cache\. "
      r"Fix: pass k_scale_cache= and v_scale_cache=", TORCH),
    C("pth-only-k_scale_cache", pth(k_scale_cache=SCALES), ValueError,
      r"^per-token-head scales need both k_scale_cache and v_scale_cache; got only k_scale_cache", TORCH),
    C("pth-with-k_scale", pth("float8_e4m3fn", k_scale_cache=SCALES, v_scale_cache=SCALES, k_scale=0.5), ValueError,
      r"^k_scale cannot be combined with k_scale_cache/v_scale_cache; got both\. Fix: drop k_scale", TORCH),
    C("pth-float-pools", change(k_scale_cache=SCALES, v_scale_cache=SCALES), ValueError,
      r"^k_scale_cache/v_scale_cache are for int8 or float8 pools; got them with a float32 pool", TORCH),
    C("pth-cache-list", pth(k_scale_cache=[[1.0] * HKV] * P, v_scale_cache=SCALES), TypeError,
      r"^k_scale_cache must be a float32 torch\.Tensor of shape \[12, 2\] \(k_pool's shape without its last "
      r"dim\); got list", TORCH),
    C("pth-cache-transposed", pth(k_scale_cache=SCALES, v_scale_cache=torch_(lambda t, a: t.ones(HKV, P))),
      ValueError, r"^v_scale_cache must have v_pool's shape without its last dim, \[12, 2\]; got \[2, 12\]", TORCH),
    C("pth-cache-float16", pth(k_scale_cache=torch_(lambda t, a: t.ones(P, HKV, dtype=t.float16)),
                               v_scale_cache=SCALES), ValueError, r"^k_scale_cache must be float32; got float16",
      TORCH),
    C("pth-cache-on-another-device", pth(k_scale_cache=SCALES, v_scale_cache=torch_(
        lambda t, a: t.ones(P, HKV, device="meta"))), TypeError,
      r"^v_scale_cache as a tensor must come from q's framework and device", TORCH),
    C("pth-caches-same-memory", pth(k_scale_cache=SCALES, v_scale_cache=lambda a, X: a["k_scale_cache"]),
      ValueError, r"^k_scale_cache and v_scale_cache are the same memory", TORCH),
    C("pth-with-mlx", change(k_scale_cache=arr(np.ones((P, HKV), np.float32)),
                             v_scale_cache=arr(np.ones((P, HKV), np.float32))), TypeError,
      r"^k_scale_cache/v_scale_cache are for torch tensors; got them with mx\.array inputs", "mlx"),
    # backend
    C("backend-unknown", change(backend="cuda"), ValueError,
      r"^backend must be one of \['mlx', 'torch', 'triton'\] or None; got 'cuda'"),
    C("backend-mlx-with-torch", change(backend="mlx"), ValueError, r"^backend 'mlx' takes mlx arrays; got torch arrays",
      TORCH),
    C("backend-triton-on-meta", change(**{n: torch_(lambda t, a, n=n: a[n].to("meta")) for n in ARRAYS},
                                       backend="triton"), ValueError,
      r"^backend 'triton' cannot run this call: tensors are on meta; the Triton kernel needs CUDA", TORCH),
]


def snapshot(X, args):
    """(name, array, NumPy copy) of each array argument with memory."""
    return [(n, x, X.numpy(x)) for n, x in args.items() if type(x).__module__.split(".")[0] in ("torch", "mlx")
            and getattr(getattr(x, "device", None), "type", None) != "meta"]


def pattern(match, X):
    return match.replace("<view>", "view" if X.framework == "torch" else "reshape")


@pytest.fixture(params=["torch", "triton", "mlx"])
def X(request):
    """Each backend on the CPU (the messages name devices; value checks run where they cost no sync):
    CUDA's behaviour with bad values is tests/gpu's."""
    X = backend_for(request.param)
    if X.device == "cuda":
        if X.name == "triton":
            pytest.skip("the Triton kernel on the CPU needs TRITON_INTERPRET=1; tests/gpu covers CUDA")
        X = Backend(X.name, "cpu")
    return X


def test_valid_call_is_valid(X):
    """The calls below differ from this one in one thing, so that thing is what they are rejected for."""
    q_rot, k_rot, k_pool, _ = call(dict(valid_call(X), backend=X.name))
    assert tuple(q_rot.shape) == (T, HQ, D)
    assert_same_bits("k_pool[3]", X.numpy(k_pool)[3], X.numpy(k_rot)[0])


def check_rejected(X, args, make_bad, exc, match, op=ropepool.rope_pool_fused, names=ARRAYS):
    make_bad(args, X)
    given = snapshot(X, args)
    with pytest.raises(exc, match=pattern(match, X)) as info:
        call(args, op, names)
    message = str(info.value)
    assert "Fix:" in message, f"the message gives no fix: {message}"
    assert exc is TypeError or isinstance(info.value, ropepool.RopePoolError)
    assert documented_pattern(message), f"docs/errors.md lists no message that starts like: {message}"
    for name, x, before in given:
        assert_same_bits(f"{name} after a rejected call", X.numpy(x), before)


@on_its_frameworks("make_bad,exc,match,only,prime", CASES)
def test_rejected_before_any_write(make_bad, exc, match, only, prime, X):
    args = dict(valid_call(X), backend=X.name)
    if prime:  # an empty valid call of this layout first: what it leaves cached must not let the bad call through
        call(dict(args, **{n: args[n][:0] for n in ARRAYS[:5]}))
    else:
        plan.forget()
    check_rejected(X, args, make_bad, exc, match)


def test_mixed_frameworks():
    torch = pytest.importorskip("torch")
    pytest.importorskip("mlx.core")
    args = valid_call(backend_for("mlx"))
    args["k"] = torch.from_numpy(np.asarray(args["k"]))
    with pytest.raises(TypeError, match=r"^rope_pool_fused expects every array from one framework; got q as "
                                        r"mx\.array and k as torch\.Tensor\. Fix: convert all arrays"):
        call(args)


@pytest.mark.parametrize("good,bad,exc,match", [
    pytest.param(dict(layer=1), dict(layer=True), TypeError, r"^layer must be an int; got bool", id="layer-True"),
    pytest.param(dict(k_scale=1.0, v_scale=1.0), dict(k_scale=True, v_scale=1.0), TypeError,
                 r"^k_scale must be a float, a one-element float32 tensor or one per KV head \(\[\d\]\); got bool",
                 id="k_scale-True"),
    pytest.param(dict(num_kv_heads=1), dict(num_kv_heads=True), TypeError, r"^num_kv_heads must be an int; got bool",
                 id="num_kv_heads-True"),
])
def test_rejected_after_an_equal_valid_call(good, bad, exc, match, X):
    """A value equal to a valid one (True == 1) is still rejected after the valid call."""
    args = dict(valid_call(X), backend=X.name)
    if "layer" in good:
        pools((LAYERS, P, HKV, D))(args, X)
    if "k_scale" in good:
        pools((P, HKV, D), "float8_e4m3fn")(args, X)
    if "num_kv_heads" in good:
        args.update({n: args[n][:, :1] for n in ("k", "v", "k_pool", "v_pool")})
    call(dict(args, **good))
    check_rejected(X, args, change(**bad), exc, match)


# --- the torch layout cache --------------------------------------------------------------------

SCALARS = ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base", "rope", "layer", "k_scale", "v_scale",
           "kv_layout", "backend", "qk_norm", "q_scale", "k_out_scale")


def cached(args):
    """The runner the layout cache holds for this call, or None (api.py's scalars and arrays)."""
    full = {**dict.fromkeys(SCALARS + ("q_out", "k_out", "k_scale_cache", "v_scale_cache")), "rope_base": 10000.0,
            **args}
    scalars = plan.pool_key(**{n: full[n] for n in inspect.signature(plan.pool_key).parameters})
    return plan.lookup(scalars, tuple(full[n] for n in ARRAYS + ("q_out", "k_out")))


def torch_call():
    backend_for("torch")  # skips without torch
    return valid_call(Backend("torch", "cpu"))


@pytest.mark.parametrize("make_other", [
    pytest.param(change(q=torch_(lambda t, a: t.randn(T, HQ + 1, D)[:, :HQ])), id="q-token-stride"),
    pytest.param(change(slots=lambda a, X: a["slots"].int()), id="slots-int32"),
    pytest.param(change(k_pool=lambda a, X: a["k_pool"].double(), v_pool=lambda a, X: a["v_pool"].double()),
                 id="pools-float64"),
    pytest.param(pools((P + 1, HKV, D)), id="pools-one-more-row"),
    pytest.param(change(q=lambda a, X: a["q"].requires_grad_()), id="q-requires-grad"),
    pytest.param(change(q_out=torch_(lambda t, a: t.empty(T, HQ, D))), id="q_out-given"),
    pytest.param(change(layer=True), id="layer-True"),
    pytest.param(change(rope_base=5e5), id="rope_base"),
    pytest.param(change(rope=RopeSpec(head_dim=D, style="gptj")), id="rope-spec"),
    pytest.param(change(qk_norm=QKNorm(None, None)), id="qk_norm"),
    pytest.param(change(backend="triton"), id="backend"),
    pytest.param(change(positions=lambda a, X: a["positions"][:3]), id="fewer-positions"),
])
@pytest.mark.parametrize("guard", ["TensorGuards", "LayoutGuard"])
def test_cache_hits_only_the_same_layout(make_other, guard, monkeypatch):
    """A checked call is cached; a call that differs in any checked property is not served from it. With
    dynamo's TensorGuards, and with the Python check a torch without it gets."""
    from ropepool.plan import cache

    if guard == "LayoutGuard":
        monkeypatch.setattr(cache, "_tensor_guards", lambda: None)
    X = Backend("torch", "cpu")
    plan.forget()  # no layout another test left behind
    args = torch_call()
    call(args)
    entries = [e for entries in cache._SEEN.values() for e in entries]
    assert [type(e[0]).__name__ for e in entries] == [guard]
    assert cached(args) is not None, "the layout cache is off"
    assert cached(dict(args, q=args["q"].clone(), k_pool=args["k_pool"].clone(), v_pool=args["v_pool"].clone()))
    make_other(args, X)
    assert cached(args) is None


@pytest.mark.parametrize("short", ["k", "v", "slots"])
def test_cache_checks_token_counts(short):
    """A cached layout is no licence for arrays of different token counts (torch path only: the
    kernel would read and write out of bounds)."""
    args = dict(torch_call(), backend="torch")
    call(args)
    before = [args[n].clone() for n in ("k_pool", "v_pool")]
    with pytest.raises(ValueError):
        call(dict(args, **{short: args[short][:3]}))
    for b, n in zip(before, ("k_pool", "v_pool")):
        assert_same_bits(n, b.numpy(), args[n].numpy())


def test_cache_never_serves_one_pool_for_both():
    args = torch_call()
    call(args)
    with pytest.raises(ValueError, match="^k_pool and v_pool are the same memory"):
        call(dict(args, v_pool=args["k_pool"]))


def test_numpy_scalars_are_numbers(X):
    """head_dim, head counts, layer, rope_base and fp8 scales read from a NumPy config are accepted like
    Python numbers, with the same result."""
    args = valid_call(X)
    pools((LAYERS, P, HKV, D), "float8_e4m3fn")(args, X)
    copy = {n: X.array(X.numpy(args[n])) for n in ("k_pool", "v_pool")}
    want = call(dict(args, **copy, layer=-1, rope_base=500000.0, k_scale=0.5, v_scale=0.25))
    got = call(dict(args, head_dim=np.int64(D), num_qo_heads=np.int32(HQ), num_kv_heads=np.int16(HKV),
                    layer=np.int64(-1), rope_base=np.float32(500000.0), k_scale=np.float32(0.5),
                    v_scale=np.float64(0.25)))
    for name, g, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, want):
        assert_same_bits(name, X.numpy(g), X.numpy(w))


VALIDATE_SLOTS_CASES = [
    pytest.param(lambda: (np.array([0, 12]), 12, None), ValueError,
                 r"^slots must be < pool_size \(12\); got slots\[1\] = 12", id="slot-past-pool"),
    pytest.param(lambda: (np.array([2, 5, 2]), 12, None), ValueError,
                 r"^slots must be unique within a call; got slot 2 2 times", id="slot-repeated"),
    pytest.param(lambda: (np.array([1, -1, 3]), 12, np.array([0, 4, -2])), ValueError,
                 r"^positions must be >= 0; got positions\[2\] = -2", id="position-negative"),
    pytest.param(lambda: ([0, 1], 12, None), TypeError,
                 r"^validate_slots expects slots as a torch\.Tensor, mx\.array or numpy\.ndarray; got list",
                 id="slots-list"),
    pytest.param(lambda: (np.array([0, 1]), 12, (0, 1)), TypeError,
                 r"^validate_slots expects positions as a torch\.Tensor, mx\.array or numpy\.ndarray; got tuple",
                 id="positions-tuple"),
    pytest.param(lambda: (np.array([0.0, 1.0]), 12, None), ValueError,
                 r"^validate_slots expects slots as a 1-D int32 or int64 array; got 1-D float64", id="slots-float"),
    pytest.param(lambda: (np.array([[0, 1]]), 12, None), ValueError,
                 r"^validate_slots expects slots as a 1-D int32 or int64 array; got 2-D int64", id="slots-2d"),
    pytest.param(lambda: (np.array([0, 1]), 0, None), ValueError, r"^pool_size must be positive; got 0",
                 id="pool_size-0"),
    pytest.param(lambda: (np.array([0, 1]), 12.0, None), TypeError, r"^pool_size must be an int; got float",
                 id="pool_size-float"),
]


@pytest.mark.parametrize("make_bad,exc,match", VALIDATE_SLOTS_CASES)
def test_validate_slots_rejects(make_bad, exc, match):
    slots, pool_size, positions = make_bad()
    with pytest.raises(exc, match=match) as info:
        ropepool.validate_slots(slots, pool_size, positions=positions)
    assert documented_pattern(str(info.value)), str(info.value)


@pytest.mark.parametrize("fw", ["numpy", "torch", "mlx"])
def test_validate_slots_accepts_valid(fw):
    convert = np.array if fw == "numpy" else lambda x: backend_for(fw).array(np.array(x))
    assert ropepool.validate_slots(convert([4, -1, 0, 11]), 12, positions=convert([0, 1, 2, 10**6])) is None
    assert ropepool.validate_slots(convert([-5, -5]), 12) is None  # skipped slots may repeat


# --- the objects a call takes: QKNorm, CosSinCache, RopeSpec's MRoPE -----------------------------

W = np.ones(D, np.float32)
CONSTRUCTORS = [
    C("norm-eps-0", lambda X: QKNorm(None, None, eps=0.0), ValueError,
      r"^QKNorm eps must be a finite float > 0; got 0\.0"),
    C("norm-eps-nan", lambda X: QKNorm(None, None, eps=float("nan")), ValueError, r"^QKNorm eps must be a finite"),
    C("norm-eps-inf", lambda X: QKNorm(None, None, eps=float("inf")), ValueError, r"^QKNorm eps must be a finite"),
    C("norm-eps-bool", lambda X: QKNorm(None, None, eps=True), ValueError, r"^QKNorm eps must be a finite float > 0"),
    C("norm-offset-nan", lambda X: QKNorm(None, None, weight_offset=float("nan")), ValueError,
      r"^QKNorm weight_offset must be a finite float; got nan"),
    C("norm-weight-list", lambda X: QKNorm([1.0] * D, None), TypeError,
      r"^QKNorm expects q_weight as a torch\.Tensor, mx\.array or numpy\.ndarray \(or None\); got list"),
    C("norm-weight-2d", lambda X: QKNorm(X.array(np.ones((2, 8), np.float32)), None), ValueError,
      r"^QKNorm expects q_weight as a 1-D float array \[head_dim\]; got \[2, 8\] float32"),
    C("norm-weight-int", lambda X: QKNorm(None, X.array(np.ones(D, np.int32))), ValueError,
      r"^QKNorm expects k_weight as a 1-D float array \[head_dim\]; got \[16\] int32"),
    C("norm-weights-two-frameworks", lambda X: QKNorm(X.array(W), W), TypeError,
      r"^QKNorm expects q_weight and k_weight from one framework and device; got .* and numpy\.ndarray"),
    C("norm-weights-two-sizes", lambda X: QKNorm(X.array(W), X.array(W[:8])), ValueError,
      r"^QKNorm expects q_weight and k_weight of one size \(head_dim\); got 16 and 8"),
    C("table-list", lambda X: CosSinCache([[1.0, 0.0]]), TypeError,
      r"^CosSinCache expects cos_sin_cache as a torch\.Tensor, mx\.array or numpy\.ndarray; got list"),
    C("table-1d", lambda X: CosSinCache(X.array(np.ones(16, np.float32))), ValueError,
      r"^CosSinCache expects cos_sin_cache of shape \[max_position, rotary_dim\] with an even rotary_dim > 0; "
      r"got \[16\]"),
    C("table-odd-width", lambda X: CosSinCache(X.array(np.ones((8, 5), np.float32))), ValueError,
      r"^CosSinCache expects cos_sin_cache of shape .*; got \[8, 5\]"),
    C("table-no-rows", lambda X: CosSinCache(X.array(np.ones((0, 8), np.float32))), ValueError,
      r"^CosSinCache expects cos_sin_cache of shape .*; got \[0, 8\]"),
    C("table-int", lambda X: CosSinCache(X.array(np.ones((8, 8), np.int32))), ValueError,
      r"^CosSinCache expects a float32, float16 or bfloat16 table; got int32"),
    C("table-float64", lambda X: CosSinCache(np.ones((8, 8))), ValueError,
      r"^CosSinCache expects a float32, float16 or bfloat16 table; got float64"),
    C("table-strided", lambda X: CosSinCache(X.array(np.ones((8, 16), np.float32))[:, ::2]), ValueError,
      r"^CosSinCache expects a table whose last dim is contiguous; got strides \[16, 2\]", TORCH),
    C("table-mrope-section-sum", lambda X: CosSinCache(X.array(TABLE), mrope_section=(2, 2, 2)), ValueError,
      r"^CosSinCache\.mrope_section must be three ints >= 0 summing to rotary_dim // 2 = 8; got \(2, 2, 2\)"),
    C("spec-mrope-section-sum", lambda X: RopeSpec(head_dim=D, mrope_section=(1, 2, 3)), ValueError,
      r"^RopeSpec\.mrope_section must be three ints >= 0 summing to rotary_dim // 2 = 8; got \(1, 2, 3\)"),
    C("spec-mrope-section-two", lambda X: RopeSpec(head_dim=D, rotary_dim=8, mrope_section=(2, 2)), ValueError,
      r"^RopeSpec\.mrope_section must be three ints >= 0 summing to rotary_dim // 2 = 4; got \(2, 2\)"),
    C("spec-mrope-section-negative", lambda X: RopeSpec(head_dim=D, mrope_section=(-1, 5, 4)), ValueError,
      r"^RopeSpec\.mrope_section must be three ints >= 0"),
    C("spec-interleaved-without-section", lambda X: RopeSpec(head_dim=D, mrope_interleaved=True), ValueError,
      r"^RopeSpec\.mrope_interleaved needs mrope_section; got mrope_section=None"),
]


@on_its_frameworks("make,exc,match,only,prime", CONSTRUCTORS)
def test_constructor_rejects(make, exc, match, only, prime, X):
    with pytest.raises(exc, match=match) as info:
        make(X)
    assert "Fix:" in str(info.value) and documented_pattern(str(info.value)), str(info.value)



# --- rope_latent_fused -------------------------------------------------------------------------

LATENT = ("q_pe", "k_pe", "kv_c", "positions", "slots", "ckv_cache", "kpe_cache")
RANK = 24


def valid_latent(X):
    a = {n: X.array(x) for n, x in zip(LATENT, (randn(T, HQ, D), randn(T, D), randn(T, RANK),
                                                 np.array([0, 5, 9, 60]), np.array([3, -1, 7, 0]),
                                                 randn(P, RANK), randn(P, D)))}
    return dict(a, rope=RopeSpec(head_dim=D, style="gptj"))


def caches(ckv, kpe, dtype="float32"):
    dt = NP_DTYPES[dtype]
    return change(ckv_cache=arr(randn(*ckv, dtype=dt)), kpe_cache=arr(randn(*kpe, dtype=dt)))


LATENT_CASES = [
    C("rope-missing", change(rope=None), TypeError,
      r"^rope_latent_fused needs rope=, a RopeSpec or CosSinCache; got None"),
    C("q_pe-2d", change(q_pe=lambda a, X: a["q_pe"].reshape(T, HQ * D)), ValueError,
      r"^rope_latent_fused expects q_pe \[T, num_heads, rope_dim\], k_pe \[T, rope_dim\] and kv_c "
      r"\[T, kv_lora_rank\]; got q_pe \[4, 64\]"),
    C("k_pe-two-heads", change(k_pe=arr(randn(T, 2, D))), ValueError,
      r"^rope_latent_fused expects k_pe \[4, 16\] \(or \[4, 1, 16\]\) and kv_c \[4, kv_lora_rank\] for q_pe "
      r"\[4, 4, 16\]; got k_pe \[4, 2, 16\]"),
    C("kv_c-token-count", change(kv_c=lambda a, X: a["kv_c"][:3]), ValueError,
      r"^rope_latent_fused expects k_pe \[4, 16\] .*kv_c \[3, 24\]"),
    C("rope-partial", change(rope=RopeSpec(head_dim=D, rotary_dim=8)), ValueError,
      r"^rope_latent_fused rotates the whole rope_dim \(16\); got a rope with rotary_dim 8"),
    C("rope-head_dim", change(rope=RopeSpec(head_dim=2 * D)), ValueError,
      r"^rope\.head_dim must equal head_dim; got rope\.head_dim=32, head_dim=16"),
    C("ckv-rank", caches((P, RANK), (P + 1, D)), ValueError,
      r"^ckv_cache must have kpe_cache's slots and kv_lora_rank \(24\) features; got ckv_cache \[12, 24\], "
      r"kpe_cache \[13, 16\]"),
    C("kpe-width", caches((P, RANK), (P, D + 2)), ValueError,
      r"^kpe_cache has incompatible shape \[12, 18\]: expected \[pool_size, rope_dim\]"),
    C("ckv-3d", caches((P, 1, RANK), (P, D)), ValueError,
      r"^rope_latent_fused expects pool tensors to be 2-D; got ckv_cache of shape \[12, 1, 24\] \(3-D\)\. "
      r"Fix: pass layer=<index> for a layer-stacked pool"),
    C("amx-latent", change(kv_layout="amx"), ValueError,
      r"^kv_layout='amx' is for rope_pool_fused's k and v pools; got it for rope_latent_fused's kpe_cache and "
      r"ckv_cache\. Fix: pass kv_layout='NHD'"),
    C("paged-with-flat-caches", change(kv_layout="NHD"), ValueError,
      r"^rope_latent_fused expects pool tensors to be 3-D with kv_layout='NHD'; got kpe_cache of shape \[12, 16\]"),
    C("fp8-without-scale", caches((P, RANK), (P, D), "float8_e4m3fn"), ValueError,
      r"^a float8_e4m3fn pool needs scale= \(stored value = value / scale\); got no scale"),
    C("scale-without-fp8", change(scale=0.5), ValueError, r"^scale is for float8 pools; got scale with a float32 pool"),
    C("scale-per-head", both(caches((P, RANK), (P, D), "float8_e4m3fn"), change(scale=arr(np.ones(2, np.float32)))),
      TypeError, r"^scale must be a float or a one-element float32 tensor; got shape \[2\]"),
    C("cache-dtypes-differ", change(kpe_cache=arr(randn(P, D, dtype=NP_DTYPES["float8_e4m3fn"]))), ValueError,
      r"^pool dtypes must match each other; got kpe_cache (float8_e4m3fn|uint8), ckv_cache float32"),
    C("dtypes-differ", change(kv_c=arr(randn(T, RANK, dtype=np.float16))), ValueError,
      r"^q_pe/k_pe/kv_c dtypes must match; got q_pe float32, k_pe float32, kv_c float16"),
    C("slot-past-pool", change(slots=arr([3, 12, 7, 0])), ValueError,
      r"^slots must be < pool_size \(12\); got slots\[1\] = 12"),
    C("position-past-the-table", change(rope=lambda a, X: CosSinCache(X.array(TABLE), is_neox=False),
                                       positions=arr([0, 5, 9, 64])), ValueError,
      r"^positions must be < the cos/sin table's max_position \(64\); got positions\[3\] = 64"),
    C("one-cache-for-both", change(kpe_cache=lambda a, X: a["ckv_cache"][:, :D]), ValueError,
      r"^ckv_cache and kpe_cache are the same memory", TORCH),
    C("q_pe_out-shape", change(q_pe_out=torch_(lambda t, a: t.empty(T, HQ, D + 2))), ValueError,
      r"^q_pe_out must have the shape and dtype of q_pe: \[4, 4, 16\] float32; got \[4, 4, 18\] float32", TORCH),
    C("q_pe_out-with-mlx", change(q_pe_out=lambda a, X: a["q_pe"]), TypeError,
      r"^q_out/k_out are for torch tensors; got them with mx\.array inputs\. Fix: drop q_pe_out", "mlx"),
]


@on_its_frameworks("make_bad,exc,match,only,prime", LATENT_CASES)
def test_latent_rejected_before_any_write(make_bad, exc, match, only, prime, X):
    args = dict(valid_latent(X), backend=X.name)
    if prime:
        call(dict(args, **{n: args[n][:0] for n in LATENT[:5]}), ropepool.rope_latent_fused, LATENT)
    else:
        plan.forget()
    check_rejected(X, args, make_bad, exc, match, ropepool.rope_latent_fused, LATENT)


def test_latent_valid_call_is_valid(X):
    q_rot, k_rot, ckv, kpe = call(dict(valid_latent(X), backend=X.name), ropepool.rope_latent_fused, LATENT)
    assert_same_bits("kpe_cache[3]", X.numpy(kpe)[3], X.numpy(k_rot)[0])


# --- docs/errors.md and the code ---------------------------------------------------------------

GAP = "…"  # in docs/errors.md, the variable part of a message
_CUTS = ("; got", ", got", " got ", ". Fix:", " Fix:")


def message_template(node) -> str | None:
    """The text of a message expression, with each computed part as GAP (None: not a string)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else GAP for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message_template(node.left), message_template(node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else GAP) + (right if right is not None else GAP)
    return None


def head(message: str) -> str:
    """What a message says is wrong: its text before 'got ...' and 'Fix: ...'."""
    cut = min([message.find(c) for c in _CUTS if c in message] or [len(message)])
    return re.sub(f"{GAP}+", GAP, message[:cut]).strip().rstrip(".:,;")


def raised_messages():
    """(where, head) of every ``raise X("...")`` in src/ropepool; where=None heads are unreadable."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                text = message_template(node.exc.args[0])
                where = f"{path.relative_to(SRC)}:{node.lineno}"
                found.append((where, None if text is None else head(text)))
    return found


def documented_heads() -> list:
    """The first `code` span of each table row of docs/errors.md: the start of one message."""
    heads = []
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^\|\s*`([^`]+)`", line)
        if m:
            heads.append(m.group(1))
    return heads


def documented_pattern(message: str):
    """The docs entry whose head (GAP: anything) starts ``message``, or None."""
    for h in documented_heads():
        pattern = ".+?".join(re.escape(part) for part in h.split(GAP))
        if re.match(pattern, message, re.S):
            return h
    return None


def test_head_reads_messages():
    node = ast.parse('f"{name} must be positive; got {val}. Fix: pass it."').body[0].value
    assert head(message_template(node)) == "… must be positive"
    node = ast.parse('"a " + f"b {x}" + y').body[0].value
    assert message_template(node) == "a b ……" and head(message_template(node)) == "a b …"
    assert head("k_pool and v_pool are the same memory. Fix: pass two pools") == "k_pool and v_pool are the same memory"


def test_every_raised_message_is_documented():
    found = raised_messages()
    assert len(found) >= 50, "the scan of src/ropepool found too few raise statements"
    unreadable = [w for w, h in found if h is None]
    assert not unreadable, f"messages the docs check cannot read (build them inline as f-strings): {unreadable}"
    documented = set(documented_heads())
    missing = sorted({h for _, h in found} - documented)
    where = {h: w for w, h in found}
    assert not missing, "docs/errors.md lacks these messages (add a row whose first cell is `<head>`):\n" + "\n".join(
        f"  {where[h]}: `{h}`" for h in missing)


def test_docs_list_only_raised_messages():
    raised = {h for _, h in raised_messages()}
    documented = documented_heads()
    stale = [h for h in documented if h not in raised]
    assert not stale, f"docs/errors.md lists messages no code raises any more: {stale}"
    assert len(documented) == len(set(documented)), "docs/errors.md lists a message twice"
