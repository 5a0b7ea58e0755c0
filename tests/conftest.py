import os

import pytest
import torch

# Without a GPU the Triton kernel runs under its interpreter, so a broken
# kernel fails CI too. Must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
