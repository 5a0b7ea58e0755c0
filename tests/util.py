"""Shared test helpers: random inputs, the oracle on them, comparisons."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import ropepool

# Max |out - ref| allowed, relative to max(1, |ref|): float32 arithmetic and
# sin/cos; one rounding of the result to the dtype (bf16: 2^-8, f16: 2^-11).
TOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1.2e-2}
NP_DTYPES = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """float64 for float tensors (fp8 kept as ml_dtypes fp8), ints as they are."""
    x = x.detach().cpu()
    if x.dtype in NP_DTYPES:
        return x.contiguous().view(torch.uint8).numpy().view(NP_DTYPES[x.dtype])
    if x.is_floating_point():
        return x.double().numpy()
    return x.numpy()


def oracle(*arrays, **kwargs):
    return ropepool.reference.rope_pool_fused(*(to_numpy(a) for a in arrays), **kwargs)


def assert_close(name, out: torch.Tensor, ref: np.ndarray, dtype):
    got = to_numpy(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} vs {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN (unwritten?) at {np.argwhere(np.isnan(got))[:5].tolist()}"
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    tol = TOL[dtype]
    if err.max() > tol:
        bad = np.argwhere(err > tol)[:5].tolist()
        raise AssertionError(f"{name}: max rel err {err.max():.3g} > {tol} for {dtype}; first at {bad}")


def random_slots(T: int, pool_size: int, gen, skip_every: int = 0) -> torch.Tensor:
    """Unique shuffled slots; every skip_every-th token gets -1."""
    slots = torch.randperm(pool_size, generator=gen)[:T]
    if skip_every:
        slots[::skip_every] = -1
    return slots
