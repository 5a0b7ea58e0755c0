"""The CPU path's rotation as C++ that inductor generates: one pass over x, called without dynamo.

``torch_cpu`` rotates a block of tokens with five torch ops; inductor fuses the
same formula (upcast, ``x * cos + swap(x) * (-sin, sin)``, one rounding, the
store into the output) into one loop for q and k, with the same results bit
for bit: each product is rounded, then the sum, as in the ops.

Through ``torch.compile`` each call also paid dynamo's guards and
AOTAutograd's wrappers, more than the loop itself at few tokens (and more than
the ops below 16). So the function is traced once with every size and stride
symbolic (``make_fx``; no duck sizing, so no two sizes are assumed equal) and
handed to inductor directly. The code it generates reads each call's sizes
and strides and asserts them against the traced layout before writing; what
it does not check (the dtypes, the flip's axis, which outputs are their
inputs) keys the cache, and each torch_cpu layout keeps its functions so that
a call does not rebuild that key. A new function is checked once against the
same function run as torch ops (every bit, NaN included); a mismatch or any
failure to trace, compile or run warns once and leaves the ops to every later
call.

Used from ``MIN_TOKENS`` tokens (one token's q and k are rotated as one tensor
by five ops, as fast). ``ROPEPOOL_CPU_COMPILE=off`` turns it off. The first
call of a dtype compiles for a few seconds; another layout hits inductor's
on-disk cache (~0.5 s).
"""
from __future__ import annotations

import os
import warnings

import torch

# Never below 2: a symbolic size is traced as >= 2, so the code may assume it (sizes 0 and 1 are not symbolic).
MIN_TOKENS = 2
_state = {"failed": False}
# (flip axis, aliases, each tensor's dtype and layout past the token axis) -> inductor's compiled function
_compiled: dict = {}


def _rotate(q, k, cos, sin, q_out, k_out, *, pair_dim: int):
    for x, out in ((q, q_out), (k, k_out)):
        xf = x.float()
        out.copy_(xf * cos + xf.flip(pair_dim) * sin)


def enabled() -> bool:
    return os.environ.get("ROPEPOOL_CPU_COMPILE", "on").lower() not in ("off", "0", "false") and not _state["failed"]


def _aliases(args) -> tuple:
    """For each argument the index of the first one that is the same elements (q_out = q: in place)."""
    views = [(x.data_ptr(), x.shape, x.stride()) for x in args]
    return tuple(views.index(view) for view in views)


def _key(args, pair_dim, aliases):
    return pair_dim, aliases, tuple((x.dtype, x.shape[1:], x.stride()[1:], x.is_contiguous()) for x in args)


def _compile(args, pair_dim, aliases):
    """Inductor's code for ``_rotate`` over the distinct arguments (an alias is traced as one tensor, so
    inductor sees the in-place write of what the flip reads)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    distinct = sorted(set(aliases))

    def traced(*tensors):
        _rotate(*(tensors[distinct.index(i)] for i in aliases), pair_dim=pair_dim)

    # Traced on tensors of their own: q and k views of one QKV row share memory but never overlap, and an
    # in-place write to a view of shared memory is what AOTAutograd cannot trace symbolically.
    examples = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype) for i in distinct]
    with fx_config.patch(use_duck_shape=False):
        graph = make_fx(traced, tracing_mode="symbolic")(*examples)
    fn = compile_fx(graph, [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"])
    return lambda *a: fn(*(a[i] for i in distinct))


def _same_bits(got, want) -> bool:
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def _checked_run(fn, args, pair_dim) -> bool:
    """Runs a new compiled function once; whether its results are the ops' bit for bit (where not, the
    outputs get the ops' results: an in-place call has overwritten its inputs by then)."""
    inputs = [x.clone() for x in args[:4]]
    fn(*args)
    want = [torch.empty_like(out) for out in args[4:]]
    _rotate(*inputs, *want, pair_dim=pair_dim)
    if all(_same_bits(out, w) for out, w in zip(args[4:], want)):
        return True
    for out, w in zip(args[4:], want):
        out.copy_(w)
    return False


def rotate(q, k, cos, sin, pair_dim: int, q_out, k_out, bound: dict) -> bool:
    """``out = x * cos + swap(x) * sin`` for q and k (torch_cpu's shapes) in one compiled call; False where
    it did not write the outputs (too few tokens, turned off, or compiling failed): they are the caller's.

    ``bound``: the caller's functions for one layout of the arguments (torch_cpu.Fast's), by which outputs
    are their inputs; working out the full key costs more than the call (~15 us)."""
    if q.shape[0] < MIN_TOKENS or not enabled():
        return False
    args = (q, k, cos, sin, q_out, k_out)
    in_place = (q_out.data_ptr() == q.data_ptr(), k_out.data_ptr() == k.data_ptr())
    try:
        fn = bound.get(in_place)
        if fn is not None:
            fn(*args)  # inductor's code asserts every size and stride before it writes
            return True
        aliases = _aliases(args)
        key = _key(args, pair_dim, aliases)
        fn = _compiled.get(key)
        if fn is not None:
            fn(*args)
        else:
            fn = _compile(args, pair_dim, aliases)
            if not _checked_run(fn, args, pair_dim):
                return _give_up("its results differ from the torch ops'", done=True)
            _compiled[key] = fn
        bound[in_place] = fn
        return True
    except Exception as e:  # no compiler, a broken toolchain, a changed private API: the ops give the same numbers
        return _give_up(f"{type(e).__name__}: {e}", done=False)


def _give_up(problem: str, done: bool) -> bool:
    _state["failed"] = True
    warnings.warn(f"ropepool: inductor's CPU rotation is not used ({problem}); using torch ops instead (slower "
                  "from 256 tokens on). Set ROPEPOOL_CPU_COMPILE=off to skip compiling.", RuntimeWarning,
                  stacklevel=5)
    return done
