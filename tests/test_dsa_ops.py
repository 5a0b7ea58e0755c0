"""DeepSeek V3.2's two caches written by the ops: ``rope_latent_fused(..., cache_format="fp8_ds_mla")`` and
``rope_indexer_fused``, on every backend that takes them, against the ports of vLLM's writers (tests/vllm_dsa.py).

Each call starts from a cache of random bytes. The rotations must match the float64 oracle
(``ropepool.reference.dsa``) within the dtype's tolerance, and the whole cache must equal, byte for byte,
what vLLM's writer makes of the same poisoned cache, given kv_c and the k the op returned: so the written
rows hold exactly vLLM's bytes of the returned rotation, and every other byte is untouched. Misuse
raises before anything is written.
"""
import re

import ml_dtypes
import numpy as np
import pytest

import ropepool
from ropepool import RopePoolError, RopeSpec
from ropepool.reference import dsa as reference_dsa
from tests.harness import TOL, Backend, make_positions, make_slots, randn
from tests.test_dsa_bytes import poison, scaled_rows

torch = pytest.importorskip("torch")
from tests import vllm_dsa  # noqa: E402  (needs torch)

MLA_ROPE = RopeSpec(head_dim=64, style="gptj", base=10000.0)
INDEXER_ROPE = RopeSpec(head_dim=128, rotary_dim=64, base=10000.0)
# (kv_layout, layer, cache shape without the row, the cache as vLLM's [blocks, block_size, W] writer sees it)
LAYOUTS = {"flat": (None, None, (21,), lambda c: c[:, None]),
           "paged": ("NHD", None, (5, 4), lambda c: c),
           "layers": ("NHD", -1, (2, 3, 8), lambda c: c[-1])}


@pytest.fixture(params=["torch", "torch-general", "triton"])
def backend(request, monkeypatch):
    """The torch backend: on CPU its native kernel (torch_native), and (torch-general) the general code, torch_eager,
    which runs these calls on other devices; the Triton kernel (fp8_ds_mla only; on CPU under its interpreter)."""
    from ropepool import backends, plan
    from tests.harness import backend_for

    plan.forget()  # no runner of the other variant from the layout cache
    if request.param == "torch-general":
        monkeypatch.setattr(backends, "BACKENDS", tuple(b for b in backends.BACKENDS if b.module != ".torch_native"))
    return backend_for(request.param.split("-")[0])


def _close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=TOL[dtype] * max(1, np.abs(want).max()))


def _rows_of(pool_shape, kv_layout):
    return int(np.prod(pool_shape[-2:])) if kv_layout else pool_shape[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ds_mla_rows_are_vllms(rng, backend, dtype, layout):
    kv_layout, layer, shape, as_vllm = LAYOUTS[layout]
    T = 9
    q_pe, k_pe = randn(rng, T, 3, 64, dtype=dtype), randn(rng, T, 64, dtype=dtype)
    kv_c = scaled_rows(rng, T, 512, dtype)
    positions, slots = make_positions(rng, T, 8192), make_slots(rng, T, _rows_of(shape, kv_layout))
    cache = poison(rng, shape + (656,))
    b = backend
    got = ropepool.rope_latent_fused(b.array(q_pe), b.array(k_pe), b.array(kv_c), b.array(positions),
                                     b.array(slots), out := b.array(cache), None, rope=MLA_ROPE, kv_layout=kv_layout,
                                     layer=layer, cache_format="fp8_ds_mla", backend=b.name)
    q_ref, k_ref, _ = reference_dsa.rope_latent_ds_mla(q_pe, k_pe, kv_c, positions, slots, cache, rope=MLA_ROPE,
                                                       kv_layout=kv_layout, layer=layer)
    _close(b.numpy(got[0]), q_ref, dtype)
    _close(b.numpy(got[1]), k_ref, dtype)
    assert got[2] is out and got[3] is None
    want = torch.from_numpy(cache.copy())
    vllm_dsa.concat_and_cache_ds_mla(Backend("torch", "cpu").array(kv_c), got[1].cpu(), as_vllm(want),
                                     torch.from_numpy(slots))
    np.testing.assert_array_equal(b.numpy(out), want.numpy())


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexer_keys_are_vllms(rng, backend, scale_fmt, dtype, layout):
    kv_layout, layer, shape, as_vllm = LAYOUTS[layout]
    T = 11
    q, k = randn(rng, T, 4, 128, dtype=dtype), scaled_rows(rng, T, 128, dtype)
    positions, slots = make_positions(rng, T, 8192), make_slots(rng, T, _rows_of(shape, kv_layout))
    cache = poison(rng, shape + (132,))
    b = backend
    got = ropepool.rope_indexer_fused(b.array(q), b.array(k), b.array(positions), b.array(slots),
                                      out := b.array(cache), rope=INDEXER_ROPE, scale_fmt=scale_fmt,
                                      kv_layout=kv_layout, layer=layer, backend=b.name)
    q_ref, k_ref, _ = reference_dsa.rope_indexer(q, k, positions, slots, cache, rope=INDEXER_ROPE,
                                                 scale_fmt=scale_fmt, kv_layout=kv_layout, layer=layer)
    _close(b.numpy(got[0]), q_ref, dtype)
    _close(b.numpy(got[1]), k_ref, dtype)
    assert got[2] is out
    want = torch.from_numpy(cache.copy())
    vllm_dsa.indexer_k_quant_and_cache(got[1].cpu(), as_vllm(want), torch.from_numpy(slots), 128, scale_fmt)
    np.testing.assert_array_equal(b.numpy(out), want.numpy())


def _ds_mla_call(rng, **change):
    args = dict(q_pe=randn(rng, 3, 2, 64, dtype="bfloat16"), k_pe=randn(rng, 3, 64, dtype="bfloat16"),
                kv_c=randn(rng, 3, 512, dtype="bfloat16"), cache=poison(rng, (8, 656)), kpe_cache=None,
                kw={"cache_format": "fp8_ds_mla"})
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    ({"cache": np.zeros((8, 576), np.uint8)}, "fp8_ds_mla rows must be uint8 [..., 656]"),
    ({"kv_c": np.zeros((3, 256), np.float32).astype(ml_dtypes.bfloat16)},
     "fp8_ds_mla needs kv_lora_rank 512 and rope_dim 64"),
    ({"kpe_cache": np.zeros((8, 64), np.uint8)}, "rope_latent_fused with cache_format='fp8_ds_mla' writes k_pe"),
    ({"kw": {"cache_format": "fp8_ds_mla", "scale": 0.5}}, "rope_latent_fused with cache_format='fp8_ds_mla' "
                                                           "computes a scale per tile"),
    ({"kw": {"cache_format": "fp8"}}, "rope_latent_fused cache_format must be None or 'fp8_ds_mla'")])
def test_ds_mla_misuse_writes_nothing(rng, change, message):
    a = _ds_mla_call(rng, **change)
    b = Backend("torch", "cpu")
    cache = b.array(a["cache"])
    before = cache.clone()
    with pytest.raises(RopePoolError, match="^" + re.escape(message)):
        ropepool.rope_latent_fused(b.array(a["q_pe"]), b.array(a["k_pe"]), b.array(a["kv_c"]), b.array(np.arange(3)),
                                   b.array(np.arange(3)), cache, b.array(a["kpe_cache"]), rope=MLA_ROPE, **a["kw"])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("kw, width, message", [
    ({"scale_fmt": "e8m0"}, 132, "rope_indexer_fused scale_fmt must be None or 'ue8m0'"),
    ({"quant_block_size": 64}, 132, "rope_indexer_fused quantizes the indexer key in groups of 128 values"),
    ({}, 136, "the indexer cache must be uint8 [..., 132] for head_dim 128")])
def test_indexer_misuse_writes_nothing(rng, kw, width, message):
    b = Backend("torch", "cpu")
    cache = b.array(poison(rng, (8, width)))
    before = cache.clone()
    with pytest.raises(RopePoolError, match="^" + re.escape(message)):
        ropepool.rope_indexer_fused(b.array(randn(rng, 3, 2, 128, dtype="bfloat16")),
                                    b.array(randn(rng, 3, 128, dtype="bfloat16")), b.array(np.arange(3)),
                                    b.array(np.arange(3)), cache, rope=INDEXER_ROPE, **kw)
    assert torch.equal(cache, before)


def test_layout_cache_tells_caches_apart(rng, monkeypatch):
    """A second call with a bigger cache is not the first call's layout (the guards check arguments by position:
    the absent v and v pool of the indexer, the absent kpe cache of fp8_ds_mla, keep their places), and a call
    like an earlier one is not checked again."""
    from ropepool.checks import validate

    checked = []
    for name in ("check_indexer", "check_latent"):
        real = getattr(validate, name)
        monkeypatch.setattr(validate, name, lambda *a, _real=real, **kw: checked.append(1) or _real(*a, **kw))
    b = Backend("torch", "cpu")
    for rows in (8, 21, 21):  # slot rows - 1: past the first cache
        q, k = randn(rng, 3, 2, 128, dtype="bfloat16"), randn(rng, 3, 128, dtype="bfloat16")
        ropepool.rope_indexer_fused(b.array(q), b.array(k), b.array(np.arange(3)), b.array(np.array([0, rows - 1, 5])),
                                    b.array(poison(rng, (rows, 132))), rope=INDEXER_ROPE)
        q_pe, k_pe = randn(rng, 3, 2, 64, dtype="bfloat16"), randn(rng, 3, 64, dtype="bfloat16")
        ropepool.rope_latent_fused(b.array(q_pe), b.array(k_pe), b.array(randn(rng, 3, 512, dtype="bfloat16")),
                                   b.array(np.arange(3)), b.array(np.array([0, rows - 1, 5])),
                                   b.array(poison(rng, (rows, 656))), None, rope=MLA_ROPE, cache_format="fp8_ds_mla")
    assert len(checked) == 4  # 8 rows: checked; 21 rows: checked; 21 rows again: found


def test_refusals_write_nothing(rng):
    """MLX arrays (no views of a byte row) and an indexer cache whose pages are not one run of bytes."""
    b = Backend("torch", "cpu")
    cache = b.array(poison(rng, (4, 8, 264)))[..., :132]  # rows 264 bytes apart: pages are not contiguous
    before = cache.clone()
    with pytest.raises(RopePoolError, match="^rope_indexer_fused expects each page of the indexer cache to be"):
        ropepool.rope_indexer_fused(b.array(randn(rng, 3, 2, 128, dtype="bfloat16")),
                                    b.array(randn(rng, 3, 128, dtype="bfloat16")), b.array(np.arange(3)),
                                    b.array(np.arange(3)), cache, rope=INDEXER_ROPE, kv_layout="NHD")
    assert torch.equal(cache, before)
    mx = pytest.importorskip("mlx.core")
    m = Backend("mlx")
    message = "^DeepSeek V3.2's caches .fp8_ds_mla rows, the indexer's keys. are for torch tensors"
    with pytest.raises(TypeError, match=message):
        ropepool.rope_indexer_fused(m.array(randn(rng, 3, 2, 128, dtype="bfloat16")),
                                    m.array(randn(rng, 3, 128, dtype="bfloat16")), mx.arange(3), mx.arange(3),
                                    mx.zeros((8, 132), dtype=mx.uint8), rope=INDEXER_ROPE)
    with pytest.raises(TypeError, match=message):
        ropepool.rope_latent_fused(m.array(randn(rng, 3, 2, 64, dtype="bfloat16")),
                                   m.array(randn(rng, 3, 64, dtype="bfloat16")),
                                   m.array(randn(rng, 3, 512, dtype="bfloat16")), mx.arange(3), mx.arange(3),
                                   mx.zeros((8, 656), dtype=mx.uint8), None, rope=MLA_ROPE, cache_format="fp8_ds_mla")
