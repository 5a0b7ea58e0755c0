"""``ropepool demo --engine vllm``'s meter (ropepool.cli.demo_vllm.Meter), without vLLM: it must count and time
every ropepool call that an engine's plugin makes, however the calling module imported the function, or the
demo would report "no calls" for a route that ran (tests/engines/test_vllm_demo.py runs the demo in vLLM)."""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool.cli.demo_vllm import Meter  # noqa: E402
from ropepool.integrations import vllm as rv  # noqa: E402  (imports rope_pool_fused by name)


def one_call(n=3, heads=2, dim=16, blocks=2, block_size=4):
    """vLLM's fused update as the plugin does it: rope_and_cache -> one rope_pool_fused call."""
    q, k, v = (torch.randn(n, heads, dim) for _ in range(3))
    cos_sin = torch.randn(32, dim)
    kv_cache = torch.zeros(2, blocks, block_size, heads, dim)
    rv.rope_and_cache(q, k, v, torch.arange(n), cos_sin, True, kv_cache, torch.arange(n), layout="kv_first")


def test_meter_counts_each_call(monkeypatch):
    for name in [m for m in sys.modules if m == "ropepool" or m.startswith("ropepool.")]:
        for fn in ("rope_pool_fused", "rope_latent_fused"):  # undone at the end of the test
            if hasattr(sys.modules[name], fn):
                monkeypatch.setattr(sys.modules[name], fn, getattr(sys.modules[name], fn))
    meter = Meter()
    assert meter.wrap_ropepool() >= 3  # ropepool, ropepool.api, ropepool.integrations.vllm at least
    one_call()
    one_call()
    assert meter.calls == 2 and meter.seconds > 0
    calls = meter.calls  # the package's own name is wrapped too
    q, k, v = (torch.randn(1, 1, 8) for _ in range(3))
    ropepool.rope_pool_fused(q, k, v, torch.tensor([0]), torch.tensor([0]), torch.zeros(2, 1, 8),
                             torch.zeros(2, 1, 8), head_dim=8, num_qo_heads=1, num_kv_heads=1)
    assert meter.calls == calls + 1
