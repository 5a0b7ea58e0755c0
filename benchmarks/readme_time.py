"""Time the README's command lines as a newcomer runs them: a clone of HEAD in a temporary directory,
each line verbatim from a shell, its venv made fresh, wall time.

    python benchmarks/readme_time.py --lines test,quick --out docs/bench/cpu-DATE-readme-time-test.json
    python benchmarks/readme_time.py --lines demo --out docs/bench/cpu-DATE-readme-time-demo.json

``demo`` is the README's demo line, ``test`` its test line (the one CI runs), ``quick`` the quick subset
the README names, run in the venv the test line made (so ``quick`` comes after ``test``). The README's
``readme-time`` block reads the newest record of each line. Run it with no other heavy job on the
machine: the times are this machine's, under its load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINES = {"demo": r"^python3 -m venv \.venv && .* ropepool demo$",
         "test": r"^python3 -m venv \.venv && .* python -m pytest"}  # .ci/run greps the test line the same way
QUICK = re.compile(r'`(python -m pytest -q -m "not slow")`')


def readme_line(text: str, name: str) -> str:
    """The README's command for ``name``, as a shell runs it."""
    if name == "quick":
        return ". .venv/bin/activate && " + QUICK.search(text).group(1)
    return next(line for line in text.splitlines() if re.match(LINES[name], line))


def main(argv=None) -> int:
    from ropepool.cli.bench_report import cpu_name

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", default="test,quick", help="comma-separated from demo, test, quick (in that order)")
    p.add_argument("--out", required=True, help="the record to write (docs/bench/cpu-DATE-readme-time-X.json)")
    p.add_argument("--note", default=None, help="the machine's load and anything else a reader needs")
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    # the lines run as from a new shell: no PYTHONPATH or active venv of the process that runs this script
    shell_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    runs = []
    with tempfile.TemporaryDirectory(prefix="ropepool-readme-") as tmp:
        subprocess.run(["git", "clone", "-q", str(ROOT), tmp], check=True)
        subprocess.run(["git", "-C", tmp, "checkout", "-q", commit], check=True)
        text = (Path(tmp) / "README.md").read_text()
        for name in a.lines.split(","):
            cmd = readme_line(text, name)
            if name != "quick":  # a fresh machine's venv, as the README's lines assume
                shutil.rmtree(Path(tmp) / ".venv", ignore_errors=True)
            t0 = time.perf_counter()
            done = subprocess.run(["bash", "-c", cmd], cwd=tmp, capture_output=True, text=True, env=shell_env)
            seconds = time.perf_counter() - t0
            summary = next((line.strip("= ") for line in reversed(done.stdout.splitlines())
                            if re.search(r"\d+ (passed|failed)", line)), None)
            runs.append({"line": name, "command": cmd, "rc": done.returncode, "seconds": seconds, "pytest": summary})
            print(f"{name}: rc {done.returncode}, {seconds:.0f} s{f', {summary}' if summary else ''}", flush=True)
    env = {"date": time.strftime("%Y-%m-%d"), "commit": commit[:7], "cpu": cpu_name(), "cores": os.cpu_count(),
           "python": platform.python_version()}
    if a.note:
        env["note"] = a.note
    Path(a.out).write_text(json.dumps({"env": env, "readme_time": runs}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
