"""ropepool inside transformers' own continuous batching, against transformers itself (float32, CPU).

For each hosted family (a small model from ``ropepool.cli.demo``'s configs,
random weights): greedy ``generate_batch`` through ropepool gives exactly the
tokens of ``generate_batch`` as shipped and of plain ``generate``, with the
same log-probabilities; every attention layer makes one ``rope_pool_fused``
call per step; and the rows it wrote into transformers' ``PagedAttentionCache``
are the ones transformers itself writes there. The prompts are longer than
the step budget (chunked prefill beside decode tokens) and than the sliding
windows (the ring buffer wraps). Last, the tensor-parallel recipe: one call
split by heads over two "ranks" equals one call.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

pytest.importorskip("transformers")

import ropepool  # noqa: E402
from ropepool.cli import demo
from ropepool.integrations import transformers as rp
from ropepool.integrations.transformers import attention, paged
from ropepool.integrations.transformers import model as model_py
from ropepool.integrations.transformers.model import attention_layers, cpu_table
from tests.torch_fixtures import backend, rng  # noqa: F401,E402

NEW_TOKENS = 6
PROMPT_LENGTHS = (3, 11, 20)
LOGPROB_TOL = 1e-5  # float32; a 1% error in a RoPE base moves them by 1e-4 to 1e-2 on these models


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    # transformers' batching manager calls gc.collect() twice when it stops (about a second over this
    # heap); freezing the heap built so far makes that instant.
    gc.freeze()
    yield
    gc.unfreeze()


def generate_batch(model, prompts):
    out = model.generate_batch(prompts, generation_config=model.generation_config, max_new_tokens=NEW_TOKENS,
                               continuous_batching_config=demo.batching_config(max_batch_tokens=8))
    results = list(out.values())
    assert len(results) == len(prompts) and all(r.error is None for r in results), [r.error for r in results]
    return [r.generated_tokens for r in results], [r.logprobs for r in results]


def generate(model, prompts):
    """Plain greedy ``generate``, one prompt at a time: tokens and the log-probability of each."""
    tokens, logprobs = [], []
    for p in prompts:
        g = model.generate(torch.tensor([p]), generation_config=model.generation_config, max_new_tokens=NEW_TOKENS,
                           output_logits=True, return_dict_in_generate=True)
        new = g.sequences[0, len(p):]
        lp = torch.stack(g.logits)[:, 0].float().log_softmax(-1).gather(1, new[:, None])[:, 0]
        tokens.append(new.tolist())
        logprobs.append(lp.tolist())
    return tokens, logprobs


def max_gap(a, b):
    """The largest difference of two runs' log-probabilities (``generate_batch``'s second item)."""
    return max(abs(x - y) for r, s in zip(a[1], b[1]) for x, y in zip(r, s))


def served_both_ways(model, prompts, spy):
    """``generate_batch`` as shipped (no ropepool call), then through ropepool (``rp.enable``): the same
    tokens and log-probabilities, in as many steps. Returns the shipped run."""
    shipped = generate_batch(model, prompts)
    assert not spy.calls and spy.steps > 0
    steps_shipped, spy.steps = spy.steps, 0
    rp.enable(model)
    fused = generate_batch(model, prompts)
    assert fused[0] == shipped[0]
    assert max_gap(fused, shipped) < LOGPROB_TOL
    assert spy.steps == steps_shipped
    return shipped


class StepSpy:
    """Counts a model's steps and keeps each cache its first attention layer ``first`` is given; subclasses
    record the integration's calls in ``calls``, each with the layer that made it (``_layer``)."""

    def __init__(self, model, first):
        self.steps, self.calls, self.caches, self._layer = 0, [], [], None
        model.register_forward_hook(self._step)
        first.register_forward_pre_hook(self._cache, with_kwargs=True, prepend=True)

    def _step(self, module, args, output):
        self.steps += 1

    def _cache(self, module, args, kwargs):
        if kwargs.get("cache") is not None and (not self.caches or self.caches[-1] is not kwargs["cache"]):
            self.caches.append(kwargs["cache"])


class Spy(StepSpy):
    """Records every layer call the integration makes (``run_layer``: its layer's ``rope_pool_fused`` call, or
    that call's bound runner after the first), and the rotation and norm of each call that went through
    ``rope_pool_fused`` itself."""

    def __init__(self, model, monkeypatch):
        super().__init__(model, attention_layers(model)[0])
        run_layer, op = attention.run_layer, attention.rope_pool_fused

        def spy_run_layer(layer, q, k, v, kv, **kw):
            self._layer = layer
            q_rot, k_rot = run_layer(layer, q, k, v, kv, **kw)
            self.calls.append({"layer": layer, "slots": kv.slots.clone(), "k_rot": k_rot.clone(), "v": v.clone()})
            return q_rot, k_rot

        def spy_op(q, k, v, positions, slots, k_pool, v_pool, **kw):
            self.op_calls.append({"layer": self._layer, "rope": kw["rope"], "norm": kw["qk_norm"]})
            return op(q, k, v, positions, slots, k_pool, v_pool, **kw)

        self.op_calls = []
        monkeypatch.setattr(attention, "run_layer", spy_run_layer)
        monkeypatch.setattr(attention, "rope_pool_fused", spy_op)


@pytest.mark.parametrize("family, attn_implementation", [
    pytest.param("llama", "sdpa", id="llama"),
    pytest.param("llama", "eager", id="llama-paged-eager"),
    pytest.param("mistral", "sdpa", id="mistral-sliding"),
    pytest.param("qwen2", "sdpa", id="qwen2-full-and-sliding"),
    pytest.param("qwen3", "sdpa", id="qwen3-qk-norm"),
    pytest.param("gemma3", "sdpa", id="gemma3-rope-per-layer"),
])
def test_generate_batch_through_ropepool_equals_transformers(family, attn_implementation, monkeypatch):
    model = demo.build_model(family, attn_implementation=attn_implementation)
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    spy = Spy(model, monkeypatch)
    shipped = served_both_ways(model, prompts, spy)

    # One call per attention layer per step, each with its own layer's rotation and norm.
    layers = {m.layer_idx: attention._LAYERS[m] for m in attention_layers(model)}
    assert [sum(c["layer"] is layers[i] for c in spy.calls) for i in layers] == [spy.steps] * len(layers)
    # Each layer's runner was bound by a rope_pool_fused call with that layer's own rotation and norm.
    # and only that first call: every later step called the runner directly (one layout per layer and cache).
    assert sorted(id(c["layer"]) for c in spy.op_calls) == sorted(id(x) for x in layers.values())
    # (on CPU the rotation as the model's cos/sin table, model.cpu_table)
    assert all(c["rope"] is cpu_table(c["layer"].rope, 0) and c["norm"] is c["layer"].norm for c in spy.op_calls)
    # the q/k norm fused where the row that runs the call takes it (else transformers' own norms ran)
    fused_norm = family in ("qwen3", "gemma3") and model_py.norm_fused(model, None)
    assert fused_norm == all(c["norm"] is not None for c in spy.op_calls)

    # transformers' cache holds what ropepool wrote, where transformers writes it itself.
    shipped_cache, fused_cache = spy.caches
    for i, layer in layers.items():
        last = {}
        for c in (c for c in spy.calls if c["layer"] is layer):
            for row, slot in enumerate(c["slots"].tolist()):
                if slot >= 0:
                    last[slot] = (c["k_rot"][row], c["v"][row])
        slots = torch.tensor(sorted(last))
        k_pool, v_pool = paged._pools(fused_cache, i)
        assert torch.equal(k_pool[slots], torch.stack([last[s][0] for s in sorted(last)]))
        assert torch.equal(v_pool[slots], torch.stack([last[s][1] for s in sorted(last)]))
        k_ref, v_ref = paged._pools(shipped_cache, i)
        torch.testing.assert_close(k_pool[slots], k_ref[slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_pool[slots], v_ref[slots], rtol=1e-5, atol=1e-5)

    # Plain generate is not touched by enable(), and agrees token for token.
    n = len(spy.calls)
    plain = generate(model, prompts)
    assert len(spy.calls) == n
    assert plain[0] == shipped[0]
    assert max_gap(plain, shipped) < LOGPROB_TOL

    rp.disable(model)
    assert generate_batch(model, prompts)[0] == shipped[0] and len(spy.calls) == n
    # enable() gave the norms an instance forward that passes their input through in a fused step
    assert not any("forward" in vars(m) for m in model.modules()), "disable() puts the modules' forward back"


def test_a_wrong_rotation_is_caught(monkeypatch):
    """The log-probabilities compared above see a RoPE base off by 1% (the tokens of these small models may not)."""
    model = demo.build_model("llama")
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    shipped = generate_batch(model, prompts)
    rp.enable(model)
    for module in attention_layers(model):
        layer = attention._LAYERS[module]
        wrong = ropepool.RopeSpec(head_dim=layer.rope.head_dim, base=layer.rope.base * 1.01)
        monkeypatch.setitem(attention._LAYERS, module, dataclasses.replace(layer, rope=wrong))
    assert max_gap(generate_batch(model, prompts), shipped) > 10 * LOGPROB_TOL


def test_cpu_table_is_the_rotation_grown_past_the_largest_position():
    spec = ropepool.RopeSpec(head_dim=16, base=1e6, scaling={"rope_type": "linear", "factor": 2.0})
    table = cpu_table(spec, 10)
    assert isinstance(table, ropepool.CosSinCache) and table.max_position == model_py._TABLE_ROWS
    assert cpu_table(ropepool.RopeSpec(head_dim=16, base=1e6, scaling={"rope_type": "linear", "factor": 2.0}),
                     model_py._TABLE_ROWS - 1) is table  # equal rotations share it while it covers the step
    pos = torch.arange(model_py._TABLE_ROWS, dtype=torch.float64)[:, None]
    ang = pos * torch.from_numpy(spec.inv_freq)[None, :]
    torch.testing.assert_close(table.cos_sin_cache.double(), torch.cat((ang.cos(), ang.sin()), 1), rtol=0,
                               atol=1e-3)  # float32 angles of positions up to 4096 (as ropepool computes them)
    grown = cpu_table(spec, model_py._TABLE_ROWS)
    assert grown is not table and grown.max_position == 2 * model_py._TABLE_ROWS
    assert torch.equal(grown.cos_sin_cache[:model_py._TABLE_ROWS], table.cos_sin_cache)
    # longrope switches frequency sets by a call's largest position, MRoPE takes 3 rows: no table stands for them
    mrope = ropepool.RopeSpec(head_dim=16, mrope_section=(2, 3, 3))
    assert cpu_table(mrope, 10) is mrope


def test_a_step_past_the_cpu_table_grows_it_and_each_layer_rebinds(monkeypatch):
    """Positions past the model's table (16 rows here; prompts of 20 tokens) grow it; each layer's runner, bound to
    the old table, is bound anew (its guard compares the table): the tokens stay transformers' own."""
    monkeypatch.setattr(model_py, "_TABLE_ROWS", 16)
    monkeypatch.setattr(model_py, "_TABLES", {})
    model = demo.build_model("llama")
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    spy = Spy(model, monkeypatch)
    served_both_ways(model, prompts, spy)
    tables = {id(c["rope"]) for c in spy.op_calls}
    assert len(tables) == 2 and len(spy.op_calls) == 2 * len(attention_layers(model))


@pytest.mark.parametrize("row_takes_norm", [False, True])
def test_the_norm_is_fused_only_where_the_fastest_row_takes_it(row_takes_norm, monkeypatch):
    """Qwen3 on CPU: where the native kernel's row does not take the q/k norm, transformers' own norms run and every
    layer's call is the kernel's (RoPE and the write); where the rows agree (the pick faked here), the norm is
    ropepool's, in that call. The tokens are transformers' either way."""
    from ropepool import backends
    from ropepool.backends import paths

    if backends.pick("torch", torch.empty(0)).module != ".torch_native":
        pytest.skip("the native CPU kernel is not built here")
    if row_takes_norm:
        monkeypatch.setattr(model_py, "pick", lambda *args: "the same row")
    else:  # (as the kernel's row is today; the test stays one of this case once it takes the norm)
        monkeypatch.setattr(backends, "BACKENDS", tuple(dataclasses.replace(b, supports=b.supports - {"norm"})
                                                        if b.module == ".torch_native" else b
                                                        for b in backends.BACKENDS))
    model = demo.build_model("qwen3")
    prompts = demo.make_prompts(model.config.vocab_size, PROMPT_LENGTHS)
    spy = Spy(model, monkeypatch)
    with paths.counting() as seen:
        served_both_ways(model, prompts, spy)
    assert spy.op_calls and all((c["norm"] is not None) == row_takes_norm for c in spy.op_calls)
    if not row_takes_norm:
        assert seen["torch_native.call"] == len(spy.calls) > 0  # every layer call: one call of the kernel


def test_unhosted_models_are_refused():
    import transformers

    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ropepool.RopePoolError, match=r"hosts model types \[.*'llama'.*\]; got 'gpt2'"):
        rp.enable(gpt2)
    llama = demo.build_model("llama", attn_implementation="flex_attention")
    with pytest.raises(ropepool.RopePoolError, match=r"with sdpa or eager attention; this model is set to "
                                                     r"'flex_attention'"):
        rp.enable(llama)
    assert not rp.is_enabled(gpt2) and not rp.is_enabled(llama)


@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk-norm-rope"])
def test_heads_split_over_two_ranks_equal_one_call(norm, rng):
    """Tensor parallelism: each rank calls the op on its own heads (q heads and the KV heads of their groups)
    and its own pool shard; together they are the one unsplit call, bit for bit. The backend is the one a
    rank gets by default: the Triton kernel on CUDA, the torch path on CPU."""
    T, HQ, HKV, D, P, TP = 9, 8, 4, 32, 24, 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(T, h, D, generator=rng).to(dev) for h in (HQ, HKV, HKV))
    positions = torch.randint(0, 100_000, (T,), generator=rng).to(dev)
    slots = torch.randperm(P, generator=rng)[:T]
    slots[::4] = -1
    slots = slots.to(dev)
    k_pool, v_pool = (torch.randn(P, HKV, D, generator=rng).to(dev) for _ in range(2))
    qk_norm = ropepool.QKNorm(torch.rand(D, generator=rng).to(dev), torch.rand(D, generator=rng).to(dev),
                              eps=1e-6) if norm else None
    rope = ropepool.RopeSpec(head_dim=D, base=1e6, scaling={"rope_type": "linear", "factor": 2.0})
    kw = {"head_dim": D, "rope": rope, "qk_norm": qk_norm}

    whole = ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool.clone(), v_pool.clone(), num_qo_heads=HQ,
                                     num_kv_heads=HKV, **kw)
    shards = []
    for r in range(TP):
        hq, hkv = slice(r * HQ // TP, (r + 1) * HQ // TP), slice(r * HKV // TP, (r + 1) * HKV // TP)
        shards.append(ropepool.rope_pool_fused(
            q[:, hq], k[:, hkv], v[:, hkv], positions, slots, k_pool[:, hkv].contiguous(),
            v_pool[:, hkv].contiguous(), num_qo_heads=HQ // TP, num_kv_heads=HKV // TP, **kw))
    for i, name in enumerate(("q_rot", "k_rot", "k_pool", "v_pool")):
        joined = torch.cat([s[i] for s in shards], dim=1)
        assert torch.equal(joined, whole[i]), name
