"""A property test: random shapes, dtypes, positions, slots and pools, torch path vs the float64 oracle.

Tolerances as tests/util.py TOL (float32 2e-6, float16 1.5e-3, bfloat16
1.2e-2, relative to max(1, |ref|)); pool memory is compared bit for bit
(written rows == the returned k_rot row and the given v row, the rest
untouched) by run_checked.
"""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.util import plant_poison, run_checked

FLOATS = [torch.float16, torch.bfloat16, torch.float32]
INDEX = [torch.int32, torch.int64]


@st.composite
def calls(draw):
    T = draw(st.integers(1, 40))
    num_kv_heads = draw(st.integers(1, 4))
    num_qo_heads = num_kv_heads * draw(st.integers(1, 4))
    head_dim = draw(st.one_of(st.integers(1, 32).map(lambda n: 2 * n), st.sampled_from([80, 96, 128, 256])))
    pool_size = T + draw(st.integers(0, 24))
    slots = draw(st.lists(st.integers(0, pool_size - 1), min_size=T, max_size=T, unique=True))
    skip = draw(st.lists(st.booleans(), min_size=T, max_size=T))
    slots = [-1 if s else slot for slot, s in zip(slots, skip)]
    positions = draw(st.lists(st.integers(0, 1_000_000), min_size=T, max_size=T))
    layers = draw(st.one_of(st.none(), st.integers(1, 3)))
    return dict(
        T=T, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, pool_size=pool_size,
        slots=torch.tensor(slots, dtype=draw(st.sampled_from(INDEX))),
        positions=torch.tensor(positions, dtype=draw(st.sampled_from(INDEX))),
        dtype=draw(st.sampled_from(FLOATS)), layers=layers,
        layer=None if layers is None else draw(st.integers(0, layers - 1)),
        rope_base=draw(st.sampled_from([10000.0, 500000.0, 1e6])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=50, deadline=None)
@given(calls())
def test_torch_path_matches_oracle(c):
    gen = torch.Generator().manual_seed(c["seed"])
    T, hq, hkv, d, dt = c["T"], c["num_qo_heads"], c["num_kv_heads"], c["head_dim"], c["dtype"]
    q, k, v = (torch.randn(T, h, d, generator=gen).to(dt) for h in (hq, hkv, hkv))
    lead = () if c["layers"] is None else (c["layers"],)
    pools = [torch.randn(*lead, c["pool_size"], hkv, d, generator=gen).to(dt) for _ in range(2)]
    for pool in pools:
        plant_poison(pool if c["layer"] is None else pool[c["layer"]], c["slots"])
    run_checked("torch", q, k, v, c["positions"], c["slots"], pools, layer=c["layer"], head_dim=d,
                num_qo_heads=hq, num_kv_heads=hkv, rope_base=c["rope_base"])
