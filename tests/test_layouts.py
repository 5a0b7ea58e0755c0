"""KV-cache layouts on every backend: paged NHD / HND pools, layer-stacked pools (layer=-1 too),
combined K/V tensors seen through views (torch), and float8 caches with scales.

What is checked, per call (tests.harness.run_checked):

- q_rot and k_rot against the float64 oracle (harness.TOL).
- The slot formula, written in the harness independently of ropepool.core.layout:
  slot ``s`` is row ``s % page_size`` of page ``s // page_size``; NHD pages
  are ``[page_size, heads, dim]``, HND pages ``[heads, page_size, dim]``.
- Every element of the memory the pools live in (the two pool arrays, or
  the one combined tensor of vLLM / FlashInfer) bit for bit as before,
  except exactly the written rows. Rows about to be written are NaN first;
  NaN / inf / -inf / -0.0 are planted in unwritten rows around them (the
  rest of their pages, neighbouring pages, the same rows of the other
  layers) and must survive.
- Written rows: bit for bit the returned k_rot row and the given v row.
  float8 pools: stored = value / scale saturated to the format's finite range
  (448 e4m3fn, 57344 e5m2), rounded to nearest even, from the float32 value
  the backend holds (k_rot rounded to q's dtype, v as given). The harness
  compares with the oracle's quantize exactly wherever that value's error
  bound cannot cross a rounding boundary (harness.check_fp8); under the
  Triton CPU interpreter one more fp8 step is allowed, since it converts
  float32 to fp8 wrongly (triton-lang/triton#8322). On a GPU, exact.

MLX has no float8 dtype: its fp8 pools are uint8 arrays holding e4m3 (as
``mx.to_fp8`` stores them); e5m2 cases are not generated there (tests/params.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import ropepool
from tests.harness import Cache, crossed, make_cache, make_positions, make_slots, poison, randn, run_checked
from tests.params import mlx_has, on_backends, on_torch

T, HQ, HKV, D = 6, 3, 2, 32
NUM_LAYERS = 3


def qkv(rng, dtype, t=T, scale=2.0):
    return [randn(rng, t, h, D, dtype=dtype, scale=scale) for h in (HQ, HKV, HKV)]


# name: (kv_layout, page_size, layer of a 3-layer stack or None)
LAYOUTS = {
    "flat": (None, 1, None),
    "flat-layer1": (None, 1, 1),
    "flat-layer-1": (None, 1, -1),
    "NHD-ps16": ("NHD", 16, None),
    "NHD-ps16-layer1": ("NHD", 16, 1),
    "NHD-ps1": ("NHD", 1, None),
    "HND-ps16": ("HND", 16, None),
    "HND-ps16-layer-1": ("HND", 16, -1),
    "HND-ps1-layer1": ("HND", 1, 1),
}


def cache_for(rng, name, dtype, num_slots=64, slots=()):
    kv_layout, ps, layer = LAYOUTS[name]
    cache = make_cache(rng, dtype, num_slots, HKV, D, kv_layout=kv_layout, page_size=ps,
                       layers=NUM_LAYERS if layer is not None else None, layer=layer,
                       scale=4.0 if dtype.startswith("float8") else 1.0)
    return poison(cache, slots)


@pytest.mark.parametrize("name,dtype", crossed(list(LAYOUTS)))
def test_layout_matches_oracle(backend, name, dtype, rng):
    slots = make_slots(rng, T, 64, skip_every=4)
    run_checked(backend, *qkv(rng, dtype), make_positions(rng, T, high=100_000), slots,
                cache_for(rng, name, dtype, slots=slots))


SLOT_PATTERNS = ["spread-pages", "one-page", "page-edges", "int32-negatives", "all-negative"]


@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("name", ["NHD-ps16", "HND-ps16-layer-1"])
def test_slot_patterns(backend, name, pattern, rng):
    """Slots spread one per page, packed in one page, on page edges, and skipped (negative)."""
    num_slots, ps, t = 128, 16, 8
    pages = rng.permutation(num_slots // ps)
    if pattern == "spread-pages":  # one token per page, random row
        slots = pages[:t] * ps + rng.integers(0, ps, t)
    elif pattern == "one-page":  # a decode-like run of rows in one page, one skipped
        slots = pages[0] * ps + rng.permutation(ps)[:t]
        slots[3] = -1
    elif pattern == "page-edges":  # first and last rows of pages, and the pool's last slot
        slots = np.array(list(dict.fromkeys([*(pages[:3] * ps), *(pages[3:6] * ps + ps - 1), num_slots - 1, 0])))
    elif pattern == "int32-negatives":
        slots = make_slots(rng, t, num_slots, skip_every=2, idx="int32")
    else:
        slots = np.array([-1, -2, -num_slots, np.iinfo(np.int64).min] * 2)
    slots = slots.astype("int32" if pattern == "int32-negatives" else "int64")
    run_checked(backend, *qkv(rng, "bfloat16", t=len(slots)), make_positions(rng, len(slots)), slots,
                cache_for(rng, name, "bfloat16", num_slots, slots))


# --- combined K/V tensors (vLLM, FlashInfer): torch views ------------------------------------

# name: (the combined tensor's shape for (pages, page_size), the views passed as k_pool / v_pool, layout, layer)
KV_RECIPES = {
    # vLLM (FlashAttention backend), one tensor a layer: [2, num_blocks, block_size, heads, dim]
    "vllm": (lambda n, ps: (2, n, ps, HKV, D), lambda kv: (kv[0], kv[1]), "NHD", None),
    # one tensor for all layers: [layers, 2, num_blocks, block_size, heads, dim]
    "vllm-layers": (lambda n, ps: (NUM_LAYERS, 2, n, ps, HKV, D), lambda kv: (kv[:, 0], kv[:, 1]), "NHD", 1),
    # FlashInfer NHD: [num_pages, 2, page_size, heads, dim]
    "flashinfer-NHD": (lambda n, ps: (n, 2, ps, HKV, D), lambda kv: (kv[:, 0], kv[:, 1]), "NHD", None),
    # FlashInfer HND: [num_pages, 2, heads, page_size, dim]
    "flashinfer-HND": (lambda n, ps: (n, 2, HKV, ps, D), lambda kv: (kv[:, 0], kv[:, 1]), "HND", None),
    # FlashInfer HND stacked over layers: [layers, num_pages, 2, heads, page_size, dim]
    "flashinfer-HND-layers": (lambda n, ps: (NUM_LAYERS, n, 2, HKV, ps, D), lambda kv: (kv[:, :, 0], kv[:, :, 1]),
                              "HND", -1),
}


def kv_recipe(backend, rng, name, num_slots, ps, dtype, slots):
    shape, views, kv_layout, layer = KV_RECIPES[name]
    base = randn(rng, *shape(num_slots // ps, ps), dtype=dtype, scale=4.0 if dtype.startswith("float8") else 1.0)
    return poison(Cache([base], kv_layout, ps, layer, lambda o: views(o[0])), slots)


@pytest.mark.parametrize("recipe", list(KV_RECIPES))
@pytest.mark.parametrize("ps", [1, 16], ids=["ps1", "ps16"])
@on_torch  # MLX arrays have no views to write through: a pool there is its own array
def test_combined_kv_tensor(backend, recipe, ps, rng):
    """k_pool / v_pool are views of one tensor: the writes land in it, at exactly the expected places."""
    slots = make_slots(rng, T, 64, skip_every=4)
    cache = kv_recipe(backend, rng, recipe, 64, ps, "float16", slots)
    cache.owners = [backend.array(o) for o in cache.owners]
    k_pool, v_pool = cache.pools()
    assert k_pool.data_ptr() != v_pool.data_ptr() and not (recipe.startswith("flashinfer") and k_pool.is_contiguous())
    run_checked(backend, *qkv(rng, "float16"), make_positions(rng, T), slots, cache)


@pytest.mark.parametrize("recipe", ["vllm", "flashinfer-HND-layers"])
@on_torch
def test_combined_kv_tensor_fp8(backend, recipe, rng):
    """vLLM's fp8 cache: one float8_e4m3fn tensor, scales as one-element float32 tensors."""
    slots = make_slots(rng, T, 64, skip_every=4)
    cache = kv_recipe(backend, rng, recipe, 64, 16, "float8_e4m3fn", slots)
    run_checked(backend, *qkv(rng, "bfloat16"), make_positions(rng, T), slots, cache,
                k_scale=np.array([0.37], np.float32), v_scale=np.array([0.055], np.float32))


# --- float8 caches ----------------------------------------------------------------------------

def scale_arg(s, kind):
    """A scale as the oracle takes it: a float, or a one-element float32 array (a tensor on the backend)."""
    return np.array([s], np.float32) if kind == "tensor" else s


FP8_CASES = [
    pytest.param("bfloat16", "float8_e4m3fn", "tensor", id="bf16-e4m3-tensor"),
    pytest.param("bfloat16", "float8_e5m2", "float", id="bf16-e5m2-float"),
    pytest.param("float16", "float8_e4m3fn", "float", id="f16-e4m3-float"),
    pytest.param("float16", "float8_e5m2", "tensor", id="f16-e5m2-tensor"),
    pytest.param("float32", "float8_e4m3fn", "float", id="f32-e4m3-float"),
    pytest.param("float32", "float8_e5m2", "tensor", id="f32-e5m2-tensor"),
]


@on_backends("dtype,fp8,scale_kind", FP8_CASES, can=lambda b, dtype, fp8, kind: mlx_has(b, fp8))
def test_fp8_matches_oracle(backend, dtype, fp8, scale_kind, rng):
    """stored = value / scale, rounded; q_rot / k_rot stay in q's dtype."""
    slots = make_slots(rng, T, 64, skip_every=4)
    cache = cache_for(rng, "NHD-ps16-layer1", fp8, slots=slots)
    # Different, non-power-of-two scales (a swapped or dropped scale shows); v spans many binades.
    q, k, v = qkv(rng, dtype)
    v = (v.astype(np.float32) * np.exp2(rng.integers(-6, 7, v.shape))).astype(v.dtype)
    res = run_checked(backend, q, k, v, make_positions(rng, T), slots, cache,
                      k_scale=scale_arg(0.37, scale_kind), v_scale=scale_arg(1.7, scale_kind))
    assert backend.numpy(res.q_rot).dtype == q.dtype and backend.numpy(res.k_rot).dtype == q.dtype


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layouts(backend, name, rng):
    slots = make_slots(rng, T, 64, skip_every=4)
    run_checked(backend, *qkv(rng, "float16"), make_positions(rng, T), slots,
                cache_for(rng, name, "float8_e4m3fn", slots=slots),
                k_scale=scale_arg(0.5, "tensor"), v_scale=scale_arg(0.25, "tensor"))


FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@on_backends("dtype,fp8,scale_kind", FP8_CASES[:4], can=lambda b, dtype, fp8, kind: mlx_has(b, fp8))
def test_fp8_saturates(backend, dtype, fp8, scale_kind, rng):
    """Values far past the format's range store +-max finite (448 / 57344), never NaN or inf."""
    scale, top = 2.0**-6, FP8_MAX[fp8]
    q, k, v = qkv(rng, dtype)
    # Position 0: cos 1, sin 0, so k_rot == k exactly and the big k values reach the pool as given.
    positions = np.zeros(T, np.int64)
    big = np.minimum(np.array([1.05, 1.5, 4.0, 1e3]) * top * scale, 6e4 if dtype == "float16" else 1e30)
    sat = np.zeros(k.shape, bool)
    sat[:, :, ::3] = True
    sign = np.where(rng.random(k.shape) < 0.5, -1.0, 1.0)
    fill = (np.resize(big, k.shape) * sign).astype(k.dtype)
    k, v = np.where(sat, fill, k), np.where(sat, -fill, v)
    slots = make_slots(rng, T, 32, skip_every=0)
    cache = cache_for(rng, "HND-ps16", fp8, 32, slots)
    run_checked(backend, q, k, v, positions, slots, cache, k_scale=scale_arg(scale, scale_kind),
                v_scale=scale_arg(scale, scale_kind))
    for name, pool, x in zip(("k", "v"), cache.pools(), (k, v)):
        stored = cache.rows(backend.numpy(pool), slots).astype(np.float64)
        want = np.sign(x.astype(np.float64)) * top
        assert np.array_equal(stored[sat], want[sat]), f"{name}: saturated values must store +-{top}"


@pytest.mark.parametrize("which", ["k-tensor", "v-tensor"])
def test_fp8_mixed_scale_kinds(backend, which, rng):
    """One scale a float, the other a tensor: both documented forms, mixed."""
    slots = make_slots(rng, T, 32)
    ks, vs = (scale_arg(0.37, "tensor"), 1.7) if which == "k-tensor" else (0.37, scale_arg(1.7, "tensor"))
    run_checked(backend, *qkv(rng, "bfloat16"), make_positions(rng, T), slots,
                cache_for(rng, "NHD-ps16", "float8_e4m3fn", 32, slots), k_scale=ks, v_scale=vs)


# --- pools with a strided head dim (torch): vLLM's CPU key cache -----------------------------

# vLLM's CPU backend stores each block's keys transposed, [heads, dim, block_size] (token dim innermost),
# and its values as rows; ropepool writes the key half through a transposed view. name: (the two owners'
# shapes for (pages, page_size), the views passed as k_pool / v_pool, layout, layer)
STRIDED = {
    "HND-vllm-cpu": (lambda n, ps: [(n, HKV, D, ps), (n, HKV, ps, D)], lambda o: (o[0].swapaxes(-1, -2), o[1]),
                     "HND", None),
    "HND-layers": (lambda n, ps: [(NUM_LAYERS, n, HKV, D, ps), (NUM_LAYERS, n, HKV, ps, D)],
                   lambda o: (o[0].swapaxes(-1, -2), o[1]), "HND", -1),
    # NHD, heads and dims both strided: [pages, page_size, heads, dim] over memory [pages, heads, dim, page_size]
    "NHD-transposed": (lambda n, ps: [(n, HKV, D, ps), (n, ps, HKV, D)],
                       lambda o: (o[0].swapaxes(1, 3).swapaxes(2, 3), o[1]), "NHD", None),
}


def strided_cache(rng, name, dtype, ps, slots):
    shapes, views, kv_layout, layer = STRIDED[name]
    scale = 4.0 if dtype.startswith("float8") else 1.0
    owners = [randn(rng, *s, dtype=dtype, scale=scale) for s in shapes(64 // ps, ps)]
    return poison(Cache(owners, kv_layout, ps, layer, views), slots)


@pytest.mark.parametrize("name,dtype", crossed(list(STRIDED), ("float16", "bfloat16", "float32", "float8_e4m3fn")))
@pytest.mark.parametrize("ps", [1, 16], ids=["ps1", "ps16"])
@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_strided_head_dim_pool(backend, name, dtype, ps, rng):
    """A key pool whose head dim has stride page_size: written through the view, the rest bit for bit."""
    slots = make_slots(rng, T, 64, skip_every=4)  # with a slot -1
    assert (np.asarray(slots) < 0).any()
    cache = strided_cache(rng, name, dtype, ps, slots)
    cache.owners = [backend.array(o) for o in cache.owners]
    k_pool, _ = cache.pools()
    assert k_pool.stride(-1) == ps and (ps == 1 or not k_pool.is_contiguous())
    fp8 = dict(k_scale=np.array([0.37], np.float32), v_scale=0.5) if dtype.startswith("float8") else {}
    run_checked(backend, *qkv(rng, "bfloat16" if fp8 else dtype), make_positions(rng, T), slots, cache, **fp8)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_strided_head_dim_pool_triton_refused(backend, rng):
    """The Triton kernel stores each head's row as one run: it refuses such a pool before writing."""
    slots = make_slots(rng, T, 64, skip_every=4)
    cache = strided_cache(rng, "HND-vllm-cpu", "float32", 16, slots)
    cache.owners = [backend.array(o) for o in cache.owners]
    before = [backend.numpy(o).copy() for o in cache.owners]
    q, k, v = (backend.array(x) for x in qkv(rng, "float32"))
    k_pool, v_pool = cache.pools()
    with pytest.raises(ValueError, match=r"^backend 'triton' writes pools whose head dim is contiguous; got k_pool "
                                         r"with strides \[1024, 512, 1, 16\]\. Fix: backend='torch'"):
        ropepool.rope_pool_fused(q, k, v, backend.array(make_positions(rng, T)), backend.array(slots), k_pool, v_pool,
                                 head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, kv_layout="HND", backend="triton")
    assert all(np.array_equal(b, backend.numpy(o), equal_nan=True) for b, o in zip(before, cache.owners))


@pytest.mark.parametrize("name,dtype", crossed(list(STRIDED), ("float16", "bfloat16", "float32", "float8_e4m3fn")))
@pytest.mark.parametrize("ps", [1, 16], ids=["ps1", "ps16"])
@pytest.mark.parametrize("in_place", [False, True], ids=["outputs", "in-place"])
def test_strided_head_dim_pool_on_the_cpu_fast_path(monkeypatch, name, dtype, ps, in_place, rng):
    """The CPU kernel (torch_native) takes such pools (vLLM's CPU route: in place, HND, page size 32 there):
    the oracle's results, both pools written by it (its counter), and torch_eager's bytes bit for bit."""
    torch = pytest.importorskip("torch")
    from ropepool import backends, plan
    from ropepool.backends import paths
    from tests.harness import Backend

    slots = make_slots(rng, T, 64, skip_every=4)
    fp8 = dict(k_scale=np.array([0.37], np.float32), v_scale=0.5) if dtype.startswith("float8") else {}
    X = Backend("torch", "cpu")
    q, k, v = (X.array(x) for x in qkv(rng, "bfloat16" if fp8 else dtype))
    positions = make_positions(rng, T)
    caches = [strided_cache(rng, name, dtype, ps, slots) for _ in range(2)]
    caches[1].owners = [o.copy() for o in caches[0].owners]
    results = []
    for fast, cache in zip((True, False), caches):
        if not fast:  # the same call on torch_eager's general code
            monkeypatch.setattr(backends, "BACKENDS",
                                tuple(b for b in backends.BACKENDS if b.module != ".torch_native"))
        plan.forget()
        cache.owners = [X.array(o) for o in cache.owners]
        qi, ki, vi = (x.clone() for x in (q, k, v))
        outs = dict(q_out=qi, k_out=ki) if in_place else {}
        before = paths.count("torch_native.call")
        results.append(run_checked(X, qi, ki, vi, positions, slots, cache, **outs, **fp8))
        assert paths.count("torch_native.call") - before == (1 if fast else 0), "the call by the CPU kernel"
    for got, want in zip((results[0].q_rot, results[0].k_rot, *caches[0].owners),
                         (results[1].q_rot, results[1].k_rot, *caches[1].owners)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
