"""The eager CUDA call's launch in one C++ call: native/triton_launch.cc.

Triton's launcher takes every kernel argument as a Python object on every
call (about 30 here); the native launcher is given the compiled kernel's
handle and every argument that does not change for a layout once
(``spec``), with the layout of the arrays it is made for, and each call
passes the 9 arrays as tensors, which it reads through torch's DLPack
exchange API without owning them. It compares them with that layout before
it does anything (``OTHER_LAYOUT``: the layout cache may then hand it calls by
their key alone, plan/cache.py) and launches on torch's current stream, read
through the same API. It is used where it can be: a built ``_triton_launch``,
apache-tvm-ffi (whose library its layout check links), a torch with the
DLPack C exchange API, and a compiled kernel this launcher understands
(checked here from its signature and metadata). Anywhere else ``make``
returns None and Triton's launch runs.
"""
from __future__ import annotations

import torch

from ..core.args import ARRAYS as _ARRAYS

_state: dict = {}
ARRAYS = len(_ARRAYS)  # q, k, v, positions, slots, k_pool, v_pool, q_out, k_out: the kernel's first parameters
# What a launcher's call returns (native/triton_launch.cc): launched; nothing done, Triton's launch to run;
# nothing done, the arrays laid out otherwise than those it was made for (core/args.py).
LAUNCHED, DECLINED = 1, 0
_INTS = {"i32": 32, "i64": 64, "u32": 32, "u64": 64}


def module():
    """The loaded launcher module, or None where it cannot run (see the module's doc)."""
    if "module" not in _state:
        _state["module"] = _load()
    return _state["module"]


def _load():
    exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if exchange is None:
        return None
    try:
        from .. import native

        if not native.load_tvm_ffi_library():  # (the module links it)
            return None
        from ..native import _triton_launch

        _triton_launch.use(exchange)
        return _triton_launch
    except (ImportError, ValueError):  # not built, no tvm-ffi, another DLPack: Triton's launch runs
        return None


def spec(kernel, split: int, offsets: tuple, args: tuple) -> list | None:
    """What the native launcher needs of one compiled variant (native/triton_launch.cc's layout), or None if
    this kernel is not one it launches. ``args``: the kernel's arguments after the 9 arrays, as Triton was
    given them (pointers as ints, None, scalars, constexprs)."""
    meta, run = getattr(kernel, "metadata", None), getattr(kernel, "run", None)
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if meta is None or run is None or not isinstance(signature, dict) or len(signature) != ARRAYS + len(args):
        return None
    plain = (getattr(meta, "num_ctas", 1) == 1 and not getattr(meta, "launch_cooperative_grid", False)
             and not getattr(meta, "launch_pdl", False) and not getattr(meta, "tensordesc_meta", None)
             and not getattr(run, "global_scratch_size", 0) and not getattr(run, "profile_scratch_size", 0)
             and getattr(kernel, "function", None))
    if not plain:
        return None
    at, words = [-1] * ARRAYS, []
    for i, (ty, value) in enumerate(zip(signature.values(), (None,) * ARRAYS + tuple(args))):
        if ty == "constexpr":  # constexprs, and what Triton specialised into one (None pointers, ints equal to 1)
            continue
        if i < ARRAYS and isinstance(ty, str) and ty.startswith("*"):
            at[i] = len(words)
            words.append(0)
        elif isinstance(ty, str) and (ty.startswith("*") or ty in _INTS) and isinstance(value, int):
            bits = value & ((1 << _INTS.get(ty, 64)) - 1)
            words.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
        else:  # a parameter type this launcher does not pack (floats, tuples, descriptors)
            return None
    return [kernel.function, split, 32 * meta.num_warps, meta.shared, *offsets, *at, *words]


def make(small_tokens: int, specs: list, arrays: tuple):
    """The native launcher of these variants (None where one is not compiled yet) for calls laid out as
    ``arrays`` (a call's 9, its new outputs included), or None (no module)."""
    mod = module()
    if mod is None or not any(specs):
        return None
    try:
        return mod.make(small_tokens, *(s or [] for s in specs), *arrays)
    except ValueError:  # arrays of more dims than a layout records (native/layout.h): Triton's launch runs
        return None
