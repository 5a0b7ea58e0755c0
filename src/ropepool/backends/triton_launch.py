"""One Triton launcher bound to one tensor layout: its compiled variants and the direct launch.

``triton_op.Launcher.bind`` makes a ``Launch`` per layout (strides, dtypes).
The first launch of a variant goes through Triton's JIT, which compiles and
returns the kernel; later launches hand the data pointers, as ints, straight
to the compiled kernel, skipping the JIT's per-argument specialisation: at
decode sizes the host time is the call's time.
"""
from __future__ import annotations

import inspect

import torch
import triton

from ..core.args import OTHER_LAYOUT
from ..errors import OtherLayout
from . import triton_native
from .triton_kernel import INTERPRET, rope_pool_kernel

CONSTEXPRS = [n for n, p in inspect.signature(rope_pool_kernel.fn).parameters.items()
              if p.annotation in ("tl.constexpr", triton.language.constexpr)]
# Bounds: plain data and Triton's compiled kernels (no caller tensor); past its bound it is emptied and
# refilled (a kernel is then found again in Triton's own cache).
_KERNELS: dict = {}  # (constexpr values, warps, ...) -> compiled kernel, shared by every launcher; MAX_ENTRIES
MAX_ENTRIES = 1024

_stream_of = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None
# Read on every eager call: looked up once (a profiler sets its hooks on this object, not a new one).
_RUNTIME = triton.knobs.runtime if hasattr(triton, "knobs") else None
_empty_like, _CONTIGUOUS = torch.empty_like, torch.contiguous_format
_LAUNCHED = triton_native.LAUNCHED


class Launch:
    """One launcher bound to one layout (strides, dtypes): its compiled variants and the direct launch.

    Everything that does not change from call to call is worked out here, so
    a call reads only the data pointers: the host time of a decode step.
    An eager plan's runner is this object itself (``adopt``), so a call is
    one Python frame from the layout cache to Triton's C launcher.
    """

    def __init__(self, launcher, strides: dict, offsets: tuple):
        # The slots' bound: the plan's pool geometry's (the kernel writes no slot outside [0, pool_size)).
        self.launcher, self.offsets, self.pool_size = launcher, offsets, launcher.geom.pool_size
        self.small_tokens = launcher.small_tokens
        self.constexprs = tuple({n: {**f, **strides}[n] for n in CONSTEXPRS} for f in launcher.features)
        self.tails = tuple(tuple(c.values()) for c in self.constexprs)
        self.kernels: dict = {}  # (variant, alignment) -> compiled kernel
        self.extras, self.long_from, self.table_ref, self.scale_views = None, None, None, None  # adopt
        self.more = None  # the pointers after the arrays, when they never change (adopt)
        # Per variant, once compiled: (C launch function, programs a token, the args before the arrays',
        # the args after them).
        self.direct = [None, None]
        # The same as one C++ call (triton_native), where it can run: (per variant) its spec, and the launcher.
        self.specs, self.native = [None, None], None

    @property
    def checks_layout(self) -> bool:
        """Whether a call of another layout is refused before anything is done (``OtherLayout``), as the layout
        cache's key-only lookup requires (plan/cache.py): once the native launcher is made."""
        return self.native is not None

    def adopt(self, extras: tuple, long_from, fixed: bool, table_ref=None, scale_views=None) -> "Launch":
        """This layout as an eager plan's runner: the plan's extra tensors (``fixed``: their memory
        never changes, so their pointers are read once) and where LongRoPE switches factors. The engine's
        table is kept as ``table_ref`` (weak), the scale caches as ``scale_views`` (a function making their
        views per call from weak references): the layout cache keeps this runner, not the caller's arrays."""
        self.extras, self.long_from = extras._replace(table=None, k_scale_cache=None, v_scale_cache=None), long_from
        self.table_ref, self.scale_views = table_ref, scale_views
        if fixed:
            self.more = _more_pointers(None, extras)
        return self

    def __call__(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None, use_long=None,
                 extras=None):
        """One call; returns q_out, k_out (new, contiguous, where not given) and the pools. Eager calls
        give neither ``use_long`` nor ``extras`` (the adopted ones are used); the custom op gives both."""
        # empty_like is the cheapest allocation on the host (no size argument to parse; two views of one
        # allocation cost more than two allocations).
        if q_out is None:
            q_out = _empty_like(q, memory_format=_CONTIGUOUS)
        if k_out is None:
            k_out = _empty_like(k, memory_format=_CONTIGUOUS)
        native = self.native
        # The whole launch of a decode step in one C++ call, which first compares the arrays with the layout it
        # was made for (checks_layout). DECLINED where it does not launch (a variant not compiled yet, an
        # unaligned array, no token, a launch hook set): the launch below handles those.
        if native is not None:
            done = native(not _hooked(_RUNTIME), q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
            if done == _LAUNCHED:
                return q_out, k_out, k_pool, v_pool
            if done == OTHER_LAYOUT:
                raise OtherLayout("the native CUDA launcher was handed arrays of another layout than the one it was "
                                  "made for; nothing was written. Fix: report it (a bug of ropepool's), with the "
                                  "call's shapes and strides.")
        T = q.shape[0]
        large = T > self.small_tokens  # the variant: 0 (decode-sized) or 1
        k_off, v_off = self.offsets
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                k_pool.data_ptr() + k_off, v_pool.data_ptr() + v_off, q_out.data_ptr(), k_out.data_ptr())
        direct = self.direct[large]
        # Triton specialises on which pointers are 16-byte aligned: almost always all are.
        if direct is not None and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[7]
                                       | ptrs[8]) % 16 and not _hooked(_RUNTIME):
            # The whole launch of a decode step: nothing is looked up but the stream.
            launch, split, lead, tail = direct
            launch(T, split, 1, _stream_of(q.get_device()), *lead, *ptrs, *tail)
        elif T:
            if extras is None:
                extras, use_long = self.extras, long_factors(positions, self.long_from)
                if self.table_ref is not None:
                    extras = extras._replace(table=self.table_ref())
                if self.scale_views is not None:
                    k_sc, v_sc = self.scale_views()
                    extras = extras._replace(k_scale_cache=k_sc, v_scale_cache=v_sc)
            self.launch(T, large, ptrs, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, extras)
        return q_out, k_out, k_pool, v_pool

    def launch(self, T, variant, ptrs, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, extras):
        """Any call: through the compiled kernel of its alignment, or the JIT the first time."""
        ln = self.launcher
        more = _more_pointers(use_long, extras) if self.more is None else self.more
        bits = 0
        for p in ptrs + more:
            bits |= p or 0
        align = True if bits % 16 == 0 else tuple(p is None or p % 16 == 0 for p in ptrs + more)
        scalars = (self.pool_size, positions.stride(0) if positions.ndim == 2 else 0)
        kernel = self.kernels.get((variant, align))
        split = ln.splits[variant]
        if kernel is not None:
            # What JITFunction.run does once it has found the compiled kernel.
            stream = _stream_of(q.get_device())
            hooks = triton.knobs.runtime
            args = (*ptrs, *more, *scalars, *self.tails[variant])
            if _hooked(hooks):
                kernel.run(T, split, 1, stream, kernel.function, kernel.packed_metadata,
                           kernel.launch_metadata((T, split, 1), stream, *args), hooks.launch_enter_hook,
                           hooks.launch_exit_hook, *args)
            else:
                kernel.run(T, split, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
            return
        # First launch of this variant (or the interpreter): through the JIT, with tensors.
        # The written layer as a tensor (the interpreter copies whole storages, so one element will do).
        pools = [p.as_strided((1,), (1,), p.storage_offset() + off // p.element_size()) if off else p
                 for p, off in zip((k_pool, v_pool), self.offsets)]
        kernel = rope_pool_kernel[(T, split, 1)](
            q, k, v, positions, slots, *pools, q_out, k_out, use_long, *extras, *scalars,
            **self.constexprs[variant], num_warps=ln.warps)
        if INTERPRET or not _fast_launch_ok(kernel):
            return
        key = (tuple(self.constexprs[variant].values()), ln.warps, align, self.pool_size >= 2**31,
               tuple(x is None for x in more), q.dtype, k.dtype, k_pool.dtype, q_out.dtype, k_out.dtype,
               positions.dtype, slots.dtype)
        if len(_KERNELS) >= MAX_ENTRIES:
            _KERNELS.clear()
        kernel = self.kernels[(variant, align)] = _KERNELS.setdefault(key, kernel)
        if align is True and self.more is not None and positions.ndim == 1:
            launch, lead = _direct_launch(kernel)
            self.direct[variant] = (launch, split, (*lead, None, None, None), (*more, *scalars, *self.tails[variant]))
            self.specs[variant] = triton_native.spec(kernel, split, self.offsets, (*more, *scalars,
                                                                                   *self.tails[variant]))
            native = triton_native.make(self.small_tokens, self.specs, (q, k, v, positions, slots, k_pool, v_pool,
                                                                        q_out, k_out))
            if native is not None:  # (else the last one stays: a runner found by its key alone must check layouts)
                self.native = native


def _direct_launch(kernel) -> tuple:
    """(function, leading args) that launch ``kernel`` given (grid, stream, leading args, launch metadata,
    enter hook, exit hook, kernel args): the last three None, as no hook is set.

    Triton 3.6's CudaLauncher.__call__ only allocates scratch memory (none for
    this kernel) before calling its C launch function: calling that directly
    skips two Python frames per launch. Other versions go through kernel.run.
    """
    run = kernel.run
    if (triton.__version__.startswith("3.6.") and hasattr(run, "launch") and not run.global_scratch_size
            and not run.profile_scratch_size):
        return run.launch, (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                            kernel.packed_metadata)
    return run, (kernel.function, kernel.packed_metadata)


def _hooked(runtime) -> bool:
    """Whether a launch hook is set (a profiler's): Triton 3.4-3.5 keep None when none is, 3.6 an empty
    HookChain, which the C launcher would still call twice per launch, and whose launch metadata
    (a dict of every argument) costs more than the launch."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def long_factors(positions, long_from):
    """LongRoPE's choice of factors, on the device: whether any position reaches ``long_from``."""
    return None if long_from is None or not positions.numel() else positions.max() >= long_from


def _more_pointers(use_long, extras) -> tuple:
    """The kernel's pointers after the call's arrays (core/args.POINTERS), as ints."""
    return tuple(None if x is None else x.data_ptr() for x in (use_long, *extras))


def _fast_launch_ok(kernel) -> bool:
    """The direct launch is written for Triton's launcher of 3.4 and later (triton.knobs)."""
    return hasattr(triton, "knobs") and all(
        hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))
