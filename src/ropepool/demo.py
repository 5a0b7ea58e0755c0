"""``ropepool demo``: transformers' own continuous batching, with and without ropepool.

For each family (Llama, Mistral, Qwen2, Qwen3, Gemma 3) a small model is
built from a config written here, with seeded random weights (nothing is
downloaded). The same prompts go through transformers' continuous batching
(``ContinuousBatchingManager``, the engine behind ``generate_batch``) twice:
as transformers ships it, and after ``ropepool.integrations.transformers.enable``,
where every attention layer's q/k norm, RoPE and paged-cache write is one
``rope_pool_fused`` call. Both runs are greedy; the demo prints tokens/s for
each and whether the tokens match.

Pass/fail. In float32 every token must be identical and the log-probability
of each chosen token within ``LOGPROB_TOL``. In bfloat16 / float16 the two
paths round differently (transformers rounds cos/sin and the normed q/k to
the model dtype, ropepool computes in float32 and rounds once), so greedy
decoding may part ways at a near-tie: the demo reports where, and checks the
log-probabilities only while both runs saw the same tokens.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
from dataclasses import dataclass

# Tiny configs: GQA (4 query heads, 2 KV heads), windows shorter than the prompts so the sliding-window
# ring buffer wraps, and a wide weight init so a wrong rotation shows in the tokens and log-probabilities.
_COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "initializer_range": 0.2, "tie_word_embeddings": False}
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
CONFIGS = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    # every layer slides (no layer_types): transformers caches all layers in a ring buffer
    "mistral": ("MistralConfig", {"sliding_window": 6, "head_dim": 16, "rope_theta": 1e6}),
    # biased q/k/v; layer 0 full attention, layer 1 sliding (layer_types)
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                              "rope_theta": 1e6}),
    # per-head q_norm / k_norm before RoPE; head_dim 32 != hidden_size / heads
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1e6}),
    # q/k norms with (1 + w) gains; sliding layers rotate with base 1e4, the full layer with 1e6 and linear scaling
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": 4,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "rope_parameters": _GEMMA3_ROPE}),
}
FAMILIES = tuple(CONFIGS)
PROMPT_LENGTHS = (7, 19, 3, 12, 26, 5, 33, 9)
MAX_BATCH_TOKENS = 16  # long prompts are prefilled in chunks, beside other requests' decode tokens
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}


def build_model(family: str, *, dtype=None, device="cpu", seed: int = 0, attn_implementation="sdpa"):
    """A small ``*ForCausalLM`` of ``family`` with seeded random weights (greedy, no EOS stop)."""
    import torch
    import transformers

    cls_name, extra = CONFIGS[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.to(device=device, dtype=dtype or torch.float32).eval()
    g = model.generation_config
    g.eos_token_id, g.pad_token_id, g.bos_token_id, g.do_sample = None, 0, None, False
    return model


def make_prompts(vocab_size: int, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def batching_config(*, page_size: int = 16, num_blocks: int = 64, max_batch_tokens: int = MAX_BATCH_TOKENS, **kw):
    """A ``ContinuousBatchingConfig`` on transformers 5.17 (``block_size``) and later 5.x (``page_size``),
    returning log-probabilities and never switching to flash attention on its own."""
    import dataclasses

    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kw["page_size" if "page_size" in fields else "block_size"] = page_size
    if "auto_switch_to_flash" in fields:
        kw["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, return_logprobs=True,
                                    **kw)


@dataclass
class Run:
    tokens: list  # per request
    logprobs: list
    seconds: float  # from the first request queued to the last one finished

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))


def run_batch(model, prompts, new_tokens: int, config=None, advance=lambda: None) -> Run:
    """The prompts through transformers' continuous batching (the manager behind ``generate_batch``)."""
    import torch

    with model.continuous_batching_context_manager(generation_config=model.generation_config, block=True, timeout=5,
                                                    continuous_batching_config=config or batching_config()) as mgr:
        t0 = time.perf_counter()
        ids = mgr.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        done = {}
        while len(done) < len(ids):
            r = mgr.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"request {r.request_id} failed in transformers' batching: {r.error}")
                done[r.request_id] = r
                advance()
            elif r is None and not mgr.is_running():
                raise RuntimeError("transformers' generation thread stopped; see the log above")
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return Run([done[i].generated_tokens for i in ids], [done[i].logprobs for i in ids], seconds)


def first_difference(a: list, b: list) -> int | None:
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if diff is None and len(a) != len(b) else diff


@dataclass
class Comparison:
    family: str
    dtype: str
    plain: Run  # transformers as shipped
    fused: Run  # after enable(model)

    @property
    def diverged_at(self) -> list:
        """Per request: the first step whose token differs (a missing token counts), or None."""
        return [first_difference(a, b) for a, b in zip(self.plain.tokens, self.fused.tokens)]

    @property
    def max_logprob_diff(self) -> float:
        """Over the steps where both runs saw the same tokens (up to and including the first divergence)."""
        diffs = [abs(x - y) for a, b, d in zip(self.plain.logprobs, self.fused.logprobs, self.diverged_at)
                 for x, y in list(zip(a, b))[:None if d is None else d + 1]]
        return max(diffs, default=0.0)

    @property
    def ok(self) -> bool:
        same = all(d is None for d in self.diverged_at) or self.dtype != "float32"
        return same and self.max_logprob_diff <= LOGPROB_TOL[self.dtype]


def compare(family: str, *, device="cpu", dtype=None, new_tokens: int = 16, prompt_lengths=PROMPT_LENGTHS,
            repeats: int = 3, advance=lambda: None) -> Comparison:
    """One family through transformers' batching as shipped and through ropepool, ``repeats`` times each in
    turn; the model and prompts are the same. Tokens are those of the first runs, the time the fastest run's
    (the first run of each also compiles kernels and fills caches)."""
    from .integrations import transformers as rp

    model = build_model(family, dtype=dtype, device=device)
    prompts = make_prompts(model.config.vocab_size, prompt_lengths)
    # transformers' manager runs gc.collect() twice when it stops: over the heap of torch and transformers
    # that takes about a second. Freezing what exists now (nothing here is garbage) makes it instant.
    gc.freeze()
    plain, fused = [], []
    for _ in range(repeats):
        plain.append(run_batch(model, prompts, new_tokens, advance=advance))
        rp.enable(model)
        try:
            fused.append(run_batch(model, prompts, new_tokens, advance=advance))
        finally:
            rp.disable(model)
    fastest = lambda runs: Run(runs[0].tokens, runs[0].logprobs, min(r.seconds for r in runs))
    return Comparison(family, str(model.dtype).rsplit(".", 1)[-1], fastest(plain), fastest(fused))


def render(results: list, device: str):
    from rich.table import Table

    table = Table(title=f"transformers continuous batching on {device}: as shipped vs through ropepool")
    for col in ("model", "dtype", "requests", "tokens", "transformers tok/s", "ropepool tok/s", "tokens match",
                "max |Δ logprob|"):
        table.add_column(col, justify="left" if col in ("model", "dtype", "tokens match") else "right")
    for c in results:
        div = [d for d in c.diverged_at if d is not None]
        n = len(c.diverged_at)
        match = "identical" if not div else f"{n - len(div)}/{n} identical, first divergence at step {min(div)}"
        verdict = "[green]ok[/]" if c.ok else "[red]MISMATCH[/]"
        table.add_row(c.family, c.dtype, str(len(c.plain.tokens)), str(c.fused.generated),
                      f"{c.plain.generated / c.plain.seconds:.0f}", f"{c.fused.generated / c.fused.seconds:.0f}",
                      f"{match} {verdict}", f"{c.max_logprob_diff:.1e}")
    return table


def main(argv=None) -> int:
    import torch

    from .cli import Parser, alias, count, names_of, torch_device

    p = Parser(prog="ropepool demo", description="Run small models of each family through transformers' own "
               "continuous batching, as shipped and with ropepool enabled; print tokens/s for both and whether "
               "the tokens match.")
    alias(p, "--model", p.add_argument("--families", type=names_of(FAMILIES, all_=True), default="all",
                                       help=f"comma-separated from {', '.join(FAMILIES)}, or all (the default)"))
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=tuple(LOGPROB_TOL), default="float32",
                   help="model dtype (default float32, where the tokens must be identical)")
    p.add_argument("--new-tokens", type=count, default=16, help="tokens to generate per request (default 16)")
    p.add_argument("--repeats", type=count, default=3,
                   help="runs of each path, alternating; tokens/s is the fastest run's (default 3)")
    a = p.parse_args(argv)
    device = torch_device(p, a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from rich.console import Console
    from rich.progress import Progress

    # The models have no EOS on purpose, which transformers' batching warns about on every run; its errors
    # (a failed request's traceback) still show.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    console = Console(width=None if sys.stdout.isatty() else 120)  # piped (CI logs): wide enough for the table
    results = []
    try:
        with Progress(console=console, transient=False) as progress:
            for family in a.families:
                task = progress.add_task(f"{family}: requests", total=2 * a.repeats * len(PROMPT_LENGTHS))
                results.append(compare(family, device=device, dtype=getattr(torch, a.dtype),
                                       new_tokens=a.new_tokens, repeats=a.repeats,
                                       advance=lambda task=task: progress.advance(task)))
    finally:
        gc.unfreeze()  # let the interpreter free it all at exit
    console.print(render(results, device))
    failed = [c.family for c in results if not c.ok]
    if failed:
        console.print(f"[red]mismatch: {', '.join(failed)}[/]")
        return 1
    console.print("[green]all tokens identical[/]" if a.dtype == "float32" else
                  f"[green]log-probabilities within {LOGPROB_TOL[a.dtype]} while the tokens agree[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
