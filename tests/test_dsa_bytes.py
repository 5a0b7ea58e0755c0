"""DeepSeek V3.2's two caches: the float64 oracle (``ropepool.reference.dsa``) writes the bytes vLLM's own
writers write (tests/vllm_dsa.py: ports of vllm-project/vllm csrc/libtorch_stable/cache_kernels.cu at
37cb21c1695d11baba8e369b071d2f44c1561c8f), every byte of the cache compared.

Caches start as random bytes, so rows never written must come back bit for bit; slots are shuffled,
some negative (skipped), token counts odd; flat, paged and layer-stacked caches, and a paged view with a
wider entry stride for fp8_ds_mla (vLLM's kernel takes any block and entry stride).
"""
import re

import ml_dtypes
import numpy as np
import pytest

from ropepool.formats import fp8_ds_mla, indexer
from ropepool.reference import dsa as reference_dsa
from tests.harness import NP_DTYPES, Backend, make_slots, randn

torch = pytest.importorskip("torch")
from tests import vllm_dsa  # noqa: E402  (needs torch)

CPU = Backend("torch", "cpu")


def scaled_rows(rng, T, D, dtype, group=128):
    """``[T, D]`` values whose groups of ``group`` span magnitudes 1e-3..1e3; one all-zero group, one with
    values below the indexer's 1e-4 floor, and one holding a single large value (T >= 5)."""
    x = randn(rng, T, D // group, group).astype(np.float32)
    x *= 10.0 ** rng.uniform(-3, 3, (T, D // group, 1)).astype(np.float32)
    # Tokens 1, 2 and 4: make_slots skips every third token from 0, so these are written.
    x[1, 0] = 0.0
    x[2, -1] *= 1e-6 / np.abs(x[2, -1]).max()
    x[4, 0] = 0.0
    x[4, 0, 5] = 3e4
    return x.reshape(T, D).astype(NP_DTYPES[dtype])


def poison(rng, shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


# (kv_layout, layer, cache shape, how the vLLM port sees the cache: a 3-D [blocks, block_size, W] view)
def layouts(width):
    return [
        (None, None, (23, width), lambda c: c[:, None]),  # flat: pages of one row
        ("NHD", None, (5, 4, width), lambda c: c),
        ("NHD", 1, (3, 4, 8, width), lambda c: c[1]),  # layer-stacked, layer 1 written
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", range(4))
def test_ds_mla_rows_are_vllms(rng, dtype, case):
    kv_layout, layer, shape, as_vllm = layouts(fp8_ds_mla.DS_MLA_ROW)[case % 3] if case < 3 else \
        ("NHD", None, (6, 4, 700), None)
    pool_size = int(np.prod(shape[-3:-1])) if kv_layout else shape[0]
    T = 11
    kv_c = scaled_rows(rng, T, fp8_ds_mla.DS_MLA_RANK, dtype)
    k_pe = randn(rng, T, fp8_ds_mla.DS_MLA_PE, dtype=dtype)
    slots = make_slots(rng, T, pool_size)
    cache = poison(rng, shape)
    if case == 3:  # [blocks, block_size, 656] seen through a wider row: entry stride 700
        ours = reference_dsa.write_ds_mla(cache[..., :fp8_ds_mla.DS_MLA_ROW], slots,
                                          reference_dsa.ds_mla_rows(kv_c, k_pe), kv_layout, layer)
        theirs = CPU.array(cache)
        vllm_dsa.concat_and_cache_ds_mla(CPU.array(kv_c), CPU.array(k_pe), theirs[..., :fp8_ds_mla.DS_MLA_ROW],
                                         CPU.array(slots))
        np.testing.assert_array_equal(ours, CPU.numpy(theirs)[..., :fp8_ds_mla.DS_MLA_ROW])
        row = fp8_ds_mla.DS_MLA_ROW
        np.testing.assert_array_equal(cache[..., row:], CPU.numpy(theirs)[..., row:])
        return
    ours = reference_dsa.write_ds_mla(cache, slots, reference_dsa.ds_mla_rows(kv_c, k_pe), kv_layout, layer)
    theirs = CPU.array(cache)
    vllm_dsa.concat_and_cache_ds_mla(CPU.array(kv_c), CPU.array(k_pe), as_vllm(theirs), CPU.array(slots))
    np.testing.assert_array_equal(ours, CPU.numpy(theirs))
    assert (ours != cache).any() and (ours == cache).any()  # some bytes written, some left


def test_ds_mla_row_bytes(rng):
    """One row read back by hand: values, scales and k_pe where docs/layouts.md draws them."""
    kv_c = scaled_rows(rng, 5, fp8_ds_mla.DS_MLA_RANK, "bfloat16")
    k_pe = randn(rng, 5, fp8_ds_mla.DS_MLA_PE, dtype="bfloat16")
    rows = reference_dsa.ds_mla_rows(kv_c, k_pe)
    assert rows.shape == (5, 656) and rows.dtype == np.uint8
    scales = rows[:, 512:528].copy().view("<f4")
    np.testing.assert_array_equal(rows[:, 528:].copy().view(k_pe.dtype), k_pe)
    assert scales[1, 0] == np.finfo(np.float32).tiny  # the all-zero tile: FLT_MIN, values 0
    assert (rows[1, :128] == 0).all()
    amax = np.abs(kv_c.astype(np.float64).reshape(5, 4, 128)).max(-1)
    np.testing.assert_allclose(scales[amax > 0], (amax / 448)[amax > 0], rtol=2**-23)
    decoded = rows[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(5, 4, 128)
    assert np.abs(decoded).max() <= 448 and (np.abs(decoded).max(-1)[amax > 0] == 448).all()


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", range(3))
def test_indexer_rows_are_vllms(rng, scale_fmt, dtype, case):
    D = 128
    kv_layout, layer, shape, as_vllm = layouts(indexer.indexer_row_bytes(D))[case]
    pool_size = int(np.prod(shape[-3:-1])) if kv_layout else shape[0]
    T = 13
    k = scaled_rows(rng, T, D, dtype)
    slots = make_slots(rng, T, pool_size)
    cache = poison(rng, shape)
    values, scales = reference_dsa.indexer_quantize(k, scale_fmt == "ue8m0")
    ours = reference_dsa.write_indexer(cache, slots, values, scales, kv_layout, layer)
    theirs = CPU.array(cache)
    vllm_dsa.indexer_k_quant_and_cache(CPU.array(k), as_vllm(theirs), CPU.array(slots), 128, scale_fmt)
    np.testing.assert_array_equal(ours, CPU.numpy(theirs))
    assert (ours != cache).any() and (ours == cache).any()


def test_indexer_block_layout(rng):
    """A page of 4 rows: the 4 x 128 values first, row by row, then the 4 float32 scales."""
    k = scaled_rows(rng, 5, 128, "bfloat16")[3:]
    values, scales = reference_dsa.indexer_quantize(k, True)
    cache = reference_dsa.write_indexer(np.zeros((3, 4, 132), np.uint8), np.array([6, 1]), values, scales, "NHD")
    page1 = cache[1].reshape(-1)
    np.testing.assert_array_equal(page1[2 * 128: 3 * 128], values[0])
    assert page1[512 + 2 * 4: 512 + 3 * 4].view("<f4")[0] == scales[0, 0]
    assert (cache[0].reshape(-1)[128:256] == values[1]).all() and cache[0].reshape(-1)[516:520].view("<f4") == scales[1]
    assert cache[2].sum() == 0 and np.count_nonzero(page1[:512]) <= 128 and (page1[:256] == 0).all()


def test_indexer_scales():
    """amax below 1e-4 counts as 1e-4; ue8m0 rounds up to a power of two, and a scale within one log2
    rounding step above a power of two stays that power (exp2f(ceilf(log2f(s))), as vLLM computes it)."""
    k = np.zeros((4, 128), np.float32)
    k[0, 0] = 1e-6
    k[1, 0] = 448.0 * 3
    k[2, 0] = np.float32(448.0 * 2.0**-9 * (1 + 2.0**-22))  # s = 2^-9 (1 + 2^-22): log2f rounds to -9
    k[3, 0] = np.float32(448.0 * 2.0**-9 * (1 + 2.0**-20))  # a few steps more: 2^-8
    _, plain = reference_dsa.indexer_quantize(k, False)
    _, ue8m0 = reference_dsa.indexer_quantize(k, True)
    assert plain[0, 0] == np.float32(np.float32(1e-4) / np.float32(448))
    assert plain[1, 0] == 3.0 and ue8m0[1, 0] == 4.0
    assert ue8m0[2, 0] == 2.0**-9 and ue8m0[3, 0] == 2.0**-8
    theirs = torch.zeros(4, 1, 132, dtype=torch.uint8)
    vllm_dsa.indexer_k_quant_and_cache(torch.from_numpy(k), theirs, torch.arange(4), 128, "ue8m0")
    np.testing.assert_array_equal(theirs[:, 0, 128:].contiguous().view(torch.float32)[:, 0].numpy(), ue8m0[:, 0])


def test_whole_op_oracles(rng):
    """rope_latent_ds_mla and rope_indexer rotate as reference.rope_latent_fused / rope_pool_fused do (the
    indexer: the first 64 of 128 features, NeoX), then write vLLM's bytes of the rotation in k's dtype."""
    from ropepool import RopeSpec, reference

    T, pool = 7, 16
    positions, slots = rng.integers(0, 4096, T), make_slots(rng, T, pool)
    spec = RopeSpec(head_dim=64, style="gptj", base=10000.0)
    q_pe, k_pe = randn(rng, T, 3, 64, dtype="bfloat16"), randn(rng, T, 64, dtype="bfloat16")
    kv_c = scaled_rows(rng, T, 512, "bfloat16")
    q_rot, k_rot, cache = reference_dsa.rope_latent_ds_mla(q_pe, k_pe, kv_c, positions, slots,
                                                           poison(rng, (pool, 656)), rope=spec)
    want = reference.rope_latent_fused(q_pe, k_pe, kv_c, positions, slots, np.zeros((pool, 512), kv_c.dtype),
                                       np.zeros((pool, 64), kv_c.dtype), rope=spec)
    np.testing.assert_array_equal(q_rot, want[0])
    np.testing.assert_array_equal(k_rot, want[1])
    theirs = torch.zeros(pool, 1, 656, dtype=torch.uint8)
    vllm_dsa.concat_and_cache_ds_mla(CPU.array(kv_c), CPU.array(k_rot.astype(k_pe.dtype)), theirs, CPU.array(slots))
    written = slots >= 0
    np.testing.assert_array_equal(cache[slots[written]], CPU.numpy(theirs)[slots[written], 0])

    spec = RopeSpec(head_dim=128, rotary_dim=64)
    q, k = randn(rng, T, 4, 128, dtype="bfloat16"), scaled_rows(rng, T, 128, "bfloat16")
    q_rot, k_rot, cache = reference_dsa.rope_indexer(q, k, positions, slots, np.zeros((pool, 132), np.uint8),
                                                     rope=spec, scale_fmt="ue8m0")
    v = np.zeros((T, 1, 128), k.dtype)
    want = reference.rope_pool_fused(q, k[:, None], v, positions, slots, np.zeros((pool, 1, 128), k.dtype),
                                     np.zeros((pool, 1, 128), k.dtype), head_dim=128, num_qo_heads=4,
                                     num_kv_heads=1, rope=spec)
    np.testing.assert_array_equal(q_rot, want[0])
    np.testing.assert_array_equal(k_rot, want[1][:, 0])
    theirs = torch.zeros(pool, 1, 132, dtype=torch.uint8)
    vllm_dsa.indexer_k_quant_and_cache(CPU.array(k_rot.astype(k.dtype)), theirs, CPU.array(slots), 128, "ue8m0")
    np.testing.assert_array_equal(cache, CPU.numpy(theirs)[:, 0])


def _ds_mla_misuse(rng, kind):
    kv_c, k_pe, cache = randn(rng, 3, 512, dtype="bfloat16"), randn(rng, 3, 64, dtype="bfloat16"), \
        np.zeros((8, 656), np.uint8)
    if kind == "row":
        cache = np.zeros((8, 576), np.uint8)
    elif kind == "dtype":
        cache = np.zeros((8, 656), NP_DTYPES["bfloat16"])
    elif kind == "rank":
        kv_c = randn(rng, 3, 256, dtype="bfloat16")
    elif kind == "float32":
        kv_c, k_pe = kv_c.astype(np.float32), k_pe.astype(np.float32)
    return kv_c, k_pe, cache


@pytest.mark.parametrize("kind, message", [
    ("row", "fp8_ds_mla rows must be uint8 [..., 656]"), ("dtype", "fp8_ds_mla rows must be uint8"),
    ("rank", "fp8_ds_mla needs kv_lora_rank 512 and rope_dim 64; got kv_c with 256"),
    ("float32", "fp8_ds_mla stores k_pe in the inputs' 16-bit dtype; got float32")])
def test_ds_mla_misuse(rng, kind, message):
    from ropepool import RopePoolError, RopeSpec

    kv_c, k_pe, cache = _ds_mla_misuse(rng, kind)
    q_pe = randn(rng, 3, 2, 64, dtype="bfloat16")
    with pytest.raises(RopePoolError, match=r"^" + re.escape(message)):
        reference_dsa.rope_latent_ds_mla(q_pe, k_pe, kv_c, np.arange(3), np.arange(3), cache,
                                         rope=RopeSpec(head_dim=64))


@pytest.mark.parametrize("kw, width, message", [
    ({"scale_fmt": "e8m0"}, 132, "rope_indexer scale_fmt must be None or 'ue8m0'; got 'e8m0'"),
    ({"quant_block_size": 64}, 132, "rope_indexer quantizes the indexer key in groups of 128 values; got "
                                    "quant_block_size=64"),
    ({}, 136, "the indexer cache must be uint8 [..., 132] for head_dim 128"),
    ({"head_dim": 64}, 132, "rope_indexer expects the indexer key's head_dim to be a multiple of 128; got 64")])
def test_indexer_misuse(rng, kw, width, message):
    from ropepool import RopePoolError, RopeSpec

    D = kw.pop("head_dim", 128)
    q, k = randn(rng, 3, 2, D, dtype="bfloat16"), randn(rng, 3, D, dtype="bfloat16")
    with pytest.raises(RopePoolError, match=r"^" + re.escape(message)):
        reference_dsa.rope_indexer(q, k, np.arange(3), np.arange(3), np.zeros((8, width), np.uint8),
                                   rope=RopeSpec(head_dim=D, rotary_dim=64), **kw)


@pytest.mark.parametrize("framework", ["torch", "mlx"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_store_math_is_the_oracles(rng, framework, dtype):
    """The formats' array math (formats/fp8_ds_mla.py, indexer.py) on torch tensors and MLX arrays: the oracle's
    bytes, both formats, both scale formats."""

    if framework == "mlx":
        pytest.importorskip("mlx.core")
        from ropepool.backends.mlx_arrays import MlxOps as ops
    else:
        from ropepool.backends.torch_arrays import TorchOps as ops
    fw = Backend("mlx") if framework == "mlx" else CPU
    kv_c, k_pe = scaled_rows(rng, 9, 512, dtype), randn(rng, 9, 64, dtype=dtype)
    rows = fp8_ds_mla.rows(fw.array(kv_c), fw.array(k_pe), ops)
    np.testing.assert_array_equal(np.array(rows) if framework == "mlx" else rows.numpy(),
                                  reference_dsa.ds_mla_rows(kv_c, k_pe))
    k = scaled_rows(rng, 9, 256, dtype)
    for ue8m0 in (False, True):
        values, scales = indexer.rows(fw.array(k), ue8m0, ops)
        want_values, want_scales = reference_dsa.indexer_quantize(k, ue8m0)
        np.testing.assert_array_equal(np.array(values) if framework == "mlx" else values.numpy(), want_values)
        got = np.array(scales) if framework == "mlx" else scales.numpy()
        np.testing.assert_array_equal(got.view("<f4"), want_scales)
