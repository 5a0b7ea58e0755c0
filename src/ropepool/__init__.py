"""ropepool: RoPE on q/k and the KV-pool write, in one fused step."""
from . import reference
from .api import rope_pool_fused
from .errors import RopePoolError
from .spec import RopeSpec
from .validate import validate_slots

__all__ = ["rope_pool_fused", "RopeSpec", "RopePoolError", "validate_slots", "reference"]
__version__ = "0.1.0"
