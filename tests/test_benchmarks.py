"""The GPU benchmark scripts' logic on the CPU: tiny sizes, each provider checked against the others.

Their GPU runs are recorded in docs/benchmarks.md; this keeps them runnable
between device sessions (a changed helper signature once broke one unseen).
Each runs in its own process, as it would from the shell: the scripts set
process-wide torch options.
"""
import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_features_script_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "features.py"), "--cpu", "--features", "table", "--tokens", "1",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads((tmp_path / "features.json").read_text())
    providers = {r["provider"] for r in records["rows"]}
    assert {"ropepool", "ropepool_table", "copy"} <= providers, providers
    assert all(c["status"] in ("ok", "skipped") for c in records["checks"]), records["checks"]
