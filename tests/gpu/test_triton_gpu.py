"""The Triton kernel on a real GPU against the float64 oracle (skipped without CUDA).

Everything goes through tests.harness.run_checked (q_rot / k_rot within
harness.TOL, every pool byte, the inputs, aliasing). On a GPU fp8 results
must be exact: no interpreter allowance. Sizes are kept so the whole file
runs in well under two minutes on an H200: the float64 oracle on the host is
the cost, not the kernel.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import CosSinCache, QKNorm, RopeSpec, plan  # noqa: E402
from ropepool.core.args import OTHER_LAYOUT  # noqa: E402
from tests.harness import (  # noqa: E402
    TOL,
    Backend,
    Cache,
    assert_same_bits,
    cos_sin_table,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
    run_latent_checked,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
X = Backend("triton", "cuda")


def qkv(rng, T, Hq, Hkv, D, dtype, fused=False):
    """q, k, v on the GPU; ``fused``: views of one projection output (token stride (Hq + 2 Hkv) * D)."""
    if not fused:
        return [X.array(randn(rng, T, h, D, dtype=dtype, scale=2.0)) for h in (Hq, Hkv, Hkv)]
    qkv = X.array(randn(rng, T, (Hq + 2 * Hkv) * D, dtype=dtype, scale=2.0))
    return [t.view(T, h, D) for t, h in zip(qkv.split([Hq * D, Hkv * D, Hkv * D], -1), (Hq, Hkv, Hkv))]


def call(rng, dtype, T, Hq, Hkv, D, *, pool="float", P=None, positions=None, fused=True, **kw):
    P = P or max(2 * T, 64)
    slots = make_slots(rng, T, P, skip_every=5)
    positions = make_positions(rng, T) if positions is None else positions
    cache = poison(make_cache(rng, dtype if pool == "float" else pool, P, Hkv, D,
                              scale=1.0 if pool == "float" else 4.0), slots)
    return run_checked(X, *qkv(rng, T, Hq, Hkv, D, dtype, fused), positions, slots, cache, **kw)


CASES = [
    pytest.param(1, 32, 8, 128, id="T1-Hq32-Hkv8-D128"),
    pytest.param(17, 32, 8, 128, id="T17-Hq32-Hkv8-D128"),
    pytest.param(423, 8, 1, 128, id="T423-MQA-D128"),
    pytest.param(64, 64, 8, 128, id="T64-Hq64-Hkv8-D128"),
    pytest.param(33, 12, 4, 80, id="T33-Hq12-Hkv4-D80"),
    pytest.param(19, 7, 1, 112, id="T19-Hq7-D112"),
    pytest.param(40, 16, 4, 256, id="T40-D256"),
    pytest.param(16384, 8, 2, 128, id="T16384-Hq8-Hkv2-D128"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("T,Hq,Hkv,D", CASES)
def test_matrix(T, Hq, Hkv, D, dtype, rng):
    call(rng, dtype, T, Hq, Hkv, D, rope_base=500000.0)


def test_precision_at_2_24(rng):
    """Accurate sin/cos: positions up to 2^24 match the oracle's float32 angles."""
    call(rng, "float32", 256, 2, 2, 128, positions=rng.integers(2**23, 2**24, 256), fused=False)


def test_out_of_range_slots_never_write(rng):
    """Canary rows around the pool: the kernel skips slots < 0 and >= pool_size (no check on CUDA)."""
    T, Hq, Hkv, D, P = 64, 4, 2, 64, 32
    slots = np.resize([P, P + 1, P + 8, 2**31 - 1, -1, -(2**31), -9, 3, 9], T)
    slots[9:] = np.where(np.isin(slots[9:], (3, 9)), -1, slots[9:])  # in-range slots once each
    cache = Cache([randn(rng, P + 16, Hkv, D, dtype="bfloat16") for _ in range(2)],
                  views=lambda o: (o[0][8: 8 + P], o[1][8: 8 + P]))
    run_checked(X, *qkv(rng, T, Hq, Hkv, D, "bfloat16"), make_positions(rng, T), slots, cache, bypass=True)
    with pytest.raises(ValueError, match="slots must be < pool_size"):
        ropepool.validate_slots(X.array(slots), P)


def test_pool_past_2_31_elements(rng):
    """int64 addressing: the last slot of a 2.2M x 8 x 128 pool (2.25e9 elements)."""
    P, H, D = 2_200_000, 8, 128
    kp, vp = (torch.zeros(P, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, k, v = qkv(rng, 3, 8, H, D, "bfloat16")
    slots = torch.tensor([P - 1, 2**31 // (H * D) + 5, 0], device="cuda")
    _, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, X.array(make_positions(rng, 3)), slots, kp, vp, head_dim=D,
                                              num_qo_heads=8, num_kv_heads=H)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kp[s], k_rot[i]) and torch.equal(vp[s], v[i])
    assert int((kp != 0).flatten(1).any(1).sum()) == 3


# --- the second round's features ---------------------------------------------------------------

def gain(norm):
    return TOL["float32"] * max(1.0, *[np.abs(norm.weight_offset + w).max() for w in norm.weights if w is not None])


def weights(rng, D, offset):
    return ((1.0 - offset) + 0.5 * rng.standard_normal(D)).astype(np.float32)


@pytest.mark.parametrize("name", ["qwen3", "gemma3-offset1-D256", "llama4-l2-after-gptj", "qwen3-fp8-pool"])
def test_qk_norm(name, rng):
    D = 256 if "D256" in name else 128
    offset = 1.0 if "offset1" in name else 0.0
    w = None if "l2" in name else weights(rng, D, offset)
    norm = QKNorm(w, None if w is None else weights(rng, D, offset), weight_offset=offset,
                  after_rope="after" in name)
    fp8 = dict(pool="float8_e4m3fn", k_scale=0.37, v_scale=0.61) if "fp8" in name else {}
    call(rng, "bfloat16", 33, 32, 8, D, rope=RopeSpec(head_dim=D, style="gptj" if "gptj" in name else "neox"),
         qk_norm=norm, arith=gain(norm) if w is not None else TOL["float32"], **fp8)


@pytest.mark.parametrize("spec", [
    pytest.param(dict(mrope_section=(16, 24, 24)), id="qwen2.5vl-chunked"),
    pytest.param(dict(mrope_section=(24, 20, 20), mrope_interleaved=True, base=5e6), id="qwen3vl-interleaved"),
    pytest.param(dict(rotary_dim=64, style="gptj", mrope_section=(8, 12, 12)), id="partial-gptj"),
])
def test_mrope(spec, rng):
    T = 40
    call(rng, "bfloat16", T, 28, 4, 128, positions=make_positions(rng, 3 * T).reshape(3, T),
         rope=RopeSpec(head_dim=128, **spec))


TABLES = {
    "neox-f32": (128, True, "float32", None),
    "gptj-partial-bf16": (64, False, "bfloat16", None),
    "mrope-interleaved": (128, True, "float32", (24, 20, 20)),
}


@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_cos_sin_cache(name, where, rng):
    """The engine's table; positions outside it (negative, past it, huge) rotate by zero and write nothing."""
    r, neox, tdt, section = TABLES[name]
    T, max_pos = 48, 8192
    rope = CosSinCache(cos_sin_table(max_pos, RopeSpec(head_dim=r).inv_freq, tdt), is_neox=neox,
                       mrope_section=section, mrope_interleaved=section is not None)
    rows = 3 if section else 1
    pos = make_positions(rng, rows * T, high=max_pos - 1).reshape(rows, T)
    if where == "outside":
        pos[:, ::3] = np.resize([max_pos, -1, 2**31 - 1, -(2**31), 10**9], pos[:, ::3].shape)
    call(rng, "float16", T, 16, 4, 128, positions=pos[0] if rows == 1 else pos, rope=rope, bypass=where == "outside")


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
def test_no_rope_layer(with_norm, rng):
    norm = QKNorm(weights(rng, 128, 0.0), None, after_rope=True) if with_norm else None
    call(rng, "bfloat16", 24, 40, 8, 128, rope=RopeSpec(head_dim=128, rotary_dim=0), qk_norm=norm,
         arith=gain(norm) if norm else TOL["float32"])


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("kind", ["flat", "fp8-combined-paged"])
@pytest.mark.parametrize("T", [1, 64, 1024])
def test_mla_deepseek_v3(kind, T, heads, rng):
    """DeepSeek-V3's latent cache: 128 heads (16 at TP-8: one warp a program), kv_lora_rank 512,
    rope_dim 64, YaRN with mscale; fp8: vLLM's combined [pages, 64, 576] row through two column views,
    a tensor scale."""
    spec = RopeSpec(head_dim=64, style="gptj", base=1e4, scaling=dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
        mscale=1.0, mscale_all_dim=1.0))
    P, ps = 2048, 64
    slots = make_slots(rng, T, P)
    if kind == "flat":
        cache, scale = make_cache(rng, "bfloat16", P, 1, 512, v_dim=64, headed=False), None
    else:
        combined = randn(rng, P // ps, ps, 576, dtype="float8_e4m3fn", scale=4.0)
        cache = Cache([combined], "NHD", ps, views=lambda o: (o[0][..., :512], o[0][..., 512:]), headed=False)
        scale = np.array([0.05], np.float32)
    q_pe = X.array(randn(rng, T, heads, 64, dtype="bfloat16"))
    run_latent_checked(X, q_pe, randn(rng, T, 64, dtype="bfloat16"), randn(rng, T, 512, dtype="bfloat16"),
                       make_positions(rng, T, high=100_000), slots, poison(cache, slots), rope=spec, scale=scale,
                       q_pe_out=q_pe if T == 64 else None)


@pytest.mark.parametrize("which", ["q-e4m3", "k-e5m2", "both-tensor-scales"])
def test_fp8_outputs_exact(which, rng):
    """fp8 q_out / k_out: the oracle's quantize of the float32 result, exactly (harness.check_fp8)."""
    T, Hq, Hkv, D = 64, 32, 8, 128
    kw = {}
    scale = (lambda s: np.array([s], np.float32)) if which == "both-tensor-scales" else float
    if which != "k-e5m2":
        kw.update(q_out=torch.empty(T, Hq, D, device="cuda", dtype=torch.float8_e4m3fn), q_scale=scale(0.3))
    if which != "q-e4m3":
        kw.update(k_out=torch.empty(T, Hkv, D, device="cuda", dtype=torch.float8_e5m2), k_out_scale=scale(0.05))
    call(rng, "bfloat16", T, Hq, Hkv, D, **kw)


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("v_scale", [
    pytest.param("per-head", id="both-per-head"),
    pytest.param("float", id="v-float"),
])
def test_per_head_scales(fp8, v_scale, rng):
    k_scale = np.linspace(0.05, 2.0, 8).astype(np.float32)
    vs = np.linspace(3.0, 0.1, 8).astype(np.float32) if v_scale == "per-head" else 0.5
    call(rng, "bfloat16", 40, 32, 8, 128, pool=fp8, k_scale=k_scale, v_scale=vs)


@pytest.mark.parametrize("pool", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("T", [1, 64, 300])
def test_per_token_head_exact(pool, T, rng):
    """Per-token-head caches, Llama-3-8B heads, vLLM's paged NHD (block 16): data and scales bit for bit
    as the port of vLLM's writer stores them (fp8 too: no interpreter allowance on a GPU);
    the checks of tests/test_per_token_head.py."""
    from tests.test_per_token_head import check_per_token_head

    check_per_token_head(X, rng, "NHD", 16, None, None, pool, "bfloat16", None, T=T, Hq=32, Hkv=8, D=128, P=1024)


# --- CUDA graphs and torch.compile, one call of each feature ---------------------------------

def feature_calls(rng):
    """(arrays, kwargs) of one small call per feature, and the pools they write (to copy)."""
    T, Hq, Hkv, D, P = 8, 16, 4, 128, 64
    q, k, v = qkv(rng, T, Hq, Hkv, D, "bfloat16")
    pos, slots = X.array(make_positions(rng, T)), X.array(make_slots(rng, T, P))
    pos3 = X.array(make_positions(rng, 3 * T).reshape(3, T))
    table = X.array(cos_sin_table(4096, RopeSpec(head_dim=D).inv_freq))
    norm = QKNorm(X.array(weights(rng, D, 1.0)), X.array(weights(rng, D, 1.0)), weight_offset=1.0)
    pool = lambda dt="bfloat16": X.array(randn(rng, P, Hkv, D, dtype=dt, scale=4.0))  # noqa: E731
    fp8_out = torch.empty(T, Hq, D, device="cuda", dtype=torch.float8_e4m3fn)
    heads = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    return [
        ((q, k, v, pos, slots, pool(), pool()), dict(heads, rope_base=5e5)),
        ((q, k, v, pos, slots, pool(), pool()), dict(heads, qk_norm=norm)),
        ((q, k, v, pos3, slots, pool(), pool()), dict(heads, rope=RopeSpec(head_dim=D, mrope_section=(16, 24, 24)))),
        ((q, k, v, pos, slots, pool(), pool()), dict(heads, rope=CosSinCache(table))),
        ((q, k, v, pos, slots, pool(), pool()), dict(heads, rope=RopeSpec(head_dim=D, rotary_dim=0))),
        ((q, k, v, pos, slots, pool("float8_e4m3fn"), pool("float8_e4m3fn")),
         dict(heads, k_scale=X.array(np.linspace(0.1, 1, Hkv).astype(np.float32)),
              v_scale=X.array(np.linspace(1, 0.1, Hkv).astype(np.float32)), q_out=fp8_out, q_scale=0.25)),
        ((q, k, v, pos, slots, pool("float8_e4m3fn"), pool("float8_e4m3fn")),
         dict(heads, k_scale_cache=torch.zeros(P, Hkv, device="cuda"),
              v_scale_cache=torch.zeros(P, Hkv, device="cuda"))),
    ]


def run_all(calls):
    return [ropepool.rope_pool_fused(*a, **kw)[:2] for a, kw in calls]


WRITTEN = ("q_out", "k_scale_cache", "v_scale_cache")  # tensors of the kwargs a call writes


def copies(calls):
    return [(a[:5] + tuple(p.clone() for p in a[5:]), {**kw, **{n: kw[n].clone() for n in WRITTEN if n in kw}})
            for a, kw in calls]


def assert_same(got_calls, got, want_calls, want):
    for i, (g, w, (ga, gkw), (wa, wkw)) in enumerate(zip(got, want, got_calls, want_calls)):
        names = ("q_rot", "k_rot", "k_pool", "v_pool", *(n for n in WRITTEN[1:] if n in gkw))
        scales = tuple(gkw[n] for n in names[4:]), tuple(wkw[n] for n in names[4:])
        for name, x, y in zip(names, (*g, *ga[5:], *scales[0]), (*w, *wa[5:], *scales[1])):
            assert_same_bits(f"call {i}: {name}", X.numpy(x), X.numpy(y))


def test_cuda_graph_capture(rng):
    """Every feature's call captured in one CUDA graph; new inputs in the captured buffers, then replay."""
    calls = feature_calls(rng)
    ref = copies(calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_all(copies(calls))  # warm-up compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_all(calls)
    q = calls[0][0][0]
    q.copy_(torch.randn_like(q))
    calls[0][0][3].copy_(torch.randint(0, 10**6, (q.shape[0],), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert_same(calls, out, ref, run_all(ref))


def test_torch_compile_inductor(rng):
    """One compiled function making every feature's call (fullgraph, inductor) == eager, bit for bit."""
    calls = feature_calls(rng)
    ref = copies(calls)
    want = run_all(ref)  # eager first: it imports the backend (tests/test_compile.py: test_compile_first_in_a_process)
    plan.forget()  # a remembered RopeSpec breaks dynamo (test_compile_after_an_eager_call_with_a_spec)
    torch._dynamo.reset()
    got = torch.compile(run_all, fullgraph=True)(calls)
    assert_same(calls, got, ref, want)


def test_later_calls_launch_directly(rng, monkeypatch):
    """A layout's later calls hand their pointers straight to the compiled kernel (no JIT, no launch
    metadata), and stay exact; with a profiler's launch hook set they go through Triton's hooks."""
    triton = pytest.importorskip("triton")
    from ropepool.backends import triton_launch

    call(rng, "bfloat16", 5, 8, 2, 64)  # compiles this layout's kernel (or finds it)
    slow, seen = [], []
    launch = triton_launch.Launch.launch
    monkeypatch.setattr(triton_launch.Launch, "launch", lambda self, *a: slow.append(1) or launch(self, *a))
    call(rng, "bfloat16", 5, 8, 2, 64)
    assert not slow, "a repeated decode call did not take the direct launch"
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no HookChain")
    hook = seen.append
    chain.add(hook)
    try:
        call(rng, "bfloat16", 5, 8, 2, 64)
    finally:
        chain.remove(hook)
    assert slow and seen, "a launch hook was set but not called"


def test_later_calls_launch_natively(rng, monkeypatch):
    """Where the native launcher runs (backends/triton_native.py), a layout's later calls of either variant
    (decode-sized, large) go through it and stay exact; a call it cannot take (an array not 16-byte aligned, the
    layout unchanged) falls back to Triton's launch, exact too."""
    from ropepool.backends import triton_native

    if triton_native.module() is None:
        pytest.skip("no native launcher here (not built, no tvm-ffi, or a torch without the DLPack exchange API)")
    taken = []
    make = triton_native.make

    def counted(*args):
        fn = make(*args)
        return None if fn is None else lambda *a: taken.append(fn(*a)) or taken[-1]

    monkeypatch.setattr(triton_native, "make", counted)
    Hq, Hkv, D = 6, 2, 96  # a geometry of its own: its launchers are made here, with the counting function

    def native_call(T, offset):
        """A call whose q starts ``offset`` elements into its buffer (bfloat16: 8 keeps 16-byte alignment)."""
        flat = X.array(randn(rng, T * Hq * D + 8, dtype="bfloat16", scale=2.0))
        q = flat[offset:offset + T * Hq * D].view(T, Hq, D)
        k, v = (X.array(randn(rng, T, Hkv, D, dtype="bfloat16", scale=2.0)) for _ in range(2))
        slots = make_slots(rng, T, 4 * T, skip_every=5)
        cache = poison(make_cache(rng, "bfloat16", 4 * T, Hkv, D), slots)
        run_checked(X, q, k, v, make_positions(rng, T), slots, cache, rope_base=500000.0)

    # (each T has a pool of its own size: another layout, the last one's runner refuses it first, OTHER_LAYOUT)
    for T in (5, 100):  # small_tokens is 64: both variants
        native_call(T, 8)  # compiles the variant (Triton's launch), then makes the native launcher
        taken.clear()
        native_call(T, 8)
        assert taken[-1] == triton_native.LAUNCHED and taken.count(triton_native.LAUNCHED) == 1, \
            f"T={T}: a repeated call did not take the native launch ({taken})"
    taken.clear()
    native_call(5, 1)  # 2 bytes off: the native launcher declines, Triton's launch compiles and runs it
    assert taken[-1] == triton_native.DECLINED and triton_native.LAUNCHED not in taken, taken


def _counted_launchers(monkeypatch):
    """What every native launcher made from now on returns, in call order."""
    from ropepool.backends import triton_native

    if triton_native.module() is None:
        pytest.skip("no native launcher here (not built, no tvm-ffi, or a torch without the DLPack exchange API)")
    taken, make = [], triton_native.make

    def counted(*args):
        fn = make(*args)
        return None if fn is None else lambda *a: taken.append(fn(*a)) or taken[-1]

    monkeypatch.setattr(triton_native, "make", counted)
    return taken


def test_key_only_calls_check_their_layout(rng, monkeypatch):
    """Once its native launcher is made, a layout's runner is found by the call's key alone (plan/cache.py:
    _FAST); a call of another layout with the same key reaches it, which refuses it before anything is done
    (OTHER_LAYOUT), and the call is looked up with its guards: every call exact, in any order of the layouts."""
    from ropepool.backends import triton_native
    from ropepool.plan import cache

    taken = _counted_launchers(monkeypatch)
    Hq, Hkv, D, T = 10, 2, 64, 6  # a geometry of its own: its launchers are made here, with the counting function

    def layout_call(fused):
        q, k, v = qkv(rng, T, Hq, Hkv, D, "bfloat16", fused=fused)
        slots = make_slots(rng, T, 8 * T, skip_every=4)
        cache_ = poison(make_cache(rng, "bfloat16", 8 * T, Hkv, D), slots)
        run_checked(X, q, k, v, make_positions(rng, T), slots, cache_, rope_base=20000.0)

    layout_call(True)  # compiles the fused projection's layout, makes its launcher
    taken.clear()
    layout_call(True)
    assert taken == [triton_native.LAUNCHED] and any(hasattr(r, "native") for r in cache._FAST.values()), taken
    taken.clear()
    layout_call(False)  # contiguous q, k, v: the same key, another layout
    assert taken == [OTHER_LAYOUT], taken
    for fused in (True, False, True, False):
        taken.clear()
        layout_call(fused)
        assert taken[-1] == triton_native.LAUNCHED, (fused, taken)


def test_native_launch_on_the_current_stream(rng, monkeypatch):
    """The native launcher launches on torch's current stream (which tvm-ffi reads for the call): a CUDA graph
    captures it on its own stream, and its replay writes what the eager call wrote."""
    from ropepool.backends import triton_native

    taken = _counted_launchers(monkeypatch)
    Hq, Hkv, D, T = 12, 4, 64, 3
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    positions = torch.randint(0, 1000, (T,), device="cuda")
    slots = torch.tensor([3, 9, 1], device="cuda")
    pools = [torch.zeros(16, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles, then makes the launcher
            want = ropepool.rope_pool_fused(q, k, v, positions, slots, pools[0], pools[1], **kw)
    torch.cuda.current_stream().wait_stream(s)
    taken.clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = ropepool.rope_pool_fused(q, k, v, positions, slots, pools[2], pools[3], **kw)
    assert taken == [triton_native.LAUNCHED], taken
    g.replay()
    torch.cuda.synchronize()
    for name, x, y in zip(("q_rot", "k_rot", "k_pool", "v_pool"), got, want):
        assert torch.equal(x, y), name
