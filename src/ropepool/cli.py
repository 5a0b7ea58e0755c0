"""``ropepool demo | bench | env``."""
from __future__ import annotations

import argparse
import importlib
import sys


def env_report() -> int:
    import importlib.metadata as md
    import platform

    from .backends import BACKENDS

    print(f"python {platform.python_version()} on {platform.machine()}")
    for name in ("ropepool", "numpy", "torch", "triton", "mlx", "transformers"):
        try:
            print(f"  {name:<13} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name:<13} not installed")
    try:
        import torch

        cuda = torch.cuda.is_available()
        print(f"  cuda          {torch.cuda.get_device_name() if cuda else 'not available'}")
        q = torch.empty(0, device="cuda" if cuda else "cpu")
    except ImportError:
        q = None
    print("backends (in order of preference):")
    for b in BACKENDS:
        why = b.why_not(q) if b.framework == "torch" and q is not None else (
            b.why_not(None) if b.framework == "mlx" else "torch is not installed")
        print(f"  {b.name:<7} {b.framework:<6} {'ready' if why is None else why}")
    return 0


def _framework(args: list) -> tuple:
    """(whether ``--framework mlx`` is among ``args``, the other args): MLX's demo and bench are their own
    modules, which import neither torch nor transformers."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--framework", choices=("torch", "mlx"), default="torch")
    a, rest = p.parse_known_args(args)
    return a.framework == "mlx", rest


def main(argv=None) -> int:
    from ._version import __version__

    p = argparse.ArgumentParser(prog="ropepool", description="RoPE + KV-pool write, fused.")
    p.add_argument("--version", action="version", version=f"ropepool {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="run transformers' continuous batching with and without ropepool: tokens/s and "
                                 "whether the tokens match (--framework mlx: mlx-lm's models)", add_help=False)
    sub.add_parser("bench", help="time ropepool beside eager PyTorch, torch.compile and a copy (--framework mlx: "
                                  "beside hand-written MLX)", add_help=False)
    sub.add_parser("env", help="versions, devices and which backend would run")
    a, rest = p.parse_known_args(argv)
    if a.cmd in ("demo", "bench"):  # demo.py / demo_mlx.py, bench.py / bench_mlx.py
        mlx, rest = _framework(rest)
        return importlib.import_module(f".{a.cmd}{'_mlx' if mlx else ''}", __package__).main(rest)
    return env_report()


if __name__ == "__main__":
    sys.exit(main())
