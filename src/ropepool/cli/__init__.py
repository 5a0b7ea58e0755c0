"""``ropepool demo | bench | env``, and the argument types the commands share.

Every mistake on the command line ends in one line on stderr naming the
option and its valid values (exit status 2), never a traceback: the parsers
are ``Parser``, list and number options are parsed by the types below, and a
missing framework is reported before the command's module is imported.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

# (command, framework) -> (modules it imports, the extra that installs them)
NEEDS = {("demo", "torch"): (("torch", "transformers", "rich"), "hf"),
         ("bench", "torch"): (("torch", "rich"), "torch,bench"),
         ("demo", "mlx"): (("mlx.core", "mlx_lm"), "mlx-lm"),
         ("bench", "mlx"): (("mlx.core", "rich"), "mlx,bench")}
FRAMEWORKS = ("torch", "mlx")
ENGINES = ("transformers", "vllm")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: argument --x: ...``), without the usage block."""

    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += f" ({self.prog} --help lists the options)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def alias(parser, flag, of):
    """Accept ``flag`` as an older spelling of the option ``of`` (its action), not shown in --help."""
    parser.add_argument(flag, dest=of.dest, type=of.type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def choosers(parser, cmd):
    """``--framework`` (and demo's ``--engine``) in a command's --help: ``main`` reads them before the
    command's own parser runs, to pick its module, so each module's parser lists them too."""
    parser.add_argument("--framework", choices=FRAMEWORKS, default="torch",
                        help="torch (the default) or mlx: mlx-lm's models and MLX arrays, no torch needed")
    if cmd == "demo":
        parser.add_argument("--engine", choices=ENGINES, default="transformers",
                            help="the serving engine the models run in (default transformers; vllm: vLLM's CPU "
                                 "build, installed by the README's vLLM line)")


def out_file(text):
    """Type of ``--out``: a file name in a directory that exists and takes new files, checked before any work
    (a write that fails at the end of a run would lose its results)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file name in it, e.g. "
                                         f"{os.path.join(text, 'run.json')}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"directory {folder!r} does not exist; create it (mkdir -p {folder}) "
                                         "or name a file in an existing one")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {folder!r} ({e.strerror}); name a file in a "
                                         "directory you can write to") from None
    return text


def names_of(valid, all_=False):
    """Type of a comma-separated option: names from ``valid`` (with ``all_``, "all" means every one)."""
    def parse(text):
        names = list(valid) if all_ and text == "all" else text.split(",")
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; valid: comma-separated from "
                                             f"{', '.join(valid)}{' (or all)' if all_ else ''}")
        return names
    return parse


def count(text, least=1):
    """Type of a whole-number option: an int >= ``least``."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < least:
        raise argparse.ArgumentTypeError(f"expected an int >= {least}; got {text!r}")
    return n


def counts(text):
    """Type of a comma-separated list of ints >= 1 (token counts)."""
    try:
        return [count(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1 (e.g. 1,16,256); got {text!r}") \
            from None


def positive(text):
    """Type of a float option > 0 (seconds)."""
    try:
        x = float(text)
    except ValueError:
        x = None
    if x is None or not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0; got {text!r}")
    return x


def torch_device(parser, text):
    """``text`` as a torch.device this machine has (else a one-line parser error naming the ones it has)."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is not None and (dev.type == "cpu" or dev.type == "cuda" and (dev.index or 0) < cuda or
                            dev.type == "mps" and mps):
        return dev
    here = ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(cuda)] if cuda else []) + (["mps"] if mps else [])
    if not (torch.version.cuda or torch.version.hip):
        build = ", a CPU build"
    else:  # a GPU build (CUDA or ROCm, both 'cuda' devices) on a machine where torch sees no GPU says so
        build = "" if cuda else ", no GPU visible"
    parser.error(f"argument --device: {text!r} is not a device of this machine (torch {torch.__version__}{build}); "
                 f"valid here: {', '.join(here)}")


def out_paths(out):
    """``--out``'s files: the records (OUT.json) and the plot beside them (OUT.png); OUT may end in .json."""
    stem = out[:-5] if out.endswith(".json") else out
    return stem + ".json", stem + ".png"


def env_report() -> int:
    import importlib.metadata as md
    import platform

    from ..backends import BACKENDS

    print(f"python {platform.python_version()} on {platform.machine()}")
    for name in ("ropepool", "numpy", "torch", "apache-tvm-ffi", "triton", "mlx", "transformers"):
        try:
            print(f"  {name:<13} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name:<13} not installed")
    try:
        import torch

        cuda = torch.cuda.is_available()
        print(f"  cuda          {torch.cuda.get_device_name() if cuda else 'not available'}")
        q = torch.empty(0, device="cuda" if cuda else "cpu")
        from .. import native

        kernel = native.kernel()
        print(f"  native CPU    {kernel.isa() + ' build' if kernel is not None else native.why()}")
    except ImportError:
        q = None
    print("backends (in order of preference):")
    for b in BACKENDS:
        why = b.why_not(q) if b.framework == "torch" and q is not None else (
            b.why_not(None) if b.framework == "mlx" else "torch is not installed")
        # two rows share the name torch (CPU fast path, general code): the module tells them apart
        print(f"  {b.name:<7} {b.framework:<6} {b.module.lstrip('.'):<12} {'ready' if why is None else why}")
    return 0


def _framework(cmd: str, args: list) -> tuple:
    """(the framework ``--framework`` names, the engine ``--engine`` names, the other args): MLX's demo and
    bench are their own modules, which import neither torch nor transformers; so is the vLLM demo."""
    p = Parser(prog=f"ropepool {cmd}", add_help=False)
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch")
    if cmd == "demo":
        p.add_argument("--engine", choices=ENGINES, default="transformers")
    a, rest = p.parse_known_args(args)
    return a.framework, getattr(a, "engine", None), rest


def _vllm_missing() -> str | None:
    """The one line to print when vLLM cannot be imported (the README's vLLM install line), else None."""
    try:
        importlib.import_module("vllm")
    except Exception as e:  # noqa: BLE001 - a broken vLLM install (e.g. CUDA torchvision) fails in many ways
        from .demo_vllm import INSTALL

        why = (str(e).splitlines() or [type(e).__name__])[0]
        return f"ropepool demo --engine vllm: error: vllm cannot be imported ({why}). Fix (from a clone): {INSTALL}"
    return None


def _missing(cmd: str, framework: str) -> str | None:
    """The one line to print when a module ``cmd`` needs under ``framework`` cannot be imported, else None."""
    modules, extra = NEEDS[cmd, framework]
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            why = (str(e).splitlines() or [type(e).__name__])[0]
            mlx = " --framework mlx" if framework == "mlx" else ""
            other = f" (with MLX and no torch: ropepool {cmd} --framework mlx)" if name == "torch" else ""
            return (f"ropepool {cmd}{mlx}: error: {name} cannot be imported ({why}). Fix: pip install "
                    f"'ropepool[{extra}]'{other}")
    return None


def main(argv=None) -> int:
    from .._version import __version__

    p = Parser(prog="ropepool", description="RoPE + KV-pool write, fused.")
    p.add_argument("--version", action="version", version=f"ropepool {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,env}")
    sub.add_parser("demo", help="run transformers' continuous batching with and without ropepool: tokens/s and "
                                 "whether the tokens match (--framework mlx: mlx-lm's models; --engine vllm: "
                                 "vLLM itself)", add_help=False)
    sub.add_parser("bench", help="time ropepool beside eager PyTorch, torch.compile and a copy (--framework mlx: "
                                  "beside hand-written MLX)", add_help=False)
    sub.add_parser("env", help="versions, devices and which backend would run")
    a, rest = p.parse_known_args(argv)
    if a.cmd in ("demo", "bench"):  # demo.py / demo_mlx.py, bench.py / bench_mlx.py
        framework, engine, rest = _framework(a.cmd, rest)
        if engine == "vllm":  # demo_vllm.py
            missing = _vllm_missing()
            if missing:
                print(missing, file=sys.stderr)
                return 2
            return importlib.import_module(".demo_vllm", __package__).main(rest)
        missing = _missing(a.cmd, framework)
        if missing:
            print(missing, file=sys.stderr)
            return 2
        return importlib.import_module(f".{a.cmd}{'_mlx' if framework == 'mlx' else ''}", __package__).main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)} (ropepool env takes none)")
    return env_report()

