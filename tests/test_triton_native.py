"""The native launcher's packing of a compiled Triton kernel (backends/triton_native.py), on any machine.

The launch itself runs on a GPU (tests/gpu/test_triton_gpu.py: test_later_calls_launch_natively); here the
layout it is given is checked against the kernel's signature as Triton 3.x records it.
"""
import glob
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import ropepool.native  # noqa: E402
from ropepool.backends import triton_native  # noqa: E402
from ropepool.core.args import OTHER_LAYOUT  # noqa: E402

ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out", "k_out")


def kernel(extra: dict, *, function=0x1234, num_warps=2, shared=256, **meta):
    """A stand-in of Triton's CompiledKernel: the 9 arrays, then ``extra`` (name -> type), no scratch."""
    signature = {**{a: "*bf16" for a in ARRAYS}, **extra}
    metadata = SimpleNamespace(num_warps=num_warps, shared=shared, num_ctas=meta.pop("num_ctas", 1),
                               launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=[])
    run = SimpleNamespace(global_scratch_size=meta.pop("global_scratch_size", 0), profile_scratch_size=0)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=metadata, run=run, function=function)


def test_spec_packs_the_parameters_triton_passes():
    """Constexprs (and what Triton specialised into one: None pointers, ints equal to 1) are not parameters;
    pointers and ints are 8-byte words, a 32-bit int its low half; the arrays' places are recorded."""
    k = kernel({"freqs": "*fp32", "table": "constexpr", "pool_size": "i32", "stride": "constexpr", "big": "i64",
                "HQ": "constexpr"})
    got = triton_native.spec(k, 8, (0, 4096), (0x7F00_0000_1000, None, -5, 1, 2**40 + 3, 32))
    assert got == [0x1234, 8, 64, 256, 0, 4096, *range(9), *[0] * 9, 0x7F00_0000_1000, 2**32 - 5, 2**40 + 3]


@pytest.mark.parametrize("extra,args,meta", [
    ({"eps": "fp32"}, (1e-6,), {}),  # a float parameter: not packed here
    ({"n": "i32"}, (), {}),  # the signature and the arguments disagree
    ({}, (), {"global_scratch_size": 128}),  # scratch memory Triton's launcher would allocate
    ({}, (), {"num_ctas": 2}),  # a cluster launch
    ({}, (), {"function": 0}),  # not loaded
])
def test_spec_declines_kernels_it_does_not_launch(extra, args, meta):
    assert triton_native.spec(kernel(extra, **meta), 1, (0, 0), args) is None


def _built():
    built = glob.glob(os.path.join(os.path.dirname(ropepool.native.__file__), "_triton_launch*.so"))
    if not built or not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("the native launcher is not built here, or this torch has no DLPack exchange API")
    assert triton_native.module() is not None


def test_module_where_built():
    """The built module loads where tvm-ffi and the exchange API are there; ``make`` declines kernels it does not
    know (no spec)."""
    _built()
    assert triton_native.make(64, [None, None], _arrays(4)) is None


def _arrays(T, *, dtype=torch.bfloat16, qkv=None):
    """A call's 9 arrays as the layout cache's guard sees them: q, k, v views of one [T, (32 + 2 * 8) * 128]
    projection, int32 positions and slots, [64, 8, 128] pools, new contiguous outputs."""
    qkv = torch.zeros(T, 48 * 128, dtype=dtype) if qkv is None else qkv
    q, k, v = (x.view(T, -1, 128) for x in qkv.split([32 * 128, 8 * 128, 8 * 128], -1))
    pools = torch.zeros(2, 64, 8, 128, dtype=dtype)
    return (q, k, v, torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int32), pools[0], pools[1],
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _replace(arrays, i, x):
    return arrays[:i] + (x,) + arrays[i + 1:]


def _other_layouts():
    """Calls that the layout cache's guard would not give the launcher made for ``_arrays``: each one thing
    changed."""
    a = _arrays(4)
    q, k, v, positions, slots, k_pool, v_pool, q_out, k_out = a
    yield "dtype", _arrays(4, dtype=torch.float16)
    yield "q's strides", _replace(a, 0, q.contiguous())
    yield "v's head count", _replace(a, 2, v[:, :4])
    yield "int64 slots", _replace(a, 4, slots.long())
    yield "2-D positions", _replace(a, 3, positions.view(1, 4))
    yield "pool size", _replace(a, 5, k_pool[:32])
    yield "pool strides", _replace(a, 6, torch.zeros(8, 64, 128, dtype=k_pool.dtype).transpose(0, 1))
    yield "one memory for both pools", _replace(a, 6, k_pool)
    yield "token counts that disagree", _replace(a, 4, torch.zeros(3, dtype=torch.int32))
    yield "k_out of another dtype", _replace(a, 8, k_out.float())


def test_launcher_checks_the_layout_before_anything():
    """The launcher compares each call's arrays with those it was made for, as the layout cache's guard does:
    any token count of the same layout is its own (DECLINED here: CPU arrays are never launched), anything else
    is OTHER_LAYOUT, nothing done (plan/cache.py then looks the call up with its guards)."""
    _built()
    spec = triton_native.spec(kernel({}), 1, (0, 0), ())
    launch = triton_native.make(64, [spec, None], _arrays(4))
    assert launch is not None
    for T in (2, 4, 100):  # (not 1: a one-token view of the projection has other strides, its own layout)
        assert launch(True, *_arrays(T)) == triton_native.DECLINED
    for what, arrays in _other_layouts():
        assert launch(True, *arrays) == OTHER_LAYOUT, what


class _Launcher:
    """A runner that checks its own layout only once it is ready, as the CUDA launcher does once its kernel is
    compiled (after its first call): ``checks_layout`` is read again at each guarded hit."""

    checks_values = True  # (on CUDA no value is checked on the host; on CPU the stand-in says it checks them)

    def __init__(self):
        self.ready = False

    @property
    def checks_layout(self):
        return self.ready

    def __call__(self, *arrays):
        return arrays[:2]


def test_a_runner_is_found_by_its_key_alone_once_it_checks_its_layout():
    """plan/cache.py: before its launcher is made, a runner is found only through the guards (a call of another
    layout with the same key gets no runner); from the first guarded hit after it checks its layout, by the key
    alone (its own check then refuses other layouts, tests/gpu/test_triton_gpu.py)."""
    from ropepool import plan
    from ropepool.checks import validate

    plan.forget()
    arrays = _replace(_arrays(4, dtype=torch.float32)[:7], 4, torch.arange(4, dtype=torch.int32))  # slots
    other = _replace(arrays, 0, arrays[0].contiguous())  # q's strides: another layout, the same key
    kw = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8)
    scalars = plan.pool_key(128, 32, 8, 10000.0, *(None,) * 13, arrays[0], arrays[1])
    run = _Launcher()
    plan.remember(scalars, arrays + (None, None), validate.check(*arrays, **kw), run)
    try:
        assert plan.lookup(scalars, other + (None, None)) is None
        assert plan.lookup(scalars, arrays + (None, None)) is run
        assert plan.lookup(scalars, other + (None, None)) is None, "found by its key before it checks layouts"
        run.ready = True
        assert plan.lookup(scalars, other + (None, None)) is None  # no guarded hit yet since it became ready
        assert plan.lookup(scalars, arrays + (None, None)) is run
        assert plan.lookup(scalars, other + (None, None)) is run  # by the key alone: the runner refuses it
        assert plan.lookup(scalars, other + (None, None), fast=False) is None
    finally:
        plan.forget()
