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
a call does not rebuild that key.

Used from ``MIN_TOKENS`` tokens (one token's q and k are rotated as one tensor
by five ops, as fast). Compiling a graph takes seconds (~5 s; ~0.5 s where
inductor has it on disk), so no call waits for it: a layout's calls run the
torch ops until it has been seen ``COMPILE_AFTER`` times, then its graph
compiles in a background thread (one log line on the ``ropepool`` logger
when done) while the ops keep serving, and calls take it once it is there.
``ROPEPOOL_CPU_COMPILE``: ``on`` (that, the default), ``off`` (never), or
``sync`` (compile on a layout's first call, in the call: ahead of time for a
warm-up run; logged when it takes over a second). ``wait()`` returns once
no compile is under way. A new graph is checked once, on inputs of its
own, against the same function run as torch ops (every bit, NaN included);
a mismatch or any failure to trace, compile or run (these are private
inductor APIs, ``make_fx`` and ``compile_fx``: a torch release may change
them) warns once and leaves the ops to every later call.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import torch

from . import paths

# Never below 2: a symbolic size is traced as >= 2, so the code may assume it (sizes 0 and 1 are not symbolic).
MIN_TOKENS = 2
# Calls of one layout before its graph compiles (in the background): a layout called a few times in a
# process would gain less from the graph (~2-10 us a call) than compiling costs (seconds of CPU).
COMPILE_AFTER = 64
_state = {"failed": False}
# (flip axis, aliases, each tensor's dtype and layout past the token axis) -> inductor's compiled function
# (a loaded module, no tensor); at most _MAX_COMPILED, past which it is emptied (inductor's disk cache refills it).
_compiled: dict = {}
_MAX_COMPILED = 256
_pending: dict = {}  # key -> [(bound, known)] waiting for a background compile of that key
_lock = threading.Lock()
_log = logging.getLogger("ropepool")


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


def mode() -> str:
    """``ROPEPOOL_CPU_COMPILE``: "off", "sync" or "on" (anything else)."""
    value = os.environ.get("ROPEPOOL_CPU_COMPILE", "on").lower()
    return "off" if value in ("off", "0", "false") else "sync" if value == "sync" else "on"


def enabled() -> bool:
    return not _state["failed"] and mode() != "off"


def wanted(tokens: int) -> bool:
    """Whether a call of this many tokens goes through ``rotate``."""
    return tokens >= MIN_TOKENS and enabled()


def wait() -> None:
    """Return once no graph is compiling in the background (a warm-up before timing calls)."""
    while _pending:
        time.sleep(0.05)


def _aliases(args) -> tuple:
    """For each argument the index of the first one that is the same elements (q_out = q: in place)."""
    views = [None if x is None else (x.data_ptr(), x.shape, x.stride()) for x in args]
    return tuple(None if view is None else views.index(view) for view in views)


def _key(args, pair_dim, aliases):
    return pair_dim, aliases, tuple(None if x is None else (x.dtype, x.shape[1:], x.stride()[1:], x.is_contiguous())
                                    for x in args)


def _examples(args, aliases):
    """Tensors of their own shaped and strided as the distinct ``args``, with values: random floats, table
    positions, distinct slots of pools of a few rows (a graph is checked on these, never on a caller's data)."""
    q, k, cos, sin, q_out, k_out, positions, v, slots, k_rows, v_rows = args
    T, gen = q.shape[0], torch.Generator().manual_seed(0)
    sizes = {9: 2 * T + 1, 10: 2 * T + 1}  # the pools: their row count is symbolic
    out = {}
    for i in sorted({i for i in aliases if i is not None}):
        x = args[i]
        t = torch.empty_strided((sizes.get(i, x.shape[0]), *x.shape[1:]), x.stride(), dtype=x.dtype)
        if i == 6:
            t.copy_(torch.randint(0, cos.shape[0], (T,), generator=gen))
        elif i == 8:
            t.copy_(torch.randperm(2 * T + 1, generator=gen)[:T])
        else:
            t.copy_(torch.randn(t.shape, generator=gen))
        out[i] = t
    return tuple(None if i is None else out[i] for i in aliases)


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


def _checked(fn, args, pair_dim) -> bool:
    """Whether ``fn``'s results (outputs, written pool rows) on ``args`` are the torch ops' bit for bit."""
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
    return all(_same_bits(g, w) for g, w in zip(got, want))


def _build(key, args, pair_dim, aliases) -> None:
    """Compile ``key``'s graph, check it on inputs of its own, and hand it to the layouts waiting for it
    (or give up: the ops then serve every call)."""
    t = time.perf_counter()
    try:
        fn = _compile(args, pair_dim, aliases)
        if not _checked(fn, _examples(args, aliases), pair_dim):
            _give_up("its results differ from the torch ops'")
            return
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        _compiled[key] = fn
    except Exception as e:  # no compiler, a broken toolchain, a changed private API: the ops give the same numbers
        _give_up(f"{type(e).__name__}: {e}")
        return
    finally:
        with _lock:
            waiting = _pending.pop(key, [])
    for bound, known in waiting:
        bound[known] = fn
    seconds = time.perf_counter() - t
    if seconds > 1:
        _log.info("ropepool: compiled the CPU rotation of %s q/k%s in %.1f s (a layout called %s)", args[0].dtype,
                  " and its pool writes" if args[8] is not None else "", seconds,
                  "now: ROPEPOOL_CPU_COMPILE=sync" if mode() == "sync" else
                  f"{COMPILE_AFTER} times; in the background, torch ops served the calls meanwhile")


def rotate(q, k, cos, sin, pair_dim: int, q_out, k_out, bound: dict, positions=None, writes=None) -> bool:
    """``_step`` in one compiled call (``writes``: None or (v, slots, k_rows, v_rows)); False where it did
    not run (not compiled yet, or compiling failed): the outputs and pools are then the caller's.

    ``bound``: the caller's functions for one layout of the arguments (torch_cpu.Fast's), by which outputs
    are their inputs and which of positions and writes are given, or the count of its calls until there is
    one; working out the full key costs more than the call (~15 us)."""
    args = (q, k, cos, sin, q_out, k_out, positions, *(writes or (None,) * 4))
    known = (q_out.data_ptr() == q.data_ptr(), k_out.data_ptr() == k.data_ptr(), positions is None, writes is None)
    fn = bound.get(known, 0)
    if not isinstance(fn, int):
        return _run(fn, args)
    sync = mode() == "sync"
    if not sync and (fn + 1) % COMPILE_AFTER:  # not yet (and, while compiling, look again every so often)
        bound[known] = fn + 1
        return False
    aliases = _aliases(args)
    key = _key(args, pair_dim, aliases)
    if key not in _compiled:
        with _lock:
            waiting = _pending.get(key)
            if waiting is None:
                _pending[key] = [(bound, known)]
            else:
                waiting.append((bound, known))
        if waiting is not None:
            bound[known] = fn + 1
            return False
        if sync:
            _build(key, args, pair_dim, aliases)
        else:
            # Daemon: a process that ends while it compiles does not wait for it.
            threading.Thread(target=_build, args=(key, args, pair_dim, aliases), daemon=True,
                             name="ropepool-compile").start()
            bound[known] = fn + 1
            return False
    fn = _compiled.get(key)
    if fn is None:  # it failed (and said so)
        return False
    bound[known] = fn
    return _run(fn, args)


def _run(fn, args) -> bool:
    try:
        fn(*args)  # inductor's code asserts every size and stride before it writes
    except Exception as e:  # a layout its asserts reject: the ops, from now on
        _give_up(f"{type(e).__name__}: {e}")
        return False
    paths.took("torch_cpu.compiled_step")
    if args[8] is not None:
        paths.took("torch_cpu.compiled_write")
    return True


def _give_up(problem: str) -> None:
    _state["failed"] = True
    warnings.warn(f"ropepool: inductor's CPU rotation is not used ({problem}); using torch ops instead (slower "
                  "from 256 tokens on). Set ROPEPOOL_CPU_COMPILE=off to skip compiling.", RuntimeWarning,
                  stacklevel=6)
