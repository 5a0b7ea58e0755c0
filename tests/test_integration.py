"""Serving transformers models through ropepool: token-for-token equal to transformers' generate."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ropepool import RopePoolError  # noqa: E402
from ropepool.demo import FAMILIES, LOGIT_TOL, build_model, compare, hf_generate, make_prompts  # noqa: E402
from ropepool.integrations.transformers import Engine, PoolAttention, SlotAllocator, read_config  # noqa: E402

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


# -- the demo's comparison, per family ----------------------------------------

@pytest.mark.parametrize("family", [pytest.param(f, id=f) for f in FAMILIES])
def test_tokens_identical_to_transformers(family):
    c = compare(family, new_tokens=NEW_TOKENS)
    for r in c.requests:
        assert r.generated == NEW_TOKENS
        assert r.diverged_at is None, f"{family} request {r.rid} diverged at step {r.diverged_at}"
    assert c.max_logit_diff <= LOGIT_TOL["float32"], f"{family}: max |logit diff| {c.max_logit_diff:.3g}"
    # The pool holds three requests: later ones must have run in freed rows.
    reused = [r for r in c.requests if r.reused_slots]
    assert reused and all(r.generated == r.identical for r in reused)
    assert c.stats["mixed_steps"] > 0  # prefill chunks and decode tokens shared steps
    assert c.ok


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}


@pytest.mark.parametrize("family, rope", [
    pytest.param("llama", LLAMA3, id="llama-llama3"),
    pytest.param("mistral", {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}, id="mistral-linear"),
    pytest.param("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                           "rope_theta": 1e6}, id="qwen3-yarn"),
])
def test_scaled_rope_from_the_config(family, rope):
    """The RoPE is RopeSpec.from_hf_config(model.config): scaled types match transformers too."""
    c = compare(family, new_tokens=NEW_TOKENS, config_overrides={"rope_scaling": dict(rope)})
    assert c.identical == c.tokens and c.max_logit_diff <= LOGIT_TOL["float32"], c.max_logit_diff


def test_float32_logit_check_catches_a_slightly_wrong_rope(monkeypatch):
    """A 1% error in the RoPE base keeps greedy tokens but not the logits: the check must see it."""
    import dataclasses

    from ropepool import RopeSpec
    from ropepool.integrations import transformers as integ

    real = integ.read_config

    def wrong_base(config):
        s = real(config)
        return dataclasses.replace(s, rope=RopeSpec(head_dim=s.head_dim, base=s.rope.base * 1.01))

    monkeypatch.setattr(integ, "read_config", wrong_base)
    c = compare("llama", new_tokens=8)
    assert c.max_logit_diff > LOGIT_TOL["float32"] and not c.ok


# -- a step that mixes prefill and decode --------------------------------------

def test_mixed_prefill_and_decode_batch(llama):
    model = llama
    a_prompt, b_prompt = make_prompts(model.config.vocab_size, (5, 20), seed=7)
    engine = Engine(model, pool_size=128, max_batch_tokens=8, record_logits=True)
    a = engine.add_request(a_prompt, NEW_TOKENS)
    engine.step()  # a's whole prompt: its first token
    assert len(a.output) == 1 and a.num_cached == 5
    b = engine.add_request(b_prompt, NEW_TOKENS)

    batch = engine.schedule()
    assert [s.request for s in batch.segments] == [a, b]
    assert (batch.num_decode_tokens, batch.num_prefill_tokens) == (1, 7)
    assert batch.positions.tolist() == [5] + list(range(7))
    assert batch.slots.tolist() == [a.slots[5]] + b.slots[:7]
    assert [s.samples for s in batch.segments] == [True, False]  # b's chunk does not end its prompt
    engine.execute(batch)
    assert len(a.output) == 2 and b.num_cached == 7 and not b.output
    engine.run()

    ref = hf_generate(model, [a_prompt, b_prompt], NEW_TOKENS)
    for r, (tokens, ref_logits) in zip((a, b), ref):
        assert r.output == tokens
        assert (torch.stack(r.logits) - ref_logits).abs().max() <= LOGIT_TOL["float32"]
    assert engine.stats["mixed_steps"] > 0

    # The rows each request left in the pool are transformers' own KV cache.
    for r in (a, b):
        out = model.model(input_ids=torch.tensor([r.tokens[:-1]]), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5.x
        rows = r.slots[:len(r.tokens) - 1]
        for i, layer in enumerate(cache.layers):
            torch.testing.assert_close(engine.k_pool[i, rows], layer.keys[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(engine.v_pool[i, rows], layer.values[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_engine_leaves_the_model_as_it_was(llama):
    before = [type(layer.self_attn) for layer in llama.model.layers]
    Engine(llama, pool_size=64).generate([[1, 2, 3]], max_new_tokens=2)
    assert [type(layer.self_attn) for layer in llama.model.layers] == before
    assert not any(isinstance(m, PoolAttention) for m in llama.modules())


def test_freed_slots_are_reused_by_the_next_request(llama):
    engine = Engine(llama, pool_size=40)
    first = engine.add_request([1, 2, 3, 4], 30)  # 33 slots: the second must wait
    second = engine.add_request([5, 6], 30)  # 31 slots
    engine.step()
    assert engine.running == [first] and list(engine.waiting) == [second]
    engine.run()
    assert set(second.slots) <= set(first.slots) and second.reused_slots == len(second.slots)
    assert engine.allocator.num_free == 40


# -- bad input ------------------------------------------------------------------

def test_unsupported_family_is_refused():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    supported = r"supports model_type \['llama', 'mistral', 'qwen2', 'qwen3'\]; got 'gpt2'"
    with pytest.raises(RopePoolError, match=supported):
        read_config(config)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(RopePoolError, match="got 'gpt2'.*Fix: use a Llama, Mistral, Qwen2 or Qwen3 model"):
        Engine(model, pool_size=16)


@pytest.mark.parametrize("config, match", [
    pytest.param(object(), r"expects a transformers config with a model_type", id="no-model-type"),
    pytest.param({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 64},
                 r"num_attention_heads must be a positive int; got None\. Fix: set config\.num_attention_heads",
                 id="missing-heads"),
    pytest.param({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 64,
                  "num_attention_heads": 4, "num_key_value_heads": 3},
                 r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)", id="gqa-heads"),
    pytest.param({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 64,
                  "num_attention_heads": 4, "rope_parameters": {"rope_type": "no-such-rope", "rope_theta": 1e4}},
                 r"cannot read the RoPE of this llama config: .*no-such-rope", id="unknown-rope"),
    pytest.param({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 64,
                  "num_attention_heads": 4, "partial_rotary_factor": 0.5},
                 r"rotates all head_dim=16 features NeoX-style; got rotary_dim=8.*Fix: remove partial_rotary_factor",
                 id="partial-rotary"),
])
def test_unreadable_config_is_refused(config, match):
    with pytest.raises(RopePoolError, match=match):
        read_config(config)


def test_pool_too_small_is_refused_before_anything_is_written(llama):
    engine = Engine(llama, pool_size=24)
    engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=8)  # the pool now holds rows
    k, v = engine.k_pool.clone(), engine.v_pool.clone()
    with pytest.raises(RopePoolError, match=r"a request needs 25 slots \(prompt 10 \+ max_new_tokens 16 - 1\) but "
                                            r"pool_size is 24\. Fix: raise pool_size to at least 25"):
        engine.add_request(list(range(10)), 16)
    assert not engine.waiting and not engine.running
    engine.run()
    assert torch.equal(engine.k_pool, k) and torch.equal(engine.v_pool, v)


@pytest.mark.parametrize("prompt, new, match", [
    pytest.param([], 4, r"prompt must be a non-empty list of token ids in \[0, 256\); got \[\]", id="empty-prompt"),
    pytest.param([1, 256], 4, r"token ids in \[0, 256\); got \[1, 256\]\. Fix: tokenize", id="token-out-of-vocab"),
    pytest.param([1, 2], 0, r"max_new_tokens must be an int >= 1; got 0", id="no-new-tokens"),
])
def test_bad_request_is_refused(llama, prompt, new, match):
    engine = Engine(llama, pool_size=16)
    with pytest.raises(RopePoolError, match=match):
        engine.generate([[1, 2, 3], prompt], max_new_tokens=new)
    assert not engine.waiting and engine.allocator.num_free == 16  # the good prompt was not queued either


@pytest.mark.parametrize("kwargs, match", [
    pytest.param(dict(pool_size=0), r"pool_size must be a positive int; got 0", id="pool-size"),
    pytest.param(dict(pool_size=8, max_batch_tokens=0), r"max_batch_tokens must be a positive int", id="budget"),
])
def test_bad_engine_arguments_are_refused(llama, kwargs, match):
    with pytest.raises(RopePoolError, match=match):
        Engine(llama, **kwargs)


def test_allocator_out_of_slots():
    alloc = SlotAllocator(4)
    held = alloc.allocate(3)
    assert held == [0, 1, 2]
    with pytest.raises(RopePoolError, match=r"asked for 2, 1 of pool_size=4 are free\. Fix: free finished"):
        alloc.allocate(2)
    assert alloc.num_free == 1  # the failed call took nothing
    alloc.free(held)
    with pytest.raises(RopePoolError, match=r"not held \(freed twice\?\)"):
        alloc.free([0])
    assert alloc.allocate(4) == [0, 1, 2, 3]
