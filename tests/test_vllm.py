"""ropepool.integrations.vllm against a port of vLLM's reference semantics (tests/vllm_reference.py).

vLLM is not installed here: the rotation is compared with vLLM's native formula
(RotaryEmbedding.forward_native) and its CUDA kernel's float32 formula, computed
from the same cos/sin table, and the cache with reshape_and_cache_flash's write,
on every cache layout vLLM's CUDA backends use. docs/engines.md says what ran.
"""
from __future__ import annotations

import logging
import sys
import types
from importlib import metadata

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

import ropepool
from ropepool import reference
from ropepool.integrations import vllm as rv
from tests import vllm_reference as ref
from tests.harness import TOL, assert_close, assert_same_bits
from tests.torch_fixtures import DEVICE, backend, rng  # noqa: F401

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# The Triton interpreter (CPU CI) rounds float32 -> bf16 by truncation, and float32 -> fp8 wrongly
# (triton-lang/triton#8322): one step off, or, where a value rounds up to a power of two, that power
# of two halved (the mantissa carry is lost). On a GPU neither may happen.
INTERPRETER = DEVICE == "cpu"


def fma_rounds_twice() -> bool:
    """Whether the installed Triton's interpreter computes tl.fma as x * y + z, rounded twice (3.7.1's
    InterpreterBuilder.create_fma; 3.9's rounds once). ropepool's x / scale (triton_kernel._fp8) is then
    sometimes one float32 ulp up, on an fp8 tie, which rounds up to a power of two and loses its carry."""
    try:
        return tuple(int(p) for p in metadata.version("triton").split(".")[:2]) < (3, 9)
    except metadata.PackageNotFoundError:
        return False


FMA_ROUNDS_TWICE = INTERPRETER and fma_rounds_twice()


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Float bits as integers ordered like the values (adjacent floats differ by 1; +0 == -0)."""
    width = x.element_size() * 8
    i = x.detach().cpu().contiguous().view({8: torch.uint8, 16: torch.int16, 32: torch.int32}[width]).long()
    mag = i & ((1 << (width - 1)) - 1)
    return torch.where((i >> (width - 1)) & 1 == 1, -mag, mag)


def rand(gen, *shape, dtype=F32):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def make_cache(layout, physical, num_blocks, block_size, heads, dim, storage, gen):
    """A poisoned vLLM kv_cache: the backend's logical shape, NHD or HND in memory (vLLM's stride order)."""
    if layout == "packed":
        mem = ((num_blocks, block_size, heads, 2 * dim) if physical == "NHD" else
               (num_blocks, heads, block_size, 2 * dim))
        perm = (0, 2, 1, 3) if physical == "NHD" else (0, 1, 2, 3)
    else:
        lead = (2, num_blocks) if layout == "kv_first" else (num_blocks, 2)
        mem = lead + ((block_size, heads, dim) if physical == "NHD" else (heads, block_size, dim))
        perm = (0, 1, 2, 3, 4) if physical == "NHD" else (0, 1, 3, 2, 4)
    if storage == torch.uint8:  # fp8 caches: random bytes, NaN codes included
        cache = torch.randint(0, 256, mem, generator=gen, dtype=torch.uint8).to(DEVICE)
    else:
        cache = rand(gen, *mem, dtype=storage)
        cache.view(-1)[::97] = float("nan")
    return cache.permute(*perm)


def split(kv_cache, layout, dim):
    """K and V caches [num_blocks, block_size, heads, dim] as vLLM's backends take them."""
    if layout == "kv_first":
        return kv_cache.unbind(0)  # FlashAttentionImpl
    if layout == "blocks_first":
        return kv_cache.unbind(1)  # TritonAttentionImpl, FlashInferImpl (kv_cache[:, 0], kv_cache[:, 1])
    return kv_cache.transpose(1, 2).split(dim, dim=-1)  # the standardized packed layout


def vllm_inputs(gen, dtype, head_size, rotary_dim, table_dtype, T=9, n=7, hq=4, hkv=2, max_pos=4096):
    """A fused QKV projection's views, positions, vLLM's table, slots (two skipped; T - n padding tokens)."""
    qkv = rand(gen, T, (hq + 2 * hkv) * head_size, dtype=dtype)
    q, k, v = (t.view(T, -1, head_size) for t in qkv.split([hq * head_size, hkv * head_size, hkv * head_size], -1))
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    table = ref.cos_sin_cache(rotary_dim, max_pos).to(DEVICE, table_dtype)
    slots = torch.randperm(3 * 16, generator=gen)[:n]
    slots[[1, n - 2]] = -1
    return q, k, v, positions, table, slots.to(DEVICE)


def fma_slack(x, table, positions, is_neox):
    """How far an FMA may move each float32 ``x*cos - y*sin`` (vLLM's nvcc build and a Triton kernel on a GPU
    contract it): one float32 rounding of a product, at most 2^-24 (|x cos| + |y sin|), doubled for safety."""
    r = table.shape[1]
    cos, sin = table.index_select(0, positions.long()).double().abs().chunk(2, dim=-1)
    x1, x2 = ref.pairs(x[..., :r].double().abs(), is_neox)
    size = ref.unpair(x1 * cos[:, None] + x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None], is_neox)
    return torch.cat((size, torch.zeros_like(x[..., r:], dtype=torch.float64)), dim=-1) * 2.0 ** -23


def check_rotation(name, got, x0, table, positions, is_neox, backend):
    """got (rotated in place) is vLLM's CUDA-kernel formula from the same table, and so within vLLM's
    tolerances of forward_native wherever that kernel's own result is."""
    n = got.shape[0]
    args = (x0[:n].cpu(), table.cpu(), positions[:n].cpu(), is_neox)
    got = got.cpu()
    cuda = ref.rotate_fp32(*args)
    if backend == "torch":
        assert_same_bits(f"{name} (vLLM's CUDA-kernel formula: float32 math, one rounding)", got, cuda)
    else:  # an FMA on a GPU, the interpreter's truncation to bf16: within one rounding of the output type
        slack = fma_slack(*args) + 2 * torch.finfo(got.dtype).eps * cuda.double().abs() + 1e-30
        off = (got.double() - cuda.double()).abs() > slack
        assert not off.any(), f"{name}: {int(off.sum())} elements off vLLM's CUDA-kernel formula"
    native = ref.rotate_native(*args).double()
    tol = ref.ATOL[got.dtype] + ref.RTOL[got.dtype] * native.abs()
    missed = (got.double() - native).abs() > tol
    kernel_missed = (cuda.double() - native).abs() > tol
    assert not (missed & ~kernel_missed).any(), (
        f"{name}: {int((missed & ~kernel_missed).sum())} elements outside vLLM's tolerances of forward_native "
        "where vLLM's CUDA-kernel formula is inside them")


def check_oracle(name, got, x0, table, positions, is_neox):
    """got (rotated in place, the first n tokens) is ropepool's float64 oracle of x0 from the same table."""
    n, H, D = got.shape
    x = x0[:n].cpu().float().numpy()  # exact: every dtype here widens to float32
    pools = [np.zeros((1, H, D), np.float32)] * 2
    want = reference.rope_pool_fused(
        x, x, x, positions[:n].cpu().numpy(), np.full(n, -1), *pools, head_dim=D, num_qo_heads=H, num_kv_heads=H,
        rope=ropepool.CosSinCache(table.cpu().float().numpy(), is_neox=is_neox))[0]
    assert_close(f"{name} (the float64 oracle)", got.cpu().float().numpy(), want, TOL[str(got.dtype)[6:]])


def interpreter_fp8_slips(got, want, fp8_dtype) -> torch.Tensor:
    """Where got is want as the Triton interpreter mis-rounds it: one step off, or a power of two halved."""
    one_step = (ordered(got.view(torch.uint8)) - ordered(want.view(torch.uint8))).abs() <= 1
    g, w = got.view(fp8_dtype).float().cpu(), want.view(fp8_dtype).float().cpu()
    halved = (g * 2 == w) & (torch.frexp(w).mantissa.abs() == 0.5)
    if FMA_ROUNDS_TWICE:  # the next value away from zero halved (fp8 bytes are sign and magnitude)
        up = (want.view(torch.uint8) + 1).view(fp8_dtype).float().cpu()
        halved |= (g * 2 == up) & (torch.frexp(up).mantissa.abs() == 0.5)
    return one_step | halved


def check_cache(got, want, written, kv_cache_dtype, backend):
    """Every byte of the cache: written rows as reshape_and_cache_flash writes them, the rest untouched."""
    if kv_cache_dtype in ref.FP8 and backend == "triton" and INTERPRETER:
        assert_same_bits("kv_cache rows not written", got[~written], want[~written])
        ok = interpreter_fp8_slips(got[written], want[written], ref.FP8[kv_cache_dtype])
        assert ok.all(), f"fp8 rows differ beyond the interpreter's known slips: {int((~ok).sum())} bytes"
    else:
        assert_same_bits("kv_cache (written rows == vLLM's write, the rest untouched)", got, want)


def written_mask(kv_cache, layout, head_size, slots):
    """True at every element of kv_cache that a slot >= 0 writes."""
    mask = torch.zeros(kv_cache.shape, dtype=torch.bool, device=kv_cache.device)
    for part in split(mask, layout, head_size):
        for s in slots.tolist():
            if s >= 0:
                part[s // part.shape[1], s % part.shape[1]] = True
    return mask


def run_case(call, layout, physical, dtype, kv_cache_dtype, is_neox, head_size, rotary_dim, table_dtype, backend,
             gen):
    q, k, v, positions, table, slots = vllm_inputs(gen, dtype, head_size, rotary_dim, table_dtype)
    fp8 = kv_cache_dtype in ref.FP8
    kv_cache = make_cache(layout, physical, 3, 16, k.shape[1], head_size, torch.uint8 if fp8 else dtype, gen)
    k_scale, v_scale = (torch.tensor([s], device=DEVICE) for s in (0.6, 1.4))
    q0, k0, v0, before = q.clone(), k.clone(), v.clone(), kv_cache.clone()
    call(q, k, v, positions, table, is_neox, kv_cache, slots, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
         v_scale=v_scale, backend=backend)
    n = slots.shape[0]
    check_rotation("q", q[:n], q0, table, positions, is_neox, backend)
    check_rotation("k", k[:n], k0, table, positions, is_neox, backend)
    for name, x, x0 in (("q padding", q[n:], q0[n:]), ("k padding", k[n:], k0[n:]), ("v", v, v0)):
        assert_same_bits(f"{name} (not touched)", x, x0)
    want = before.clone()
    views = split(want, layout, head_size)
    if fp8:
        views = tuple(c.view(ref.FP8[kv_cache_dtype]) for c in views)
    ref.reshape_and_cache_flash(k[:n], v, *views, slots, kv_cache_dtype, k_scale, v_scale)
    check_cache(kv_cache, want, written_mask(kv_cache, layout, head_size, slots), kv_cache_dtype, backend)


def case(layout, physical, dtype, cache, style, head_size, rotary_dim, table_dtype=None):
    name = (f"{layout}-{physical}-{str(dtype)[6:]}-{cache}-{style}-D{head_size}"
            + (f"-rot{rotary_dim}" if rotary_dim < head_size else ""))
    return pytest.param(layout, physical, dtype, cache, style == "neox", head_size, rotary_dim,
                        table_dtype or dtype, id=name + ("-f32table" if table_dtype else ""))


# Every layout vLLM's CUDA backends use (kv_first: FlashAttention; blocks_first: Triton and FlashInfer;
# packed: the standardized layout), NHD and HND in memory, float and fp8 caches, both pair styles,
# full and partial rotary, head sizes 64-256.
CASES = [
    case("kv_first", "NHD", BF16, "auto", "neox", 128, 128),
    case("kv_first", "HND", F16, "auto", "gptj", 64, 32),
    case("kv_first", "NHD", BF16, "fp8", "neox", 256, 256),
    case("kv_first", "NHD", F32, "fp8_e5m2", "gptj", 64, 64),
    case("blocks_first", "NHD", F32, "auto", "gptj", 64, 64),
    case("blocks_first", "NHD", BF16, "fp8_e4m3", "gptj", 128, 64),
    case("blocks_first", "HND", F16, "fp8_e5m2", "neox", 128, 128),
    case("blocks_first", "HND", BF16, "auto", "neox", 256, 64, table_dtype=F32),
    case("packed", "NHD", BF16, "auto", "neox", 128, 128),
    case("packed", "HND", F16, "fp8", "gptj", 64, 64),
    case("packed", "NHD", F32, "auto", "neox", 96, 32),
]


@pytest.mark.parametrize("layout, physical, dtype, kv_cache_dtype, is_neox, head_size, rotary_dim, table_dtype", CASES)
def test_rope_and_cache(layout, physical, dtype, kv_cache_dtype, is_neox, head_size, rotary_dim, table_dtype, backend,
                        rng):
    run_case(rv.rope_and_cache, layout, physical, dtype, kv_cache_dtype, is_neox, head_size, rotary_dim, table_dtype,
             backend, rng)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (80, 80), (120, 32), (256, 256), (256, 32)])
def test_stays_vllm_given_its_table(head_size, rotary_dim, dtype, is_neox, backend):
    """vLLM's own rotary test, with ropepool as the kernel: given vLLM's table (in the model dtype), q_rot and
    k_rot are forward_native's within vLLM's tolerances. Its cases (tests/kernels/core/test_pos_encoding.py):
    batch 5 x seq 11 tokens, 17 heads, positions < 8192, seed 0 (the Triton interpreter takes 11 tokens and
    5 heads). A fixed seed, as there: vLLM's own float32 kernel formula misses these tolerances on a few seeds
    in a hundred (docs/engines.md); check_rotation holds for every seed."""
    gen = torch.Generator().manual_seed(0)
    T, H, max_pos = (11, 5, 8192) if backend == "triton" and INTERPRETER else (55, 17, 8192)
    q, k = rand(gen, T, H, head_size, dtype=dtype), rand(gen, T, H, head_size, dtype=dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    table = ref.cos_sin_cache(rotary_dim, max_pos).to(DEVICE, dtype)
    pools = [torch.zeros(4, H, head_size, device=DEVICE, dtype=dtype) for _ in range(2)]
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(
        q, k, k, positions, torch.full((T,), -1, device=DEVICE), *pools, head_dim=head_size, num_qo_heads=H,
        num_kv_heads=H, rope=ropepool.CosSinCache(table, is_neox=is_neox), backend=backend)
    for name, got, x in (("q", q_rot, q), ("k", k_rot, k)):
        want = ref.rotate_native(x.cpu(), table.cpu(), positions.cpu(), is_neox)
        torch.testing.assert_close(got.cpu(), want, atol=ref.ATOL[dtype], rtol=ref.RTOL[dtype])
        check_rotation(name, got, x, table, positions, is_neox, backend)


def test_tensor_parallel_shards_equal_one_call(backend, rng):
    """Each TP rank calls the op on its head shard and its own cache: two calls equal one."""
    head_size, hq, hkv = 64, 8, 4
    q, k, v, positions, table, slots = vllm_inputs(rng, BF16, head_size, head_size, BF16, hq=hq, hkv=hkv)
    whole = make_cache("kv_first", "NHD", 3, 16, hkv, head_size, BF16, rng)
    ranks = [whole[:, :, :, h:h + hkv // 2].clone() for h in (0, hkv // 2)]
    q_ranks = [x.clone() for x in q.split(hq // 2, 1)]
    k_ranks = [x.clone() for x in k.split(hkv // 2, 1)]
    for rank, (qr, kr, vr) in enumerate(zip(q_ranks, k_ranks, v.split(hkv // 2, 1))):
        rv.rope_and_cache(qr, kr, vr, positions, table, True, ranks[rank], slots, backend=backend)
    rv.rope_and_cache(q, k, v, positions, table, True, whole, slots, backend=backend)
    assert_same_bits("q", torch.cat(q_ranks, 1), q)
    assert_same_bits("k", torch.cat(k_ranks, 1), k)
    assert_same_bits("cache", torch.cat(ranks, 3), whole)


# --- the vLLM plugin ---------------------------------------------------------------------------------

class FakeImpl:
    """What ropepool reads of a vLLM AttentionImpl; its own methods stand for vLLM's unfused path."""

    def __init__(self, kv_cache_dtype="auto", kv_sharing_target_layer_name=None):
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, "decoder"
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def fused_rope_kvcache_supported(self):
        return False

    def do_rope_and_kv_cache_update(self, *args):
        return "vllm's own path"


@pytest.fixture
def fake_vllm(monkeypatch):
    """A vllm package whose FlashAttention backend has the kv_first cache shape; other backends absent."""
    impl = type("FlashAttentionImpl", (FakeImpl,), {})
    backend = type("FlashAttentionBackend", (), {
        "get_kv_cache_shape": staticmethod(lambda num_blocks, block_size, heads, dim, cache_dtype_str="auto":
                                           (2, num_blocks, block_size, heads, dim)),
        "get_impl_cls": staticmethod(lambda: impl)})
    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    module.FlashAttentionBackend = backend
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for name in ("triton_attn", "flashinfer"):
        monkeypatch.setitem(sys.modules, f"vllm.v1.attention.backends.{name}", None)
    monkeypatch.setattr(rv, "_nvidia", lambda: True)  # CPU CI: let the CPU tensors through
    return impl


def test_register_installs_the_adapter(fake_vllm, backend, rng):
    assert rv.register() == ["FlashAttentionBackend"]
    impl = fake_vllm()
    assert impl.fused_rope_kvcache_supported()

    def call(q, k, v, positions, table, is_neox, kv_cache, slots, *, kv_cache_dtype, k_scale, v_scale, backend):
        impl.kv_cache_dtype = kv_cache_dtype
        layer = types.SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale)
        assert impl.do_rope_and_kv_cache_update(layer, q, k, v, positions, table, is_neox, kv_cache, slots) is None

    run_case(call, "kv_first", "NHD", BF16, "fp8", True, 64, 64, BF16, backend, rng)


@pytest.mark.parametrize("impl_args", [("int4_per_token_head",), ("fp8_per_token_head",), ("auto", "layers.0.attn")],
                         ids=["int4-per-token-head", "per-token-head-without-scale-views", "kv-sharing"])
def test_register_leaves_unsupported_layers_to_vllm(fake_vllm, impl_args):
    rv.register()
    impl = fake_vllm(*impl_args)
    assert not impl.fused_rope_kvcache_supported()
    assert impl.do_rope_and_kv_cache_update(*[None] * 9) == "vllm's own path"


def test_register_without_vllm(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with caplog.at_level(logging.WARNING, logger=rv.__name__):
        assert rv.register() == []
    assert "vLLM is not importable" in caplog.text


def test_layout_detection_and_errors():
    d = 8
    assert rv.detect_layout(torch.empty(2, 5, 16, 2, d), d) == "kv_first"
    assert rv.detect_layout(torch.empty(5, 2, 16, 2, d), d) == "blocks_first"
    assert rv.detect_layout(torch.empty(5, 2, 16, 2 * d), d) == "packed"
    with pytest.raises(ValueError, match=r"^cannot tell the vLLM cache layout of kv_cache \[2, 2, 16, 2, 8\]"):
        rv.detect_layout(torch.empty(2, 2, 16, 2, d), d)  # two blocks: either layout
    with pytest.raises(ValueError, match=r"^kv_cache_dtype 'int4_per_token_head' is not one ropepool writes"):
        rv.rope_and_cache(*[None] * 8, kv_cache_dtype="int4_per_token_head")
    key, cache = torch.empty(3, 2, d), torch.empty(5, 2, 16, 2, d + 4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype 'int8_per_token_head' needs k_scale_cache and "):
        rv.rope_and_cache(key, key, key, torch.zeros(3), None, True, cache, torch.zeros(3),
                          kv_cache_dtype="int8_per_token_head")


# --- per-token-head caches (kv_cache_dtype "int8_per_token_head", "fp8_per_token_head") --------------

PER_TOKEN_HEAD = [pytest.param("blocks_first", torch.int8, id="blocks_first-int8"),
                  pytest.param("packed", torch.float8_e4m3fn, id="packed-fp8e4m3")]


def vllm_scale_views(kv_cache, head_size, layout):
    """The scale views as TritonAttentionImpl._ensure_scale_caches builds them: torch.as_strided over the
    storage as float32, strides and offsets counted in float32 units (4 bytes; the cache is 1-byte)."""
    base = torch.tensor([], dtype=torch.float32).set_(kv_cache.untyped_storage())
    if layout == "blocks_first":  # older stride arithmetic: K and V halves of a block are adjacent
        num_blocks, _, block_size, heads, row = kv_cache.shape
        half = block_size * heads * row
        strides, offsets = (2 * half // 4, heads * row // 4, row // 4), (head_size // 4, (half + head_size) // 4)
    else:  # strides read from the packed tensor [num_blocks, heads, block_size, 2 * row]
        num_blocks, heads, block_size, content = kv_cache.shape
        row, (sb, sh, ss, _) = content // 2, kv_cache.stride()
        strides, offsets = (sb // 4, ss // 4, sh // 4), (head_size // 4, (row + head_size) // 4)
    return tuple(torch.as_strided(base, (num_blocks, block_size, heads), strides, off) for off in offsets)


@pytest.mark.parametrize("layout, cache_dtype", PER_TOKEN_HEAD)
def test_per_token_head_reference(layout, cache_dtype, rng):
    """The port of vLLM's per-token-head write: where the scales live, how they are computed, the rounding."""
    T, H, D = 6, 2, 64
    kv_cache = ref.per_token_head_cache(3, 16, H, D, cache_dtype, layout, fill=0x55)
    before = kv_cache.clone()
    views = ref.per_token_head_views(kv_cache, D, cache_dtype, layout)
    for mine, theirs in zip(views[2:], vllm_scale_views(kv_cache, D, layout)):
        assert (mine.data_ptr(), mine.stride(), mine.shape) == (theirs.data_ptr(), theirs.stride(), theirs.shape)
    key, value = torch.randn(T, H, D, generator=rng).to(BF16), 3 * torch.randn(T, H, D, generator=rng).to(BF16)
    key[2, 1] = 0  # an all-zero head: the scale floor 1e-6, data 0
    slots = torch.tensor([5, -1, 16, 47, 0, 30])
    ref.reshape_and_cache_per_token_head(key, value, *views, slots)

    qmax = ref.quant_range(cache_dtype)[0]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for x, data, scales in ((key[t], views[0], views[2]), (value[t], views[1], views[3])):
            block, row = divmod(s, 16)
            amax = x.double().abs().amax(-1)
            want_scale = torch.clamp_min((amax / qmax).float(), 1e-6)  # float64 quotient rounds as float32's would
            assert torch.equal(scales[block, row], want_scale)
            q = data[block, row].double()
            ratio = x.double() / scales[block, row].double()[:, None]
            if cache_dtype == torch.int8:  # truncation toward zero (of the float32 x * (1 / scale), hence 1e-4)
                assert ((ratio - q).abs() < 1 + 1e-4).all() and (q * ratio >= 0).all()
                assert (q.abs() <= ratio.abs() + 1e-4).all(), "rounded away from zero"
            else:  # round to nearest: within half an e4m3 step (3 mantissa bits) of ratio, or of the subnormal grid
                assert ((ratio - q).abs() <= torch.maximum(ratio.abs() * 2.0 ** -4, torch.tensor(2.0 ** -10))).all()
    floor = torch.tensor(1e-6, dtype=torch.float32)
    assert views[2][1, 0, 1] == floor and (views[0][1, 0, 1].float() == 0).all()  # token 2 (slot 16), head 1
    if cache_dtype == torch.int8:  # each head's largest |x| lands on 127, or 126 where x * (1 / scale) < 127
        written = views[0][slots[slots >= 0] // 16, slots[slots >= 0] % 16]
        assert set(written.abs().amax(-1).flatten().tolist()) <= {0, 126, 127}  # 0: the all-zero head
    touched = torch.zeros_like(kv_cache, dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            touched[s // 16, :, s % 16] = True  # K and V, every head, data and scale bytes
    assert_same_bits("bytes of slots not written", kv_cache[~touched], before[~touched])


@pytest.mark.parametrize("layout, cache_dtype", PER_TOKEN_HEAD)
def test_per_token_head_ropepool(layout, cache_dtype, backend, rng):
    """The proposed call: vLLM's data views as the pools and its float32 scale views as k_scale_cache /
    v_scale_cache ([num_blocks, block_size, num_kv_heads], any strides), written by the kernel for each
    written slot exactly as _reshape_cache_per_token_head writes them (the reference port)."""
    head_size = 64
    q, k, v, positions, table, slots = vllm_inputs(rng, BF16, head_size, head_size, BF16)
    n = slots.shape[0]
    kv_cache = ref.per_token_head_cache(3, 16, k.shape[1], head_size, cache_dtype, layout, fill=0x55).to(DEVICE)
    before, q0, k0 = kv_cache.cpu(), q.clone(), k.clone()
    k_data, v_data, k_scales, v_scales = ref.per_token_head_views(kv_cache, head_size, cache_dtype, layout)
    ropepool.rope_pool_fused(q[:n], k[:n], v[:n], positions[:n], slots, k_data, v_data, head_dim=head_size,
                             num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], rope=ropepool.CosSinCache(table),
                             kv_layout="NHD", k_scale_cache=k_scales, v_scale_cache=v_scales, q_out=q[:n],
                             k_out=k[:n], backend=backend)
    check_rotation("q", q[:n], q0, table, positions, True, backend)
    check_rotation("k", k[:n], k0, table, positions, True, backend)
    want = before.clone()
    want_views = ref.per_token_head_views(want, head_size, cache_dtype, layout)
    ref.reshape_and_cache_per_token_head(k[:n].cpu(), v[:n].cpu(), *want_views, slots.cpu())
    got_views = ref.per_token_head_views(kv_cache.cpu(), head_size, cache_dtype, layout)
    for name, got, wanted in zip(("k scales", "v scales"), got_views[2:], want_views[2:]):
        assert_same_bits(name, got, wanted)
    if cache_dtype == torch.int8 or backend == "torch" or not INTERPRETER:
        assert_same_bits("kv_cache (vLLM's per-token-head write, the rest untouched)", kv_cache, want)
    else:
        for got, wanted in zip(got_views[:2], want_views[:2]):
            assert interpreter_fp8_slips(got, wanted, cache_dtype).all()


@pytest.mark.parametrize("layout, cache_dtype", PER_TOKEN_HEAD)
def test_register_per_token_head(fake_vllm, monkeypatch, layout, cache_dtype, backend, rng):
    """register(): a per-token-head layer with vLLM's scale views is written by ropepool through
    rope_and_cache, data and scales exactly as the port of _reshape_cache_per_token_head writes them."""
    monkeypatch.setattr(rv, "probe_layout", lambda backend_cls: None)  # the layout read from each cache
    rv.register()
    kv_dtype = "int8_per_token_head" if cache_dtype == torch.int8 else "fp8_per_token_head"
    impl = fake_vllm(kv_dtype)

    def ensure_scale_caches(kv_cache):  # TritonAttentionImpl._ensure_scale_caches, as the port builds it
        impl._k_scale_cache, impl._v_scale_cache = ref.per_token_head_views(kv_cache, 64, cache_dtype, layout)[2:]

    impl._ensure_scale_caches = ensure_scale_caches
    assert impl.fused_rope_kvcache_supported()
    q, k, v, positions, table, slots = vllm_inputs(rng, BF16, 64, 64, BF16)
    n = slots.shape[0]
    kv_cache = ref.per_token_head_cache(3, 16, k.shape[1], 64, cache_dtype, layout, fill=0x55).to(DEVICE)
    want, q0, k0, v0 = kv_cache.cpu(), q.clone(), k.clone(), v.clone()
    impl.do_rope_and_kv_cache_update(types.SimpleNamespace(_k_scale=None, _v_scale=None), q, k, v, positions, table,
                                     True, kv_cache, slots)
    for name, x, x0 in (("q", q, q0), ("k", k, k0)):  # the rotation: the oracle's, and vLLM's formula
        check_oracle(name, x[:n], x0, table, positions, True)
        check_rotation(name, x[:n], x0, table, positions, True, backend)
    for name, x, x0 in (("q padding", q[n:], q0[n:]), ("k padding", k[n:], k0[n:]), ("v", v, v0)):
        assert_same_bits(f"{name} (not touched)", x, x0)
    ref.reshape_and_cache_per_token_head(k[:n].cpu(), v0[:n].cpu(), *ref.per_token_head_views(
        want, 64, cache_dtype, layout), slots.cpu())
    got, wanted = (ref.per_token_head_views(c, 64, cache_dtype, layout) for c in (kv_cache.cpu(), want))
    for name, a, b in zip(("k scales", "v scales"), got[2:], wanted[2:]):
        assert_same_bits(name, a, b)
    if cache_dtype == torch.int8 or backend == "torch" or not INTERPRETER:
        assert_same_bits("kv_cache (vLLM's per-token-head write, the rest untouched)", kv_cache.cpu(), want)
    else:
        for a, b in zip(got[:2], wanted[:2]):
            assert interpreter_fp8_slips(a, b, cache_dtype).all()
