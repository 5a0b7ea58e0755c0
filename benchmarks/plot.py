"""Draw saved benchmark records (``ropepool bench --out``): µs against tokens, and % of copy bandwidth (CUDA)
or the speed-up over eager (CPU). ``ropepool bench --out`` saves this plot itself; this redraws or merges.

    python benchmarks/plot.py records.json [more.json ...] -o docs/benchmarks.png
"""
import argparse
import json

from ropepool.cli.bench_report import plot


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records", nargs="+", help="JSON files written by ropepool bench --out")
    p.add_argument("-o", "--out", default="benchmarks.png", help="the PNG to write")
    a = p.parse_args()
    rows, env = [], {}
    for path in a.records:
        with open(path) as f:
            d = json.load(f)
        rows += d["rows"]
        env = d["env"]
    plot(rows, env, a.out)


if __name__ == "__main__":
    main()
