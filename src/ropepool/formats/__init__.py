"""One module per cache format: its constants, its check, its oracle rows, its array-op store, and the backend
rows that implement it (``BACKENDS``: support.py builds each row's features from them).

Each module names: ``NAME`` (the ``Store.format`` and the feature ``"pool.<NAME>"``), ``MEANS`` (what a
destination of that format stores), ``BACKENDS`` (the modules of the backend rows that write it), and the
functions of its kind. The block-quantized formats (a cache passed as a tuple of arrays, ``BLOCK``):
``PARTS`` (what each array holds), ``GLOBAL_SCALE`` (whether k_scale / v_scale apply), ``check(names, pools,
head_dim, q, fw)`` -> the Store's fields, ``oracle_rows(x, store)`` (NumPy), ``rows(x, store, scale, ops)``
(torch and MLX array math). The kernel's store of each is in backends/triton_stores.py.
"""
from . import affine, nvfp4

BLOCK = {m.NAME: m for m in (nvfp4, affine)}
BLOCK_BY_PARTS = {len(m.PARTS): m for m in BLOCK.values()}  # a tuple's length names its format
