"""rope_pool_fused on MLX arrays against the float64 oracle, and against the PyTorch path.

On Linux CI this is MLX's CPU backend (mlx-cpu); on a Mac the same tests run
on MLX's default device (its Apple GPU).

Tolerance (tests/util.py TOL), max |out - ref| / max(1, |ref|) against the
float64 oracle: float32 2e-6, float16 1.5e-3, bfloat16 1.2e-2. Exact, bit for
bit: each written pool row (the returned k_rot row and the given v row), every
other element of the pools, and every array the caller passed in (MLX calls
are functional). Laziness: the call evaluates nothing of q/k/v/pools (it runs
under mx.compile, never calls mx.eval, returns unevaluated arrays) and its
graph does not grow with the number of tokens (no per-token Python loop).
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]'): "
                                            "the MLX backend is not tested here")

import ropepool  # noqa: E402
from ropepool import RopeSpec, reference, validate  # noqa: E402
from ropepool.backends import mlx as mlx_backend  # noqa: E402
from ropepool.layout import page_and_row, paged_view  # noqa: E402
from tests.util import TOL as _TORCH_TOL  # noqa: E402
from tests.util import shape_params  # noqa: E402

FLOATS = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOL = {str(d).rsplit(".", 1)[-1]: tol for d, tol in _TORCH_TOL.items()}
INDEX = {"int32": mx.int32, "int64": mx.int64}
UINT = {2: mx.uint16, 4: mx.uint32}
ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")


@pytest.fixture(params=list(FLOATS))
def dtype(request):
    return FLOATS[request.param]


@pytest.fixture
def gen(rng):
    """NumPy randomness seeded from conftest's rng (so a failure reports a seed to rerun)."""
    return np.random.default_rng(int(torch.randint(0, 2**62, (), generator=rng)))


# --- conversions and comparisons ---------------------------------------------------------------

def name_of(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def to64(x: mx.array) -> np.ndarray:
    """float64 for float arrays (bf16 through float32 in MLX), ints as they are."""
    if mx.issubdtype(x.dtype, mx.floating):
        return np.array(x.astype(mx.float32)).astype(np.float64)
    return np.array(x)


def bits(x: mx.array) -> np.ndarray:
    """The raw bits as same-width unsigned ints: NaN payloads and -0.0 compare exactly."""
    return np.array(mx.view(mx.contiguous(x), UINT[x.itemsize]))


def assert_close(name, got: mx.array, ref: np.ndarray, dt):
    g = to64(got)
    assert g.shape == ref.shape, f"{name}: shape {g.shape} vs {ref.shape}"
    assert not np.isnan(g).any(), f"{name}: NaN at {np.argwhere(np.isnan(g))[:5].tolist()}"
    err = np.abs(g - ref) / np.maximum(1.0, np.abs(ref))
    tol = TOL[name_of(dt)]
    if err.size and err.max() > tol:
        raise AssertionError(f"{name}: max rel err {err.max():.3g} > {tol} for {name_of(dt)}; "
                             f"first at {np.argwhere(err > tol)[:5].tolist()}")


def assert_same_bits(name, got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} vs {list(want.shape)}"
    bad = np.argwhere(got != want)
    if len(bad):
        raise AssertionError(f"{name}: {len(bad)} of {got.size} elements differ bit for bit; "
                             f"first mismatching indices {bad[:5].tolist()}")


def primitives(*arrays) -> int:
    """How many unevaluated operations stand behind ``arrays`` (0: all evaluated)."""
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return f.getvalue().count("shape=rectangle")


# --- inputs -----------------------------------------------------------------------------------

def randn(gen, *shape, dtype=mx.float32):
    return mx.array(gen.standard_normal(shape).astype(np.float32)).astype(dtype)


def qkv_inputs(gen, T, Hq, Hkv, D, dtype):
    return randn(gen, T, Hq, D, dtype=dtype), randn(gen, T, Hkv, D, dtype=dtype), randn(gen, T, Hkv, D, dtype=dtype)


def make_slots(gen, T, P, idx="int64", skip_every=3) -> mx.array:
    """Unique shuffled slots in [0, P); every skip_every-th token gets a (varied) negative slot."""
    slots = gen.permutation(P)[:T].astype(np.int64)
    if skip_every:
        negatives = np.array([-1, -2, -P, np.iinfo(idx).min], dtype=np.int64)
        n = len(slots[::skip_every])
        slots[::skip_every] = np.resize(negatives, n)
    return mx.array(slots.astype(idx))


def make_positions(gen, T, idx="int64", high=1_000_000) -> mx.array:
    return mx.array(gen.integers(0, high + 1, T).astype(idx))


POISON = (np.nan, np.inf, -np.inf, -0.0)


def poisoned_pool(gen, shape, dtype, slots, flat=True):
    """Random pool; rows to be written NaN (every other), rows that must survive get NaN/inf/-0.0."""
    pool = gen.standard_normal(shape).astype(np.float32)
    rows = pool.reshape(-1, shape[-1])
    for i, r in enumerate(gen.permutation(len(rows))[:6]):
        rows[r, i % 3::3] = POISON[i % len(POISON)]
    if flat:  # a flat [P, H, D] pool: NaN-fill half the rows that will be written
        written = sorted(s for s in np.array(slots).tolist() if s >= 0)
        pool[written[::2]] = np.nan
    return mx.array(pool).astype(dtype)


def oracle(call_kw, q, k, v, positions, slots, k_pool, v_pool):
    return reference.rope_pool_fused(*(to64(a) for a in (q, k, v, positions, slots, k_pool, v_pool)), **call_kw)


def run_checked(q, k, v, positions, slots, k_pool, v_pool, *, layer=None, kv_layout=None, rope=None,
                rope_base=10000.0, backend="mlx"):
    """Run the op and check all it returns, and that every array passed in keeps its value."""
    kw = dict(head_dim=q.shape[2], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], rope_base=rope_base,
              rope=rope, layer=layer, kv_layout=kv_layout)
    inputs = (q, k, v, positions, slots, k_pool, v_pool)
    before = [np.array(a) if not mx.issubdtype(a.dtype, mx.floating) else bits(a) for a in inputs]
    out = ropepool.rope_pool_fused(*inputs, backend=backend, **kw)
    q_rot, k_rot, kp, vp = out
    assert all(isinstance(o, mx.array) for o in out)
    assert kp is not k_pool and vp is not v_pool, "MLX calls are functional: new pool arrays"
    for o, like in zip(out, (q, k, k_pool, v_pool)):
        assert o.shape == like.shape and o.dtype == like.dtype, f"{o.shape} {o.dtype} vs {like.shape} {like.dtype}"
    mx.eval(*out)

    for name, a, b in zip(ARRAYS, inputs, before):
        now = np.array(a) if not mx.issubdtype(a.dtype, mx.floating) else bits(a)
        assert_same_bits(f"{name} after the call (the caller's arrays keep their values)", now, b)

    ref = oracle(kw, *inputs)
    assert_close("q_rot", q_rot, ref[0], q.dtype)
    assert_close("k_rot", k_rot, ref[1], q.dtype)

    # The pools: as before, except each written row, which holds the returned
    # k_rot row and the given v row, bit for bit. The expectation is built
    # through ropepool.layout on NumPy (independent of the backend's indexing).
    call = validate.check(*inputs, **kw, k_scale=None, v_scale=None)
    write = np.array(slots) >= 0
    page, row = page_and_row(np.array(slots)[write], call.page_size)
    for name, pool, new, rows in (("k_pool", k_pool, kp, k_rot), ("v_pool", v_pool, vp, v)):
        want = bits(pool).copy()
        paged_view(want, call)[page, row] = bits(rows)[write]
        assert_same_bits(f"{name} (written rows == k_rot/v, the rest untouched)", bits(new), want)
    np.testing.assert_array_equal(to64(vp), ref[3])  # and the oracle's v pool (NaN == NaN here)
    return q_rot, k_rot, kp, vp


def heads(q, k):
    return dict(head_dim=q.shape[2], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1])


# --- numerics ---------------------------------------------------------------------------------

SHAPES = shape_params()


@pytest.mark.parametrize("T,Hq,Hkv,D", SHAPES)
def test_matches_oracle(dtype, T, Hq, Hkv, D, gen):
    idx = "int32" if T % 2 else "int64"
    P = 2 * T + 7
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    slots = make_slots(gen, T, P, idx, skip_every=3 if T > 1 else 0)
    pools = [poisoned_pool(gen, (P, Hkv, D), dtype, slots) for _ in range(2)]
    run_checked(q, k, v, make_positions(gen, T, idx), slots, *pools, rope_base=500000.0)


@pytest.mark.parametrize("kind", ["repeated", "shuffled", "zero-and-1e6", "near-1e6", "near-2^24"])
def test_positions(dtype, kind, gen):
    """Shuffled, repeated and large positions (the contract holds up to 2^24)."""
    T, Hq, Hkv, D, P = 24, 4, 2, 128, 40
    if kind == "repeated":
        pos = np.repeat(gen.integers(0, 10**6, 4), 6)
    elif kind == "shuffled":
        pos = gen.permutation(T) + int(gen.integers(0, 10**5))
    elif kind == "zero-and-1e6":
        pos = np.tile([0, 1_000_000], T // 2)
    elif kind == "near-1e6":
        pos = gen.integers(999_000, 1_000_001, T)
    else:
        pos = gen.integers(2**24 - 10**4, 2**24 + 1, T)
    q, k, v = (np.array(a.astype(mx.float32)) for a in qkv_inputs(gen, T, Hq, Hkv, D, dtype))
    if kind == "repeated":  # tokens 0-5 share a position: equal inputs there give equal outputs
        q[1:6], k[1:6] = q[0], k[0]
    q, k, v = (mx.array(a).astype(dtype) for a in (q, k, v))
    slots = make_slots(gen, T, P)
    pools = [poisoned_pool(gen, (P, Hkv, D), dtype, slots) for _ in range(2)]
    q_rot, k_rot, _, _ = run_checked(q, k, v, mx.array(pos), slots, *pools)
    if kind == "repeated":
        assert_same_bits("q_rot of equal rows at one position", bits(q_rot[1:6]),
                         np.broadcast_to(bits(q_rot[0]), (5, Hq, D)))
        assert_same_bits("k_rot of equal rows at one position", bits(k_rot[1:6]),
                         np.broadcast_to(bits(k_rot[0]), (5, Hkv, D)))


@pytest.mark.parametrize("pos_idx,slot_idx", [("int32", "int32"), ("int32", "int64"), ("int64", "int32"),
                                              ("int64", "int64")],
                         ids=["pos32-slot32", "pos32-slot64", "pos64-slot32", "pos64-slot64"])
def test_index_dtypes(pos_idx, slot_idx, gen):
    T, Hq, Hkv, D, P = 13, 4, 2, 64, 20
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, mx.bfloat16)
    slots = make_slots(gen, T, P, slot_idx)
    pools = [poisoned_pool(gen, (P, Hkv, D), mx.bfloat16, slots) for _ in range(2)]
    run_checked(q, k, v, make_positions(gen, T, pos_idx), slots, *pools)


@pytest.mark.parametrize("idx", ["int32", "int64"])
@pytest.mark.parametrize("which", ["all-skipped", "extremes"])
def test_negative_slots_skip(idx, which, gen):
    """Any slot < 0 skips the write: -1, -pool_size, the int type's minimum."""
    T, Hq, Hkv, D, P = 8, 4, 2, 64, 8
    lo = int(np.iinfo(idx).min)
    slots = [-1] * T if which == "all-skipped" else [lo, 0, -P, P - 1, lo + 1, -1, 3, -(2**31)]
    slots = mx.array(np.array(slots, dtype=idx))
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, mx.float32)
    pools = [poisoned_pool(gen, (P, Hkv, D), mx.float32, slots) for _ in range(2)]
    run_checked(q, k, v, make_positions(gen, T), slots, *pools)


def test_empty_call(gen):
    T, Hq, Hkv, D, P = 0, 4, 2, 64, 8
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, mx.float16)
    slots = make_slots(gen, T, P)
    pools = [poisoned_pool(gen, (P, Hkv, D), mx.float16, slots) for _ in range(2)]
    q_rot, k_rot, _, _ = run_checked(q, k, v, make_positions(gen, T), slots, *pools)
    assert q_rot.shape == (0, Hq, D) and k_rot.shape == (0, Hkv, D)


ROPES = {
    "partial-0.5": lambda: RopeSpec(head_dim=128, rotary_dim=64, base=10000.0),
    "partial-0.25-gptj": lambda: RopeSpec(head_dim=64, rotary_dim=16, style="gptj"),
    "gptj": lambda: RopeSpec(head_dim=128, style="gptj", base=1e6),
    "yarn-x4": lambda: RopeSpec(head_dim=128, base=1e6, scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)),
    "llama3": lambda: RopeSpec(head_dim=128, base=500000.0, scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    "longrope-short": lambda: _longrope(),
    "longrope-long": lambda: _longrope(),
}


def _longrope():
    n = 48
    return RopeSpec(head_dim=128, rotary_dim=96, base=10000.0, max_position_embeddings=131072, scaling=dict(
        rope_type="longrope", short_factor=list(np.linspace(1.0, 1.2, n)), long_factor=list(np.linspace(1.0, 40.0, n)),
        original_max_position_embeddings=4096))


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_specs(dtype, name, gen):
    """Partial rotary, GPT-J pairs, attention scaling, longrope's switch to the long factors."""
    spec = ROPES[name]()
    T, Hq, Hkv, D, P = 19, 8, 2, spec.head_dim, 32
    high = 4000 if name == "longrope-short" else 100_000
    positions = make_positions(gen, T, high=high)
    if name == "longrope-long":  # one token past the original context switches all of them
        positions = mx.concatenate([mx.array([4096]), make_positions(gen, T - 1, high=100)])
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    slots = make_slots(gen, T, P)
    pools = [poisoned_pool(gen, (P, Hkv, D), dtype, slots) for _ in range(2)]
    q_rot, _, _, _ = run_checked(q, k, v, positions, slots, *pools, rope=spec)
    if spec.rotary_dim < D:  # the features past rotary_dim are copied, bit for bit
        assert_same_bits("unrotated features", bits(q_rot[..., spec.rotary_dim:]), bits(q[..., spec.rotary_dim:]))


# --- pools ------------------------------------------------------------------------------------

L = 3


@pytest.mark.parametrize("layer,kv_layout", [(0, None), (2, None), (1, "NHD"), (1, "HND")],
                         ids=["4d-layer0", "4d-layer2", "5d-NHD-layer1", "5d-HND-layer1"])
def test_layer_stacked_pools(dtype, layer, kv_layout, gen):
    """Only the chosen layer changes; the returned pools are the whole stack."""
    T, Hq, Hkv, D, pages, page_size = 21, 8, 4, 64, 8, 4
    P = pages * page_size
    shape = {None: (L, P, Hkv, D), "NHD": (L, pages, page_size, Hkv, D), "HND": (L, pages, Hkv, page_size, D)}
    slots = make_slots(gen, T, P)
    pools = [poisoned_pool(gen, shape[kv_layout], dtype, slots, flat=False) for _ in range(2)]
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    _, _, kp, _ = run_checked(q, k, v, make_positions(gen, T), slots, *pools, layer=layer, kv_layout=kv_layout)
    others = [i for i in range(L) if i != layer]
    assert_same_bits("the other layers", bits(kp[mx.array(others)]), bits(pools[0][mx.array(others)]))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_paged_pools(dtype, kv_layout, gen):
    """Slot s is row s % page_size of page s // page_size."""
    T, Hq, Hkv, D, pages, page_size = 14, 4, 2, 64, 5, 4
    shape = (pages, page_size, Hkv, D) if kv_layout == "NHD" else (pages, Hkv, page_size, D)
    slots = make_slots(gen, T, pages * page_size)
    pools = [poisoned_pool(gen, shape, dtype, slots, flat=False) for _ in range(2)]
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    _, k_rot, kp, vp = run_checked(q, k, v, make_positions(gen, T), slots, *pools, kv_layout=kv_layout)
    t = int(np.argmax(np.array(slots) >= 0))  # one row spelled out by hand
    page, row = divmod(int(np.array(slots)[t]), page_size)
    got = kp[page, row] if kv_layout == "NHD" else kp[page, :, row]
    assert_same_bits(f"k row of slot {page * page_size + row}", bits(got), bits(k_rot[t]))


@pytest.mark.parametrize("idx", ["int32", "int64"])
@pytest.mark.parametrize("layer", [None, 1], ids=["flat", "layer-stack"])
def test_out_of_range_slots_never_written(idx, layer, gen):
    """Past validation (the backend called directly) no slot writes outside its pool or layer."""
    T, Hq, Hkv, D, P = 12, 2, 2, 64, 16
    hi = int(np.iinfo(idx).max)
    bad = np.array([P, P + 1, 2 * P, hi, -1, -P - 1, int(np.iinfo(idx).min), 3, 5, P * L, -2, 2**31 - 1], idx)
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, mx.float32)
    positions = make_positions(gen, T)
    shape = (P, Hkv, D) if layer is None else (L, P, Hkv, D)
    pools = [randn(gen, *shape) for _ in range(2)]
    call = validate.check(q, k, v, positions, mx.arange(T), *pools, head_dim=D, num_qo_heads=Hq,
                          num_kv_heads=Hkv, rope_base=10000.0, rope=None, layer=layer, k_scale=None,
                          v_scale=None, kv_layout=None)
    q_rot, k_rot, kp, vp = mlx_backend.run(call, q, k, v, positions, mx.array(bad), *pools)
    for name, pool, new, rows in (("k_pool", pools[0], kp, k_rot), ("v_pool", pools[1], vp, v)):
        want = bits(pool).copy()
        (want if layer is None else want[layer])[[3, 5]] = bits(rows)[[7, 8]]  # the only in-range slots
        assert_same_bits(f"{name} (only slots 3 and 5 written)", bits(new), want)


def test_rows_are_per_token(gen):
    """Each written row is its own token's (a swap of rows or heads would still be close to the oracle)."""
    T, Hq, Hkv, D, P = 6, 6, 3, 64, 6
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, mx.float32)
    pos = mx.arange(T) * 1000
    slots = mx.array([5, 0, 4, 1, 3, 2])
    pools = [randn(gen, P, Hkv, D) for _ in range(2)]
    _, k_rot, kp, vp = ropepool.rope_pool_fused(q, k, v, pos, slots, *pools, **heads(q, k))
    for t, s in enumerate([5, 0, 4, 1, 3, 2]):
        assert_same_bits(f"v row of token {t}", bits(vp[s]), bits(v[t]))
        assert_same_bits(f"k row of token {t}", bits(kp[s]), bits(k_rot[t]))


def test_append_into_filled_pool(dtype, gen):
    """Prefill, then decode steps, each call taking the pools the last returned: earlier rows survive."""
    Hq, Hkv, D, P = 8, 2, 128, 48
    pools = [randn(gen, P, Hkv, D, dtype=dtype) for _ in range(2)]
    order = gen.permutation(P)
    start = 0
    for T in (20, 1, 1, 5):
        q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
        slots = mx.array(order[start: start + T])
        *_, kp, vp = run_checked(q, k, v, mx.arange(start, start + T), slots, *pools)
        pools = [kp, vp]
        start += T


# --- parity with the PyTorch path ------------------------------------------------------------

TORCH_DTYPES = {mx.float16: torch.float16, mx.bfloat16: torch.bfloat16, mx.float32: torch.float32}


def to_torch(x: mx.array) -> torch.Tensor:
    if x.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(mx.view(x, mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(x))


@pytest.mark.parametrize("case", ["flat-gqa", "layer-stacked", "paged-HND", "gptj-partial-yarn"])
def test_parity_with_torch(dtype, case, gen):
    """The same inputs through the torch path and the MLX path: same rotation, same pool bits."""
    T, Hq, Hkv, D, pages, page_size = 37, 8, 2, 128, 12, 4
    P = pages * page_size
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    shape = (P, Hkv, D)
    if case == "layer-stacked":
        shape, kw["layer"] = (L, P, Hkv, D), 1
    elif case == "paged-HND":
        shape, kw["kv_layout"] = (pages, Hkv, page_size, D), "HND"
    elif case == "gptj-partial-yarn":
        kw["rope"] = RopeSpec(head_dim=D, rotary_dim=64, style="gptj", base=1e6, scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    slots = make_slots(gen, T, P)
    positions = make_positions(gen, T)
    pools = [randn(gen, *shape, dtype=dtype) for _ in range(2)]
    mlx_out = ropepool.rope_pool_fused(q, k, v, positions, slots, *pools, backend="mlx", **kw)
    t_in = [to_torch(a) for a in (q, k, v, positions, slots, *pools)]
    torch_out = ropepool.rope_pool_fused(*t_in, backend="torch", **kw)
    assert torch_out[2] is t_in[5]  # torch: in place
    for name, m, t in zip(("q_rot", "k_rot", "k_pool", "v_pool"), mlx_out, torch_out):
        assert_close(f"{name} mlx vs torch", m, t.double().numpy(), dtype)
    torch_bits = torch_out[3].view({2: torch.int16, 4: torch.int32}[torch_out[3].element_size()]).numpy()
    assert_same_bits("v_pool mlx vs torch", bits(mlx_out[3]), torch_bits.view(bits(mlx_out[3]).dtype))


# --- MLX semantics: functional, lazy, vectorised -------------------------------------------------

def small_call(gen, T=9, dtype=mx.float32):
    Hq, Hkv, D, P = 4, 2, 64, max(16, T + 4)
    q, k, v = qkv_inputs(gen, T, Hq, Hkv, D, dtype)
    slots = make_slots(gen, T, P)
    return (q, k, v, make_positions(gen, T), slots, randn(gen, P, Hkv, D, dtype=dtype),
            randn(gen, P, Hkv, D, dtype=dtype)), heads(q, k)


def test_never_calls_eval(monkeypatch, gen):
    arrays, kw = small_call(gen)
    mx.eval(*arrays)

    def refuse(*args, **kwargs):
        raise AssertionError("rope_pool_fused forced an evaluation (mx.eval / mx.async_eval)")

    with monkeypatch.context() as m:
        m.setattr(mx, "eval", refuse)
        m.setattr(mx, "async_eval", refuse)
        out = ropepool.rope_pool_fused(*arrays, **kw)
    mx.eval(*out)


def test_outputs_are_lazy(gen):
    """Every output comes back unevaluated (work still in the graph), and lazy inputs stay lazy."""
    arrays, kw = small_call(gen)
    mx.eval(arrays[3], arrays[4])
    lazy = [a * 1 for a in arrays[:3]] + list(arrays[3:5]) + [a * 1 for a in arrays[5:]]
    out = ropepool.rope_pool_fused(*lazy, **kw)
    for name, o in zip(("q_rot", "k_rot", "k_pool", "v_pool"), out):
        assert primitives(o) > 0, f"{name} came back evaluated"
    for name, a in zip(("q", "k", "v"), lazy[:3]):
        assert primitives(a) > 0, f"{name} (a lazy input) was evaluated by the call"
    assert primitives(lazy[5]) > 0 and primitives(lazy[6]) > 0, "a lazy pool was evaluated by the call"


@pytest.mark.parametrize("what", ["public-call", "backend-all-traced"])
def test_runs_under_compile(what, gen):
    """Under mx.compile any evaluation of a traced array raises: the call evaluates none.

    public-call: q, k, v and the pools traced (positions and slots are
    constants: validation reads their values). backend-all-traced: every
    array traced, the backend alone (as after validation).
    """
    arrays, kw = small_call(gen, dtype=mx.bfloat16)
    q, k, v, positions, slots, k_pool, v_pool = arrays
    eager = ropepool.rope_pool_fused(*arrays, **kw)
    if what == "public-call":
        fn = mx.compile(lambda q, k, v, kp, vp: ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, **kw))
        compiled = fn(q, k, v, k_pool, v_pool)
    else:
        call = validate.check(*arrays, **kw, rope_base=10000.0, rope=None, layer=None, k_scale=None,
                              v_scale=None, kv_layout=None)
        fn = mx.compile(lambda *a: mlx_backend.run(call, *a))
        compiled = fn(*arrays)
    for name, c, e in zip(("q_rot", "k_rot", "k_pool", "v_pool"), compiled, eager):
        assert_close(f"{name} compiled vs eager", c, to64(e), mx.bfloat16)
    assert_same_bits("v_pool compiled vs eager", bits(compiled[3]), bits(eager[3]))


def test_graph_does_not_grow_with_tokens(gen):
    """Same number of graph nodes for 2 tokens and for 300: no per-token Python loop."""
    counts = []
    for T in (2, 300):
        arrays, kw = small_call(gen, T=T)
        mx.eval(*arrays)
        counts.append(primitives(*ropepool.rope_pool_fused(*arrays, **kw)))
    assert counts[0] == counts[1], f"graph nodes: {counts[0]} for T=2, {counts[1]} for T=300"


def test_backend_choice(gen):
    arrays, kw = small_call(gen)
    auto = ropepool.rope_pool_fused(*arrays, **kw)
    named = ropepool.rope_pool_fused(*arrays, backend="mlx", **kw)
    for a, b in zip(auto, named):
        assert_same_bits("backend=None vs backend='mlx'", bits(a), bits(b))
    with pytest.raises(ValueError, match=r"^backend 'torch' takes torch arrays; got mlx arrays"):
        ropepool.rope_pool_fused(*arrays, backend="torch", **kw)


# --- errors: the same as on the torch path ---------------------------------------------------

@pytest.mark.parametrize("which", ["q", "k_pool", "slots"])
def test_mixed_frameworks(which, gen):
    arrays, kw = small_call(gen)
    names = list(ARRAYS)
    i = names.index(which)
    mixed = list(arrays)
    mixed[i] = to_torch(arrays[i])
    first, second = ("q", "k") if which == "q" else ("q", which)
    a, b = ("torch.Tensor", "mx.array") if which == "q" else ("mx.array", "torch.Tensor")
    with pytest.raises(TypeError, match=rf"^rope_pool_fused expects every array from one framework; got "
                                        rf"{first} as {a} and {second} as {b}\. Fix: convert all arrays"):
        ropepool.rope_pool_fused(*mixed, **kw)


def _bad(case, a):
    P, Hkv, D = a["k_pool"].shape
    if case == "4d-pool-without-layer":
        a["k_pool"] = a["v_pool"] = np.stack([a["k_pool"]] * 3)
    elif case == "2d-pool":
        a["k_pool"] = a["v_pool"] = a["k_pool"].reshape(P, Hkv * D)
    elif case == "slot-past-pool":
        a["slots"][2] = P
    elif case == "duplicate-slots":
        a["slots"][3] = a["slots"][1]
    elif case == "negative-position":
        a["positions"][1] = -5
    elif case == "q-heads":
        a["q"] = a["q"][:, :3]
    return a


@pytest.mark.parametrize("case,match", [
    ("4d-pool-without-layer", r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool of shape "
                              r"\[3, 16, 2, 64\] \(4-D\)\. Fix: pass layer=<index> or index the layer dimension"),
    ("2d-pool", r"^rope_pool_fused expects pool tensors to be 3-D; got k_pool of shape \[16, 128\] \(2-D\)\. "
                r"Fix: reshape to \[pool_size, num_kv_heads, head_dim\]"),
    ("slot-past-pool", r"^slots must be < pool_size \(16\); got slots\[2\] = 16"),
    ("duplicate-slots", r"^slots must be unique within a call; got slot 1 2 times"),
    ("negative-position", r"^positions must be >= 0; got positions\[1\] = -5"),
    ("q-heads", r"^q shape must be \[num_tokens, num_qo_heads, head_dim\]"),
])
def test_bad_inputs_same_message_as_torch(case, match, gen):
    arrays, kw = small_call(gen)
    base = {n: np.array(x) for n, x in zip(ARRAYS, arrays)}
    base["slots"] = np.arange(len(base["slots"]))
    errors = []
    for convert in (mx.array, torch.from_numpy):
        bad = _bad(case, {n: x.copy() for n, x in base.items()})
        with pytest.raises(ValueError, match=match) as info:
            ropepool.rope_pool_fused(*(convert(bad[n]) for n in ARRAYS), **kw)
        errors.append(str(info.value))
    assert errors[0] == errors[1], f"MLX and torch messages differ:\n{errors[0]}\n{errors[1]}"
