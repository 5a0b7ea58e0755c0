"""Every ```python block of README.md and docs/*.md runs exactly as shown.

What a block needs is written in its first line, where a reader sees it:

- ``# needs CUDA``, ``# needs MLX``, ``# needs vLLM``, ``# needs the Hugging Face Hub (...)``: the block
  runs only where that is present (the Hub never here: nothing is downloaded); several may be named,
  ``# needs MLX and the Hugging Face Hub``.
- ``# setup: NAME``: the block defines names that later blocks of the same page use.
- ``# continues: NAME``: the block runs after the page's setup block NAME, in the same namespace, so
  its imports and inputs are the ones shown there.

Parts may share the first line, separated by ``;`` (``# needs CUDA; continues: step``). Anything else a
block uses it imports itself: no setup is hidden from the reader. A block whose imports are not installed
is skipped (torch and transformers in the MLX venv of the README's third line); every block runs in the
venv of the README's test line, and the MLX and NumPy ones in the MLX venv too.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {"CUDA": "CUDA", "MLX": "MLX", "vLLM": "vLLM", "Hugging Face Hub": "the Hugging Face Hub"}
MAX_HUB = 2  # blocks that load a real model: shown for the reader, never run here


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the fence
    code: str
    needs: tuple
    setup: str | None
    continues: str | None

    @property
    def first(self) -> str:
        return self.code.splitlines()[0] if self.code else ""


def parse(where: str, code: str) -> Block:
    first = code.splitlines()[0] if code.strip() else ""
    needs, setup, continues = (), None, None
    if first.startswith("#"):
        for part in first.lstrip("# ").split(";"):
            part = part.strip()
            if part.startswith("needs "):
                needs = tuple(k for k in NEEDS if k in part)
            elif m := re.match(r"setup: ([\w-]+)", part):
                setup = m[1]
            elif m := re.match(r"continues: ([\w-]+)", part):
                continues = m[1]
    return Block(where, code, needs, setup, continues)


def blocks() -> list:
    found = []
    for path in FILES:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.strip() == "```python":
                end = lines.index("```", n + 1)
                found.append(parse(f"{path.relative_to(ROOT)}:{n + 1}", "\n".join(lines[n + 1:end])))
    return found


BLOCKS = blocks()


def setup_of(block: Block) -> Block | None:
    """The setup block ``block`` continues: the last one of that name above it on its page."""
    if block.continues is None:
        return None
    page, line = block.where.rsplit(":", 1)
    named = [b for b in BLOCKS if b.setup == block.continues and b.where.rsplit(":", 1)[0] == page
             and int(b.where.rsplit(":", 1)[1]) < int(line)]
    return named[-1] if named else None


def chain(block: Block) -> list:
    """The blocks to run, in order: the setups it continues (transitively), then itself."""
    out = [block]
    while (up := setup_of(out[0])) is not None:
        out.insert(0, up)
    return out


def missing(block: Block) -> str | None:
    """Why ``block`` cannot run here, or None."""
    needs = {n for b in chain(block) for n in b.needs}
    if "Hugging Face Hub" in needs:
        return "downloads a model from the Hugging Face Hub"
    if "CUDA" in needs:
        torch = importlib.util.find_spec("torch") and __import__("torch")
        if not (torch and torch.cuda.is_available()):
            return "needs CUDA"
    for name, module in (("MLX", "mlx"), ("vLLM", "vllm")):
        if name in needs and importlib.util.find_spec(module) is None:
            return f"needs {name}"
    code = "\n".join(b.code for b in chain(block))
    imported = re.findall(r"^\s*(?:from|import) (\w+)", code, re.M) + \
        re.findall(r"^\s*import \w+(?:\.\w+)*, (\w+)", code, re.M)  # import torch, ropepool
    absent = sorted({m for m in imported if importlib.util.find_spec(m) is None})
    if absent:  # torch or transformers in the MLX venv: the venv of the README's test line has them
        return f"{', '.join(absent)} not installed here"
    return None


def test_blocks_say_what_they_need():
    """No hidden setup; every `continues:` names a setup above it; a block that uses MLX or CUDA says so in
    its first line; only a few blocks load a real model."""
    hidden = [f"{p.name}:{n}" for p in FILES for n, line in enumerate(p.read_text().splitlines(), 1)
              if "<!-- doc-test" in line]
    assert not hidden, f"setups hidden in HTML comments: {hidden}"
    assert len(BLOCKS) >= 30 and any(b.where.startswith("README.md") for b in BLOCKS)
    assert not [b.where for b in BLOCKS if b.continues and setup_of(b) is None]
    unsaid = [b.where for b in BLOCKS
              if re.search(r"\bimport mlx|\bmx\.", b.code) and "MLX" not in {n for c in chain(b) for n in c.needs}
              or re.search(r"""device=["']cuda|\.cuda\(""", b.code) and "CUDA" not in b.needs]
    assert not unsaid, f"blocks that need MLX or CUDA without saying so in their first line: {unsaid}"
    assert len([b for b in BLOCKS if "Hugging Face Hub" in b.needs]) <= MAX_HUB


def test_parse_reads_the_first_line():
    b = parse("x.md:1", "# needs CUDA; continues: step\nq = 1")
    assert b.needs == ("CUDA",) and b.continues == "step" and b.setup is None
    assert parse("x.md:1", "# needs MLX and the Hugging Face Hub (downloads a model)\n").needs == \
        ("MLX", "Hugging Face Hub")
    assert parse("x.md:1", "# setup: step (the blocks below continue it)\n").setup == "step"
    assert parse("x.md:1", "import torch\n# continues: step\n").continues is None  # only the first line counts


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs(block):
    why = missing(block)
    if why:
        pytest.skip(why)
    namespace = {"__name__": "doc_block"}
    for b in chain(block):
        exec(compile(b.code, b.where, "exec"), namespace)
