"""Fixtures: ``backend`` (every backend that can run here, or a skip saying why) and ``rng``.

Imports no framework it does not find: the no-torch CI job runs the MLX,
oracle and validation tests with this conftest.
"""
import ctypes
import os
import platform

import numpy as np
import pytest

from tests.harness import HAS, backend_for

# Without a GPU the Triton kernel runs under its interpreter, so a broken
# kernel fails CI too. Must be set before triton is imported.
if HAS["torch"] and HAS["triton"]:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# glibc serves an allocation from mmap, returned to the system when freed, only above a threshold that
# it raises after each such free (up to 32 MB); below it, freed memory stays in the process. The suite
# makes and drops many arrays, tables and models of a few MB to tens of MB, so with the moving
# threshold its resident memory only grew (test_hf_conformance.py: 2.0 GB, 0.9 GB with it fixed).
# Fixed at 128 KB (glibc's default start), as MALLOC_MMAP_THRESHOLD_=131072 would fix it.
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    ctypes.CDLL(None).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD




def pytest_configure(config):
    config.addinivalue_line("markers", "big: too big for the Triton CPU interpreter; there the triton backend "
                                       "skips it (it runs on CUDA)")
    config.addinivalue_line("markers", "torch_only: as big, for the modules on tests/torch_fixtures.py")


@pytest.fixture(params=["torch", "triton", "mlx"])
def backend(request):
    """The torch path, the Triton kernel (on CUDA, else under the CPU interpreter) and MLX."""
    return backend_for(request.param, big=request.node.get_closest_marker("big") is not None)


@pytest.fixture
def rng(request):
    """A NumPy generator, a fresh seed each run (ROPEPOOL_SEED=<n> repeats one); a failing test reports it."""
    seed = int(os.environ.get("ROPEPOOL_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"rerun with ROPEPOOL_SEED={value}"))
