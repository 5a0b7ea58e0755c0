"""ropepool inside transformers' continuous batching on a GPU: the Triton kernel in every layer (skipped without CUDA).

float32: tokens identical to transformers' own batching, log-probabilities
within 1e-4. bfloat16: the two runs round differently (transformers rounds
cos/sin and the normed q/k to bf16 before rotating; ropepool computes in
float32 and rounds once), so greedy tokens may part ways at a near-tie and
differ from there on. What is compared: the log-probability of every chosen
token while both runs saw the same tokens (up to and including the first
divergence), and, at a divergence, that transformers' own forward on the
shared prefix scores the two chosen tokens within ``TIE`` of each other. A
wrong rotation fails both long before (a 1% error in the RoPE base already
moves float32 log-probabilities by up to 1e-2 on these models).
"""
import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

pytest.importorskip("transformers")

from ropepool import demo
from ropepool.integrations import transformers as rp
from ropepool.integrations.transformers import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW_TOKENS = 12
TIE = 0.25  # bf16 logits of the two tokens at a divergence may differ by this much (a near-tie)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    gc.freeze()  # transformers' manager runs gc.collect() on stop: instant over a frozen heap
    yield
    gc.unfreeze()


def both_runs(family, dtype, monkeypatch, **config):
    model = demo.build_model(family, dtype=dtype, device="cuda")
    prompts = demo.make_prompts(model.config.vocab_size)
    cb = demo.batching_config(**config)
    shipped = demo.run_batch(model, prompts, NEW_TOKENS, cb)
    calls = []
    op = attention.rope_pool_fused

    def counting(q, *args, **kw):
        calls.append(q.device.type)
        return op(q, *args, **kw)

    monkeypatch.setattr(attention, "rope_pool_fused", counting)
    rp.enable(model)
    fused = demo.run_batch(model, prompts, NEW_TOKENS, cb)
    rp.disable(model)
    assert calls and set(calls) == {"cuda"}
    return model, prompts, shipped, fused


@pytest.mark.parametrize("family", demo.FAMILIES)
def test_float32_tokens_identical(family, monkeypatch):
    _, _, shipped, fused = both_runs(family, torch.float32, monkeypatch)
    c = demo.Comparison(family, "float32", shipped, fused)
    assert fused.tokens == shipped.tokens
    assert c.max_logprob_diff < demo.LOGPROB_TOL["float32"]


@pytest.mark.parametrize("family, config", [pytest.param(f, {}, id=f) for f in demo.FAMILIES] + [
    pytest.param("llama", {"use_cuda_graph": True}, id="llama-cuda-graphs"),
])
def test_bfloat16_agrees_until_a_near_tie(family, config, monkeypatch):
    model, prompts, shipped, fused = both_runs(family, torch.bfloat16, monkeypatch, **config)
    c = demo.Comparison(family, "bfloat16", shipped, fused)
    assert c.max_logprob_diff < demo.LOGPROB_TOL["bfloat16"]
    for prompt, a, b, d in zip(prompts, shipped.tokens, fused.tokens, c.diverged_at):
        if d is None:
            continue
        assert d < min(len(a), len(b)), "a run returned fewer tokens"
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + a[:d]], device="cuda")).logits[0, -1].float()
        gap = (logits[a[d]] - logits[b[d]]).abs().item()
        assert gap <= TIE, f"request diverged at step {d} where transformers' logits differ by {gap:.3f}"
