"""Features no backend row of the call's framework implements (support.py), refused before anything is
written, with the framework's own message."""
from __future__ import annotations

from ..core.dtypes import FRAMEWORK_TYPES
from ..errors import RopePoolError
from ..support import DSA, LAYOUT, takes

FUNCTIONAL = ("mlx", "numpy")  # frameworks whose calls return new arrays: nothing is written in place


def refuse(framework: str, feature: str, **names) -> None:
    """Raise when no row of ``framework`` takes ``feature`` (``names``: the arguments' names for the message).
    NumPy's oracle is functional: outputs written in place are refused as MLX's are."""
    if framework in FUNCTIONAL and (not takes(framework, feature) or framework == "numpy" and
                                    feature in ("out", "q_out.scaled", "k_out.scaled")):
        _functional(framework, feature, **names)


def _functional(framework: str, feature: str, names: str = "", name: str = "") -> None:
    """The refusals of a functional framework (MLX; NumPy's oracle alike): what is written in place."""
    given = FRAMEWORK_TYPES[framework]
    if feature == "pool.per_token_head":
        raise TypeError(f"k_scale_cache/v_scale_cache are for torch tensors; got them with {given} inputs. Fix: drop "
                        "them (MLX calls are functional and return only the pools; per-token-head caches are a torch "
                        "feature, docs/mlx.md).")
    if feature == "out":
        raise TypeError(f"q_out/k_out are for torch tensors; got them with {given} inputs. Fix: drop {names} (MLX and "
                        "NumPy calls are functional).")
    if feature in LAYOUT:
        raise TypeError(f"kv_layout='amx' (vLLM's CPU AMX-packed cache) is for torch tensors; got {given} inputs. "
                        "Fix: pass torch tensors, or kv_layout='HND' for MLX pools (MLX has no strided views, "
                        "which the tiles are written through; docs/layouts.md).")
    if feature in DSA:
        raise TypeError(f"DeepSeek V3.2's caches (fp8_ds_mla rows, the indexer's keys) are for torch tensors; got "
                        f"{given} inputs. Fix: pass torch tensors (the formats are uint8 byte rows that the torch "
                        "backends write through views; MLX has no views, docs/layouts.md).")
    if feature in ("q_out.scaled", "k_out.scaled"):
        raise RopePoolError(f"{name} is for a float8 {name[0]}_out tensor; got {name} without one. Fix: drop {name} "
                            f"(fp8 outputs are torch tensors passed as {name[0]}_out).")
