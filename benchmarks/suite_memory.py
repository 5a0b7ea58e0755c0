"""Peak memory of the test suite: the README's test command, measured as CI's machine would see it.

    flock /tmp/heavy.lock python benchmarks/suite_memory.py [--out docs/bench/test-memory-<name>.json] [-- ARGS]

Runs ``python -m pytest -q`` (ARGS replace ``-q``) in the repository under ``/usr/bin/time -v`` (Linux,
GNU time): its "Maximum resident set size" is the pytest process's peak (the largest of it and any child
it waited for). Child processes (tests that start a Python of their own) run at the same time as
pytest, so the whole process group's resident memory is also summed every 0.25 s: its peak is what the
machine had to hold. Prints both, the wall time and pytest's last line; ``--out`` writes them as a new
record (an existing file is refused).
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def group_rss_mb(pgid: int) -> tuple[float, int]:
    """The summed VmRSS of the processes of this group, and how many there are."""
    total, n = 0, 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS")), 0)
        except (OSError, ProcessLookupError):
            continue
        total, n = total + rss, n + 1
    return total / 1024, n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the record here (a new JSON file under docs/bench/)")
    p.add_argument("--note", default="", help="a note for the record (where it ran)")
    p.add_argument("pytest_args", nargs="*", default=["-q"], help="pytest's arguments (after --)")
    args = p.parse_args(argv)
    if args.out and Path(args.out).exists():
        sys.exit(f"suite_memory: --out {args.out} exists; records are added, never overwritten. Fix: a new name.")
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "pytest", *args.pytest_args]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    peak = [0.0, 0]

    def sample():
        while proc.poll() is None:
            mb, n = group_rss_mb(proc.pid)
            if mb > peak[0]:
                peak[:] = [mb, n]
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    sampler.join()
    wall = time.time() - start
    max_rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out).group(1)) / 1024
    summary = next((line.strip("= ") for line in reversed(out.splitlines())
                    if re.search(r"\d+ (passed|failed)", line)), "")
    print(out[-3000:])
    print(f"pytest process peak (time -v): {max_rss:,.0f} MB; process group peak: {peak[0]:,.0f} MB "
          f"({peak[1]} processes); {wall:.0f} s; {summary}")
    if args.out:
        import torch

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "commit": commit,
               "note": args.note}
        record = {"env": env, "test_memory": {
            "command": "python -m pytest " + " ".join(args.pytest_args), "max_rss_mb": round(max_rss, 1),
            "group_peak_mb": round(peak[0], 1), "group_processes_at_peak": peak[1], "wall_s": round(wall, 1),
            "pytest": summary, "exit": proc.returncode}}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
