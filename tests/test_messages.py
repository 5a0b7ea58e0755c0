"""Messages that say what is actually wrong: the pool checks for any combination of wrong pools, and the
others a newcomer met (QKNorm's sizes, the fix for a non-array in an MLX call, the large-position warning).

Hypothesis draws, for k_pool and v_pool separately, what is wrong with each
(rank, KV head count, head_dim, pool size, dtype; any number of them, the same
or different for the two pools) in each pool layout, on PyTorch and on MLX.
Whatever it draws, the message must be true of the call: the kind of error
(rank, head shape, K/V mismatch, dtype) is one the pools have, every pool it
names is wrong in that way, every shape it prints is the real shape of the
pool named just before it, it never says two equal shapes or dtypes must
match, and nothing was written. The messages start as the seed's do
(``rope_pool_fused expects pool tensors to be 3-D``, ``k_pool has
incompatible shape``, ``v_pool shape must match k_pool shape``, ``pool dtypes
must match q/k/v dtype``).
"""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ropepool
from tests.harness import HAS, NP_DTYPES, Backend, assert_same_bits, backend_for

T, HQ, HKV, D, SIZE, PAGE, LAYERS = 1, 4, 2, 8, 16, 4, 2
WRONG = ("rank", "heads", "head_dim", "size", "dtype")
LAYOUTS = ("flat", "NHD", "HND", "layer")
SHAPE = re.compile(r"(?<= )\[\d+(?:, \d+)*\]")  # a printed shape; "k_pool[0]" (indexing) has no space before
NAME = re.compile(r"\b[kv]_pool\b")


def pool_shape(layout, wrong: frozenset) -> list:
    heads = HKV + 1 if "heads" in wrong else HKV
    dim = 2 * D if "head_dim" in wrong else D
    size = 2 * SIZE if "size" in wrong else SIZE
    shape = {"flat": [size, heads, dim], "NHD": [size // PAGE, PAGE, heads, dim],
             "HND": [size // PAGE, heads, PAGE, dim], "layer": [LAYERS, size, heads, dim]}[layout]
    if "rank" in wrong:  # the last two dims merged, as a pool flattened to [pool_size, heads * dim]
        shape = shape[:-2] + [shape[-2] * shape[-1]]
    return shape


wrongs = st.frozensets(st.sampled_from(WRONG))


@pytest.mark.parametrize("fw", ["torch", "mlx"])
@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), k_wrong=wrongs, v_wrong=wrongs,
       dtypes=st.tuples(st.sampled_from(("float16", "bfloat16")), st.sampled_from(("float16", "bfloat16"))))
def test_pool_message_is_true(fw, layout, k_wrong, v_wrong, dtypes):
    X = backend_for(fw)
    rng = np.random.default_rng(0)
    shapes = {"k_pool": pool_shape(layout, k_wrong), "v_pool": pool_shape(layout, v_wrong)}
    dts = {"k_pool": dtypes[0] if "dtype" in k_wrong else "float32",
           "v_pool": dtypes[1] if "dtype" in v_wrong else "float32"}
    given_ = {n: rng.standard_normal(shapes[n]).astype(np.float32).astype(NP_DTYPES[dts[n]]) for n in shapes}
    given_.update(q=rng.standard_normal((T, HQ, D)).astype(np.float32),
                  k=rng.standard_normal((T, HKV, D)).astype(np.float32),
                  v=rng.standard_normal((T, HKV, D)).astype(np.float32),
                  positions=np.array([5], np.int32), slots=np.array([3], np.int32))
    a = {n: X.array(x) for n, x in given_.items()}
    kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, kv_layout=layout if layout in ("NHD", "HND") else None,
              layer=1 if layout == "layer" else None)
    args = [a[n] for n in ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")]
    if not (k_wrong | v_wrong) - {"size"} and ("size" in k_wrong) == ("size" in v_wrong):
        ropepool.rope_pool_fused(*args, **kw)  # the valid call (any pool size, the same for both) passes
        return
    with pytest.raises(ValueError) as info:
        ropepool.rope_pool_fused(*args, **kw)
    for n, x in given_.items():  # nothing written
        assert_same_bits(n, X.numpy(a[n]), x)
    check_message(str(info.value), shapes, dts, {"k_pool": k_wrong, "v_pool": v_wrong})


def check_message(msg, shapes, dts, wrong):
    said = msg.split(" Fix:")[0]  # what the message says is wrong (the fix may name pools to change)
    named = set(NAME.findall(said))
    for m in SHAPE.finditer(said):  # every shape printed is the real shape of the pool named before it
        owner = NAME.findall(said[:m.start()])
        assert owner and m.group() == str(shapes[owner[-1]]), (msg, shapes)
    ranked = {n for n in wrong if "rank" in wrong[n]}
    headed = {n for n in wrong if wrong[n] & {"heads", "head_dim"}}
    if msg.startswith("rope_pool_fused expects pool tensors to be"):
        assert ranked and named == ranked, (msg, wrong)
    elif msg.startswith("k_pool has incompatible shape"):
        assert not ranked and "k_pool" in headed and named == headed, (msg, wrong)
    elif msg.startswith("v_pool shape must match k_pool shape"):
        assert not ranked and "k_pool" not in headed, (msg, wrong)
        assert shapes["v_pool"] != shapes["k_pool"], msg  # never a mismatch between equal shapes
    elif msg.startswith("pool dtypes must match q/k/v dtype"):
        assert not ranked | headed and shapes["k_pool"] == shapes["v_pool"], (msg, wrong)
        assert named == {n for n in wrong if "dtype" in wrong[n]}, (msg, wrong)
        if len(named) == 2 and dts["k_pool"] == dts["v_pool"]:
            assert f"k_pool and v_pool {dts['k_pool']}" in said, msg
        else:
            assert all(f"{n} {dts[n]}" in said for n in named), msg
    elif msg.startswith("pool dtypes must match each other"):
        assert dts["k_pool"] != dts["v_pool"], msg
    else:
        pytest.fail(f"a message the pool checks should not give here: {msg} ({wrong})")


def test_both_pools_wrong_the_same_way():
    """The issue's case: both pools [32, 2, 256] with head_dim=128 are no K/V mismatch."""
    X = backend_for("mlx" if not HAS["torch"] else "torch")
    pools = [X.array(np.zeros((32, 2, 256), np.float32)) for _ in range(2)]
    q, k = X.array(np.zeros((1, 2, 128), np.float32)), X.array(np.zeros((1, 2, 128), np.float32))
    idx = X.array(np.zeros(1, np.int32))
    with pytest.raises(ValueError) as info:
        ropepool.rope_pool_fused(q, k, k, idx, idx, *pools, head_dim=128, num_qo_heads=2, num_kv_heads=2)
    msg = str(info.value)
    assert msg.startswith("k_pool has incompatible shape [32, 2, 256]: expected [pool_size, num_kv_heads, head_dim] "
                          "with num_kv_heads=2, head_dim=128 (v_pool too, of the same shape). Fix: "), msg


def test_qknorm_sizes_say_norms_over_all_heads():
    """q/k norms over all heads (OLMo 2's, 32 x 128 and 8 x 128) are not two layers' norms."""
    with pytest.raises(ValueError) as info:
        ropepool.QKNorm(np.ones(4096, np.float32), np.ones(1024, np.float32))
    msg = str(info.value)
    assert "got 4096 and 1024" in msg and "span all heads" in msg and "of one layer" not in msg, msg


def test_convert_hint_is_the_calls_framework():
    """A list among MLX arrays is to become an mx.array, not a torch tensor."""
    X = backend_for("mlx")
    q = X.array(np.zeros((1, 2, 8), np.float32))
    pool = X.array(np.zeros((4, 2, 8), np.float32))
    with pytest.raises(TypeError) as info:
        ropepool.rope_pool_fused(q, q, q, X.array(np.zeros(1, np.int32)), [0], pool, pool, head_dim=8,
                                 num_qo_heads=2, num_kv_heads=2)
    assert str(info.value).endswith("Fix: convert it, e.g. mx.array(x)."), info.value


def test_convert_hint_without_torch():
    """With no torch installed (None in sys.modules), lists everywhere are told of mx.array only."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]')")
    code = ("import sys; sys.modules['torch'] = None\nimport ropepool\n"
            "try:\n    ropepool.rope_pool_fused([[[0.0]]], [[[0.0]]], [[[0.0]]], [0], [0], [[[0.0]]], [[[0.0]]], "
            "head_dim=2, num_qo_heads=1, num_kv_heads=1)\nexcept TypeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Fix: convert it, e.g. mx.array(x)." in out.stdout and "torch" not in out.stdout, out


def test_large_position_warning_says_2_24():
    # Positions are read on the host only (a CUDA call reads no values): CPU arrays, also on a GPU machine.
    X = Backend("torch", "cpu") if HAS["torch"] else backend_for("mlx")
    q = X.array(np.zeros((1, 2, 8), np.float32))
    pools = [X.array(np.zeros((4, 2, 8), np.float32)) for _ in range(2)]
    idx = X.array(np.zeros(1, np.int32))
    with pytest.warns(RuntimeWarning, match=r"^positions above 2\^24 = 16777216 \(the largest given: 20000000\): "):
        ropepool.rope_pool_fused(q, q, q, X.array(np.array([20_000_000], np.int32)), idx, *pools, head_dim=8,
                                 num_qo_heads=2, num_kv_heads=2)


def test_float32_fix_in_the_frameworks_words():
    X = backend_for("mlx")
    with pytest.raises(ValueError, match=r"Fix: cos_sin_cache\.astype\(mx\.float32\)\.$"):
        ropepool.CosSinCache(X.array(np.zeros((8, 4), np.int32)), is_neox=True)
