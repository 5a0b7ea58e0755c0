"""The plan record between the checked call and the backends (plan/, core/stores.py, support.py).

- every keyword of the public signatures reaches the layout cache's key (a keyword left out of it would return
  the runner of another call: silently wrong results);
- a plan names the features its call uses, and its static key tells the calls that differ apart;
- a backend row gets only plans whose features it declares (``plan.features <= row.supports``);
- the kernels' arguments are named once (core/args.py): the Triton kernel's, the custom op's and MLX's
  graph's follow it.
"""
import inspect

import numpy as np
import pytest

import ropepool
from ropepool import QKNorm, RopeSpec, backends, plan
from ropepool.checks import validate
from ropepool.rotation.spec import CosSinCache

# The whole module needs torch (its parametrize lists hold tensors, built while collecting): in the MLX
# job it is skipped, not an error.
torch = pytest.importorskip("torch")

T, HQ, HKV, D, P = 2, 4, 2, 16, 8


def pool_args():
    q, k, v = (torch.randn(T, h, D) for h in (HQ, HKV, HKV))
    return (q, k, v, torch.arange(T), torch.arange(T), torch.zeros(P, HKV, D), torch.zeros(P, HKV, D)), \
        dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV)


def latent_args():
    arrays = (torch.randn(T, HQ, D), torch.randn(T, D), torch.randn(T, 32), torch.arange(T), torch.arange(T),
              torch.zeros(P, 32), torch.zeros(P, D))
    return arrays, dict(rope=RopeSpec(head_dim=D))


def indexer_args():
    """rope_indexer_fused's: DeepSeek V3.2's indexer key [T, 128] into a uint8 cache of 132-byte rows."""
    arrays = (torch.randn(T, HQ, 128), torch.randn(T, 128), torch.arange(T), torch.arange(T),
              torch.zeros(P, 132, dtype=torch.uint8))
    return arrays, dict(rope=RopeSpec(head_dim=128, rotary_dim=64))


def other_values(arrays):
    """For each keyword: values that make another call than its default (or the base call's) value."""
    q, k = arrays[0], arrays[1]  # (another call's: not in place)
    caches = torch.ones(P, HKV)
    return {
        "head_dim": [D + 2], "num_qo_heads": [HQ + 1], "num_kv_heads": [HKV + 1], "rope_base": [5e5],
        "rope": [RopeSpec(head_dim=D, style="gptj"), CosSinCache(torch.zeros(64, D))], "layer": [0],
        "k_scale": [0.5], "v_scale": [0.5], "kv_layout": ["NHD"], "q_out": [torch.empty_like(q), IN_PLACE],
        "k_out": [torch.empty_like(k), IN_PLACE], "backend": ["torch"], "qk_norm": [QKNorm(None, None)],
        "q_scale": [0.5], "k_out_scale": [0.5], "k_scale_cache": [caches], "v_scale_cache": [caches],
        "scale": [0.5], "q_pe_out": [torch.empty_like(q), IN_PLACE], "cache_format": ["fp8_ds_mla"],
        "scale_fmt": ["ue8m0"], "quant_block_size": [64],
    }


IN_PLACE = "the input itself"  # q_out=q, k_out=k


@pytest.mark.parametrize("op,make", [("rope_pool_fused", pool_args), ("rope_latent_fused", latent_args),
                                     ("rope_indexer_fused", indexer_args)])
def test_layout_key_covers_every_keyword(op, make, monkeypatch):
    """Each keyword of the op's public signature, changed alone, changes the key api.py looks the layout up by.

    A keyword missing from plan.pool_key / latent_key (tried: k_out_scale dropped from pool_key's tuple) fails
    here: the call with it changed would find the base call's runner."""
    keys = []
    real = plan.lookup
    monkeypatch.setattr(plan, "lookup", lambda scalars, arrays: keys.append(scalars) or real(scalars, arrays))
    fn = getattr(ropepool, op)
    arrays, base = make()
    fn(*arrays, **base)
    base_key = keys[-1]
    hash(base_key)
    keywords = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    others = other_values(arrays)
    missing = [n for n in keywords if n not in others]
    assert not missing, f"give tests/test_plan.py other values for {missing} (and put them in plan's key)"
    seen = {base_key}
    for name in keywords:
        for value in others[name]:
            arrays, base = make()  # fresh arrays: q_out=q means q itself
            if value is IN_PLACE:
                value = arrays[1] if name == "k_out" else arrays[0]
            try:
                fn(*arrays, **{**base, name: value})
            except (ValueError, TypeError):
                pass  # rejected by the checks: what matters is that it was not found under the base key
            assert keys[-1] != base_key, f"{op}: {name}={value!r} gives the base call's layout key"
            seen.add(keys[-1])


def test_in_place_output_is_its_own_key():
    """q_out=q (in place) and q_out=another tensor are two keys (plan.out_kind)."""
    (q, k, *_), _ = pool_args()
    base = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, rope_base=1e4, rope=None, layer=None, k_scale=None,
                v_scale=None, kv_layout=None, k_out=None, backend=None, qk_norm=None, q_scale=None, k_out_scale=None,
                k_scale_cache=None, v_scale_cache=None, q=q, k=k)
    keys = {plan.pool_key(**base, q_out=out) for out in (None, q, torch.empty_like(q))}
    assert len(keys) == 3


def build(**kw):
    arrays, base = pool_args()
    extra = kw.pop("arrays", lambda a: a)
    arrays = extra(list(arrays))
    return plan.build(validate.check(*arrays, **{**base, **kw}))


def fp8_pools(a):
    a[5], a[6] = (torch.zeros(P, HKV, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    return a


def int8_pools(a):
    a[5], a[6] = (torch.zeros(P, HKV, D, dtype=torch.int8) for _ in range(2))
    return a


def mrope_positions(a):
    a[3] = torch.zeros(3, T, dtype=torch.int64)
    return a


@pytest.mark.parametrize("kw,features", [
    (dict(), set()),
    (dict(qk_norm=QKNorm(None, None)), {"norm"}),
    (dict(rope=RopeSpec(head_dim=D, mrope_section=(2, 3, 3)), arrays=mrope_positions), {"mrope"}),
    (dict(rope=CosSinCache(torch.zeros(64, D))), {"table"}),
    (dict(rope=RopeSpec(head_dim=D, scaling={"rope_type": "longrope", "short_factor": [1.0] * (D // 2),
                                             "long_factor": [2.0] * (D // 2), "original_max_position_embeddings": 8},
                        max_position_embeddings=32)), {"longrope"}),
    (dict(k_scale=0.5, v_scale=0.5, arrays=fp8_pools), {"pool.scaled"}),
    (dict(k_scale_cache=torch.ones(P, HKV), v_scale_cache=torch.ones(P, HKV), arrays=int8_pools),
     {"pool.per_token_head"}),
])
def test_plan_names_its_features(kw, features):
    built = build(**kw)
    assert built.features == features
    assert all(f in plan.FEATURES for f in built.features)
    assert {s.format for s in built.stores} == {"plain"} | {f.split(".")[1] for f in features if "." in f}


def test_plan_features_of_outputs_latent_and_grad():
    arrays, base = pool_args()
    q_out = torch.empty(T, HQ, D, dtype=torch.float8_e4m3fn)
    assert plan.build(validate.check(*arrays, **base, q_out=q_out, q_scale=0.5)).features == {"q_out.scaled"}
    arrays[0].requires_grad_()
    assert plan.build(validate.check(*arrays, **base)).features == {"autograd"}
    arrays, base = latent_args()
    assert plan.build(validate.check_latent(*arrays, **base)).features == {"latent"}


def test_static_key_tells_plans_apart():
    """Plans that compiled code must treat differently have different keys; equal calls the same key."""
    variants = [dict(), dict(qk_norm=QKNorm(None, None)), dict(qk_norm=QKNorm(None, None, eps=1e-5)),
                dict(rope=RopeSpec(head_dim=D, style="gptj")), dict(rope=RopeSpec(head_dim=D, rotary_dim=8)),
                dict(k_scale=0.5, v_scale=0.5, arrays=fp8_pools), dict(k_scale=0.25, v_scale=0.5, arrays=fp8_pools),
                dict(k_scale=torch.ones(HKV), v_scale=0.5, arrays=fp8_pools)]
    keys = [build(**kw).key for kw in variants]
    assert len(set(keys)) == len(keys)
    assert build().key == build().key and hash(build().key) == hash(build().key)


@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=QKNorm(None, None)), dict(arrays=mrope_positions,
                                rope=RopeSpec(head_dim=D, mrope_section=(2, 3, 3))),
                                dict(k_scale_cache=torch.ones(P, HKV), v_scale_cache=torch.ones(P, HKV),
                                     arrays=int8_pools)])
def test_pick_takes_the_first_row_that_supports_the_plan(kw):
    built = build(**kw)
    q = torch.zeros(1)
    row = backends.pick("torch", q, None, built.features)
    assert built.features <= row.supports
    assert row.module == next(b.module for b in backends.BACKENDS if b.framework == "torch" and
                              built.features <= b.supports and b.devices in (None, ("cpu",)))
    assert row.module == (".torch_native" if "pool.per_token_head" not in built.features else ".torch_eager")


def test_rows_declare_features_as_data():
    """Every row's support is a set of known features; the explicit names stay the user's three."""
    for b in backends.BACKENDS:
        assert b.supports <= plan.FEATURES
    assert backends.NAMES == ["mlx", "torch", "triton"]


def test_extras_have_one_order():
    """The custom op takes the extras in plan.Extras' order (its parameters are named after them)."""
    pytest.importorskip("triton")
    from ropepool.backends import triton_op

    params = [a.name for a in torch.ops.ropepool.rope_pool.default._schema.arguments]
    assert triton_op.rope_pool_op is not None
    start = params.index(plan.EXTRAS[0])
    assert params[start:start + len(plan.EXTRAS)] == list(plan.EXTRAS)


def test_kernel_arguments_follow_one_declaration():
    """The Triton kernel's pointer arguments are core/args.POINTERS in its order, as the custom op's are; every
    kernel constexpr is a stride the launcher names or a feature ``_features`` sets, and nothing else is set; the
    MLX graph takes the call's arrays, then the extras mlx.READS names. (Tried: the kernel's use_long back after
    table, a stride field renamed, a feature dropped from _features: each fails here.)"""
    pytest.importorskip("triton")
    from ropepool.backends import triton_launch, triton_op
    from ropepool.backends.triton_kernel import rope_pool_kernel

    kernel = list(inspect.signature(rope_pool_kernel.fn).parameters)
    assert tuple(kernel[:len(plan.POINTERS)]) == plan.POINTERS
    op = [a.name for a in torch.ops.ropepool.rope_pool.default._schema.arguments]
    assert tuple(op[:len(plan.POINTERS)]) == plan.POINTERS
    features = triton_op._features(build(), 1)
    assert triton_op._STRIDES.isdisjoint(features)
    assert triton_op._STRIDES | set(features) == set(triton_launch.CONSTEXPRS)
    mlx = pytest.importorskip("ropepool.backends.mlx")
    graph = list(inspect.signature(mlx._graph(build())).parameters)
    assert graph == list(plan.ARRAYS[:7] + mlx.READS) and set(mlx.READS) <= set(plan.EXTRAS)


def test_native_runners_share_the_python_constants():
    """The native runners' array count and "other layout" answer (native/layout.h) are core/args.py's."""
    import pathlib
    import re

    from ropepool.core import args

    header = (pathlib.Path(ropepool.__file__).parent / "native" / "layout.h").read_text()
    consts = dict(re.findall(r"constexpr int(?:64_t)? (NUM_ARRAYS|OTHER_LAYOUT) = (-?\d+);", header))
    assert int(consts["NUM_ARRAYS"]) == len(args.ARRAYS)
    assert int(consts["OTHER_LAYOUT"]) == args.OTHER_LAYOUT


def test_plan_extras_read_held_arrays_now():
    table = torch.zeros(64, D)
    built = build(rope=CosSinCache(table))
    assert built.fixed.table is None and built.extras().table is table
    assert isinstance(build().fixed.freqs, np.ndarray)


def test_static_key_covers_every_rotation_field():
    """A Rotation that differs in any field but its arrays gives another key (the key lists the record's fields,
    not a hand-kept subset: tried, a hand-written tuple without mrope_interleaved fails here)."""
    import dataclasses

    base = build()
    others = {int: lambda x: x + 2, bool: lambda x: not x, float: lambda x: x * 2, type(None): lambda x: 4,
              tuple: lambda x: (x[0] + 1,) + x[1:]}
    unset = {"mrope_section": (2, 3, 3)}  # fields whose None has a shaped other value
    for f in dataclasses.fields(base.call.rotation):
        if f.name in ("freqs", "table_ref", "rows"):
            continue
        value = getattr(base.call.rotation, f.name)
        new = unset[f.name] if value is None and f.name in unset else others[type(value)](value)
        rot = dataclasses.replace(base.call.rotation, **{f.name: new})
        other = plan.build(dataclasses.replace(base.call, rotation=rot))
        assert other.key != base.key, f"Rotation.{f.name} is not in plan.Plan.key"


def test_triton_variants_are_found_by_the_plan_key():
    """The Triton launcher finds a plan's constexprs by plan.Plan.key: equal keys share them, others do not."""
    pytest.importorskip("triton")
    from ropepool.backends import triton_op

    a, b, c = build(), build(), build(rope=RopeSpec(head_dim=D, style="gptj"))
    assert a.key == b.key and a.key != c.key
    assert triton_op._variant(a, 1) is triton_op._variant(b, 1)
    assert triton_op._variant(c, 1) is not triton_op._variant(a, 1)
    assert triton_op._variant(c, 1)["GPTJ"] == 1 and triton_op._variant(a, 1)["GPTJ"] == 0
