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

``rotate`` runs ``_step`` from ``MIN_TOKENS`` tokens. A decode call (one token,
outputs of its own, a written slot, pools of one layer) runs ``_one`` through
``one_token``: one graph per layout, its token count the constant 1, that
rotates q and k into new outputs, picks the table's rows and writes both pools
(flat, NHD or HND; fp8 quantized as torch_cpu writes it): ~12 us a call where
torch_cpu's one-token lane of torch ops takes ~25 and ``torch.compile`` of the
eager code ~30 (docs/benchmarks.md). Compiling a graph takes seconds (~5 s; ~0.5 s where
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
from dataclasses import dataclass
from typing import Callable

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
# One compile at a time: make_fx and inductor keep process-wide state, and two layouts' graphs traced in two
# threads at once fail (measured: "CURRENT_PATCHER is None", "'CustomDecompTable' object is not a mapping"),
# which turned the compiled path off for the process.
_compiling = threading.Lock()
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


def _one(q, k, v, cos, sin, positions, slots, k_pool, v_pool, k_scale, v_scale, *, pairs, pair_dim, fp8_max,
         kv_layout, page_size):
    """One token's ``out = x * cos + swap(x) * sin`` for q and k (cos, sin: tables, picked at ``positions``),
    and k_rot's and v's rows into the pools (flat, or NHD / HND pages of ``page_size``) at ``slots``, stored
    as ``row / scale`` saturated where ``fp8_max`` (as torch_cpu.Fast.write). Returns q_rot, k_rot."""
    cos, sin = cos[positions], sin[positions]
    rotated = []
    for x in (q, k):
        xf = x.unflatten(-1, pairs).float()
        rotated.append((xf * cos + xf.flip(pair_dim) * sin).to(x.dtype).flatten(-2))
    slot = slots.long()
    page, row = slot // page_size, slot % page_size
    # HND: a page's rows of one head are apart: indexed [T, H] (page, head, row), as the rows are [T, H, D]
    rows = (slot,) if kv_layout is None else (page, row) if kv_layout == "NHD" else \
        (page[:, None], torch.arange(k_pool.shape[1]), row[:, None])
    for pool, x, scale in ((k_pool, rotated[1], k_scale), (v_pool, v, v_scale)):
        if fp8_max:
            x = (x.float() / (scale.view(-1, 1) if scale.numel() > 1 else scale)).clamp(-fp8_max, fp8_max)
        pool.index_put_(rows, x.to(pool.dtype))  # (index_copy_ has no fp8 kernels)
    return rotated


@dataclass(frozen=True)
class Graph:
    """A function to compile with its constants, and which arguments are the table, positions, slots and
    pools (the examples it is checked on hold values valid for them); part of a compiled function's key."""

    fn: Callable
    consts: tuple  # (name, value) pairs: keyword arguments of fn
    what: str  # for the log line
    table: int
    positions: int
    slots: int
    pools: tuple

    def run(self, *args):
        return self.fn(*args, **dict(self.consts))


_STEPS = {d: Graph(_step, (("pair_dim", d),), "rotation", 2, 6, 8, (9, 10)) for d in (-1, -2)}


def one_token_graph(pairs, pair_dim, fp8_max, kv_layout, page_size) -> Graph:
    """``_one``'s Graph: q, k, v, cos, sin, positions, slots, k_pool, v_pool, k_scale, v_scale."""
    consts = (("pairs", pairs), ("pair_dim", pair_dim), ("fp8_max", fp8_max), ("kv_layout", kv_layout),
              ("page_size", page_size))
    return Graph(_one, consts, "one-token step", 3, 5, 6, (7, 8))


def mode() -> str:
    """``ROPEPOOL_CPU_COMPILE``: "off", "sync" or "on" (anything else)."""
    value = os.environ.get("ROPEPOOL_CPU_COMPILE", "on").lower()
    return "off" if value in ("off", "0", "false") else "sync" if value == "sync" else "on"


def enabled() -> bool:
    return not _state["failed"] and mode() != "off"


def failed() -> bool:
    """Whether compiling or running a graph failed (the ops serve every call from then on)."""
    return _state["failed"]


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


def _key(args, graph, aliases):
    # A size 1 is traced as a constant, never a symbol: a pool of one row (or page) is a graph of its own.
    return graph, aliases, tuple(None if x is None else (x.dtype, x.shape[1:], x.stride()[1:], x.is_contiguous(),
                                                         x.shape[:1] == (1,)) for x in args)


def _examples(args, graph, aliases):
    """Tensors of their own shaped and strided as the distinct ``args``, with values: random floats, table
    positions, distinct slots of pools of a few rows (a graph is checked on these, never on a caller's data)."""
    T, gen = args[0].shape[0], torch.Generator().manual_seed(0)  # q's tokens
    sizes = dict.fromkeys(graph.pools, 2 * T + 1)  # the pools: their row count is symbolic
    out = {}
    for i in sorted({i for i in aliases if i is not None}):
        x = args[i]
        t = torch.empty_strided((sizes[i], *x.shape[1:]) if i in sizes else x.shape, x.stride(), dtype=x.dtype)
        if i == graph.positions:
            t.copy_(torch.randint(0, args[graph.table].shape[0], (T,), generator=gen))
        elif i == graph.slots:
            t.copy_(torch.randperm(2 * T + 1, generator=gen)[:T])
        else:
            t.copy_(torch.randn(t.shape, generator=gen))
        out[i] = t
    return tuple(None if i is None else out[i] for i in aliases)


def _compile(args, graph, aliases):
    """Inductor's code for ``graph.fn`` over the distinct arguments (an alias is traced as one tensor, so
    inductor sees the in-place write of what the flip reads)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental import _config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    distinct = sorted({i for i in aliases if i is not None})

    def traced(*tensors):
        return graph.run(*(None if i is None else tensors[distinct.index(i)] for i in aliases))

    # Traced on tensors of their own: q and k views of one QKV row share memory but never overlap, and an
    # in-place write to a view of shared memory is what AOTAutograd cannot trace symbolically.
    examples = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype) for i in distinct]
    with fx_config.patch(use_duck_shape=False):
        traced_graph = make_fx(traced, tracing_mode="symbolic")(*examples)
    fn = compile_fx(traced_graph, [n.meta["val"] for n in traced_graph.graph.nodes if n.op == "placeholder"])
    if distinct == list(range(len(args))):  # every argument its own tensor: called as is (a wrapper costs ~1 us)
        return fn
    return lambda *a: fn(*(a[i] for i in distinct))


def _same_bits(got, want) -> bool:
    if got.dtype.itemsize == 1:  # fp8: its bytes (NaN included)
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return bool(((got == want) | (got.isnan() & want.isnan())).all())


def _checked(fn, args, graph) -> bool:
    """Whether ``fn``'s results on ``args`` (its outputs and every tensor it writes: outputs, whole pools)
    are those of ``graph.run`` as torch ops on copies of them, bit for bit."""
    copies = {}
    for x in args:  # the same aliases among the copies
        if x is not None and id(x) not in copies:
            copies[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
    mine = [None if x is None else copies[id(x)] for x in args]
    got, want = fn(*args), graph.run(*mine)
    got, want = ([] if r is None else list(r) for r in (got, want))
    got += [x for x in args if x is not None]
    want += [x for x in mine if x is not None]
    return len(got) == len(want) and all(_same_bits(g, w) for g, w in zip(got, want))


def _build(key, args, graph, aliases) -> None:
    """Compile ``key``'s graph, check it on inputs of its own, and hand it to the layouts waiting for it
    (or give up: the ops then serve every call)."""
    t = time.perf_counter()
    try:
        with _compiling:
            fn = _compile(args, graph, aliases)
            same = _checked(fn, _examples(args, graph, aliases), graph)
        if not same:
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
        _log.info("ropepool: compiled the CPU %s of %s q/k in %.1f s (a layout called %s)", graph.what,
                  args[0].dtype, seconds, "now: ROPEPOOL_CPU_COMPILE=sync" if mode() == "sync" else
                  f"{COMPILE_AFTER} times; in the background, torch ops served the calls meanwhile")


def _function(bound: dict, known, args, graph):
    """``graph``'s compiled function for these arguments, or None where there is none yet (not compiled,
    compiling, or compiling failed).

    ``bound``: the caller's functions for one layout of the arguments (torch_cpu.Fast's), by ``known`` (what
    else of the arguments tells graphs apart: which outputs are their inputs, which arguments are given), or
    the count of its calls until there is one; working out the full key costs more than the call (~15 us)."""
    fn = bound.get(known, 0)
    if not isinstance(fn, int):
        return fn
    if not enabled():
        return None
    sync = mode() == "sync"
    if not sync and (fn + 1) % COMPILE_AFTER:  # not yet (and, while compiling, look again every so often)
        bound[known] = fn + 1
        return None
    aliases = _aliases(args)
    key = _key(args, graph, aliases)
    if key not in _compiled:
        with _lock:
            waiting = _pending.get(key)
            if waiting is None:
                _pending[key] = [(bound, known)]
            else:
                waiting.append((bound, known))
        if waiting is not None:
            bound[known] = fn + 1
            return None
        if sync:
            _build(key, args, graph, aliases)
        else:
            # Daemon: a process that ends while it compiles does not wait for it.
            threading.Thread(target=_build, args=(key, args, graph, aliases), daemon=True,
                             name="ropepool-compile").start()
            bound[known] = fn + 1
            return None
    fn = _compiled.get(key)
    if fn is not None:  # (None: it failed, and said so)
        bound[known] = fn
    return fn


def rotate(q, k, cos, sin, pair_dim: int, q_out, k_out, bound: dict, positions=None, writes=None) -> bool:
    """``_step`` in one compiled call (``writes``: None or (v, slots, k_rows, v_rows)); False where it did
    not run (not compiled yet, or compiling failed): the outputs and pools are then the caller's.
    ``bound``: as ``_function``'s."""
    args = (q, k, cos, sin, q_out, k_out, positions, *(writes or (None,) * 4))
    known = (q_out.data_ptr() == q.data_ptr(), k_out.data_ptr() == k.data_ptr(), positions is None, writes is None)
    fn = _function(bound, known, args, _STEPS[pair_dim])
    if fn is None or _run(fn, args) is _FAILED:
        return False
    paths.took("torch_cpu.compiled_step")
    if writes is not None:
        paths.took("torch_cpu.compiled_write")
    return True


def one_token(args, graph, bound: dict):
    """``_one``'s ``q_rot, k_rot`` for ``args`` (q, k, v, cos, sin, positions, slots, k_pool, v_pool, k_scale,
    v_scale), the pools written, in one compiled call; None where it did not run (not compiled yet, or
    compiling failed): nothing is written then. ``graph``: a ``Graph`` of ``_one``; ``bound``: as
    ``_function``'s."""
    fn = _function(bound, "one", args, graph)
    if fn is None:
        return None
    out = _run(fn, args)
    if out is _FAILED:
        return None
    paths.took("torch_cpu.compiled_one_token")
    return out


_FAILED = object()


def _run(fn, args):
    """``fn(*args)``'s result, or _FAILED where it raised."""
    try:
        return fn(*args)  # inductor's code asserts every size and stride before it writes
    except Exception as e:  # a layout its asserts reject: the ops, from now on
        _give_up(f"{type(e).__name__}: {e}")
        return _FAILED


def _give_up(problem: str) -> None:
    _state["failed"] = True
    warnings.warn(f"ropepool: inductor's CPU rotation is not used ({problem}); using torch ops instead (slower "
                  "from 256 tokens on). Set ROPEPOOL_CPU_COMPILE=off to skip compiling.", RuntimeWarning,
                  stacklevel=6)
