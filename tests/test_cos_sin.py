"""The Triton kernel's cos/sin (``triton_kernel._cos_sin``) against float64 on float32 angles of every size.

The same function runs under the CPU interpreter (CI) and compiled on a GPU. Bounds (docs/precision.md):
within 1e-7 of the exact cos/sin up to 2^26 rad (about 1.6 float32 steps of values near 1; NumPy's own
float32 cos is within 6.9e-8), within 2e-7 up to 2^31.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ropepool.backends.triton_kernel import _cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU, and TRITON_INTERPRET is not 1")
BLOCK = 1 << 14


@triton.jit
def cos_sin_kernel(a_ptr, c_ptr, s_ptr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c, s = _cos_sin(tl.load(a_ptr + o))
    tl.store(c_ptr + o, c)
    tl.store(s_ptr + o, s)


def angles(rng, lo, hi, n=8 * BLOCK):
    """float32 angles as the kernel forms them (float32(p) * inv_freq), with the worst cases of a reduction:
    the float32 numbers nearest to odd multiples of pi/4 (quadrant edges) and to multiples of pi/2."""
    inv = (500000.0 ** (-np.arange(0, 128, 2) / 128)).astype(np.float32)
    a = rng.integers(lo, hi, n).astype(np.float32) * inv[rng.integers(0, 4, n)]
    k = rng.integers(max(1, int(lo / (np.pi / 4))), int(hi / (np.pi / 4)), n // 4)
    a[: n // 4] = (k * (np.pi / 4)).astype(np.float32)
    return a.astype(np.float32)


@pytest.mark.parametrize("lo, hi, bound", [(0, 2**12, 1e-7), (0, 2**24, 1e-7), (2**24, 2**26, 1e-7),
                                           (2**26, 2**31, 2e-7)])
def test_cos_sin_accurate(lo, hi, bound, rng):
    a = angles(rng, lo, hi)
    x = torch.from_numpy(a).to(DEVICE)
    c, s = torch.empty_like(x), torch.empty_like(x)
    cos_sin_kernel[(a.size // BLOCK,)](x, c, s, BLOCK=BLOCK)
    exact = a.astype(np.float64)
    err = max(np.abs(c.cpu().numpy() - np.cos(exact)).max(), np.abs(s.cpu().numpy() - np.sin(exact)).max())
    assert err <= bound, f"angles in [{lo}, {hi}): cos/sin off by {err:.3g}"
