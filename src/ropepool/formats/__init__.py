"""One module per cache format: its constants, its check, its oracle rows, its array-op store, and the backend
rows that implement it (``BACKENDS``: support.py builds each row's features from them).

Each module names: ``NAME`` (the ``Store.format`` and the feature ``"pool.<NAME>"``), ``MEANS`` (what a
destination of that format stores), ``BACKENDS`` (the modules of the backend rows that write it), and the
functions of its kind. The block-quantized formats (a cache passed as a tuple of arrays, ``BLOCK``):
``PARTS`` (what each array holds), ``GLOBAL_SCALE`` (whether k_scale / v_scale apply), ``check(names, pools,
head_dim, q, fw)`` -> the Store's fields, ``oracle_rows(x, store)`` (NumPy), ``rows(x, store, scale, ops)``
(torch and MLX array math). The byte formats (DeepSeek V3.2's caches, a uint8 cache written through views,
``BYTES``): ``check``, the NumPy model, ``rows`` and ``put(fmt, pool, geom, page, row, rows, ops)`` (torch).
``per_token_head`` (vLLM's int8 / fp8 pools with a scale per row): its models, ``oracle_rows`` and ``rows``.
The kernel's store of each is in backends/triton_stores.py (per-token-head: the kernel's ``PTH`` branch).
"""
from . import affine, fp8_ds_mla, indexer, nvfp4, per_token_head

BLOCK = {m.NAME: m for m in (nvfp4, affine)}
BLOCK_BY_PARTS = {len(m.PARTS): m for m in BLOCK.values()}  # a tuple's length names its format
BYTES = {fp8_ds_mla.NAME: fp8_ds_mla, **{name: indexer for name in indexer.NAMES}}
NONE = "none"  # the store of a destination the call has not (the indexer's key has no value)
# Each format's feature -> the modules of the backend rows that write it (support.py).
ROWS = {**{f"pool.{n}": m.BACKENDS for n, m in {**BLOCK, **BYTES}.items()}, f"pool.{NONE}": indexer.BACKENDS,
        f"pool.{per_token_head.NAME}": per_token_head.BACKENDS}
