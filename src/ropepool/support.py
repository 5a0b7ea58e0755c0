"""What each backend row implements: features declared positively, as data.

A plan names the features its call uses (``plan.build``: the rotation's, each store's ``stores.feature``, the
torch call's). A backend row (backends/__init__.py) is picked only if it implements all of them and no set of
them is one it does not take together (``apart``: a routing rule, as data). Each format module (formats/)
names the rows that write it (``BACKENDS``). The checks read ``SUPPORT`` to refuse, before anything is
written, a feature that no row of the call's framework implements (checks/refusals.py); they import no
backend.

A new feature is implemented by no row until a row below (or a format's ``BACKENDS``) names it.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import formats

ROTATION = frozenset({"norm", "mrope", "table", "longrope", "latent"})
SCALED = frozenset({"pool.scaled", "q_out.scaled", "k_out.scaled"})  # fp8 pools and outputs, a fixed scale
FORMATS = frozenset(formats.ROWS)  # the formats of formats/: "pool.<name>"
BLOCK = frozenset(f"pool.{name}" for name in formats.BLOCK)  # block-quantized (tuple) pools
DSA = frozenset(f"pool.{name}" for name in (*formats.BYTES, formats.NONE))  # DeepSeek V3.2's byte caches
TORCH = frozenset({"autograd", "traced"})  # q/k/v require grad; traced by torch.compile
LAYOUT = frozenset({"layout.amx"})  # tiled pools (core/layout.py: TILED): vLLM's CPU AMX cache
ALL = ROTATION | SCALED | FORMATS | TORCH | LAYOUT


@dataclass(frozen=True)
class Support:
    framework: str
    features: frozenset
    apart: tuple = ()  # sets of features the row does not take together


def _formats(module: str) -> frozenset:
    """The formats whose modules name the row ``module`` among their ``BACKENDS``."""
    return frozenset(f for f, rows in formats.ROWS.items() if module in rows)


# Keyed by the row's module (backends.BACKENDS).
SUPPORT = {
    # Block pools: not with an fp8 k_out (the kernel quantizes k_rot as returned, read back from k_out), nor traced
    # (the custom op takes no tuples).
    ".triton_op": Support("torch", ROTATION | SCALED | TORCH | LAYOUT | _formats(".triton_op"),
                          tuple(frozenset({b, f}) for b in sorted(BLOCK) for f in ("k_out.scaled", "traced"))),
    # The compiled CPU kernel: per-token-head, block and DeepSeek V3.2's caches, autograd and tracing stay on the
    # general torch code.
    ".torch_native": Support("torch", ROTATION | SCALED | LAYOUT),
    ".torch_eager": Support("torch", ROTATION | SCALED | TORCH | LAYOUT | _formats(".torch_eager")),
    ".mlx": Support("mlx", ROTATION | {"pool.scaled"} | _formats(".mlx")),
}


def takes(framework: str, feature: str) -> bool:
    """Whether a row of ``framework`` implements ``feature`` (a framework without rows, NumPy's oracle: yes)."""
    rows = [s for s in SUPPORT.values() if s.framework == framework]
    return not rows or any(feature in s.features for s in rows)
