"""The benchmark scripts' logic on the CPU: tiny sizes, each provider checked against the others.

Their GPU and CPU runs are recorded in docs/benchmarks.md and docs/mlx.md;
this keeps them runnable between those runs (a changed helper signature once
broke one unseen). Each runs in its own process, as it would from the shell:
the scripts set process-wide options.
"""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, codes=(0,)):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode in codes, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_features_script_on_cpu(tmp_path):
    pytest.importorskip("torch")
    run(str(ROOT / "benchmarks" / "features.py"), "--cpu", "--features", "table", "--tokens", "1", "--out",
        str(tmp_path))
    records = json.loads((tmp_path / "features.json").read_text())
    providers = {r["provider"] for r in records["rows"]}
    assert {"ropepool", "ropepool_table", "copy"} <= providers, providers
    assert all(c["status"] in ("ok", "skipped") for c in records["checks"]), records["checks"]


def test_mlx_bench_cli(tmp_path):
    """``ropepool bench --framework mlx --out``: the records, and the plot or why there is none."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]')")
    out = tmp_path / "mlx"
    # exit 1 means a speed target was missed: timing on a busy CI machine, not what this test is about;
    # the code must say so in the table exactly when it exits 1
    done = run("-m", "ropepool.cli", "bench", "--framework", "mlx", "--geometries", "llama70b-tp8", "--dtype",
               "float32", "--tokens", "1,300", "--warmup", "1", "--calls", "3", "--seconds", "1", "--pool-size",
               "512", "--small-pool-size", "64", "--out", str(out), codes=(0, 1))
    printed = done.stdout
    assert (done.returncode == 1) == ("MISSED" in printed), printed[-1500:]
    records = json.loads(out.with_suffix(".json").read_text())
    assert {(r["provider"], r["tokens"]) for r in records["records"]} >= {("ropepool", 1), ("ropepool", 300),
                                                                         ("hand-written", 300)}
    assert f"the plot {out}.png" in printed or "no plot: matplotlib is not installed" in printed, printed[-500:]
