"""A property test: random shapes, dtypes, head counts, positions, slots and pools, against the oracle.

On the torch and MLX backends (the Triton interpreter is too slow for
examples by the dozen; the named cases cover it). Checks as
tests.harness.run_checked: q_rot / k_rot within harness.TOL, pool memory bit
for bit (written rows == the returned k_rot row and the given v row, the
rest untouched), inputs unchanged.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import FLOATS, Cache, backend_for, poison, randn, run_checked


@st.composite
def calls(draw):
    T = draw(st.integers(1, 40))
    pool_size = T + draw(st.integers(0, 24))
    slots = draw(st.lists(st.integers(0, pool_size - 1), min_size=T, max_size=T, unique=True))
    skip = draw(st.lists(st.booleans(), min_size=T, max_size=T))
    layers = draw(st.one_of(st.none(), st.integers(1, 3)))
    return dict(
        T=T, num_qo_heads=draw(st.integers(1, 8)), num_kv_heads=draw(st.integers(1, 4)), pool_size=pool_size,
        head_dim=draw(st.one_of(st.integers(1, 32).map(lambda n: 2 * n), st.sampled_from([80, 96, 128, 256]))),
        slots=np.array([-1 if s else slot for slot, s in zip(slots, skip)], draw(st.sampled_from(["int32", "int64"]))),
        positions=np.array(draw(st.lists(st.integers(0, 1_000_000), min_size=T, max_size=T)),
                           draw(st.sampled_from(["int32", "int64"]))),
        dtype=draw(st.sampled_from(FLOATS)), layers=layers,
        layer=None if layers is None else draw(st.integers(-layers, layers - 1)),
        rope_base=draw(st.sampled_from([10000.0, 500000.0, 1e6])), seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.fixture(params=["torch", "mlx"])
def fast_backend(request):
    return backend_for(request.param)


# The fixture is an immutable Backend: sharing it between examples is fine.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=calls())
def test_matches_oracle(fast_backend, c):
    X = fast_backend
    rng = np.random.default_rng(c["seed"])
    T, hq, hkv, d, dt = c["T"], c["num_qo_heads"], c["num_kv_heads"], c["head_dim"], c["dtype"]
    lead = () if c["layers"] is None else (c["layers"],)
    cache = Cache([randn(rng, *lead, c["pool_size"], hkv, d, dtype=dt) for _ in range(2)], layer=c["layer"])
    run_checked(X, *(randn(rng, T, h, d, dtype=dt) for h in (hq, hkv, hkv)), c["positions"], c["slots"],
                poison(cache, c["slots"]), rope_base=c["rope_base"])
