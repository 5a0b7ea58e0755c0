"""ropepool: RoPE on q/k and the KV-pool write, in one fused step (the contract: docs/api.md)."""
import sys

from . import reference
from ._version import __version__
from .api import rope_indexer_fused, rope_latent_fused, rope_pool_fused
from .checks.values import validate_slots
from .errors import RopePoolError
from .rotation.norm import QKNorm
from .rotation.spec import CosSinCache, RopeSpec

if sys.modules.get("torch") is not None:  # torch is in use already: ready its backends before anything is compiled
    from .backends import load_torch_backends

    load_torch_backends()

__all__ = ["rope_pool_fused", "rope_latent_fused", "rope_indexer_fused", "RopeSpec", "CosSinCache", "QKNorm",
           "RopePoolError", "validate_slots", "reference", "__version__"]
