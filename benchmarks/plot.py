"""Draw the benchmark records: µs and % of copy bandwidth against tokens.

    python benchmarks/plot.py records.json [more.json ...] -o docs/benchmarks.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"copy": "grey", "ropepool": "tab:orange", "flashinfer": "tab:green", "compiled": "tab:red",
          "eager": "tab:purple"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("records", nargs="+")
    p.add_argument("-o", "--out", default="benchmarks.png")
    a = p.parse_args()
    rows, env = [], {}
    for path in a.records:
        with open(path) as f:
            d = json.load(f)
        rows += d["rows"]
        env = d["env"]
    # Graph replay where it was measured, else eager calls: the numbers the targets speak of.
    best = {}
    for r in rows:
        key = (r["geometry"], r["layout"], r["provider"], r["tokens"])
        if key not in best or r["mode"] == "graph":
            best[key] = r
    panels = sorted({(g, lay) for g, lay, _, _ in best})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    for col, (g, lay) in enumerate(panels):
        for prov, color in COLORS.items():
            pts = sorted((t, r) for (gg, ll, pp, t), r in best.items() if (gg, ll, pp) == (g, lay, prov))
            if not pts:
                continue
            ts = [t for t, _ in pts]
            axes[0][col].loglog(ts, [r["us"] for _, r in pts], marker="o", color=color, label=prov)
            if prov != "copy":
                axes[1][col].semilogx(ts, [r["pct_copy"] for _, r in pts], marker="o", color=color, label=prov)
        axes[0][col].set_title(f"{g} ({lay})")
        axes[0][col].set_ylabel("µs (graph replay to 4096 tokens)")
        axes[1][col].set_ylabel("% of copy bandwidth")
        axes[1][col].set_xlabel("tokens")
        axes[1][col].axhline(90, color="grey", lw=0.5, ls="--")
        axes[0][col].legend(fontsize=7)
        axes[1][col].legend(fontsize=7)
    fig.suptitle(f"rope_pool_fused, bf16, {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, "
                 f"triton {env.get('triton')}, {env.get('date')}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
