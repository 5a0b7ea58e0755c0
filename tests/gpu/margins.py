"""The numbers behind test_integration_gpu.py's bounds: per case, how far the kernel's log-probabilities
are from transformers' own and from ropepool's torch path, with the right RoPE base and with it off by 1%.

    python -m tests.gpu.margins --out margins.json      (on a CUDA machine, from the repository root)

One row per (case, base factor): the checks' statistics (``max_logprob_diff`` against transformers and,
in bfloat16, against the torch path), how many requests diverged, and the largest logit gap at a divergence.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import pytest
import torch
import transformers

from ropepool.cli import demo
from tests.gpu import test_integration_gpu as gpu


def stats(r: gpu.Runs, c: demo.Comparison, name: str) -> dict:
    gaps = gpu.tie_gaps(r, c)
    return {f"{name}_max_logprob_diff": c.max_logprob_diff,
            f"{name}_diverged": sum(d is not None for d in c.diverged_at),
            f"{name}_max_tie_gap": max(gaps, default=None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cpu: ropepool's CPU path in place of the kernel")
    a = p.parse_args()
    gpu.DEVICE = a.device
    rows = []
    for case in gpu.CASES:
        family, dtype, config = case.values
        if config.get("use_cuda_graph") and a.device != "cuda":
            continue
        for factor in (1.0, *gpu.WRONG_BASES):
            row = {"case": case.id, "base_factor": factor}
            try:
                with pytest.MonkeyPatch.context() as mp:
                    r = gpu.runs(family, dtype, mp, factor, **config)
                row["requests"] = len(r.prompts)
                row.update(stats(r, demo.Comparison(family, dtype, [r.shipped], [r.kernel]), "hf"))
                if r.torch_path is not None:
                    row.update(stats(r, demo.Comparison(family, dtype, [r.torch_path], [r.kernel]), "torch_path"))
            except Exception as e:  # noqa: BLE001  (recorded: the other cases still run)
                row["error"] = repr(e)
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "new_tokens": gpu.NEW_TOKENS,
           "prompt_lengths": list(demo.PROMPT_LENGTHS)}
    with open(a.out, "w") as f:
        json.dump({"env": env, "cases": rows}, f, indent=1)  # "rows" would be read as timings


if __name__ == "__main__":
    main()
