"""The block-quantized formats' oracle (ropepool.reference.quant) against the engines' own writers, byte for byte.

- NVFP4: the NumPy model of FlashInfer's quantizer against the statement-by-
  statement torch port of its slot-mapping append kernel (tests/quant_ports.py),
  on rows built to hit every rounding tie of e2m1, zero blocks, block scales
  that underflow to e4m3 subnormals or zero and that saturate at 448, and
  random rows of float16 / bfloat16 over eight decades; written into flat,
  paged (NHD, HND) and layer-stacked pools full of random bytes, odd token
  counts, negative slots: every byte of data and scale pools compared, so rows
  no token names are checked untouched too.
- Affine (mlx-lm's quantized cache): the NumPy model of MLX's CPU quantizer
  against ``mx.quantize`` itself, bits 4 and 8, every group size MLX has,
  float32 / float16 / bfloat16, and the same pool writes against mx.quantize
  followed by an engine-style scatter.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from ropepool.formats.affine import AFFINE_BITS, AFFINE_GROUP_SIZES
from ropepool.reference import quant as rq
from tests import quant_ports as port
from tests.harness import HAS, assert_same_bits, make_slots

# name: (kv_layout, page_size, layers, layer)
POOLS = {
    "flat": (None, 1, None, None),
    "nhd": ("NHD", 4, None, None),
    "hnd": ("HND", 2, None, None),
    "nhd-layers": ("NHD", 4, 3, 1),
    "hnd-layers-last": ("HND", 4, 2, -1),
}
NUM_SLOTS, H = 16, 2


def pool_shape(kv_layout, page_size, layers, last):
    one = {None: (NUM_SLOTS, H), "NHD": (NUM_SLOTS // page_size, page_size, H),
           "HND": (NUM_SLOTS // page_size, H, page_size)}[kv_layout]
    return ((layers,) if layers else ()) + one + (last,)


def random_bytes(rng, shape, dtype):
    """``dtype`` array of random bytes (NaN, inf among them for floats): what rows never written must keep."""
    raw = rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


# --- NVFP4 ----------------------------------------------------------------------------------------------

# Each value's e2m1 code, read off the format (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code; sign bit 3).
E2M1_CASES = [(0.0, 0), (0.25, 0), (0.26, 1), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2), (1.3, 3), (1.75, 4),
              (2.5, 4), (2.6, 5), (3.5, 6), (4.9, 6), (5.0, 6), (5.01, 7), (6.0, 7), (1e30, 7), (-0.0, 8),
              (-0.75, 10), (-5.5, 15), (float("nan"), 0)]


@pytest.mark.parametrize("value,code", E2M1_CASES)
def test_e2m1_code_of_each_tie(value, code):
    assert int(rq.e2m1_codes(np.float32(value))) == code
    if HAS["torch"]:  # the MLX job has no torch: the model is still checked there
        import torch

        assert int(port.fi_quantize_e2m1(torch.tensor([value], dtype=torch.float32))[0]) == code


def nvfp4_rows(rng, T, D, dtype):
    """Rows whose 16-blocks cover every case of the block quantizer (global scale 0.5 in the tests)."""
    x = rng.standard_normal((T, H, D)) * 10.0 ** rng.uniform(-4, 4, (T, H, D // 16, 1)).repeat(16, -1).reshape(T, H, D)
    blocks = x.reshape(T * H * D // 16, 16)
    # amax 3 = 6 * sf * gs with sf = 1 exact: the others sit on every tie (times sf * gs = 0.5), both signs.
    ties = np.array([3.0, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -0.125, -0.375, -0.625, -0.875, -1.25,
                     -1.75, -2.5, 0.0])
    # Block scales on e4m3 ties (amax = 6 * 0.5 * the midpoint): 1.0625 rounds down to 1.0, 1.1875 up to 1.25.
    scale_ties = [np.r_[3.1875, np.linspace(-1, 1, 15)], np.r_[-3.5625, np.linspace(-1, 1, 15)]]
    special = [ties, np.zeros(16), -np.zeros(16), np.full(16, 1e-6), np.full(16, -4000.0), np.linspace(-7, 7, 16),
               np.full(16, 0.01), *scale_ties]
    for i, b in enumerate(special[: len(blocks)]):
        blocks[i] = b
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_nvfp4_writes_as_flashinfer(pool, dtype):
    torch = pytest.importorskip("torch")
    kv_layout, page_size, layers, layer = POOLS[pool]
    rng = np.random.default_rng(zlib.crc32(f"{pool}-{dtype}".encode()))
    T, D, gs = 7, 64, 0.5
    rows = nvfp4_rows(rng, T, D, {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype])
    slots = make_slots(rng, T, NUM_SLOTS)
    data0 = random_bytes(rng, pool_shape(kv_layout, page_size, layers, D // 2), np.uint8)
    sf0 = random_bytes(rng, pool_shape(kv_layout, page_size, layers, D // 16), ml_dtypes.float8_e4m3fn)

    want_data, want_sf = rq.write_rows((data0, sf0), rq.nvfp4_rows(rows, gs), slots, kv_layout=kv_layout, layer=layer)

    # FlashInfer's kernel takes paged caches: a flat pool is pages of one row; a stacked pool, one layer's view.
    data, sf = torch.from_numpy(data0.copy()), torch.from_numpy(sf0.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    d, s = (data, sf) if layer is None else (data[layer], sf[layer])
    if kv_layout is None:
        d, s = d[:, None], s[:, None]
    key = torch.from_numpy(rows.astype(np.float32)).to(getattr(torch, dtype))
    port.fi_append_slot_mapping(key, torch.from_numpy(slots), d, s, gs, kv_layout or "NHD")
    assert_same_bits("data", data.numpy(), want_data)
    assert_same_bits("block scales", sf.view(torch.uint8).numpy(), want_sf.view(np.uint8))
    written = np.unique(slots[slots >= 0])
    assert len(written) and not np.array_equal(want_data, data0), "the case writes nothing"


def test_nvfp4_scale_cases_reached():
    """The special blocks reach what they are for: sf exactly 1, zero (all zero, or e4m3 underflow), saturated
    at 448, an e4m3 subnormal, and both ways of an e4m3 tie."""
    rows = nvfp4_rows(np.random.default_rng(0), 7, 64, np.float16)
    _, sf = rq.nvfp4_rows(rows, 0.5)
    sf = sf.reshape(-1).astype(np.float32)
    assert sf[0] == 1.0 and sf[1] == 0.0 and sf[3] == 0.0 and sf[4] == 448.0 and 0 < sf[6] < 2.0**-6
    assert sf[7] == 1.0 and sf[8] == 1.25


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_nvfp4_array_math_as_model(framework):
    """ropepool's NVFP4 store math (formats/nvfp4.py) on torch and MLX == the model, every byte."""
    pytest.importorskip(framework if framework == "torch" else "mlx.core")
    from ropepool.formats import nvfp4

    rows = nvfp4_rows(np.random.default_rng(3), 33, 128, ml_dtypes.bfloat16).astype(np.float32)
    want_data, want_sf = rq.nvfp4_rows(rows, 0.37)
    if framework == "torch":
        import torch

        from ropepool.backends.torch_arrays import TorchOps

        data, sf = nvfp4.nvfp4(torch.from_numpy(rows), torch.tensor(0.37), TorchOps)
        data, sf = data.numpy(), sf.numpy()
    else:
        import mlx.core as mx

        from ropepool.backends.mlx_arrays import MlxOps

        data, sf = nvfp4.nvfp4(mx.array(rows), mx.array(0.37), MlxOps)
        data, sf = np.array(data), np.array(sf)
    assert_same_bits("data", data, want_data)
    assert_same_bits("block scales", sf, want_sf.view(np.uint8))


@pytest.mark.parametrize("group_size", AFFINE_GROUP_SIZES)
@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_affine_torch_math_as_model(dtype, bits, group_size):
    """ropepool's torch affine math == the model of mx.quantize (checked against mx.quantize above)."""
    torch = pytest.importorskip("torch")
    from ropepool.formats import affine

    rows = affine_rows_input(np.random.default_rng(bits + group_size), 9, 128, dtype)
    words, scales, biases = affine.torch_quantize(torch.from_numpy(rows.astype(np.float32)), bits, group_size,
                                                    getattr(torch, dtype))
    want = rq.affine_rows(rows, bits, group_size)
    assert_same_bits("words", words.numpy().view(np.uint32), want[0])
    for name, got, w in (("scales", scales, want[1]), ("biases", biases, want[2])):
        if got.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own
            got = got.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        assert_same_bits(name, got.numpy() if isinstance(got, torch.Tensor) else got, w)


# --- affine (mx.quantize, mlx-lm's QuantizedKVCache) ----------------------------------------------------

AFFINE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def affine_rows_input(rng, T, D, dtype):
    x = rng.standard_normal((T, H, D)) * 10.0 ** rng.uniform(-3, 3, (T, H, 1))
    x[0, 0, :32] = 0.0  # a constant group: the scale's floor (1e-7) and a zero bias
    x[0, 1, :32] = np.linspace(-1, 3, 32)  # max edge larger: the negative-scale branch
    x[-1, 0, :] = 2.5  # q0 == 0 never: an edge exactly representable
    return x.astype(AFFINE_DTYPES[dtype])


@pytest.mark.parametrize("group_size", AFFINE_GROUP_SIZES)
@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("dtype", list(AFFINE_DTYPES))
def test_affine_rows_as_mx_quantize(dtype, bits, group_size):
    pytest.importorskip("mlx.core")
    rows = affine_rows_input(np.random.default_rng(bits * group_size), 9, 128, dtype)
    for name, got, want in zip(("words", "scales", "biases"), rq.affine_rows(rows, bits, group_size),
                               port.mlx_affine_rows(rows, bits, group_size)):
        assert got.dtype == want.dtype, f"{name}: {got.dtype} vs {want.dtype}"
        assert_same_bits(name, got, want)


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("pool", list(POOLS))
def test_affine_writes_as_mlx(pool, bits):
    pytest.importorskip("mlx.core")
    kv_layout, page_size, layers, layer = POOLS[pool]
    rng = np.random.default_rng(zlib.crc32(f"{pool}-{bits}".encode()))
    T, D, g = 5, 128, 64
    rows = affine_rows_input(rng, T, D, "bfloat16")
    slots = make_slots(rng, T, NUM_SLOTS)
    parts = (random_bytes(rng, pool_shape(kv_layout, page_size, layers, D * bits // 32), np.uint32),
             random_bytes(rng, pool_shape(kv_layout, page_size, layers, D // g), ml_dtypes.bfloat16),
             random_bytes(rng, pool_shape(kv_layout, page_size, layers, D // g), ml_dtypes.bfloat16))
    got = rq.write_rows(parts, rq.affine_rows(rows, bits, g), slots, kv_layout=kv_layout, layer=layer)
    want = [port.scatter(p, r, slots, kv_layout, layer) for p, r in zip(parts, port.mlx_affine_rows(rows, bits, g))]
    for name, a, b in zip(("words", "scales", "biases"), got, want):
        assert_same_bits(name, a, b)
