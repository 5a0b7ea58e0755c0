"""rope_pool_fused into block-quantized pools (NVFP4, MLX's affine 4/8-bit) on the torch path and MLX.

Each case passes pools full of random bytes and checks every byte of every
array of both caches:

- the written rows of the K cache hold exactly what the engine's own writer
  stores for the returned k_rot: FlashInfer's NVFP4 append kernel (the port in
  tests/quant_ports.py, shown equal to the oracle's model in
  tests/test_quant_formats.py) or ``mx.quantize`` itself followed by an
  engine-style scatter; the V cache the same for the given v, and equal to the
  float64 oracle's (``reference.rope_pool_fused`` with tuple pools);
- k_rot and q_rot agree with the oracle's rotation (the dtype's rounding);
- rows no token names (negative slots, other slots, other layers) keep their bytes.

Backends: the torch code, MLX and the Triton kernel (on the CPU under TRITON_INTERPRET=1, as conftest
sets it), each both formats.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import ropepool
from ropepool import reference
from tests import quant_ports as port
from tests.harness import NP_DTYPES, TOL, Backend, assert_same_bits, make_positions, make_slots, randn
from tests.params import BACKENDS
from tests.test_quant_formats import nvfp4_rows, pool_shape, random_bytes

# name: (kv_layout, page_size, layers, layer)
LAYOUTS = {"flat": (None, 1, None, None), "nhd": ("NHD", 4, None, None), "hnd-layers": ("HND", 2, 3, 1)}
FORMATS = {"nvfp4": None, "affine4": 4, "affine8": 8}
H, HQ, D, G = 2, 4, 64, 32


def parts_of(fmt, rng, layout, dtype):
    """The random-byte arrays of one cache (NumPy), in the tuple's order."""
    kv_layout, page_size, layers, _ = layout
    if fmt == "nvfp4":  # (MLX receives the block scales' bytes as uint8: to_fw)
        specs = ((D // 2, np.uint8), (D // 16, ml_dtypes.float8_e4m3fn))
    else:
        bits = FORMATS[fmt]
        specs = ((D * bits // 32, np.uint32), (D // G, NP_DTYPES[dtype]), (D // G, NP_DTYPES[dtype]))
    return tuple(random_bytes(rng, pool_shape(kv_layout, page_size, layers, last), t) for last, t in specs)


def to_fw(a, backend):
    """A NumPy array (bits kept) as one of ``backend``'s framework, on its device (torch: CUDA where the
    Triton backend runs there)."""
    if backend.framework == "mlx":
        return port.to_mx(a.view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a)
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        x = torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    elif a.dtype == ml_dtypes.float8_e4m3fn:
        x = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    elif a.dtype == np.uint32:
        x = torch.from_numpy(a.view(np.int32).copy()).view(torch.uint32)
    else:
        x = torch.from_numpy(a.copy())
    return x.to(backend.device)


def to_np(x, like):
    """A framework array back as NumPy with ``like``'s dtype (bits kept)."""
    if framework_of_np(x) == "mlx":
        return port.mx_to_np(x) if like.dtype == ml_dtypes.bfloat16 else np.array(x).view(like.dtype)
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[like.dtype.itemsize]
    return x.view(width).cpu().numpy().view(like.dtype)


def framework_of_np(x):
    return "mlx" if type(x).__module__.startswith("mlx") else "torch"


def engine_rows(fmt, rows, scale):
    """What the engine's writer stores for ``rows`` (NumPy, the row's dtype): a tuple of NumPy arrays."""
    if fmt == "nvfp4":
        import torch

        T = rows.shape[0]
        data = torch.zeros(T, 1, H, D // 2, dtype=torch.uint8)
        sf = torch.zeros(T, 1, H, D // 16, dtype=torch.float8_e4m3fn)
        x = torch.from_numpy(rows.astype(np.float32)).to(getattr(torch, str(rows.dtype)))
        port.fi_append_slot_mapping(x, torch.arange(T), data, sf, scale)
        return data[:, 0].numpy(), sf[:, 0].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return port.mlx_affine_rows(rows, FORMATS[fmt], G)


CASES = [(b, f, lay, dt) for b in BACKENDS for f in FORMATS for lay in LAYOUTS for dt in ("bfloat16", "float16")]


@pytest.mark.parametrize("backend,fmt,layout,dtype", [pytest.param(*c, id="-".join(c)) for c in CASES],
                         indirect=["backend"])
def test_block_pool_bytes(backend, fmt, layout, dtype):
    if fmt == "nvfp4":
        pytest.importorskip("torch")  # the NVFP4 writer's port is torch
    if fmt != "nvfp4":
        pytest.importorskip("mlx.core")  # the affine writer is mx.quantize
    rng = np.random.default_rng(zlib.crc32(f"{backend}{fmt}{layout}{dtype}".encode()))
    kv_layout, page_size, layers, layer = LAYOUTS[layout]
    T = 7
    q, k, v = (randn(rng, T, h, D, dtype=dtype, scale=3.0) for h in (HQ, H, H))
    if fmt == "nvfp4":  # V is not rotated: its blocks can sit on every rounding tie (v_scale 0.5), at the
        v = np.roll(nvfp4_rows(rng, T, D, NP_DTYPES[dtype]), 1, axis=0)  # tokens 1 and 2 (written: 0 is not)
    positions, slots = make_positions(rng, T), make_slots(rng, T, 16)  # every third token skipped, from 0
    k0, v0 = parts_of(fmt, rng, LAYOUTS[layout], dtype), parts_of(fmt, rng, LAYOUTS[layout], dtype)
    scales = {"k_scale": 0.25, "v_scale": 0.5} if fmt == "nvfp4" else {}
    kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=H, kv_layout=kv_layout, layer=layer, **scales)
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(
        *(to_fw(a, backend) for a in (q, k, v, positions, slots)), tuple(to_fw(a, backend) for a in k0),
        tuple(to_fw(a, backend) for a in v0), backend=backend.name, **kw)
    assert isinstance(kp, tuple) and len(kp) == len(k0)
    k_rot = to_np(k_rot, k)
    ref = reference.rope_pool_fused(q, k, v, positions, slots, k0, v0, **kw)
    for name, got, want in (("q_rot", to_np(q_rot, q), ref[0]), ("k_rot", k_rot, ref[1])):
        err = np.abs(got.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
        assert err < TOL[dtype], f"{name}: {err:.2e}"
    for cache, got, start, rows, scale in (("k", kp, k0, k_rot, scales.get("k_scale")),
                                           ("v", vp, v0, v, scales.get("v_scale"))):
        want = [port.scatter(p, r, slots, kv_layout, layer) for p, r in zip(start, engine_rows(fmt, rows, scale))]
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_bits(f"{cache}_pool[{i}]", to_np(g, w), w)
    for i, (g, w) in enumerate(zip(vp, ref[3])):  # V is not rotated: the oracle's bytes exactly
        assert_same_bits(f"v_pool[{i}] vs the oracle", to_np(g, w), w)


def test_nvfp4_pools_the_same_with_an_fp8_k_out():
    """With an fp8 k_out the pools still hold k_rot in k's dtype quantized (the torch code takes such calls
    on every device): the same bytes as the call without k_out."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    q, k, v = (torch.from_numpy(randn(rng, 5, h, D, scale=3.0)).bfloat16() for h in (HQ, H, H))
    positions, slots = torch.arange(5), torch.tensor([3, -1, 0, 9, 12])
    kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=H, k_scale=0.25, v_scale=0.5)
    cpu = Backend("torch", "cpu")
    pools = [tuple(to_fw(a, cpu) for a in parts_of("nvfp4", np.random.default_rng(8), LAYOUTS["flat"], "bfloat16"))
             for _ in range(4)]
    ropepool.rope_pool_fused(q, k, v, positions, slots, pools[0], pools[1], **kw)
    k_out = torch.empty(5, H, D, dtype=torch.float8_e4m3fn)
    ropepool.rope_pool_fused(q, k, v, positions, slots, pools[2], pools[3], k_out=k_out, k_out_scale=1.0, **kw)
    for a, b in zip(pools[0] + pools[1], pools[2] + pools[3]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_nvfp4_into_flashinfer_stacked_cache_views(backend):
    """FlashInfer's stacked NVFP4 cache, ``[pages, 2, page_size, H, D // 2]`` with its scales ``[pages, 2,
    page_size, H, D // 16]``, passed as the K and V views ``cache[:, 0]``, ``cache[:, 1]``: written through
    the views, every byte of both tensors as the FlashInfer port writes each half."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    pages, page, T = 4, 4, 6
    q, k, v = (backend.array(randn(rng, T, h, D, dtype="bfloat16", scale=3.0)) for h in (HQ, H, H))
    positions, slots = backend.array(make_positions(rng, T)), backend.array(make_slots(rng, T, pages * page))
    data = backend.array(random_bytes(rng, (pages, 2, page, H, D // 2), np.uint8))
    sf = backend.array(random_bytes(rng, (pages, 2, page, H, D // 16), ml_dtypes.float8_e4m3fn))
    want_data, want_sf = data.clone(), sf.clone()
    _, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, positions, slots, (data[:, 0], sf[:, 0]), (data[:, 1], sf[:, 1]),
                                              head_dim=D, num_qo_heads=HQ, num_kv_heads=H, kv_layout="NHD",
                                              k_scale=0.25, v_scale=0.5, backend=backend.name)
    for half, rows, scale in ((0, k_rot, 0.25), (1, v, 0.5)):
        port.fi_append_slot_mapping(rows.cpu(), slots.cpu(), want_data[:, half], want_sf[:, half], scale)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(sf.view(torch.uint8), want_sf.view(torch.uint8))


# (bits, group_size, head_dim, kv_layout): every group size mx.quantize has; 96 features pad the kernel's row
# tile to 128 (a group wholly outside the row).
AFFINE_SHAPES = [(4, 64, 128, None), (8, 128, 128, "NHD"), (4, 32, 96, "HND"), (8, 32, 96, None)]


@pytest.mark.parametrize("bits,group,dim,kv_layout", AFFINE_SHAPES)
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_affine_group_sizes(backend, bits, group, dim, kv_layout):
    """Affine pools of each group size and a head_dim that is no power of two: every byte of both caches as
    ``mx.quantize`` of the returned k_rot and of v, scattered (5 tokens, two of them skipped)."""
    pytest.importorskip("mlx.core")
    rng = np.random.default_rng(bits * 1000 + group + dim)
    T, page_size = 5, 1 if kv_layout is None else 4
    q, k, v = (randn(rng, T, h, dim, dtype="float16", scale=3.0) for h in (HQ, H, H))
    positions, slots = make_positions(rng, T), make_slots(rng, T, 16)
    specs = ((dim * bits // 32, np.uint32), (dim // group, np.float16), (dim // group, np.float16))
    k0, v0 = ([random_bytes(rng, pool_shape(kv_layout, page_size, None, n), t) for n, t in specs] for _ in "kv")
    _, k_rot, kp, vp = ropepool.rope_pool_fused(
        *(to_fw(a, backend) for a in (q, k, v, positions, slots)), tuple(to_fw(a, backend) for a in k0),
        tuple(to_fw(a, backend) for a in v0), head_dim=dim, num_qo_heads=HQ, num_kv_heads=H, kv_layout=kv_layout,
        backend=backend.name)
    for cache, got, start, rows in (("k", kp, k0, to_np(k_rot, k)), ("v", vp, v0, v)):
        want = [port.scatter(p, r, slots, kv_layout) for p, r in zip(start, port.mlx_affine_rows(rows, bits, group))]
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_bits(f"{cache}_pool[{i}]", to_np(g, w), w)
