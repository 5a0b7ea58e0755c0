"""The CPU path's step as C++ that inductor generates, called without dynamo.

``torch_cpu`` rotates a block of tokens with five torch ops; inductor fuses the
same formula (upcast, ``x * cos + swap(x) * (-sin, sin)``, one rounding, the
store into the output) into one loop for q and k, with the same results bit
for bit: each product is rounded, then the sum, as in the ops. The same call
picks the cos/sin rows of torch_cpu's table and, where all of k rotates, no
token is skipped and each pool is one run of rows (not HND pages), writes the
rotated k and v into the pools: at a few tokens each torch op saved is ~2-4 us.

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
by five ops, as fast). ``ROPEPOOL_CPU_COMPILE=off`` turns it off. Each new
graph (a dtype, with or without table rows, pool writes, in place) compiles
for ~5 s; a key whose graph inductor has on disk takes ~0.5 s.
"""
from __future__ import annotations

import os
import warnings

import torch

# Never below 2: a symbolic size is traced as >= 2, so the code may assume it (sizes 0 and 1 are not symbolic).
MIN_TOKENS = 2
_state = {"failed": False}
# (flip axis, aliases, each tensor's dtype and layout past the token axis) -> inductor's compiled function
# (a loaded module, no tensor); at most _MAX_COMPILED, past which it is emptied (inductor's disk cache refills it).
_compiled: dict = {}
_MAX_COMPILED = 256


def _step(q, k, cos, sin, q_out, k_out, positions, v, slots, k_rows, v_rows, *, pair_dim: int):
    """``out = x * cos + swap(x) * sin`` for q and k. With ``positions``, cos and sin are tables and these
    their rows; with ``slots``, k_out's and v's rows also go to those rows of k_rows and v_rows (the pools as
    ``[rows, heads, dim]``; k_out then holds all of k_rot)."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    for x, out in ((q, q_out), (k, k_out)):
        xf = x.float()
        out.copy_(xf * cos + xf.flip(pair_dim) * sin)
    if slots is not None:
        rows = slots.long()
        k_rows.index_copy_(0, rows, k_out.flatten(2))
        v_rows.index_copy_(0, rows, v)


def enabled() -> bool:
    return os.environ.get("ROPEPOOL_CPU_COMPILE", "on").lower() not in ("off", "0", "false") and not _state["failed"]


def wanted(tokens: int) -> bool:
    """Whether a call of this many tokens goes through ``rotate``."""
    return tokens >= MIN_TOKENS and enabled()


def _aliases(args) -> tuple:
    """For each argument the index of the first one that is the same elements (q_out = q: in place)."""
    views = [None if x is None else (x.data_ptr(), x.shape, x.stride()) for x in args]
    return tuple(None if view is None else views.index(view) for view in views)


def _key(args, pair_dim, aliases):
    return pair_dim, aliases, tuple(None if x is None else (x.dtype, x.shape[1:], x.stride()[1:], x.is_contiguous())
                                    for x in args)


def _compile(args, pair_dim, aliases):
    """Inductor's code for ``_step`` over the distinct arguments (an alias is traced as one tensor, so
    inductor sees the in-place write of what the flip reads)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    distinct = sorted({i for i in aliases if i is not None})

    def traced(*tensors):
        _step(*(None if i is None else tensors[distinct.index(i)] for i in aliases), pair_dim=pair_dim)

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
    """Runs a new compiled function once; whether its results (outputs, written pool rows) are the ops' bit
    for bit. Where not, they get the ops' results: an in-place call has overwritten its inputs by then."""
    q, k, cos, sin, q_out, k_out, positions, v, slots, k_rows, v_rows = args
    q0, k0 = q.clone(), k.clone()
    fn(*args)
    want = [torch.empty_like(q_out), torch.empty_like(k_out)]
    _step(q0, k0, cos, sin, *want, positions, None, None, None, None, pair_dim=pair_dim)
    got = [q_out, k_out]
    if slots is not None:
        rows = slots.long()
        got += [k_rows[rows], v_rows[rows]]
        want += [want[1].flatten(2), v]
    if all(_same_bits(g, w) for g, w in zip(got, want)):
        return True
    q_out.copy_(want[0])
    k_out.copy_(want[1])
    if slots is not None:
        k_rows.index_copy_(0, rows, want[2])
        v_rows.index_copy_(0, rows, v)
    return False


def rotate(q, k, cos, sin, pair_dim: int, q_out, k_out, bound: dict, positions=None, writes=None) -> bool:
    """``_step`` in one compiled call (``writes``: None or (v, slots, k_rows, v_rows)); False where it did
    not run (compiling failed): the outputs and pools are then the caller's.

    ``bound``: the caller's functions for one layout of the arguments (torch_cpu.Fast's), by which outputs
    are their inputs and which of positions and writes are given; working out the full key costs more than
    the call (~15 us)."""
    args = (q, k, cos, sin, q_out, k_out, positions, *(writes or (None,) * 4))
    known = (q_out.data_ptr() == q.data_ptr(), k_out.data_ptr() == k.data_ptr(), positions is None, writes is None)
    try:
        fn = bound.get(known)
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
            if len(_compiled) >= _MAX_COMPILED:
                _compiled.clear()
            _compiled[key] = fn
        bound[known] = fn
        return True
    except Exception as e:  # no compiler, a broken toolchain, a changed private API: the ops give the same numbers
        return _give_up(f"{type(e).__name__}: {e}", done=False)


def _give_up(problem: str, done: bool) -> bool:
    _state["failed"] = True
    warnings.warn(f"ropepool: inductor's CPU rotation is not used ({problem}); using torch ops instead (slower "
                  "from 256 tokens on). Set ROPEPOOL_CPU_COMPILE=off to skip compiling.", RuntimeWarning,
                  stacklevel=6)
    return done
