"""The native launcher's packing of a compiled Triton kernel (backends/triton_native.py), on any machine.

The launch itself runs on a GPU (tests/gpu/test_triton_gpu.py: test_later_calls_launch_natively); here the
layout it is given is checked against the kernel's signature as Triton 3.x records it.
"""
import ctypes.util
import glob
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from ropepool.backends import triton_native  # noqa: E402

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


def test_module_where_built():
    """The built module loads where tvm-ffi and the exchange API are there; without a CUDA driver ``make``
    returns None (Triton's launch runs)."""
    built = glob.glob(os.path.join(triton_native._HERE, "_triton_launch*.so"))
    if not built or not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("the native launcher is not built here, or this torch has no DLPack exchange API")
    pytest.importorskip("tvm_ffi")
    assert triton_native.module() is not None
    if ctypes.util.find_library("cuda") is None:
        spec = triton_native.spec(kernel({}), 1, (0, 0), ())
        assert triton_native.make(0, 64, [spec, None]) is None
