"""sglang's own MLX model runner with ropepool as its ``sgl_kernel.metal.rope_pool_fused``.

- install(): registers ropepool's module where sglang imports the kernel
  (``from sgl_kernel import metal``), keeps a working native one unless
  forced, and uninstall() restores what was there (runs wherever ropepool does).
- sglang 0.5.23's ``MlxModelRunner`` (skipped where sglang is not installed;
  CI's engines job installs it) on MLX's CPU backend, with a tiny mlx-lm model
  saved to a temp dir from a config in code (random weights): three prompts
  prefilled, decoded together in batched steps, then one request released and
  a new one prefilled on its cached prefix (a prefix hit read from sglang's
  KV pool) and decoded with the other two. float32 greedy tokens are
  identical with ropepool, with sglang's own path (``mx.fast.rope``) and with
  mlx-lm's ``generate_step``. Every decode step of every layer calls ropepool
  with pool slots (counted), and the pool rows ropepool wrote are the ones
  sglang's own sync writes later, bit for bit.
- sglang's gate keeps Llama 3 scaling on its own path: no kernel selected.

Mutations seen to fail: the forwarder's rope_base doubled (tokens differ from
mlx-lm's), install() not called (sglang falls back: no ropepool call).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest

import ropepool.api
from ropepool.integrations import sglang as integration

PROMPTS = ((7, 200, 31, 4, 99), tuple(range(40, 51)), (3, 250, 17))  # three lengths, batched together
FIRST, SECOND, EXTRA = 6, 4, (11, 12, 13)  # tokens before the release, after it; D's new tokens past A's


@pytest.fixture
def clean_modules(monkeypatch):
    """sys.modules without any sgl_kernel; install() undone after the test."""
    for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    integration.uninstall()


def test_install_without_sgl_kernel_registers_ropepool(clean_modules):
    assert integration.install() is True and integration.installed()
    from sgl_kernel import metal  # sglang's own import (aot.py, _load_metal_rope_pool_fused)

    assert metal.rope_pool_fused is integration.rope_pool_fused
    assert metal._metal is not None and metal._IMPORT_ERROR is None  # sglang's check that the kernel loaded
    assert integration.install() is True  # again: nothing changes
    integration.uninstall()
    assert "sgl_kernel" not in sys.modules and "sgl_kernel.metal" not in sys.modules
    with pytest.raises(ImportError):
        from sgl_kernel import metal  # noqa: F401,F811


@pytest.fixture
def native_sgl_kernel(clean_modules, tmp_path, monkeypatch):
    """A package sgl_kernel on sys.path whose metal module says its native extension loaded."""
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "metal.py").write_text("_metal = object()\n_IMPORT_ERROR = None\ndef rope_pool_fused(*a, **k): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_install_keeps_a_working_sgl_kernel_unless_forced(native_sgl_kernel):
    assert integration.install() is False and not integration.installed()
    import sgl_kernel.metal as native

    assert native.rope_pool_fused is not integration.rope_pool_fused
    assert integration.install(force=True) is True
    from sgl_kernel import metal

    assert metal.rope_pool_fused is integration.rope_pool_fused
    integration.uninstall()
    from sgl_kernel import metal

    assert metal is native and sys.modules["sgl_kernel.metal"] is native


def test_install_replaces_a_metal_module_without_its_extension(native_sgl_kernel, tmp_path):
    (tmp_path / "sgl_kernel" / "metal.py").write_text("_metal = None\n_IMPORT_ERROR = ImportError('no metallib')\n")
    assert integration.install() is True
    from sgl_kernel import metal

    assert metal.rope_pool_fused is integration.rope_pool_fused


# ---- sglang's own MLX model runner ---------------------------------------------------------------------------

def _import_runner():
    """sglang's MlxModelRunner and ReqToTokenPool, or a skip. sglang imports torchvision unconditionally (a
    multimodal config module); where the registry's torchvision cannot run here (a CUDA build: CI's engines
    job leaves it out), transformers is told it is absent and a stand-in module takes its import."""
    for name in ("sglang", "mlx.core", "mlx_lm"):
        if importlib.util.find_spec(name.split(".")[0]) is None:
            pytest.skip(f"{name} is not installed (CI's engines job installs sglang with MLX's CPU backend)")
    if importlib.util.find_spec("torchvision") is None:
        from transformers.utils import import_utils

        assert not import_utils.is_torchvision_available()  # cached: stays False after the stand-in
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
            sys.modules.setdefault(name, _TorchvisionStandIn(name))
    from sglang.srt.hardware_backend.mlx.model_runner import MlxModelRunner
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return MlxModelRunner, ReqToTokenPool


class _TorchvisionStandIn(types.ModuleType):
    """Any name sglang's image code imports at module level is a placeholder class; nothing here calls them."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


@pytest.fixture(scope="module")
def runner_classes():
    return _import_runner()


def _config(family):
    from ropepool.cli.demo_mlx import CONFIGS

    if family == "llama":  # no rope_scaling: sglang's gate sends Llama 3 scaling to its own path
        return {k: v for k, v in CONFIGS["llama"].items() if k != "rope_scaling"}
    return CONFIGS[family]


def _checkpoint(config, path):
    """A small mlx-lm model with seeded random weights, saved as sglang loads it (config, safetensors and a
    word-level tokenizer: one token per id, no download)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer, models

    from ropepool.cli.demo_mlx import build

    model = build(config, mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    vocab = {str(i): i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


class Served:
    """sglang's scheduler's part, by hand: req_to_token rows and shuffled pool slots, prefill (on a released
    request's prefix), batched decode, release. Keeps the generated tokens and, for a released request, the
    pool rows of its decode slots before and after sglang's release writes them."""

    def __init__(self, runner, req_to_token, pool_size):
        self.runner, self.table = runner, req_to_token.req_to_token
        self.free = iter(np.random.default_rng(5).permutation(np.arange(1, pool_size + 1)).tolist())  # 0: padding
        self.rows, self.slots, self.prompt_len, self.tokens, self.released = {}, {}, {}, {}, {}

    def prefill(self, rid, full, prefix_of=None):
        import torch

        prefix = self.slots[prefix_of][:self.owned(prefix_of)] if prefix_of else []
        new = [next(self.free) for _ in full[len(prefix):]]
        row = self.rows[rid] = len(self.rows) + 1
        self.slots[rid], self.prompt_len[rid] = prefix + new, len(full)
        self.table[row, :len(full)] = torch.tensor(prefix + new, dtype=torch.int32)
        self.tokens[rid] = [self.runner.prefill(rid, list(full[len(prefix):]), list(full), prefix, new, row)]

    def owned(self, rid):
        """Positions with KV: the prompt and every generated token but the last."""
        return self.prompt_len[rid] + len(self.tokens[rid]) - 1

    def decode(self, rids, steps):
        for _ in range(steps):
            for rid in rids:  # the scheduler gives each request's next position a slot before the step
                self.slots[rid].append(next(self.free))
                self.table[self.rows[rid], self.owned(rid)] = self.slots[rid][-1]
            for rid, t in zip(rids, self.runner.decode_batch(list(rids))):
                self.tokens[rid].append(t)

    def release(self, rid):
        decoded = self.slots[rid][self.prompt_len[rid]:self.owned(rid)]
        before = self._rows(decoded)
        self.runner.release_request_row(rid, self.owned(rid))  # sglang copies the request's KV to the pool
        self.runner.remove_request(rid)
        self.released[rid] = (before, self._rows(decoded))

    def _rows(self, slots):
        pool = self.runner._attention_kv_pool  # sglang's MlxAttentionKVPool: k_buffer, v_buffer per layer
        return [np.array(b)[np.array(slots)] for b in pool.k_buffer + pool.v_buffer]


def serve(runner_classes, path, pool_size=256):
    """Prompts A, B, C prefilled and decoded together; A released; D (A's tokens and more: a prefix hit on A's
    cached KV) prefilled and decoded with B and C. Returns the Served record."""
    MlxModelRunner, ReqToTokenPool = runner_classes
    runner = MlxModelRunner(str(path), pool_size=pool_size)  # on MLX's CPU backend the pool is not auto-sized
    req_to_token = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    runner.init_cache_pools(req_to_token)
    served = Served(runner, req_to_token, pool_size)
    for rid, prompt in zip("ABC", PROMPTS):
        served.prefill(rid, prompt)
    served.decode("ABC", FIRST - 1)
    served.release("A")
    served.prefill("D", PROMPTS[0] + tuple(served.tokens["A"]) + EXTRA, prefix_of="A")
    served.decode("BCD", SECOND)
    served.kernels = runner._aot_kernels.selected_kernel_names
    return served


def mlx_lm_tokens(model, prompt, n):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(list(prompt)), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


@pytest.fixture
def calls(monkeypatch):
    """Every call that reaches ropepool.rope_pool_fused: (batch, slots)."""
    seen = []
    original = ropepool.api.rope_pool_fused

    def spy(q, k, v, positions, slots, *args, **kwargs):
        seen.append((q.shape[0], np.array(slots).tolist()))
        return original(q, k, v, positions, slots, *args, **kwargs)

    monkeypatch.setattr(ropepool.api, "rope_pool_fused", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # GQA; Qwen3's q/k norms (sglang applies them first)
def test_sglang_mlx_runner_serves_through_ropepool(family, runner_classes, tmp_path, monkeypatch, calls,
                                                   clean_modules):
    config = _config(family)
    model = _checkpoint(config, tmp_path)
    monkeypatch.setenv("SGLANG_MLX_USE_CUSTOM_ROPE", "0")
    own = serve(runner_classes, tmp_path)
    assert own.kernels == () and calls == []

    monkeypatch.setenv("SGLANG_MLX_USE_CUSTOM_ROPE", "1")
    assert integration.install() is True
    fused = serve(runner_classes, tmp_path)
    assert fused.kernels == ("metal_rope_pool_fused",), "sglang did not select the kernel: it ran its own path"

    want = {rid: mlx_lm_tokens(model, p, FIRST + SECOND) for rid, p in zip("ABC", PROMPTS)}
    want["A"] = want["A"][:FIRST]
    want["D"] = mlx_lm_tokens(model, PROMPTS[0] + tuple(want["A"]) + EXTRA, SECOND + 1)
    assert own.tokens == want, f"{family}: sglang's own path differs from mlx-lm's generation"
    assert fused.tokens == want, f"{family}: sglang through ropepool differs from mlx-lm's generation"
    assert len({t for seq in want.values() for t in seq}) > FIRST, f"{family}: a degenerate model"

    layers = config["num_hidden_layers"]
    steps = [3] * (FIRST - 1) + [3] * SECOND  # decode steps, each of three requests
    assert [b for b, _ in calls] == [b for b in steps for _ in range(layers)], "not one call per layer and step"
    assert all(s > 0 for _, slots in calls for s in slots), "a call without pool slots (sglang's RoPE-only mode)"
    before, after = fused.released["A"]
    assert all(np.array_equal(x, y) for x, y in zip(before, after)), \
        "the pool rows ropepool wrote differ from those sglang's release writes"
    assert all(np.abs(x).max() > 0 for x in before), "decode rows were not written"


def test_sglang_gate_keeps_llama3_scaling_on_its_own_path(runner_classes, tmp_path, monkeypatch, clean_modules):
    from ropepool.cli.demo_mlx import CONFIGS

    _checkpoint(CONFIGS["llama"], tmp_path)
    monkeypatch.setenv("SGLANG_MLX_USE_CUSTOM_ROPE", "1")
    integration.install()
    MlxModelRunner, _ = runner_classes
    assert MlxModelRunner(str(tmp_path), pool_size=64)._aot_kernels.selected_kernel_names == ()


def test_sglang_plugin_loader_installs_only_when_the_kernel_is_asked_for(runner_classes, monkeypatch,
                                                                          clean_modules):
    """sglang runs the ``sglang.srt.plugins`` entry points in each of its processes (its scheduler too)."""
    from sglang.srt import plugins

    for flag, want in (("0", False), ("1", True)):
        monkeypatch.setenv("SGLANG_MLX_USE_CUSTOM_ROPE", flag)
        monkeypatch.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        assert integration.installed() is want, f"SGLANG_MLX_USE_CUSTOM_ROPE={flag}"
