"""sglang's MLX backend with ropepool as its fused RoPE + KV-pool kernel, no Metal extension to build.

sglang's MLX model runner (``sglang.srt.hardware_backend.mlx``) can do each
decode step's RoPE and KV-pool write in one call: with
``SGLANG_MLX_USE_CUSTOM_ROPE=1`` it runs ``from sgl_kernel import metal`` and
takes ``metal.rope_pool_fused`` when ``metal._metal`` is set and
``metal._IMPORT_ERROR`` is None (``sglang/srt/hardware_backend/mlx/aot.py``,
``_load_metal_rope_pool_fused``, sglang 0.5.23). Without sgl-kernel's native
Metal extension it falls back to ``mx.fast.rope`` and writes the pool later.

``install()`` makes that import find ropepool: it registers a module
``sgl_kernel.metal`` in ``sys.modules`` whose ``rope_pool_fused`` is
:func:`rope_pool_fused` below (``ropepool.rope_pool_fused`` on MLX arrays).
Where ``sgl_kernel`` itself cannot be imported, a stand-in package module
``sgl_kernel`` holding only ``metal`` is registered too. Nothing of sglang is
patched, and a working ``sgl_kernel.metal`` (the native extension loaded) is
left alone unless ``force=True``. Call it before sglang builds its model
runner (the runner reads the kernel once, when it is made)::

    import os
    os.environ["SGLANG_MLX_USE_CUSTOM_ROPE"] = "1"
    from ropepool.integrations import sglang
    sglang.install()
    # ... then start sglang's MLX engine in this process

sglang's server starts its scheduler in a fresh process; there the package's
``sglang.srt.plugins`` entry point (sglang loads that group in every process)
calls :func:`plugin`, which installs when ``SGLANG_MLX_USE_CUSTOM_ROPE`` is on.
sglang's own gate still decides which models take the kernel (docs/engines.md).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

from .. import api

_STANDIN = "__ropepool_standin__"   # marks the modules this file registered
_saved: dict[str, object] = {}      # what install() replaced, for uninstall()
_MISSING = object()


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
                    rope_base=10000.0):
    """``sgl_kernel.metal.rope_pool_fused``'s call, served by ``ropepool.rope_pool_fused(..., backend="mlx")``.

    sglang passes ``q [B, num_qo_heads, head_dim]``, ``k``, ``v [B, num_kv_heads, head_dim]``,
    ``positions`` and ``slots [B]`` (int32; -1: no write) and one layer's ``k_pool``, ``v_pool``
    ``[pool_size, num_kv_heads, head_dim]``; it rebinds the layer's buffers to the returned pools.
    """
    return api.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                               num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
                               backend="mlx")


def installed() -> bool:
    """Whether ``from sgl_kernel import metal`` now gives ropepool's module."""
    return getattr(sys.modules.get("sgl_kernel.metal"), _STANDIN, False)


def install(force: bool = False) -> bool:
    """Register ropepool as ``sgl_kernel.metal`` for sglang's MLX backend.

    Parameters
    ----------
    force : bool
        Replace a working ``sgl_kernel.metal`` too. By default one whose native
        Metal extension loaded (the test sglang applies) is kept.

    Returns
    -------
    bool
        True when ropepool serves ``sgl_kernel.metal.rope_pool_fused`` after
        the call, False when a working native module was kept. Calling it
        again changes nothing.
    """
    if installed():
        return True
    if not force and _native_metal() is not None:
        return False
    metal = _module("sgl_kernel.metal", "ropepool's stand-in for sgl_kernel's Metal RoPE + KV-pool kernel")
    metal.rope_pool_fused = rope_pool_fused
    metal._metal = metal          # sglang's check: not None means the native extension loaded
    metal._IMPORT_ERROR = None
    parent = sys.modules.get("sgl_kernel")
    if parent is None:
        parent = _module("sgl_kernel", "ropepool's stand-in: only sgl_kernel.metal (sgl_kernel is not installed)",
                         package=True)
        _replace("sgl_kernel", parent)
    _saved.setdefault("sgl_kernel.metal attr", getattr(parent, "metal", _MISSING))
    parent.metal = metal
    _replace("sgl_kernel.metal", metal)
    return True


def uninstall() -> None:
    """Undo :func:`install`: the modules (and ``sgl_kernel.metal``) that were there before come back."""
    if not installed():
        return
    parent = sys.modules.get("sgl_kernel")
    attr = _saved.pop("sgl_kernel.metal attr", _MISSING)
    if parent is not None:
        if attr is _MISSING:
            vars(parent).pop("metal", None)
        else:
            parent.metal = attr
    for name in ("sgl_kernel.metal", "sgl_kernel"):
        if name in _saved:
            old = _saved.pop(name)
            if old is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def plugin() -> None:
    """sglang's general-plugin hook (entry point group ``sglang.srt.plugins``): install() where the user
    turned sglang's custom RoPE kernel on (``SGLANG_MLX_USE_CUSTOM_ROPE``, read by sglang); otherwise nothing."""
    from sglang.srt.environ import envs

    if envs.SGLANG_MLX_USE_CUSTOM_ROPE.get():
        install()


def _native_metal():
    """The importable ``sgl_kernel.metal`` whose native extension loaded, else None (sglang's own test)."""
    try:
        metal = importlib.import_module("sgl_kernel.metal")
    except Exception:   # a CUDA build of sgl_kernel can fail with OSError or RuntimeError on a Mac
        return None
    if getattr(metal, "_metal", None) is None or getattr(metal, "_IMPORT_ERROR", None) is not None:
        return None
    return metal


def _module(name: str, doc: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    setattr(module, _STANDIN, True)
    return module


def _replace(name: str, module: types.ModuleType) -> None:
    _saved.setdefault(name, sys.modules.get(name, _MISSING))
    sys.modules[name] = module
