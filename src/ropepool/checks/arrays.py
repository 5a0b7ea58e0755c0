"""The small checks every part of validation uses: array types and devices, ints, shapes, strides, places."""
from __future__ import annotations

import importlib.util
import numbers

import numpy as np

from ..core.dtypes import FRAMEWORK_TYPES, framework_of
from ..errors import RopePoolError


def shape_of(x) -> list:
    return list(x.shape)


def is_int(val) -> bool:
    return isinstance(val, numbers.Integral) and not isinstance(val, (bool, np.bool_))


def check_ints(**values):
    out = []
    for name, val in values.items():
        if not is_int(val):
            raise TypeError(f"{name} must be an int; got {type(val).__name__} {val!r}. Fix: pass an int.")
        if val <= 0:
            raise RopePoolError(f"{name} must be positive; got {val}. Fix: pass the model's value.")
        out.append(int(val))
    return out


def reshape_word(fw) -> str:
    """The call that reshapes without a copy, in the framework's words."""
    return "view" if fw == "torch" else "reshape"


def as_float32(fw, name) -> str:
    """The cast of ``name`` to float32, in the framework's words."""
    return {"torch": f"{name}.float()", "mlx": f"{name}.astype(mx.float32)"}.get(fw, f"{name}.astype(np.float32)")


def convert_hint(arrays, frameworks) -> str:
    """How to make an array of the call's framework: the one its other arrays come from, else each accepted
    framework installed here (an MLX user without torch is not told to use torch)."""
    hints = {"torch": "torch.as_tensor(x)", "mlx": "mx.array(x)", "numpy": "np.asarray(x)"}
    used = [f for f in map(framework_of, arrays) if f in frameworks][:1] or installed_frameworks(frameworks)
    return " or ".join(hints[f] for f in used)


def installed_frameworks(frameworks) -> list:
    """Those of ``frameworks`` installed here (all of them if none is)."""
    return [f for f in frameworks if importlib.util.find_spec(f) is not None] or list(frameworks)


def same_place(name, x, q):
    """``x`` (a norm weight, a table, a scale) must be an array of q's framework and device."""
    if framework_of(x) != framework_of(q) or getattr(x, "device", None) != getattr(q, "device", None):
        where = f" on {x.device}" if hasattr(x, "device") else ""
        raise TypeError(f"{name} as a tensor must come from q's framework and device; got "
                        f"{type(x).__module__}.{type(x).__name__}{where}. Fix: move it next to q "
                        f"(.to(q.device)), or pass a float where one is accepted.")


def check_strides(**tensors):
    for name, x in tensors.items():
        if x.stride(-1) != 1 and x.shape[-1] > 1 and x.numel():  # an empty tensor's strides mean nothing
            fix = (f"{name}.contiguous() (it is only read)" if name == "positions" or x.ndim == 1 else
                   "pass a view whose last dim is contiguous (any token/head stride is fine)")
            raise RopePoolError(f"{name} must have a contiguous last dim (stride 1); got strides {list(x.stride())}. "
                                f"Fix: {fix}.")


def check_types(op, names, arrays, frameworks) -> str:
    """The one framework of the call's arrays (raising on any other type, or on two frameworks)."""
    found = None
    for name, x in zip(names, arrays):
        fw = framework_of(x)
        if fw not in frameworks:
            allowed = " or ".join(FRAMEWORK_TYPES[f] for f in installed_frameworks(frameworks))
            given = type(x).__module__ + "." + type(x).__name__ if fw is None else FRAMEWORK_TYPES[fw]
            hint = convert_hint(arrays, frameworks)
            raise TypeError(f"{op} expects {name} to be a {allowed}; got {given}. Fix: convert it, e.g. {hint}.")
        if found is None:
            found = (name, fw)
        elif fw != found[1]:
            raise TypeError(f"{op} expects every array from one framework; got {found[0]} as "
                            f"{FRAMEWORK_TYPES[found[1]]} and {name} as {FRAMEWORK_TYPES[fw]}. "
                            "Fix: convert all arrays to the same framework.")
    return found[1]


def check_devices(op, names, tensors):
    """Every tensor given (None: not given) a torch.Tensor on the first one's device."""
    dev = tensors[0].device
    for name, x in zip(names, tensors):
        if x is None:
            continue
        if framework_of(x) != "torch":
            raise TypeError(f"{op} expects {name} to be a torch.Tensor like {names[0]}; got {type(x).__name__}. "
                            "Fix: pass a tensor or leave it None.")
        if x.device != dev:
            raise TypeError(f"{op} expects every tensor on one device; got {names[0]} on {dev} and {name} on "
                            f"{x.device}. Fix: move {name} with .to({str(dev)!r}).")
