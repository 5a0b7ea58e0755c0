"""The published figures are the records' figures.

- Every generated block of README.md, docs/benchmarks.md, docs/benchmarks_features.md and
  docs/mlx.md is what ``python -m ropepool.cli.bench_summary`` derives from docs/bench/ now.
- A changed record value, and a record added for a measured cell, change the derived text.
- Outside the generated blocks, the checked sections (``CHECKED``) hold no number that reads as a
  measurement: a number followed by µs, us, ms, %, x or tok/s, unless a comparator (>=, <=, at most,
  at least, within, target) precedes it, which makes it a target, not a figure.
"""
from __future__ import annotations

import json
import re
import shutil
import statistics

import pytest

from ropepool.cli import bench_blocks, bench_records, bench_summary
from ropepool.cli.bench_records import ROOT, Records

# Which code a record measured comes from git: a copy of the tree without .git (the H200's) cannot tell.
NEEDS_GIT = pytest.mark.skipif(bench_records._git("rev-parse", "HEAD") is None, reason="needs the git history")


def _git_history() -> bool:
    return bench_records._git("log", "-1", "--format=%h", "--", "docs/bench") not in (None, "")


pytestmark = pytest.mark.skipif(not _git_history(), reason="needs the git history of docs/bench (a clone)")


@pytest.fixture(scope="module")
def recs():
    return Records()


@NEEDS_GIT
def test_docs_match_records(recs):
    bad = bench_summary.differing(recs)
    assert not bad, (f"generated blocks differ from the records (run python -m ropepool.cli.bench_summary --write): "
                     f"{bad}")


def test_every_block_is_placed(recs):
    bench_summary._load_blocks()
    text = "".join((ROOT / doc).read_text() for doc in bench_summary.DOCS)
    placed = {m["name"] for m in bench_summary.MARKER.finditer(text)}
    assert set(bench_summary.BLOCKS) <= placed, f"registered but in no doc: {set(bench_summary.BLOCKS) - placed}"


def _copy_bench(tmp_path):
    dst = tmp_path / "bench"
    shutil.copytree(bench_records.BENCH, dst, ignore=shutil.ignore_patterns("*.png", "*.txt"))
    return dst


def _plain_t1(recs, geometry="llama3-8b"):
    return recs.cell(device=bench_blocks.GPU, variant="flat", geometry=geometry, provider="ropepool", mode="graph",
                     tokens=1, dtype="bfloat16")


def _scale_plain_t1(d: dict, geometry: str, factor: float) -> None:
    """Every row of cell ``_plain_t1(geometry)`` in record ``d`` times ``factor`` (the peers harness's rows or
    ropepool bench's)."""
    for r in d["rows"]:
        if (r.get("shape", r.get("geometry")), r.get("impl", r.get("provider")), r["mode"], r.get("T", r.get("tokens")),
                r.get("layout", "flat")) == (geometry, "ropepool", "graph", 1, "flat"):
            r["us"] *= factor


def test_changed_record_is_seen(tmp_path, recs):
    """Record values changed in a copy of docs/bench make the README block differ."""
    dst = _copy_bench(tmp_path)
    for name in {r.record.file for r in _plain_t1(recs).runs}:  # the records of the newest code in the cell
        d = json.loads((dst / name).read_text())
        _scale_plain_t1(d, "llama3-8b", 2)
        (dst / name).write_text(json.dumps(d))
    changed = Records(dst)
    assert _plain_t1(changed).us == pytest.approx(2 * _plain_t1(recs).us)
    bad = bench_summary.differing(changed)
    assert "README.md: headline" in bad


def test_new_record_joins_its_cell(tmp_path, recs):
    """A record added for the same code joins the cell's median; one on newer code replaces it."""
    dst = _copy_bench(tmp_path)
    old = _plain_t1(recs, "llama70b-tp8")
    first = old.runs[0].record
    mine = [r.us for r in old.runs if r.record == first]  # the copied record's runs of the cell
    src = json.loads((dst / first.file).read_text())
    for name, factor in (("h200-2099-01-01-a.json", 1.5), ("h200-2099-01-01-b.json", 2.5)):
        d = json.loads(json.dumps(src))
        d["env"]["commit"] = first.commit
        _scale_plain_t1(d, "llama70b-tp8", factor)
        (dst / name).write_text(json.dumps(d))
    joined = _plain_t1(Records(dst), "llama70b-tp8")
    both = [r.us for r in old.runs] + [f * u for f in (1.5, 2.5) for u in mine]
    assert len(joined.runs) == len(both) and joined.us == pytest.approx(statistics.median(both))
    head = bench_records._git("rev-parse", "--short", "HEAD")
    newer = json.loads((dst / "h200-2099-01-01-b.json").read_text())
    newer["env"]["commit"] = head
    (dst / "h200-2099-01-01-b.json").write_text(json.dumps(newer))
    cell = _plain_t1(Records(dst), "llama70b-tp8")
    if cell.runs[0].record.code == first.code:
        pytest.skip("the GPU code at HEAD is the record's")
    assert {r.record.file for r in cell.runs} == {"h200-2099-01-01-b.json"}
    assert cell.us == pytest.approx(statistics.median([2.5 * u for u in mine]))
    assert len([r for r in cell.history if r.record.code == first.code]) == len(old.runs) + len(mine)


def test_demo_table_lists_each_record_of_the_code(tmp_path, recs):
    """The CPU demo table gives, per model and dtype, the ratio of every demo record of the newest one's code (how
    far a record's ratio moves on the machine), and names those records."""
    from ropepool.cli.bench_blocks_runs import demo_ratio, demo_rows

    dst = _copy_bench(tmp_path)
    rec, rows = demo_rows(recs, "cpu")[("float32",)]
    d = json.loads((dst / rec.file).read_text())
    d["env"]["commit"] = rec.commit
    for row in d["demo"]:
        row["fused_cpu_s"] = [2 * x for x in row["fused_cpu_s"]]  # ropepool's tokens/s halved
    (dst / "cpu-2099-01-01-demo-halved.json").write_text(json.dumps(d))
    text = bench_summary.BLOCKS["demo-table"](Records(dst), "cpu")
    row = rows[0]
    line = next(x for x in text.splitlines() if x.startswith(f"| {row['family']} | float32 |"))
    assert f"{demo_ratio(row, True):.2f}x" in line.split("|")[-2]
    assert f"{demo_ratio(row, True) / 2:.2f}x" in line.split("|")[-2]
    assert "cpu-2099-01-01-demo-halved.json" in text and rec.file in text


def test_demo_ratio_of_abba_turns_is_the_median_pair(tmp_path, recs):
    """A demo record whose runs took ABBA turns (its rows name the path that ran first in each pair) gives the
    median over pairs of neighbouring runs and its quartiles, not the ratio of the two medians; the text says so."""
    from ropepool.cli.bench_blocks_runs import demo_rows

    dst = _copy_bench(tmp_path)
    rec, _ = demo_rows(recs, "cpu")[("float32",)]
    d = json.loads((dst / rec.file).read_text())
    d["env"]["commit"] = rec.commit
    for row in d["demo"]:  # pair ratios 2.00x, 1.25x, 2.00x; the ratio of the medians 1.25x
        row.update(plain_cpu_s=[1.0, 1.0, 2.0], fused_cpu_s=[0.5, 0.8, 1.0], first=["fused", "plain", "fused"])
    (dst / "cpu-2099-01-01-demo-abba.json").write_text(json.dumps(d))
    text = bench_summary.BLOCKS["demo-table"](Records(dst), "cpu")
    line = next(x for x in text.splitlines() if x.startswith("| llama | float32 |"))
    assert line.split("|")[5].strip() == "2.00x (1.25-2.00)"
    assert "ABBA" in text and "median (quartiles) over the pairs of neighbouring runs" in text


def test_other_harness_record_is_kept_whole(tmp_path):
    """A record the cells do not read (an engine run) is kept for its block, with its provenance."""
    dst = _copy_bench(tmp_path)
    d = {"env": {"gpu": "NVIDIA H200", "vllm": "0.99", "date": "2099-01-01", "note": "a test"}, "steps": [1.0]}
    (dst / "engine-step-2099-01-01.json").write_text(json.dumps(d))
    recs = Records(dst)
    [(rec, data)] = recs.others("engine-step-*.json")
    assert data == d and rec.kind == "gpu" and "vllm 0.99" in rec.versions
    assert "`engine-step-2099-01-01.json` (2099-01-01" in bench_summary.sources([rec])
    assert rec.note == "a test" and "a test" not in bench_summary.sources([rec])  # notes stay in the record


def test_overwritten_record_is_read_at_its_last_write(recs):
    """cpu-2026-12-04.json was added at 9f05cfa and overwritten by later runs (the last after
    4058d18 changed torch_cpu.py): its rows measured 4058d18's code, not the first CPU path's."""
    rec = next(r.record for rs in recs.by_key.values() for r in rs if r.record.file == "cpu-2026-12-04.json")
    assert rec.commit == bench_records._git("log", "-1", "--format=%h", "4058d18")


# Backend modules a device's path imports but whose changes do not change its speed (counters of the paths taken).
NOT_MEASURED = {"paths"}


@pytest.mark.parametrize("kind,entry", [("cpu", "torch_native"), ("mlx", "mlx"), ("gpu", "triton_op")])
def test_code_paths_cover_the_path(kind, entry):
    """Every backend module the CPU / MLX / GPU path imports (transitively, within backends/) is in its
    CODE_PATHS, so a change to the math it runs marks its records stale (†)."""
    import ast

    backends = ROOT / "src" / "ropepool" / "backends"
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or not (backends / f"{name}.py").exists():
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((backends / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo += [node.module] if node.module else [a.name for a in node.names]
    listed = {p.rsplit("/", 1)[1].removesuffix(".py") for p in bench_records.CODE_PATHS[kind]}
    assert seen - NOT_MEASURED <= listed, f"{kind}: imported but not in CODE_PATHS: {seen - NOT_MEASURED - listed}"


def test_code_paths_cover_the_native_sources():
    """Every C++ source of the native libraries (the CPU kernel, the CUDA launcher) is in a device's
    CODE_PATHS: a change to it marks the records of the code it builds stale (†)."""
    listed = set(bench_records.CODE_PATHS["cpu"]) | set(bench_records.CODE_PATHS["gpu"])
    native = ROOT / "src" / "ropepool" / "native"
    files = {f"src/ropepool/native/{p.name}" for p in (*native.glob("*.cc"), *native.glob("*.h"))}
    assert files <= listed, files - listed


def test_serving_records_follow_the_integration():
    """A demo record (transformers' serving step through ropepool) goes stale with any module of the
    transformers integration as with the device's path: each is in CODE_PATHS["serving"] (CPU) and
    CODE_PATHS["gpu-serving"]."""
    folder = ROOT / "src" / "ropepool" / "integrations" / "transformers"
    files = {f"src/ropepool/integrations/transformers/{p.name}" for p in folder.glob("*.py")}
    for kind, device in (("serving", "cpu"), ("gpu-serving", "gpu")):
        paths = set(bench_records.CODE_PATHS[kind])
        assert files <= paths, files - paths
        assert set(bench_records.CODE_PATHS[device]) <= paths
    for pattern, kind in (("cpu-*-demo-*.json", "serving"), ("h100-*-demo-*.json", "gpu-serving")):
        demo = next(bench_records.BENCH.glob(pattern))
        assert bench_records.describe(demo, json.loads(demo.read_text())).kind == kind


@NEEDS_GIT
def test_docstring_changes_are_not_code_changes():
    """410571c changed only torch_cpu.py's docstring: the CPU code is the same before and after, so a
    record of 7c8ee73's code is not stale after it; 7c8ee73 (fp8 pools on the fast path) changed the code."""
    same = [bench_records.code_id(bench_records._git("log", "-1", "--format=%h", c), "cpu")
            for c in ("410571c~1", "410571c")]
    assert same[0] == same[1]
    assert bench_records.code_id(bench_records._git("log", "-1", "--format=%h", "7c8ee73~1"), "cpu") != \
        bench_records.code_id(bench_records._git("log", "-1", "--format=%h", "7c8ee73"), "cpu")


def test_unknown_block_is_an_error(recs):
    with pytest.raises(KeyError, match="no block named 'nope'"):
        bench_summary.render("<!-- summary:nope -->\n<!-- /summary:nope -->", recs)


# --- no measured figure in prose ----------------------------------------------------------------
# (doc, heading of a checked section): the section runs to the next heading of its level or higher.
CHECKED = (("README.md", "## Performance"), ("docs/benchmarks.md", "## Summary"),
           ("docs/mlx.md", "## Speed"), ("docs/benchmarks_features.md", "# "))
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)?\s*(µs|us|ms|%|x|tok/s)(?![\w])")
TARGET = re.compile(r"(>=|<=|≥|≤|at most|at least|within|target|above|below)[^.|]{0,20}$")


def _section(text: str, heading: str) -> str:
    level = len(heading.split(" ")[0])
    start = text.index(heading + ("" if heading.endswith(" ") else "\n"))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, start + len(heading) + 1)
    return text[start:end.start() if end else len(text)]


def measured_figures(text: str) -> list[str]:
    """Numbers with a unit of measurement outside generated blocks, code and targets."""
    text = bench_summary.MARKER.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return [m.group(0) for m in FIGURE.finditer(text) if not TARGET.search(text[max(0, m.start() - 40):m.start()])]


@pytest.mark.parametrize("doc,heading", CHECKED)
def test_no_figures_in_prose(doc, heading):
    found = measured_figures(_section((ROOT / doc).read_text(), heading))
    assert not found, f"{doc} ({heading}): figures not generated from records: {found}"


def test_figure_rule_sees_figures():
    assert measured_figures("takes 1.3-2.6 µs and 91% of copy, 5.0x at 4,096") == ["2.6 µs", "91%", "5.0x"]
    assert measured_figures("target: >= 90% of copy, at most 2.6 µs\n`1.5x` ```\n3 µs\n```") == []


def test_cpp_code_reads_the_same_from_git_and_the_working_tree():
    """The kernel's C++ files are compared as text: `git show` drops the trailing newline a file on disk keeps, so
    without stripping both every CPU record read as changed since (†) in any checkout."""
    assert bench_records._stripped("int x;\n") == bench_records._stripped("int x;")
    head = bench_records._git("rev-parse", "HEAD")
    path = "src/ropepool/native/rope_kernel.h"
    if head is None or bench_records._git("diff", "--quiet", "HEAD", "--", path) is None:
        pytest.skip("no git checkout here, or the kernel changed in the working tree")
    assert bench_records._stripped(bench_records._git("show", f"HEAD:{path}")) == \
        bench_records._stripped((ROOT / path).read_text())
