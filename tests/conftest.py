"""Fixtures: ``backend`` (every backend that can run here, or a skip saying why) and ``rng``.

Imports no framework it does not find: the no-torch CI job runs the MLX,
oracle and validation tests with this conftest.
"""
import ctypes
import os
import platform
import re

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




# The quick subset for contributors, `python -m pytest -q -m "not slow"` (README): these modules compile graphs
# with inductor, run the CLI and the benchmarks in processes of their own, or sweep properties and transformers'
# modules, and the Triton kernel's cases run under its CPU interpreter; together about four fifths of the
# suite's time on a 2-core CPU. Their tests carry the marker `slow`; everything else is the quick subset.
SLOW_MODULES = frozenset({"test_amx_layout.py", "test_bench_summary.py", "test_benchmarks.py", "test_cli.py",
                          "test_compile.py", "test_cpu_one_token.py", "test_cpu_path.py", "test_dsa_ops.py",
                          "test_hf_conformance.py", "test_memory.py", "test_property.py"})


def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.path.name in SLOW_MODULES or callspec is not None and re.search(r"\btriton\b", callspec.id):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    config.addinivalue_line("markers", "big: too big for the Triton CPU interpreter; there the triton backend "
                                       "skips it (it runs on CUDA)")
    config.addinivalue_line("markers", "torch_only: as big, for the modules on tests/torch_fixtures.py")


@pytest.fixture(params=["torch", "triton", "mlx"])
def backend(request):
    """The torch path, the Triton kernel (on CUDA, else under the CPU interpreter) and MLX."""
    return backend_for(request.param, big=request.node.get_closest_marker("big") is not None)


def _for_triton(request) -> bool:
    """Whether a test is generated for the Triton backend (a parameter ``"triton"``, or the ``backend``
    fixture's)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    return any(value == "triton" or getattr(value, "name", None) == "triton" for value in params.values())


@pytest.fixture(autouse=True)
def triton_cases_on_cuda(request, monkeypatch):
    """On a machine with CUDA, a Triton case whose call gets CPU tensors fails: there the call would be
    refused, or picked by the torch code instead, and the Triton kernel would not run at all."""
    if not (HAS["torch"] and HAS["triton"] and _for_triton(request)):
        yield
        return
    import torch

    if not torch.cuda.is_available():
        yield
        return
    from ropepool import plan

    make = plan.make

    def make_on_cuda(call, q, *args, **kwargs):
        device = getattr(q, "device", None)
        if device is not None and device.type != "cuda":
            pytest.fail(f"a Triton case called ropepool with tensors on {device}; this machine has CUDA: make "
                        "the test's arrays on the backend's device (Backend.array, or .to(backend.device))")
        return make(call, q, *args, **kwargs)

    monkeypatch.setattr(plan, "make", make_on_cuda)
    yield


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
