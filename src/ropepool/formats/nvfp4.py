"""FlashInfer's NVFP4 KV cache: e2m1 codes two a byte and an e4m3 scale per block of 16."""
from __future__ import annotations

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
