"""``ropepool demo``: serve small transformers models through ropepool and compare.

For each family (Llama, Mistral, Qwen2, Qwen3) a small model is built from a
config written here, with seeded random weights (nothing is downloaded). A
batch of prompts of different lengths is generated greedily twice: by
transformers' own ``generate`` (one prompt at a time, its own KV cache), and
by ``ropepool.integrations.transformers.Engine`` (continuous batching over
one slot pool, every RoPE and KV write done by ``rope_pool_fused``). The pool
holds only about three requests at once, so later requests reuse the rows of
finished ones, and long prompts are prefilled in chunks beside other
requests' decode steps.

Pass/fail. In float32 (the default on CPU) every generated token must be
identical and the logits within ``LOGIT_TOL``. In bfloat16 / float16 the two
paths round differently (transformers rounds cos/sin to the model dtype,
ropepool rotates in float32), so greedy decoding may legitimately part ways at
a near-tie; there the table reports the first step where a request diverged,
and the check is on the logits up to and including that step, while both
paths still see the same tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# Tiny configs: 2 layers, GQA (4 query heads, 2 KV heads). rope_theta= is read
# by transformers 4.x and turned into rope_parameters by 5.x.
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.1, tie_word_embeddings=False)
CONFIGS = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    # A window shorter than the longer requests, so it is exercised.
    "mistral": ("MistralConfig", dict(sliding_window=24, head_dim=16, rope_theta=1e6)),
    # Biased q/k/v; sliding window on the second layer only (layer_types).
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1,
                                  rope_theta=1e6)),
    # q_norm / k_norm per head; head_dim 32 != hidden_size / heads.
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1e6)),
}
PROMPT_LENGTHS = (7, 19, 3, 12, 26, 5)
MAX_BATCH_TOKENS = 8
LOGIT_TOL = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}  # max |logit difference| allowed


def build_model(family: str, *, dtype=None, device="cpu", seed: int = 0, **overrides):
    """A small ``*ForCausalLM`` of ``family`` with seeded random weights (greedy, no EOS stop)."""
    import torch
    import transformers

    cls_name, extra = CONFIGS[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype or torch.float32).eval()
    g = model.generation_config
    g.eos_token_id, g.pad_token_id, g.bos_token_id = None, 0, None
    return model


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def hf_generate(model, prompts, new_tokens: int):
    """transformers' own greedy generate, one prompt at a time: (tokens, float32 logits [steps, vocab]) each."""
    import torch

    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
            out.append((g.sequences[0, len(p):].tolist(), torch.stack(g.logits)[:, 0].float().cpu()))
    return out


@dataclass
class RequestResult:
    rid: int
    prompt_len: int
    slots: list[int]
    reused_slots: int
    generated: int
    identical: int  # tokens equal to transformers' up to the first difference
    diverged_at: int | None  # first step whose token differs, None if none
    max_logit_diff: float  # over the steps where both saw the same tokens


@dataclass
class Comparison:
    family: str
    dtype: str
    device: str
    requests: list[RequestResult]
    stats: dict
    pool_size: int
    hf_seconds: float
    ropepool_seconds: float

    @property
    def tokens(self) -> int:
        return sum(r.generated for r in self.requests)

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.requests)

    @property
    def max_logit_diff(self) -> float:
        return max(r.max_logit_diff for r in self.requests)

    @property
    def ok(self) -> bool:
        logits_ok = self.max_logit_diff <= LOGIT_TOL[self.dtype]
        if self.dtype == "float32":
            return logits_ok and self.identical == self.tokens
        return logits_ok


def compare(family: str, *, new_tokens: int = 32, device="cpu", dtype=None, prompt_lengths=PROMPT_LENGTHS,
            pool_size: int | None = None, max_batch_tokens: int = MAX_BATCH_TOKENS, seed: int = 0,
            config_overrides: dict | None = None) -> Comparison:
    """Generate with transformers and through ropepool; compare token by token."""
    import torch

    from .integrations.transformers import Engine

    model = build_model(family, dtype=dtype, device=device, seed=seed, **(config_overrides or {}))
    prompts = make_prompts(model.config.vocab_size, prompt_lengths, seed=seed + 1)
    if pool_size is None:  # room for the first three requests: the rest reuse their rows
        pool_size = sum(len(p) + new_tokens - 1 for p in prompts[:3])

    # Queue first: a pool too small is refused before anything runs.
    engine = Engine(model, pool_size=pool_size, max_batch_tokens=max_batch_tokens, record_logits=True)
    reqs = [engine.add_request(p, new_tokens) for p in prompts]
    t0 = time.perf_counter()
    ref = hf_generate(model, prompts, new_tokens)
    t1 = time.perf_counter()
    engine.run()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()

    results = []
    for r, (ref_tokens, ref_logits) in zip(reqs, ref):
        diverged = next((i for i, (a, b) in enumerate(zip(r.output, ref_tokens)) if a != b), None)
        same_ctx = len(r.output) if diverged is None else diverged + 1
        diff = (torch.stack(r.logits[:same_ctx]) - ref_logits[:same_ctx]).abs().max().item()
        results.append(RequestResult(r.rid, len(r.prompt), r.slots, r.reused_slots, len(r.output),
                                     len(r.output) if diverged is None else diverged, diverged, diff))
    return Comparison(family, str(model.dtype).rsplit(".", 1)[-1], str(model.device), results, dict(engine.stats),
                      pool_size, t1 - t0, t2 - t1)


def slot_ranges(slots: list[int]) -> str:
    """``[0, 1, 2, 7, 8]`` -> ``"0-2,7-8"``."""
    out, start = [], None
    for i, s in enumerate(slots):
        if start is None:
            start = s
        if i + 1 == len(slots) or slots[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ",".join(out)


def render(c: Comparison):
    from rich.table import Table

    st = c.stats
    table = Table(title=f"{c.family} ({c.dtype}, {c.device}): transformers generate vs ropepool",
                  caption=(f"pool_size {c.pool_size}; {st['steps']} steps, {st['mixed_steps']} mixing prefill and "
                           f"decode; transformers {c.hf_seconds:.2f} s, ropepool {c.ropepool_seconds:.2f} s"))
    for col in ("request", "prompt", "slots", "reused", "generated", "identical", "max |Δlogit|"):
        table.add_column(col, justify="left" if col == "slots" else "right")
    for r in c.requests:
        same = f"{r.identical}" if r.diverged_at is None else f"[yellow]{r.identical} (diverged)[/]"
        table.add_row(str(r.rid), str(r.prompt_len), slot_ranges(r.slots), str(r.reused_slots),
                      str(r.generated), same, f"{r.max_logit_diff:.2e}")
    verdict = "[green]ok[/]" if c.ok else "[red]MISMATCH[/]"
    table.add_row(f"{len(c.requests)} requests", "", "", "", str(c.tokens), f"{c.identical}",
                  f"{c.max_logit_diff:.2e} {verdict}", end_section=True)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ropepool demo", description="Serve small transformers models through "
                                "ropepool and compare with transformers' own generate, token by token.")
    p.add_argument("--model", choices=FAMILIES + ("all",), default="all", help="model family (default: all)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=tuple(LOGIT_TOL), default="float32",
                   help="model dtype (default float32: tokens must be identical)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per request (default 32)")
    p.add_argument("--pool-size", type=int, default=None,
                   help="KV pool rows (default: room for three requests, so the rest reuse slots)")
    a = p.parse_args(argv)

    try:
        import torch

        from .integrations import transformers as _  # noqa: F401  (fails early without the extra)
    except ImportError as e:
        print(f"ropepool demo needs torch and transformers: pip install 'ropepool[hf]' ({e})", file=sys.stderr)
        return 2
    from rich.console import Console

    from .errors import RopePoolError

    console = Console()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    failed = []
    for family in FAMILIES if a.model == "all" else (a.model,):
        try:
            c = compare(family, new_tokens=a.new_tokens, device=device, dtype=dtype, pool_size=a.pool_size)
        except RopePoolError as e:
            console.print(f"[red]{family}: {e}[/]")
            failed.append(family)
            continue
        console.print(render(c))
        if not c.ok:
            failed.append(family)
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}[/]")
        return 1
    console.print("[green]all tokens identical[/]" if a.dtype == "float32" else
                  f"[green]logits within {LOGIT_TOL[a.dtype]} while the contexts agree[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
