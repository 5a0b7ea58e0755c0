"""Fixtures for the modules that test against transformers and vLLM with torch tensors.

They override conftest's framework-neutral ``backend`` (a harness Backend) and
``rng`` (a NumPy generator) with torch's own: ``backend`` is the name "torch"
or "triton" (the interpreter skips cases marked ``torch_only``), ``rng`` a
seeded torch.Generator whose seed a failing test reports. Import them into a
module: ``from tests.torch_fixtures import DEVICE, backend, rng  # noqa: F401``.
"""
import os

import pytest
import torch

from tests.harness import backend_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    backend_for(request.param, big=request.node.get_closest_marker("torch_only") is not None)  # skips with a reason
    return request.param


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("ROPEPOOL_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)
