import importlib.util
import os

import pytest
import torch

# Without a GPU the Triton kernel runs under its interpreter, so a broken
# kernel fails CI too. Must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """The torch path, and the Triton kernel (on CUDA, or under the interpreter on CPU)."""
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU, and TRITON_INTERPRET is not 1")
        if DEVICE == "cpu" and request.node.get_closest_marker("torch_only"):
            pytest.skip("too big for the Triton CPU interpreter (runs on CUDA)")
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_only: too big for the Triton CPU interpreter; on CPU the "
                                       "triton backend skips it (it runs on CUDA)")


@pytest.fixture
def rng(request):
    """A fresh seed each run (ROPEPOOL_SEED=<n> repeats one); a failing test reports it."""
    seed = int(os.environ.get("ROPEPOOL_SEED") or int.from_bytes(os.urandom(4), "little"))
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("seed", f"rerun with ROPEPOOL_SEED={value}"))
