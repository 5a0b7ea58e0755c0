"""mlx-lm's own model classes served through ropepool, against mlx-lm's own generation (no torch needed).

Models are built from config dicts in code with seeded random weights (no
download) through mlx-lm's own model registry: Llama (with llama3 scaling),
Mistral (mlx-lm serves it with its Llama classes), Qwen2 (q/k/v biases) and
Qwen3 (per-head q/k norms, fused as ropepool.QKNorm). The weights are scaled
up (x4) so that the next token depends on the whole context: with the raw
initialisation a tiny model repeats one token whatever RoPE does.

- float32: greedy tokens of four prompts of different lengths, prefilled one
  by one and then decoded together in batched steps through ropepool's slot
  pools, are identical to ``mlx_lm.generate.generate_step`` run on each prompt
  alone; teacher-forced logits agree to 1e-3 of their spread.
- bfloat16: mlx-lm rotates in bf16 (cos/sin rounded), ropepool in float32, so
  greedy paths may part after a near tie. Compared: the teacher-forced logits
  of every prompt and continuation position. ropepool's must be no farther
  from the float32 model's than mlx-lm's own bf16 logits are (within 1.5x),
  and pick the same top token as mlx-lm's bf16 at >= 75% of positions.
- A wrong RoPE (another base) changes the greedy tokens: the comparison can fail.
"""
from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx-lm]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'ropepool[mlx-lm]')")

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import ropepool  # noqa: E402
from ropepool.cli.demo_mlx import CONFIGS, build  # noqa: E402
from ropepool.integrations.mlx_lm import PooledAttention, PooledModel  # noqa: E402

VOCAB = CONFIGS["llama"]["vocab_size"]
PROMPT_LENGTHS = (5, 13, 2, 30)
NEW_TOKENS = 10


def prompts():
    gen = np.random.default_rng(1)
    return [gen.integers(0, VOCAB, n).tolist() for n in PROMPT_LENGTHS]


def greedy_mlx_lm(model, prompt, n, **kv):
    """mlx-lm's own greedy generation; ``kv``: its quantized cache (kv_bits=, kv_group_size=, quantized_kv_start=)."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1), **kv)
    return [int(t) for t, _ in steps]


def logits_mlx_lm(model, seq, n_prompt):
    """Teacher-forced logits of mlx-lm with its own KV cache: after the prompt, then after each token."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([seq[:n_prompt]]), cache=cache)[0, -1]]
    out += [model(mx.array([[t]]), cache=cache)[0, -1] for t in seq[n_prompt:-1]]
    return np.array(mx.stack(out).astype(mx.float32))


def logits_ropepool(model, config, seqs, n_prompts):
    """The same through ropepool's slot pools: prompts prefilled one by one, then batched decode steps."""
    pooled = PooledModel(model, config, pool_rows=256, slot_order=np.random.default_rng(2).permutation(256))
    outs = [[pooled.forward([i], mx.array([s[:n]]))[0, -1]] for i, (s, n) in enumerate(zip(seqs, n_prompts))]
    for j in range(len(seqs[0]) - n_prompts[0] - 1):
        step = pooled.forward(list(range(len(seqs))), mx.array([[s[n + j]] for s, n in zip(seqs, n_prompts)]))
        for i, o in enumerate(outs):
            o.append(step[i, -1])
    return [np.array(mx.stack(o).astype(mx.float32)) for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_greedy_tokens_identical_to_mlx_lm(name):
    config = CONFIGS[name]
    model = build(config, mx.float32)
    want = [greedy_mlx_lm(model, p, NEW_TOKENS) for p in prompts()]
    pooled = PooledModel(model, config, pool_rows=256, slot_order=np.random.default_rng(3).permutation(256))
    assert all(isinstance(layer.self_attn, PooledAttention) for layer in model.model.layers)
    got = pooled.generate(prompts(), NEW_TOKENS)
    assert got == want, f"{name}: ropepool's batched greedy decode differs from mlx-lm's:\n{got}\nvs\n{want}"
    assert len({t for seq in want for t in seq}) > NEW_TOKENS, f"{name}: a degenerate model (one token repeated)"
    # The wrapped model still runs mlx-lm's own cache path unchanged.
    assert greedy_mlx_lm(model, prompts()[0], NEW_TOKENS) == want[0]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_float32_logits_match_mlx_lm(name):
    config, ps = CONFIGS[name], prompts()
    gen = np.random.default_rng(4)
    seqs = [p + gen.integers(0, VOCAB, NEW_TOKENS).tolist() for p in ps]
    model = build(config, mx.float32)
    want = [logits_mlx_lm(model, s, len(p)) for s, p in zip(seqs, ps)]
    got = logits_ropepool(model, config, seqs, [len(p) for p in ps])
    spread = np.std(np.concatenate(want))
    err = max(np.abs(g - w).max() for g, w in zip(got, want)) / spread
    assert err < 1e-3, f"{name}: float32 logits differ from mlx-lm's by {err:.2e} of their spread"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bfloat16_logits_as_close_as_mlx_lm_own(name):
    config, ps = CONFIGS[name], prompts()
    gen = np.random.default_rng(4)
    seqs = [p + gen.integers(0, VOCAB, NEW_TOKENS).tolist() for p in ps]
    exact = [logits_mlx_lm(build(config, mx.float32), s, len(p)) for s, p in zip(seqs, ps)]
    model = build(config, mx.bfloat16)
    theirs = [logits_mlx_lm(model, s, len(p)) for s, p in zip(seqs, ps)]
    ours = logits_ropepool(model, config, seqs, [len(p) for p in ps])
    spread = np.std(np.concatenate(exact))

    def dist(a):
        return max(np.abs(x - y).max() for x, y in zip(a, exact)) / spread

    top1 = np.mean(np.concatenate([o.argmax(-1) == t.argmax(-1) for o, t in zip(ours, theirs)]))
    assert dist(ours) <= 1.5 * dist(theirs), (
        f"{name}: ropepool's bf16 logits are {dist(ours):.3f} (in logit spreads) from the float32 model's, "
        f"mlx-lm's own bf16 logits {dist(theirs):.3f}")
    assert top1 >= 0.75, f"{name}: ropepool's bf16 top token agrees with mlx-lm's bf16 at {top1:.0%} of positions"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_quantized_cache_tokens_identical_to_mlx_lm(name, bits):
    """mlx-lm's quantized KV cache (kv_bits, kv_group_size=64, from the first token) served through ropepool:
    rope_pool_fused writes each row as mx.quantize stores it into tuple pools, attention reads them as mlx-lm's
    QuantizedKVCache does; float32 greedy tokens identical to mlx-lm's own quantized generation, every layer's
    write one ropepool call."""
    from ropepool.backends import paths

    config = {**CONFIGS[name], "head_dim": 64}  # a group of 64 needs head_dim >= 64
    model = build(config, mx.float32)
    kv = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
    want = [greedy_mlx_lm(model, p, NEW_TOKENS, **kv) for p in prompts()]
    pooled = PooledModel(model, config, pool_rows=256, slot_order=np.random.default_rng(6).permutation(256),
                         kv_bits=bits, kv_group_size=64)
    with paths.counting() as seen:
        got = pooled.generate(prompts(), NEW_TOKENS)
    assert got == want, f"{name}, {bits} bits: ropepool's tokens differ from mlx-lm's:\n{got}\nvs\n{want}"
    forwards = len(PROMPT_LENGTHS) + NEW_TOKENS  # each prompt but its last token alone, then batched steps
    assert seen["mlx.block_store"] == forwards * len(model.model.layers), seen
    if bits == 4:  # the quantization shows: the float cache's tokens are others (the comparison can fail)
        assert [greedy_mlx_lm(model, p, NEW_TOKENS) for p in prompts()] != want


def test_quantized_first_forwards_run_alone():
    config = {**CONFIGS["llama"], "head_dim": 64}
    pooled = PooledModel(build(config, mx.float32), config, pool_rows=16, kv_bits=4)
    with pytest.raises(ropepool.RopePoolError, match="first forward runs alone"):
        pooled.forward([0, 1], mx.array([[3], [4]]))


def test_a_wrong_rope_changes_the_tokens():
    config = CONFIGS["mistral"]
    model = build(config, mx.float32)
    want = [greedy_mlx_lm(model, p, NEW_TOKENS) for p in prompts()]
    got = PooledModel(model, {**config, "rope_theta": 10000.0}, pool_rows=256).generate(prompts(), NEW_TOKENS)
    assert got != want, "a model served with another RoPE base gave mlx-lm's tokens: the comparison cannot fail"


@pytest.mark.parametrize("compiled", [True, False], ids=["decode-sized", "eager"])
def test_batched_decode_rotates_every_sequence(compiled, monkeypatch):
    """One token per sequence across a batch (T = batch, each at its own position): every row is rotated
    by its own position, and equals the same token's call alone.

    The regression of mx.fast.rope with seq_len 1 and batch > 1 (only row 0 rotated, fixed in MLX 0.32)."""
    from ropepool import plan
    from ropepool.backends import paths

    plan.forget()  # the runners of this layout are made with the tuning of this test
    if not compiled:
        monkeypatch.setattr(plan, "DEFAULT_TUNING", plan.Tuning(compile_tokens=0))
    B, Hq, Hkv, D, P = 6, 8, 2, 64, 64
    gen = np.random.default_rng(5)
    q, k, v = (mx.array(gen.standard_normal((B, h, D)).astype(np.float32)) for h in (Hq, Hkv, Hkv))
    positions = mx.array([3, 70000, 11, 900, 0, 123456], dtype=mx.int32)
    slots = mx.array(gen.permutation(P)[:B].astype(np.int32))
    pools = [mx.array(gen.standard_normal((P, Hkv, D)).astype(np.float32)) for _ in range(2)]
    kw = {"head_dim": D, "num_qo_heads": Hq, "num_kv_heads": Hkv, "rope_base": 10000.0}
    with paths.counting() as seen:
        q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(q, k, v, positions, slots, *pools, **kw)
    plan.forget()  # no runner of this tuning stays in the layout cache
    assert seen["mlx.compiled"] == compiled, f"{seen['mlx.compiled']} compiled calls"
    ref = ropepool.reference.rope_pool_fused(*(np.array(a) for a in (q, k, v, positions, slots, *pools)), **kw)
    for name, got, want in (("q_rot", q_rot, ref[0]), ("k_rot", k_rot, ref[1]), ("k_pool", kp, ref[2])):
        err = np.abs(np.array(got) - want).max(axis=(-1, -2))
        if got.ndim == 3 and got.shape[0] == B:
            assert (err < 2e-5).all(), f"{name}: rows rotated wrongly: max error per sequence {err.tolist()}"
        else:
            assert err.max() < 2e-5, f"{name}: max error {err.max():.2e}"
    np.testing.assert_array_equal(np.array(vp), ref[3], err_msg="v_pool: each token's v row at its slot")
    for b in range(B):
        alone = ropepool.rope_pool_fused(q[b:b + 1], k[b:b + 1], v[b:b + 1], positions[b:b + 1],
                                         slots[b:b + 1], *pools, **kw)
        np.testing.assert_allclose(np.array(alone[0][0]), np.array(q_rot[b]), rtol=0, atol=2e-6,
                                   err_msg=f"sequence {b}: batched q_rot differs from its call alone")


def test_demo_runs_mlx_lm_with_and_without_ropepool(capsys):
    """``ropepool demo --framework mlx``: every family's float32 tokens identical, exit 0."""
    from ropepool.cli import main

    assert main(["demo", "--framework", "mlx", "--dtype", "float32", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens identical") == 4, out
