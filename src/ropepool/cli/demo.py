"""``ropepool demo``: transformers' own continuous batching, with and without ropepool.

For each family (Llama, Mistral, Qwen2, Qwen3, Gemma 3) a small model is
built from a config written here, with seeded random weights (nothing is
downloaded). The same prompts go through transformers' continuous batching
(``ContinuousBatchingManager``, the engine behind ``generate_batch``) twice:
as transformers ships it, and after ``ropepool.integrations.transformers.enable``,
where every attention layer's q/k norm, RoPE and paged-cache write is one
``rope_pool_fused`` call. Both runs are greedy; after one untimed run of
each, ``--repeats`` timed runs of each take turns in ABBA order, and the demo
prints the median tokens/s of each with its min-max, the ratio of the pairs
of neighbouring runs (median and quartiles: the paired turn method,
paired.py), whether the tokens match, and for each model ropepool does not
serve faster, that it does not and why.

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

from . import demo_scale
from .demo_report import losses, render
from .demo_scale import GEOMETRIES
from .paired import quartiles, turn

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
    cpu_seconds: float = 0.0  # the process's CPU time meanwhile (all its threads)

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tok_s(self) -> float:
        """Tokens per second of the process's CPU time on CPU (wall time on a machine shared with other work
        swings by 2-4x between runs; CPU time counts the work, every thread's), of wall time on a GPU."""
        return self.generated / (self.cpu_seconds if CPU_TIME[0] else self.seconds)


CPU_TIME = [True]  # compare() sets it per device


def run_batch(model, prompts, new_tokens: int, config=None, advance=lambda: None) -> Run:
    """The prompts through transformers' continuous batching (the manager behind ``generate_batch``)."""
    import torch

    with model.continuous_batching_context_manager(generation_config=model.generation_config, block=True, timeout=5,
                                                    continuous_batching_config=config or batching_config()) as mgr:
        t0, c0 = time.perf_counter(), time.process_time()
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
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Run([done[i].generated_tokens for i in ids], [done[i].logprobs for i in ids], seconds, cpu)


def first_difference(a: list, b: list) -> int | None:
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if diff is None and len(a) != len(b) else diff


@dataclass
class Comparison:
    family: str
    dtype: str
    plains: list  # transformers as shipped: the timed runs (Run)
    fuseds: list  # after enable(model): fuseds[i] ran beside plains[i]
    firsts: tuple = ()  # the untimed first run of each (plain, fused): caches filled, graphs compiled
    order: tuple = ()  # per pair, the path that ran first ("plain" or "fused"): ABBA

    @property
    def plain(self) -> Run:
        return self.plains[0]

    @property
    def fused(self) -> Run:
        return self.fuseds[0]

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

    @property
    def paired(self) -> dict:
        """Tokens/s through ropepool over tokens/s as shipped in each pair of neighbouring runs: median, quartiles."""
        return quartiles(f.tok_s / p.tok_s for p, f in zip(self.plains, self.fuseds))

    @property
    def speedup(self) -> float:
        return self.paired["ratio_median"]

    @property
    def verdict(self) -> str:
        """"faster" or "slower" by the median pair; "within spread" where the pairs' quartiles reach 1.00x."""
        q = self.paired
        if q["ratio_median"] >= 1:
            return "faster" if q["ratio_q1"] > 1 else "faster, within spread"
        return "slower, within spread" if q["ratio_q3"] >= 1 else "slower"

    def record(self) -> dict:
        return {"family": self.family, "dtype": self.dtype, "requests": len(self.plain.tokens),
                "tokens": self.fused.generated, "identical": all(d is None for d in self.diverged_at),
                "max_logprob_diff": self.max_logprob_diff, "ok": self.ok,
                "plain_s": [r.seconds for r in self.plains], "fused_s": [r.seconds for r in self.fuseds],
                "plain_cpu_s": [r.cpu_seconds for r in self.plains],
                "fused_cpu_s": [r.cpu_seconds for r in self.fuseds],
                "first_cpu_s": [r.cpu_seconds for r in self.firsts], "first": list(self.order)}


def compare(family: str, *, device="cpu", dtype=None, new_tokens: int = 16, prompt_lengths=PROMPT_LENGTHS,
            repeats: int = 5, advance=lambda: None, model=None, config=None) -> Comparison:
    """One family through transformers' batching as shipped and through ropepool, in turn: one untimed run
    of each (it fills caches), then ``repeats`` timed runs of each in ABBA turns, on the same model and prompts.
    ``model``, ``config``: another model than the family's small one (demo_scale.py), its batching config."""
    from ..integrations import transformers as rp

    model = model if model is not None else build_model(family, dtype=dtype, device=device)
    CPU_TIME[0] = model.device.type == "cpu"
    prompts = make_prompts(model.config.vocab_size, prompt_lengths)
    # transformers' manager runs gc.collect() twice when it stops: over the heap of torch and transformers
    # that takes about a second. Freezing what exists now (nothing here is garbage) makes it instant.
    gc.freeze()
    runs, order = {"plain": [], "fused": []}, []
    for i in range(repeats + 1):  # turn 0 (untimed): plain first, then ABBA
        order.append(turn(i, "plain", "fused")[0])
        for path in turn(i, "plain", "fused"):
            if path == "fused":
                rp.enable(model)
            try:
                runs[path].append(run_batch(model, prompts, new_tokens, config, advance))
            finally:
                rp.disable(model)  # (nothing to undo after a plain run)
    (p0, *plain), (f0, *fused) = runs["plain"], runs["fused"]
    return Comparison(family, str(model.dtype).rsplit(".", 1)[-1], plain, fused, (p0, f0), tuple(order[1:]))


def _clock(run) -> float:
    return run.cpu_seconds if CPU_TIME[0] else run.seconds


def record(results: list, device: str, note: str | None, setup: dict | None = None) -> dict:
    """The demo's record (docs/bench/): versions, device, date, commit and every run's seconds (``setup``: the
    prompts and batching of a run at another geometry, demo_scale.py)."""
    import importlib.metadata as md
    import platform
    import subprocess

    import torch

    from .._version import __version__
    from .bench_report import cpu_name

    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "device": str(device),
           "torch": torch.__version__, "transformers": md.version("transformers"), "ropepool": __version__,
           "threads": torch.get_num_threads(),
           "prompts": list(PROMPT_LENGTHS), "max_batch_tokens": MAX_BATCH_TOKENS, **(setup or {})}
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = cpu_name()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                       cwd=__file__.rsplit("/", 1)[0]).stdout.strip() or None
    except OSError:
        env["commit"] = None
    if note:
        env["note"] = note
    return {"env": env, "demo": [c.record() for c in results]}


def parser():
    from . import Parser, alias, choosers, count, names_of, out_file

    p = Parser(prog="ropepool demo", description="Run small models of each family through transformers' own "
               "continuous batching, as shipped and with ropepool enabled; print tokens/s for both and whether "
               "the tokens match.")
    choosers(p, "demo")
    alias(p, "--model", p.add_argument("--families", type=names_of(FAMILIES, all_=True), default="all",
                                       help=f"comma-separated from {', '.join(FAMILIES)}, or all (the default)"))
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", type=names_of(tuple(LOGPROB_TOL)), default="float32,bfloat16",
                   help="model dtypes, comma-separated from float32, bfloat16, float16 (default float32,bfloat16; "
                        "in float32 the tokens must be identical)")
    p.add_argument("--new-tokens", type=count, default=16, help="tokens to generate per request (default 16)")
    p.add_argument("--repeats", type=count, default=5,
                   help="timed runs of each path, in ABBA turns, after an untimed one; tokens/s is their median, "
                        "with the min-max, the ratio the median over pairs of neighbouring runs (default 5)")
    p.add_argument("--geometry", choices=tuple(GEOMETRIES), default=None,
                   help="instead of the small models: a Llama of this model's widths with --layers layers and "
                        "random weights (for a GPU; demo_scale.py)")
    p.add_argument("--layers", type=count, default=4, help="layers of the --geometry model (default 4)")
    p.add_argument("--requests", type=count, default=8, help="requests of the --geometry run (default 8)")
    p.add_argument("--out", type=out_file, default=None, help="also write the runs as a record to OUT.json")
    p.add_argument("--note", default=None, help="a note stored in the record (where and how it was measured)")
    return p


def main(argv=None) -> int:
    import torch

    from . import torch_device

    p = parser()
    a = p.parse_args(argv)
    device = torch_device(p, a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from rich.console import Console
    from rich.progress import Progress

    # The models have no EOS on purpose, which transformers' batching warns about on every run; its errors
    # (a failed request's traceback) still show.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    console = Console(width=None if sys.stdout.isatty() else 120)  # piped (CI logs): wide enough for the table
    results, lengths, scaled, setup = [], PROMPT_LENGTHS, {}, None
    if a.geometry:
        lengths = demo_scale.prompt_lengths(a.requests)
        scaled = dict(config=demo_scale.batching(a.requests, lengths, a.new_tokens, demo_scale.MAX_BATCH_TOKENS))
        setup = {"geometry": a.geometry, "layers": a.layers, "prompts": lengths, "new_tokens": a.new_tokens,
                 "max_batch_tokens": demo_scale.MAX_BATCH_TOKENS}
    try:
        with Progress(console=console, transient=False) as progress:
            for dtype in a.dtype:
                if a.geometry:
                    scaled["model"] = demo_scale.build(a.geometry, layers=a.layers, dtype=getattr(torch, dtype),
                                                       device=device)
                for family in [a.geometry] if a.geometry else a.families:
                    task = progress.add_task(f"{family} {dtype}: requests", total=2 * (a.repeats + 1) * len(lengths))
                    results.append(compare(family, device=device, dtype=getattr(torch, dtype),
                                           new_tokens=a.new_tokens, repeats=a.repeats, prompt_lengths=lengths,
                                           advance=lambda task=task: progress.advance(task), **scaled))
    finally:
        gc.unfreeze()  # let the interpreter free it all at exit
    console.print(render(results, device, "process CPU time" if CPU_TIME[0] else "wall time"))
    if results and results[0].firsts:  # what a server's first requests pay, kept out of the medians
        clock = "CPU" if CPU_TIME[0] else "wall"
        console.print("first (untimed) run of each model, s of " + clock + " time, transformers / through ropepool: " +
                      ", ".join(f"{c.family} {c.dtype} {_clock(c.firsts[0]):.2f} / {_clock(c.firsts[1]):.2f}"
                                for c in results))
    lost = losses(results, device)
    if lost:
        console.print(lost)
    if a.out:
        import json

        path = a.out if a.out.endswith(".json") else a.out + ".json"
        with open(path, "w") as f:
            json.dump(record(results, device, a.note, setup), f, indent=1)
        console.print(f"wrote {path}")
    failed = [f"{c.family} {c.dtype}" for c in results if not c.ok]
    if failed:
        console.print(f"[red]mismatch: {', '.join(failed)}[/]")
        return 1
    for dtype in a.dtype:
        console.print(f"[green]{dtype}: all tokens identical[/]" if dtype == "float32" else
                      f"[green]{dtype}: log-probabilities within {LOGPROB_TOL[dtype]} while the tokens agree[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
