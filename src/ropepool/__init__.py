"""ropepool: RoPE on q/k and the KV-pool write, in one fused step."""
from . import reference
from ._version import __version__
from .api import rope_latent_fused, rope_pool_fused
from .errors import RopePoolError
from .norm import QKNorm
from .spec import CosSinCache, RopeSpec
from .validate import validate_slots

__all__ = ["rope_pool_fused", "rope_latent_fused", "RopeSpec", "CosSinCache", "QKNorm", "RopePoolError",
           "validate_slots", "reference", "__version__"]
