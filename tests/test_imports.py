"""The code's structure: each module of ropepool imports first, the lower floors never import upward, and no
source file is over 400 lines.

- Each module under the public face is imported in a fresh interpreter before any other module of the
  package (the package's ``__init__.py``, which imports the public call and so everything, is replaced by an
  empty package), so a module that only works because something else was imported before it (a run-time
  import cycle, a module half-made at the time it is read) fails here by name. ``cli/`` and
  ``integrations/`` stand on the public face (``import ropepool``), which always comes first.
- Read from the sources (``ast``, every import, also those inside functions): ``core/`` imports only
  ``core/`` and ``errors``; ``formats/`` only those and itself; ``checks/`` nothing of ``backends/``,
  ``plan/`` or ``api``. What each backend implements reaches the checks as data (support.py).
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import ropepool

SRC = pathlib.Path(ropepool.__file__).parent
FIRST = """
import importlib, sys, types
pkg = types.ModuleType("ropepool")
pkg.__path__ = [sys.argv[1]]
sys.modules["ropepool"] = pkg
try:
    importlib.import_module(sys.argv[2])
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] == "ropepool":
        raise
    sys.exit(3)  # an optional framework or engine not installed here
"""
# What each floor may import of the package (a prefix of a module's dotted name, after "ropepool.").
MAY_IMPORT = {
    "core": ("core", "errors"),
    "formats": ("core", "errors", "formats"),
    "support.py": ("core", "errors", "formats"),
    "checks": ("core", "errors", "formats", "support", "checks", "rotation"),
}


def _modules() -> list:
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[0] in ("cli", "integrations") or parts == ("__init__",):
            continue
        names.append(".".join(("ropepool",) + (parts[:-1] if parts[-1] == "__init__" else parts)))
    return names


def _first(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FIRST, str(SRC), name], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})


def test_each_module_imports_first_in_a_fresh_interpreter():
    names = _modules()
    assert {"ropepool.support", "ropepool.checks.validate", "ropepool.plan.cache"} <= set(names)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = dict(zip(names, pool.map(_first, names)))
    failed = {n: r.stderr.strip().splitlines()[-1] for n, r in done.items() if r.returncode not in (0, 3)}
    assert not failed, failed
    assert sum(r.returncode == 0 for r in done.values()) > len(names) // 2, "most modules were skipped"


def _imports(path: pathlib.Path) -> set:
    """The package modules ``path`` imports, as dotted names after "ropepool."."""
    package = path.relative_to(SRC).with_suffix("").parts
    package = package[:-1] if package[-1] != "__init__" else package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            stem = base + tuple((node.module or "").split(".")) if node.module else base
            found |= {".".join(stem + ((a.name,) if not node.module else ())) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "ropepool":  # from ropepool import backends
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ropepool."):
            found.add(node.module.removeprefix("ropepool."))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ropepool.") for a in node.names if a.name.startswith("ropepool.")}
    return {f.strip(".") for f in found if f.strip(".")}


@pytest.mark.parametrize("floor", list(MAY_IMPORT))
def test_lower_floors_import_nothing_above_them(floor):
    allowed = MAY_IMPORT[floor]
    files = [SRC / floor] if floor.endswith(".py") else sorted((SRC / floor).rglob("*.py"))
    assert files
    upward = {f"{p.relative_to(SRC)} -> {m}" for p in files for m in _imports(p)
              if m.split(".")[0] not in allowed}
    assert not upward, sorted(upward)


def test_no_source_file_over_400_lines():
    """One module per concern keeps each file short enough to read whole: a file past 400 lines is split
    along a concern, not squeezed."""
    files = [p for p in SRC.rglob("*") if p.suffix in (".py", ".cc", ".h")]
    assert len(files) > 50
    long = {str(p.relative_to(SRC)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
