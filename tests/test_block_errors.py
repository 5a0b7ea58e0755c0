"""Misuses of block-quantized (tuple) pools: each raises before anything is written, naming the array.

Every case starts from a valid call (which runs), changes one thing, and
checks the error's type and words, and that no array of either cache changed.
The messages are rows of docs/errors.md (tests/test_errors.py keeps them in step).
"""
from __future__ import annotations

import numpy as np
import pytest

import ropepool

torch = pytest.importorskip("torch")

T, H, HQ, D = 3, 2, 4, 64


def nvfp4_cache(dt=torch.float8_e4m3fn, data_last=D // 2, sf_last=D // 16, rows=8):
    return (torch.full((rows, H, data_last), 7, dtype=torch.uint8),
            torch.full((rows, H, sf_last), 0.5).to(dt))


def affine_cache(bits=4, groups=D // 64, dtype=torch.float32, words=None, rows=8):
    words = D * bits // 32 if words is None else words
    return (torch.full((rows, H, words), 7, dtype=torch.uint32), torch.ones(rows, H, groups, dtype=dtype),
            torch.zeros(rows, H, groups, dtype=dtype))


def call(k_pool, v_pool, **kw):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (HQ, H, H))
    return ropepool.rope_pool_fused(q, k, v, torch.arange(T), torch.tensor([1, -1, 4]), k_pool, v_pool,
                                    head_dim=D, num_qo_heads=HQ, num_kv_heads=H, **kw)


G = {"k_scale": 1.0, "v_scale": 1.0}  # NVFP4's global scales
CASES = {
    # name: (k_pool, v_pool, keywords, error type, words the message starts with)
    "one-tuple": (nvfp4_cache(), torch.zeros(8, H, D), G, ValueError,
                  "k_pool and v_pool must both be tuples"),
    "four-arrays": (nvfp4_cache() * 2, nvfp4_cache() * 2, {}, ValueError, "k_pool as a tuple must hold"),
    "mixed-formats": (nvfp4_cache(), affine_cache(), {}, ValueError, "k_pool and v_pool must be caches of one"),
    "not-a-tensor": ((nvfp4_cache()[0], np.zeros((8, H, D // 16), np.uint8)), nvfp4_cache(), {}, TypeError,
                     "k_pool[1] must be a torch.Tensor"),
    "nvfp4-data-dtype": (nvfp4_cache()[:1] + nvfp4_cache()[1:], (torch.zeros(8, H, D // 2, dtype=torch.int8),
                         nvfp4_cache()[1]), G, ValueError,
                         "v_pool[0] (data) must have dtype uint8"),
    "nvfp4-data-last-dim": (nvfp4_cache(data_last=D), nvfp4_cache(data_last=D), {"k_scale": 1.0, "v_scale": 1.0},
                            ValueError, "k_pool[0] (data) must have a last dim of 32"),
    "nvfp4-block-of-32": (nvfp4_cache(sf_last=D // 32), nvfp4_cache(sf_last=D // 32),
                          G, ValueError, "k_pool[1] (block scales) must have a last dim of 4"),
    "nvfp4-scale-dtype": (nvfp4_cache(dt=torch.float32), nvfp4_cache(dt=torch.float32),
                          G, ValueError, "k_pool[1] (block scales) must have dtype float8_e4m3fn"),
    "nvfp4-no-global-scale": (nvfp4_cache(), nvfp4_cache(), {}, ValueError, "a nvfp4 pool needs k_scale= and v_scale="),
    "nvfp4-rows-differ": ((nvfp4_cache()[0], nvfp4_cache(rows=4)[1]), nvfp4_cache(),
                          G, ValueError, "k_pool[1] (block scales) must have k_pool[0]'s shape"),
    "affine-bits-2": (affine_cache(bits=2), affine_cache(bits=2), {}, ValueError,
                      "k_pool[0] (words) must have a last dim of head_dim * bits // 32"),
    "affine-words-dtype": ((torch.zeros(8, H, 8, dtype=torch.int32),) + affine_cache()[1:], affine_cache(), {},
                           ValueError, "k_pool[0] (words) must have dtype uint32"),
    "affine-group-16": (affine_cache(groups=D // 16), affine_cache(groups=D // 16), {}, ValueError,
                        "k_pool[1] (scales) must have head_dim // group_size entries"),
    "affine-scales-dtype": (affine_cache(dtype=torch.float16), affine_cache(dtype=torch.float16), {}, ValueError,
                            "k_pool[1] (scales) must have dtype float32"),
    "affine-k-bits-4-v-bits-8": (affine_cache(bits=4), affine_cache(bits=8), {}, ValueError,
                                 "k_pool and v_pool must be caches of one format"),
    "affine-with-k-scale": (affine_cache(), affine_cache(), G, ValueError,
                            "k_scale/v_scale are for float8 pools"),
    "with-scale-caches": (affine_cache(), affine_cache(), {"k_scale_cache": torch.ones(8, H),
                          "v_scale_cache": torch.ones(8, H)}, ValueError, "k_scale_cache/v_scale_cache are for int8"),
    # The kernel quantizes k_rot read back from k_out: not from an fp8 k_out (the torch code takes it).
    "triton-nvfp4-fp8-k-out": (nvfp4_cache(), nvfp4_cache(), {**G, "backend": "triton", "k_scale": 1.0,
                               "k_out": torch.empty(T, H, D, dtype=torch.float8_e4m3fn), "k_out_scale": 1.0},
                               ValueError, "backend 'triton' cannot run this call: it does not take "
                               "['k_out.scaled', 'pool.nvfp4'] together"),
    "triton-affine-fp8-k-out": (affine_cache(), affine_cache(), {"backend": "triton", "k_out": torch.empty(
                                T, H, D, dtype=torch.float8_e4m3fn), "k_out_scale": 1.0}, ValueError,
                                "backend 'triton' cannot run this call: it does not take "
                                "['k_out.scaled', 'pool.affine'] together"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_before_writing(name):
    k_pool, v_pool, kw, error, words = CASES[name]
    before = [x.clone() for x in (*k_pool, *v_pool) if isinstance(x, torch.Tensor)] if isinstance(v_pool, tuple) \
        else None
    with pytest.raises(error) as info:
        call(k_pool, v_pool, **kw)
    assert str(info.value).startswith(words), str(info.value)
    assert "Fix:" in str(info.value)
    if before is not None:
        after = [x for x in (*k_pool, *v_pool) if isinstance(x, torch.Tensor)]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after)), \
            "a cache changed although the call raised"


def test_valid_calls_write():
    """The cases' starting points are valid: both formats run and write slot 1."""
    for k_pool, v_pool, kw in ((nvfp4_cache(), nvfp4_cache(), {"k_scale": 1.0, "v_scale": 1.0}),
                               (affine_cache(), affine_cache(), {})):
        before = k_pool[0].clone()
        call(k_pool, v_pool, **kw)
        assert not torch.equal(k_pool[0][1], before[1]) and torch.equal(k_pool[0][0], before[0])


def test_a_remembered_layout_still_checks_every_array():
    """Calls with tuple pools are remembered by the layout cache (their first arrays guarded, the others'
    layouts in the key): a later call whose other arrays differ is checked in full again, and raises."""
    from ropepool import plan

    good = affine_cache()
    for _ in range(2):  # the second call finds the first one's runner
        call(good, affine_cache())
    hits = []
    real = plan.lookup
    plan.lookup = lambda *a: hits.append(real(*a)) or hits[-1]
    try:
        call(good, affine_cache())
        assert hits[-1] is not None, "a repeated block-quantized call was checked in full again"
        bad = (good[0], good[1].to(torch.float16), good[2])  # scales of another dtype, same shapes
        with pytest.raises(ValueError, match=r"k_pool\[1\] \(scales\) must have dtype float32"):
            call(bad, affine_cache())
        assert hits[-1] is None
    finally:
        plan.lookup = real
