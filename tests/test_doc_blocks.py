"""Every ```python block of README.md and docs/*.md runs, as written, on the framework it is for.

A block is for MLX when it imports mlx or calls ``mx.``, else for PyTorch;
each runs where its framework is installed (the MLX job has no torch: its
blocks run there and in the torch job, which has MLX too). A block that
reads names defined elsewhere says so on the line before its fence:

- ``<!-- doc-test: setup=EXPR -->``: EXPR, evaluated in tests/doc_setups.py,
  returns those names (small models from configs, engine stand-ins, a step's
  tensors); the block then runs unchanged with them, ``ropepool`` and
  ``torch``. Without a GPU, ``device="cuda"`` in a block means the CPU (the
  calls are device-agnostic; the GPU job runs them on CUDA).
- ``<!-- doc-test: skip: REASON -->``: not run, for the reason given (a model
  download); at most MAX_SKIPPED blocks.

A block without a marker runs in an empty namespace: it must import what it
uses.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- doc-test: (setup=(?P<setup>.+?)|skip: (?P<skip>.+?)) -->$")
MAX_SKIPPED = 2


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the fence
    code: str
    setup: str | None
    skip: str | None

    @property
    def framework(self) -> str:
        return "mlx" if re.search(r"\bimport mlx|\bmx\.", self.code) else "torch"


def blocks() -> list:
    found = []
    for path in FILES:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip() != "```python":
                continue
            end = lines.index("```", n + 1)
            mark = MARK.match(lines[n - 1].strip()) if n else None
            if n and lines[n - 1].startswith("<!-- doc-test") and not mark:
                raise ValueError(f"{path.name}:{n}: a doc-test marker that does not read: {lines[n - 1]}")
            found.append(Block(f"{path.relative_to(ROOT)}:{n + 1}", "\n".join(lines[n + 1:end]),
                               mark and mark["setup"], mark and mark["skip"]))
    return found


def installed(framework: str) -> bool:
    return importlib.util.find_spec("mlx" if framework == "mlx" else "torch") is not None


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if not b.skip and installed(b.framework)]


def test_blocks_are_accounted_for():
    """Blocks are found in the README and docs, only a few are skipped (each with its reason), and no MLX
    block needs a setup (the MLX job has no torch for one)."""
    assert len(BLOCKS) >= 30 and any(b.where.startswith("README.md") for b in BLOCKS)
    skipped = [b for b in BLOCKS if b.skip]
    assert len(skipped) <= MAX_SKIPPED, [b.where for b in skipped]
    assert not [b.where for b in BLOCKS if b.framework == "mlx" and b.setup]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_block_runs(block):
    namespace = {"__name__": "doc_block"}
    code = block.code
    if block.setup:
        import torch

        import ropepool
        from tests import doc_setups

        namespace.update(torch=torch, ropepool=ropepool, **eval(block.setup, vars(doc_setups)))
        if not torch.cuda.is_available():
            code = code.replace('device="cuda"', 'device="cpu"')
    exec(compile(code, block.where, "exec"), namespace)
