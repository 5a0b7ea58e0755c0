"""ropepool inside transformers' continuous batching on a GPU: the Triton kernel in every layer (skipped without CUDA).

float32: tokens identical to transformers' own batching, log-probabilities
within ``BOUND["float32"]``.

bfloat16: transformers rounds cos/sin and the normed q/k to bf16 before
rotating; ropepool computes in float32 and rounds once. That rounding alone
moves log-probabilities by more than a RoPE base off by 1% does, so against
transformers the test only bounds the difference (``BOUND["bfloat16-hf"]``,
while both runs saw the same tokens, up to and including the first
divergence) and requires that greedy decoding parts ways only at a near-tie
(transformers' own forward on the shared prefix scores the two tokens within
``TIE``). What sees a wrong rotation in bf16 is the second comparison: the
kernel against ropepool's torch path (``backend="torch"``, the same float32
arithmetic rounded once, itself checked against the float64 oracle) in the
same batching, within ``BOUND["bfloat16"]``.

The bounds are measured differences times a margin (docs/integration.md, and
the record docs/bench/h200-2026-12-05-integration-margins.json written by
``python -m tests.gpu.margins``). The negative control shows that they see a
wrong rotation: with every layer's RoPE base off by 1% (either way) in the
kernel's run, the same check fails on a log-probability bound.
"""
import dataclasses
import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

pytest.importorskip("transformers")

from ropepool.cli import demo  # noqa: E402
from ropepool.integrations import transformers as rp  # noqa: E402
from ropepool.integrations.transformers import attention  # noqa: E402
from ropepool.integrations.transformers.model import attention_layers  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda"
NEW_TOKENS = 12
WRONG_BASES = (1.01, 0.99)
# Largest |Δ log-probability| allowed: float32 against transformers, bfloat16 against the torch path, bfloat16
# against transformers. Measured on the H200 (docs/bench/h200-2026-12-05-integration-margins.json; the CPU path's
# cpu-2026-12-05-integration-margins.json agrees): float32 4.8e-6 at most with the right base, 3.3e-4 at least
# (Gemma 3) with every base off by 1%: the bound is 10x the first and 6.6x under the second. bfloat16 against the
# torch path: 0 with the right base (the same log-probabilities), 0.031 at least with a 1%-wrong one: 2.1x under
# it. bfloat16 against transformers: 0.087 at most with the right base (and as much with a wrong one): 2.9x.
BOUND = {"float32": 5e-5, "bfloat16": 1.5e-2, "bfloat16-hf": 0.25}
TIE = 0.25  # bf16 logits of the two tokens at a divergence may differ by this much (a near-tie; H200: 0.031 at most)
CASES = [pytest.param(f, d, {}, id=f"{f}-{d}") for d in ("float32", "bfloat16") for f in demo.FAMILIES] + [
    pytest.param("llama", "float32", {"use_cuda_graph": True}, id="llama-float32-cuda-graphs")]


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    gc.freeze()  # transformers' manager runs gc.collect() on stop: instant over a frozen heap
    yield
    gc.unfreeze()


@dataclasses.dataclass
class Runs:
    model: object
    prompts: list
    shipped: demo.Run  # transformers as shipped
    kernel: demo.Run  # through ropepool's default backend (the Triton kernel)
    torch_path: demo.Run | None  # through ropepool's torch path (bfloat16 only)


def through_ropepool(model, prompts, cb, monkeypatch, backend=None, base_factor=1.0):
    """One batching run with ropepool enabled, every layer's RoPE base times ``base_factor``."""
    calls = []
    op = attention.rope_pool_fused

    def counting(q, *args, **kw):
        calls.append((q.device.type, kw["backend"]))
        return op(q, *args, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(attention, "rope_pool_fused", counting)
        rp.enable(model, backend=backend)
        for module in attention_layers(model):
            layer = attention._LAYERS[module]
            rope = dataclasses.replace(layer.rope, base=layer.rope.base * base_factor)
            mp.setitem(attention._LAYERS, module, dataclasses.replace(layer, rope=rope))
        run = demo.run_batch(model, prompts, NEW_TOKENS, cb)
        rp.disable(model)
    assert calls and set(calls) == {(DEVICE, backend)}
    return run


def runs(family, dtype, monkeypatch, base_factor=1.0, **config) -> Runs:
    model = demo.build_model(family, dtype=getattr(torch, dtype), device=DEVICE)
    prompts = demo.make_prompts(model.config.vocab_size)
    cb = demo.batching_config(**config)
    shipped = demo.run_batch(model, prompts, NEW_TOKENS, cb)
    kernel = through_ropepool(model, prompts, cb, monkeypatch, base_factor=base_factor)
    torch_path = through_ropepool(model, prompts, cb, monkeypatch, "torch") if dtype == "bfloat16" else None
    return Runs(model, prompts, shipped, kernel, torch_path)


def tie_gaps(r: Runs, c: demo.Comparison) -> list:
    """At each divergence, how far apart transformers' own forward on the shared prefix scores the two tokens."""
    gaps = []
    for prompt, a, b, d in zip(r.prompts, c.plain.tokens, c.fused.tokens, c.diverged_at):
        if d is None:
            continue
        assert d < min(len(a), len(b)), "a run returned fewer tokens"
        with torch.inference_mode():
            logits = r.model(torch.tensor([prompt + a[:d]], device=DEVICE)).logits[0, -1].float()
        gaps.append((logits[a[d]] - logits[b[d]]).abs().item())
    return gaps


def check(family, dtype, r: Runs):
    hf = demo.Comparison(family, dtype, [r.shipped], [r.kernel])
    if dtype == "float32":
        assert hf.max_logprob_diff < BOUND[dtype], f"log-probabilities differ by {hf.max_logprob_diff:.2e}"
        assert r.kernel.tokens == r.shipped.tokens
        return
    same = demo.Comparison(family, dtype, [r.torch_path], [r.kernel])
    assert same.max_logprob_diff < BOUND[dtype], \
        f"log-probabilities differ by {same.max_logprob_diff:.2e} from ropepool's torch path"
    assert hf.max_logprob_diff < BOUND["bfloat16-hf"], \
        f"log-probabilities differ by {hf.max_logprob_diff:.2e} from transformers"
    for c in (hf, same):
        for gap in tie_gaps(r, c):
            assert gap <= TIE, f"a request diverged where transformers' logits differ by {gap:.3f}"


@pytest.mark.parametrize("family, dtype, config", CASES)
def test_agrees_with_transformers(family, dtype, config, monkeypatch):
    check(family, dtype, runs(family, dtype, monkeypatch, **config))


@pytest.mark.parametrize("factor", WRONG_BASES)
@pytest.mark.parametrize("family, dtype, config", CASES)
def test_a_1pct_wrong_base_fails_the_check(family, dtype, config, factor, monkeypatch):
    r = runs(family, dtype, monkeypatch, factor, **config)
    with pytest.raises(AssertionError, match="log-probabilities differ"):
        check(family, dtype, r)


def test_fused_steps_never_wait_for_the_gpu(monkeypatch):
    """No fused step reads a GPU value on the host (positions, slots, their largest): each read would make the
    host wait for every kernel queued before it, and decode steps are host-bound. torch's sync debug mode turns
    any such read inside a step into an error, which fails the request."""
    model = demo.build_model("llama", dtype=torch.float32, device=DEVICE)
    prompts = demo.make_prompts(model.config.vocab_size)
    cb = demo.batching_config()
    step = attention.fused_step

    def never_waiting(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    rp.enable(model)
    try:
        demo.run_batch(model, prompts, NEW_TOKENS, cb)  # the first call of each layer binds its runner
        monkeypatch.setattr(attention, "fused_step", never_waiting)
        run = demo.run_batch(model, prompts, NEW_TOKENS, cb)
    finally:
        rp.disable(model)
    assert run.tokens == demo.run_batch(model, prompts, NEW_TOKENS, cb).tokens
