"""Which backends a test is generated for: only those that can take it, so no test id skips everywhere.

conftest's ``backend`` fixture (and test_errors' ``X``) runs each test on the
torch path, the Triton kernel and MLX, and skips where this machine lacks one
(no torch in the MLX job, no GPU). A case a backend can never take (MLX has
no float8_e5m2, no views to write through, no torch outputs) is not
generated for it: it would skip on every machine, a test that is no test
(issue 27). These decorators parametrize the fixture themselves, so pytest
generates only the pairs that run::

    @on_torch  # MLX arrays have no views to write through
    def test_views(backend): ...

    @on_backends("fp8", ["float8_e4m3fn", "float8_e5m2"], can=lambda b, fp8: mlx_has(b, fp8))
    def test_pool(backend, fp8): ...  # ids torch-float8_e4m3fn, ..., mlx-float8_e4m3fn
"""
from __future__ import annotations

import pytest

BACKENDS = ("torch", "triton", "mlx")
TORCH_BACKENDS = ("torch", "triton")
MLX_LACKS = ("float8_e5m2",)  # MLX keeps e4m3 in uint8 (mx.to_fp8) and has no other fp8 type


def framework(backend: str) -> str:
    return "mlx" if backend == "mlx" else "torch"


def mlx_has(backend: str, dtype) -> bool:
    """False for MLX and a dtype it has no array of."""
    return backend != "mlx" or dtype not in MLX_LACKS


def on_backends(argnames: str, cases, can, fixture: str = "backend"):
    """Parametrize ``fixture`` (indirectly) and ``argnames`` together: each case on each backend for which
    ``can(backend, *values)`` holds. ``cases``: pytest.param objects (ids and marks kept), or values (a
    tuple per case; with one argname the value itself). Ids read ``<backend>-<case id>``, as with the
    fixture's own parameters."""
    params = []
    for i, case in enumerate(cases):
        if hasattr(case, "values"):
            values, marks, name = case.values, case.marks, case.id if case.id is not None else str(i)
        else:  # as pytest names them: the values joined by "-"
            values, marks = ((case,) if "," not in argnames else tuple(case)), ()
            name = "-".join(map(str, values))
        params += [pytest.param(b, *values, id=f"{b}-{name}", marks=marks) for b in BACKENDS if can(b, *values)]
    return pytest.mark.parametrize(f"{fixture},{argnames}", params, indirect=[fixture])


# The torch backends only, for a feature MLX's arrays cannot have (views, torch outputs): ``@on_torch``.
on_torch = pytest.mark.parametrize("backend", TORCH_BACKENDS, indirect=True)
