"""Every rejected input: the error type, a message that names the argument and the fix, no write.

Each case changes one thing in a valid call (``valid_call``), expects
ValueError (ropepool.RopePoolError) or TypeError with a message matching a
pattern, and checks that every tensor of the call is bit for bit as it was.
The last tests keep docs/errors.md in step with the ``raise`` statements of
src/ropepool.
"""
from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest
import torch

import ropepool
from ropepool import RopeSpec, validate
from tests.util import assert_same_bits

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "ropepool"
DOCS = ROOT / "docs" / "errors.md"
ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
T, HQ, HKV, D, P, LAYERS = 4, 4, 2, 16, 12, 3


def valid_call(gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(q=randn(T, HQ, D), k=randn(T, HKV, D), v=randn(T, HKV, D), positions=torch.tensor([0, 5, 9, 1000]),
                slots=torch.tensor([3, -1, 7, 0]), k_pool=randn(P, HKV, D), v_pool=randn(P, HKV, D),
                head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV)


def call(args):
    args = dict(args)
    arrays = [args.pop(n) for n in ARRAYS]
    return ropepool.rope_pool_fused(*arrays, **args)


def change(**changes):
    """Set arguments; a function value is called with the current arguments."""
    def apply(a):
        for key, value in changes.items():
            a[key] = value(a) if callable(value) and not isinstance(value, type) else value
    return apply


def pools(shape, dtype=torch.float32, device="cpu"):
    return change(k_pool=torch.randn(*shape).to(device, dtype), v_pool=torch.randn(*shape).to(device, dtype))


def all_to(fn):
    return change(**{n: (lambda a, n=n: fn(a[n])) for n in ARRAYS})


def fp8(**scales):
    return lambda a: (pools((P, HKV, D), torch.float8_e4m3fn)(a), change(**scales)(a))


def mx_array(x):
    mx = pytest.importorskip("mlx.core")

    return mx.array(x.numpy())


CASES = [
    # pools: rank and layout
    pytest.param(pools((LAYERS, P, HKV, D)), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool of shape \[3, 12, 2, 16\] \(4-D\)\. "
                 r"Fix: pass layer=<index> or index the layer dimension first", id="4d-pool-without-layer"),
    pytest.param(pools((P, HKV * D)), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool of shape \[12, 32\] \(2-D\)\. "
                 r"Fix: reshape to \[pool_size, num_kv_heads, head_dim\]: k_pool\.view\(-1, 2, 16\)",
                 id="2d-flattened-pool"),
    pytest.param(pools((1, P, HKV, D)), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool of shape \[1, 12, 2, 16\] \(4-D\)\. "
                 r"Fix: squeeze the extra leading dim of size 1 \(k_pool\[0\]",
                 id="1xPxHxD-pool"),
    pytest.param(pools((LAYERS, P, 2, HKV, D)), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 3-D; .*\(5-D\).*pass layer=<index> and kv_layout=",
                 id="5d-pool-without-layer"),
    pytest.param(change(v_pool=lambda a: a["v_pool"][None]), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 3-D; got v_pool of shape \[1, 12, 2, 16\]",
                 id="v_pool-4d"),
    pytest.param(change(layer=0), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 4-D with layer= \(a leading layer dim\); got k_pool "
                 r"of shape \[12, 2, 16\]\. Fix: drop layer= for a single-layer pool", id="layer-with-3d-pool"),
    pytest.param(lambda a: (pools((LAYERS, P, HKV, D))(a), change(layer=3)(a)), ValueError,
                 r"^layer must be in \[0, 3\) for a pool of 3 layers; got 3", id="layer-out-of-range"),
    pytest.param(lambda a: (pools((LAYERS, P, HKV, D))(a), change(layer=-1)(a)), ValueError,
                 r"^layer must be in \[0, 3\) .*got -1", id="layer-negative"),
    pytest.param(lambda a: (pools((LAYERS, P, HKV, D))(a), change(layer=1.0)(a)), TypeError,
                 r"^layer must be an int; got float", id="layer-float"),
    pytest.param(change(kv_layout="nhd"), ValueError, r"^kv_layout must be None, 'NHD' or 'HND'; got 'nhd'",
                 id="kv_layout-unknown"),
    pytest.param(change(kv_layout="NHD"), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 4-D with kv_layout='NHD'; got k_pool of shape "
                 r"\[12, 2, 16\]\. Fix: drop kv_layout=", id="kv_layout-with-flat-pool"),
    pytest.param(lambda a: (pools((LAYERS, 3, 4, HKV, D))(a), change(kv_layout="HND")(a)), ValueError,
                 r"^rope_pool_fused expects pool tensors to be 4-D with kv_layout='HND'; .*pass layer=<index>",
                 id="kv_layout-5d-pool-without-layer"),
    pytest.param(pools((P, HKV + 1, D)), ValueError,
                 r"^k_pool has incompatible shape \[12, 3, 16\]: expected \[pool_size, num_kv_heads, head_dim\] "
                 r"with num_kv_heads=2, head_dim=16", id="pool-head-count"),
    pytest.param(change(v_pool=lambda a: torch.randn(P + 1, HKV, D)), ValueError,
                 r"^v_pool shape must match k_pool shape, got \[13, 2, 16\] vs \[12, 2, 16\]", id="pool-shapes-differ"),
    pytest.param(change(v_pool=lambda a: a["v_pool"].half()), ValueError,
                 r"^pool dtypes must match each other; got k_pool float32, v_pool float16", id="pool-dtypes-differ"),
    pytest.param(pools((P, HKV, D), torch.bfloat16), ValueError,
                 r"^pool dtypes must match q/k/v dtype; got pools bfloat16, q float32", id="pool-dtype-not-q"),
    pytest.param(change(v_pool=lambda a: a["k_pool"]), ValueError, r"^k_pool and v_pool are the same memory",
                 id="k_pool-is-v_pool"),
    pytest.param(change(v_pool=lambda a: a["k_pool"][:]), ValueError, r"^k_pool and v_pool are the same memory",
                 id="k_pool-and-v_pool-views-of-one-tensor"),
    pytest.param(change(k_pool=lambda a: torch.randn(P, HKV, 2 * D)[..., ::2]), ValueError,
                 r"^k_pool must have a contiguous last dim \(stride 1\); got strides \[64, 32, 2\]",
                 id="k_pool-strided-last-dim"),
    # q, k, v
    pytest.param(change(q=lambda a: a["q"].view(T, HQ * D)), ValueError,
                 r"^rope_pool_fused expects q/k/v to be 3-D; got q \[4, 64\], k \[4, 2, 16\]", id="q-2d"),
    pytest.param(change(k=lambda a: a["k"][None]), ValueError,
                 r"^rope_pool_fused expects q/k/v to be 3-D; .* k \[1, 4, 2, 16\]", id="k-4d"),
    pytest.param(change(v=lambda a: a["v"].flatten()), ValueError,
                 r"^rope_pool_fused expects q/k/v to be 3-D; .* v \[128\]", id="v-1d"),
    pytest.param(change(num_qo_heads=8), ValueError,
                 r"^q shape must be \[num_tokens, num_qo_heads, head_dim\] = \[4, 8, 16\], got \[4, 4, 16\]",
                 id="num_qo_heads-wrong"),
    pytest.param(change(k=lambda a: a["k"][:, :1], v=lambda a: a["v"][:, :1]), ValueError,
                 r"^k shape must be \[num_tokens, num_kv_heads, head_dim\] = \[4, 2, 16\], got \[4, 1, 16\]",
                 id="k-head-count"),
    pytest.param(change(k=lambda a: a["k"][:3]), ValueError,
                 r"^k shape must be .* = \[4, 2, 16\], got \[3, 2, 16\]", id="k-token-count"),
    pytest.param(change(v=lambda a: a["v"][:, :, :8]), ValueError,
                 r"^v shape must match k shape, got \[4, 2, 8\] vs \[4, 2, 16\]", id="v-shape"),
    pytest.param(change(num_kv_heads=3), ValueError,
                 r"^num_qo_heads must be divisible by num_kv_heads; got 4 and 3", id="gqa-not-divisible"),
    pytest.param(change(head_dim=15), ValueError, r"^head_dim must be even \(RoPE rotates pairs\); got 15",
                 id="head_dim-odd"),
    pytest.param(change(head_dim=32), ValueError, r"^q shape must be .* = \[4, 4, 32\], got \[4, 4, 16\]",
                 id="head_dim-wrong"),
    pytest.param(change(head_dim="16"), TypeError, r"^head_dim must be an int; got str '16'", id="head_dim-str"),
    pytest.param(change(num_qo_heads=True), TypeError, r"^num_qo_heads must be an int; got bool",
                 id="num_qo_heads-bool"),
    pytest.param(change(num_kv_heads=0), ValueError, r"^num_kv_heads must be positive; got 0", id="num_kv_heads-0"),
    pytest.param(change(k=lambda a: a["k"].half()), ValueError,
                 r"^q/k/v dtypes must match; got q float32, k float16, v float32", id="k-dtype"),
    pytest.param(change(v=lambda a: a["v"].bfloat16()), ValueError,
                 r"^q/k/v dtypes must match; got q float32, k float32, v bfloat16", id="v-dtype"),
    pytest.param(lambda a: [a.update({n: a[n].double()}) for n in ("q", "k", "v", "k_pool", "v_pool")], ValueError,
                 r"^q dtype must be one of \('float16', 'bfloat16', 'float32'\); got float64", id="float64-on-torch"),
    pytest.param(change(q=lambda a: torch.randn(T, HQ, 2 * D)[..., ::2]), ValueError,
                 r"^q must have a contiguous last dim \(stride 1\); got strides \[128, 32, 2\]\. "
                 r"Fix: pass a view whose head_dim is contiguous", id="q-strided-last-dim"),
    pytest.param(change(v=lambda a: a["v"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
                 r"^v must have a contiguous last dim", id="v-transposed"),
    # positions and slots
    pytest.param(change(positions=lambda a: a["positions"].short()), ValueError,
                 r"^positions dtype must be int32 or int64; got int16", id="positions-int16"),
    pytest.param(change(slots=lambda a: a["slots"].float()), ValueError,
                 r"^slots dtype must be int32 or int64; got float32", id="slots-float32"),
    pytest.param(change(positions=lambda a: a["positions"][:, None]), ValueError,
                 r"^rope_pool_fused expects positions/slots to be 1-D; got positions \[4, 1\], slots \[4\]",
                 id="positions-2d"),
    pytest.param(change(slots=lambda a: a["slots"][:3]), ValueError,
                 r"^positions/slots must have one entry per token \(4\); got positions \[4\], slots \[3\]",
                 id="slots-too-few"),
    pytest.param(change(positions=lambda a: torch.arange(2 * T)[::2]), ValueError,
                 r"^positions must have a contiguous last dim \(stride 1\); got strides \[2\]\. "
                 r"Fix: positions\.contiguous\(\)", id="positions-strided"),
    pytest.param(change(slots=torch.tensor([3, -1, 12, 0])), ValueError,
                 r"^slots must be < pool_size \(12\); got slots\[2\] = 12", id="slot-past-pool"),
    pytest.param(change(slots=torch.tensor([3, -1, 3, 0], dtype=torch.int32)), ValueError,
                 r"^slots must be unique within a call; got slot 3 2 times", id="slot-repeated"),
    pytest.param(change(positions=torch.tensor([0, -5, 2, 3])), ValueError,
                 r"^positions must be >= 0; got positions\[1\] = -5", id="position-negative"),
    # types, frameworks, devices
    pytest.param(change(q=lambda a: a["q"].tolist()), TypeError,
                 r"^rope_pool_fused expects q to be a torch\.Tensor or mx\.array; got builtins\.list", id="q-list"),
    pytest.param(change(slots=[3, -1, 7, 0]), TypeError,
                 r"^rope_pool_fused expects slots to be a torch\.Tensor or mx\.array; got builtins\.list",
                 id="slots-list"),
    pytest.param(all_to(lambda x: x.numpy()), TypeError,
                 r"^rope_pool_fused expects q to be a torch\.Tensor or mx\.array; got numpy\.ndarray\. "
                 r"Fix: convert it, e\.g\. torch\.as_tensor", id="numpy-arrays"),
    pytest.param(change(positions=lambda a: a["positions"].numpy()), TypeError,
                 r"^rope_pool_fused expects positions to be a torch\.Tensor or mx\.array; got numpy\.ndarray",
                 id="torch-and-numpy"),
    pytest.param(change(k=lambda a: mx_array(a["k"])), TypeError,
                 r"^rope_pool_fused expects every array from one framework; got q as torch\.Tensor and k as mx\.array",
                 id="torch-and-mlx"),
    pytest.param(pools((P, HKV, D), device="meta"), TypeError,
                 r"^rope_pool_fused expects every tensor on one device; got q on cpu and k_pool on meta\. "
                 r"Fix: move k_pool with \.to\('cpu'\)", id="pool-on-another-device"),
    pytest.param(change(q_out=lambda a: torch.empty(T, HQ, D, device="meta")), TypeError,
                 r"^rope_pool_fused expects every tensor on one device; got q on cpu and q_out on meta",
                 id="q_out-on-another-device"),
    # rope, rope_base
    pytest.param(change(rope=RopeSpec(head_dim=D), rope_base=500000.0), ValueError,
                 r"^rope_base conflicts with rope\.base; got rope_base=500000\.0, rope\.base=10000\.0",
                 id="rope_base-and-rope"),
    pytest.param(change(rope={"rope_theta": 10000.0}), TypeError, r"^rope must be a ropepool\.RopeSpec; got dict",
                 id="rope-dict"),
    pytest.param(change(rope=RopeSpec(head_dim=2 * D)), ValueError,
                 r"^rope\.head_dim must equal head_dim; got rope\.head_dim=32, head_dim=16", id="rope-head_dim"),
    pytest.param(change(rope_base=0.0), ValueError, r"^rope_base must be a float > 0; got 0\.0", id="rope_base-0"),
    pytest.param(change(rope_base="1e4"), ValueError, r"^rope_base must be a float > 0; got '1e4'",
                 id="rope_base-str"),
    # fp8 scales
    pytest.param(change(k_scale=1.0, v_scale=1.0), ValueError,
                 r"^k_scale/v_scale are for float8 pools; got a float32 pool", id="scales-without-fp8"),
    pytest.param(fp8(), ValueError,
                 r"^an float8_e4m3fn pool needs k_scale= and v_scale= .*; got no k_scale and v_scale",
                 id="fp8-without-scales"),
    pytest.param(fp8(k_scale=0.5), ValueError, r"^an float8_e4m3fn pool needs .*; got no v_scale\.",
                 id="fp8-without-v_scale"),
    pytest.param(fp8(k_scale=-1.0, v_scale=1.0), ValueError, r"^k_scale must be a finite float > 0; got -1\.0",
                 id="fp8-negative-scale"),
    pytest.param(fp8(k_scale=1.0, v_scale="1"), TypeError,
                 r"^v_scale must be a float or a one-element float32 tensor; got str", id="fp8-scale-str"),
    pytest.param(fp8(k_scale=torch.ones(1, dtype=torch.float16), v_scale=1.0), ValueError,
                 r"^k_scale as a tensor must be float32; got float16", id="fp8-scale-float16-tensor"),
    pytest.param(fp8(k_scale=np.ones(1, np.float32), v_scale=1.0), TypeError,
                 r"^k_scale as a tensor must come from q's framework and device; got numpy\.ndarray",
                 id="fp8-scale-numpy-array"),
    pytest.param(fp8(k_scale=1.0, v_scale=torch.ones(1, device="meta")), TypeError,
                 r"^v_scale as a tensor must come from q's framework and device; got torch\.Tensor on meta",
                 id="fp8-scale-on-another-device"),
    # q_out, k_out
    pytest.param(change(q_out=torch.empty(T, HQ, D + 2)), ValueError,
                 r"^q_out must have the shape and dtype of q: \[4, 4, 16\] float32; got \[4, 4, 18\] float32",
                 id="q_out-shape"),
    pytest.param(change(k_out=torch.empty(T, HKV, D, dtype=torch.float16)), ValueError,
                 r"^k_out must have the shape and dtype of k: \[4, 2, 16\] float32; got \[4, 2, 16\] float16",
                 id="k_out-dtype"),
    pytest.param(change(q_out=torch.empty(T, HQ, 2 * D)[..., ::2]), ValueError,
                 r"^q_out must have a contiguous last dim", id="q_out-strided-last-dim"),
    pytest.param(change(q_out=np.empty((T, HQ, D), np.float32)), TypeError,
                 r"^rope_pool_fused expects q_out to be a torch\.Tensor like q; got ndarray", id="q_out-numpy"),
    pytest.param(lambda a: (all_to(mx_array)(a), change(q_out=torch.empty(T, HQ, D))(a)), TypeError,
                 r"^q_out/k_out are for torch tensors; got them with mx\.array inputs", id="q_out-with-mlx"),
    # backend
    pytest.param(change(backend="cuda"), ValueError,
                 r"^backend must be one of \['mlx', 'torch', 'triton'\] or None; got 'cuda'", id="backend-unknown"),
    pytest.param(change(backend="mlx"), ValueError, r"^backend 'mlx' takes mlx arrays; got torch arrays",
                 id="backend-mlx-with-torch"),
    pytest.param(lambda a: (all_to(lambda x: x.to("meta"))(a), change(backend="triton")(a)), ValueError,
                 r"^backend 'triton' cannot run this call: tensors are on meta; the Triton kernel needs CUDA",
                 id="backend-triton-on-meta"),
]


def snapshot(args):
    """(name, tensor, copy) of each tensor argument with memory."""
    return [(n, x, x.clone()) for n, x in args.items() if isinstance(x, torch.Tensor) and x.device.type != "meta"]


def test_valid_call_is_valid(rng):
    """The calls below differ from this one in one thing, so that thing is what they are rejected for."""
    args = valid_call(rng)
    q_rot, k_rot, k_pool, _ = call(args)
    assert q_rot.shape == (T, HQ, D) and torch.equal(k_pool[3], k_rot[0])


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("make_bad,exc,match", CASES)
def test_rejected_before_any_write(make_bad, exc, match, backend, rng):
    args = valid_call(rng)
    # A valid call of this layout first: whatever it leaves cached must not let the bad call through.
    call(dict(args, k_pool=args["k_pool"].clone(), v_pool=args["v_pool"].clone(), backend="torch"))
    originals = snapshot(args)
    make_bad(args)
    if backend is not None:
        args.setdefault("backend", backend)
    given = snapshot(args)
    with pytest.raises(exc, match=match) as info:
        call(args)
    message = str(info.value)
    assert "Fix:" in message, f"the message gives no fix: {message}"
    assert exc is TypeError or isinstance(info.value, ropepool.RopePoolError)
    assert documented_pattern(message), f"docs/errors.md lists no message that starts like: {message}"
    for name, x, before in originals + given:
        assert_same_bits(f"{name} after a rejected call", x, before)


@pytest.mark.parametrize("good,bad,exc,match", [
    pytest.param(dict(layer=1), dict(layer=True), TypeError, r"^layer must be an int; got bool", id="layer-True"),
    pytest.param(dict(k_scale=1.0, v_scale=1.0), dict(k_scale=True, v_scale=1.0), TypeError,
                 r"^k_scale must be a float or a one-element float32 tensor; got bool", id="k_scale-True"),
    pytest.param(dict(num_kv_heads=1), dict(num_kv_heads=True), TypeError, r"^num_kv_heads must be an int; got bool",
                 id="num_kv_heads-True"),
])
def test_rejected_after_an_equal_valid_call(good, bad, exc, match, rng):
    """A value equal to a valid one (True == 1) is still rejected after the valid call."""
    args = valid_call(rng)
    if "layer" in good:
        pools((LAYERS, P, HKV, D))(args)
    if "k_scale" in good:
        pools((P, HKV, D), torch.float8_e4m3fn)(args)
    if "num_kv_heads" in good:
        args.update(k=args["k"][:, :1], v=args["v"][:, :1], k_pool=args["k_pool"][:, :1], v_pool=args["v_pool"][:, :1])
    call(dict(args, **good))
    before = snapshot(args)
    with pytest.raises(exc, match=match):
        call(dict(args, **bad))
    for name, x, copy in before:
        assert_same_bits(name, x, copy)


SCALARS = ("head_dim", "num_qo_heads", "num_kv_heads", "rope_base", "rope", "layer", "k_scale", "v_scale", "kv_layout")


def cached(args):
    """The Call validation's cache holds for this call, or None."""
    full = {**dict.fromkeys(SCALARS), "rope_base": 10000.0, **args}
    return validate.cached(*(full[n] for n in ARRAYS), full.get("q_out"), full.get("k_out"),
                           tuple(full[n] for n in SCALARS))


@pytest.mark.parametrize("make_other", [
    pytest.param(change(q=lambda a: torch.randn(T, HQ + 1, D)[:, :HQ]), id="q-token-stride"),
    pytest.param(change(slots=lambda a: a["slots"].int()), id="slots-int32"),
    pytest.param(change(k_pool=lambda a: a["k_pool"].double(), v_pool=lambda a: a["v_pool"].double()),
                 id="pools-float64"),
    pytest.param(pools((P + 1, HKV, D)), id="pools-one-more-row"),
    pytest.param(change(q=lambda a: a["q"].requires_grad_()), id="q-requires-grad"),
    pytest.param(change(q_out=lambda a: torch.empty(T, HQ, D)), id="q_out-given"),
    pytest.param(change(layer=True), id="layer-True"),
    pytest.param(change(rope_base=5e5), id="rope_base"),
    pytest.param(change(positions=lambda a: a["positions"][:3]), id="fewer-positions"),
])
def test_cache_hits_only_the_same_layout(make_other, rng):
    """A checked call is cached; a call that differs in any checked property is not served from it."""
    args = valid_call(rng)
    call(args)
    assert cached(args) is not None, "validation's cache is off: is TensorGuards missing from this torch?"
    assert cached(dict(args, q=args["q"].clone(), k_pool=args["k_pool"].clone(), v_pool=args["v_pool"].clone()))
    make_other(args)
    assert cached(args) is None


def test_cache_never_serves_one_pool_for_both(rng):
    args = valid_call(rng)
    call(args)
    with pytest.raises(ValueError, match="^k_pool and v_pool are the same memory"):
        call(dict(args, v_pool=args["k_pool"]))


def test_numpy_scalars_are_numbers(rng):
    """rope_base and fp8 scales read from a NumPy config are accepted like Python floats."""
    args = valid_call(rng)
    fp8(k_scale=0.5, v_scale=0.25)(args)
    want = call(dict(args, rope_base=500000.0, k_pool=args["k_pool"].clone(), v_pool=args["v_pool"].clone()))
    got = call(dict(args, rope_base=np.float32(500000.0), k_scale=np.float32(0.5), v_scale=np.float64(0.25)))
    for name, g, w in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, want):
        assert_same_bits(name, g, w)


VALIDATE_SLOTS_CASES = [
    pytest.param(lambda: (torch.tensor([0, 12]), 12, None), ValueError,
                 r"^slots must be < pool_size \(12\); got slots\[1\] = 12", id="slot-past-pool"),
    pytest.param(lambda: (torch.tensor([2, 5, 2]), 12, None), ValueError,
                 r"^slots must be unique within a call; got slot 2 2 times", id="slot-repeated"),
    pytest.param(lambda: (np.array([1, -1, 3]), 12, np.array([0, 4, -2])), ValueError,
                 r"^positions must be >= 0; got positions\[2\] = -2", id="position-negative"),
    pytest.param(lambda: ([0, 1], 12, None), TypeError,
                 r"^validate_slots expects slots as a torch\.Tensor, mx\.array or numpy\.ndarray; got list",
                 id="slots-list"),
    pytest.param(lambda: (torch.tensor([0, 1]), 12, (0, 1)), TypeError,
                 r"^validate_slots expects positions as a torch\.Tensor, mx\.array or numpy\.ndarray; got tuple",
                 id="positions-tuple"),
    pytest.param(lambda: (torch.tensor([0.0, 1.0]), 12, None), ValueError,
                 r"^validate_slots expects slots as a 1-D int32 or int64 array; got 1-D float32", id="slots-float"),
    pytest.param(lambda: (torch.tensor([[0, 1]]), 12, None), ValueError,
                 r"^validate_slots expects slots as a 1-D int32 or int64 array; got 2-D int64", id="slots-2d"),
    pytest.param(lambda: (torch.tensor([0, 1]), 0, None), ValueError, r"^pool_size must be positive; got 0",
                 id="pool_size-0"),
    pytest.param(lambda: (torch.tensor([0, 1]), 12.0, None), TypeError, r"^pool_size must be an int; got float",
                 id="pool_size-float"),
]


@pytest.mark.parametrize("make_bad,exc,match", VALIDATE_SLOTS_CASES)
def test_validate_slots_rejects(make_bad, exc, match):
    slots, pool_size, positions = make_bad()
    with pytest.raises(exc, match=match) as info:
        ropepool.validate_slots(slots, pool_size, positions=positions)
    assert documented_pattern(str(info.value)), str(info.value)


@pytest.mark.parametrize("convert", [torch.tensor, np.array, lambda x: mx_array(torch.tensor(x))],
                         ids=["torch", "numpy", "mlx"])
def test_validate_slots_accepts_valid(convert):
    assert ropepool.validate_slots(convert([4, -1, 0, 11]), 12, positions=convert([0, 1, 2, 10**6])) is None
    assert ropepool.validate_slots(convert([-5, -5]), 12) is None  # skipped slots may repeat


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
