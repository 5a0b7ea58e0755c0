"""DeepSeek V3.2's two caches on the CPU: ropepool's fused write beside the unfused RoPE + quantize-and-scatter.

Features: ``ds_mla`` (``rope_latent_fused(..., cache_format="fp8_ds_mla")``: q_pe and k_pe rotated,
656-byte rows written) and ``indexer`` (``rope_indexer_fused(..., scale_fmt="ue8m0")``: the indexer's
q and k rotated on their first 64 features, the key quantized and written). The unfused peer,
``eager``, is what vLLM runs where its kernels are missing: the rotation as
``RotaryEmbedding.forward_native`` computes it (cos/sin from the model-dtype table, products in
bfloat16), then the writer's quantization as vectorized torch (``ropepool.formats.fp8_ds_mla`` / ``indexer``, equal
byte for byte to the ports of vLLM's kernels in tests/vllm_dsa.py) and one scatter of the rows.

Each provider is first checked: kv_c's bytes and scales of every written row equal the float64
oracle's, the other rows keep their poison. Then the providers are timed interleaved: each round
times every provider (process CPU time of a batch of calls over 4 input sets), and the record holds
each provider's median and IQR over the rounds. Run under the heavy lock on the shared VM:

    flock /tmp/heavy.lock env OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/dsa.py --out docs/bench/NAME.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import ml_dtypes
import numpy as np
import torch

import ropepool
from ropepool.backends.torch_arrays import TorchOps
from ropepool.cli.bench import environment
from ropepool.formats import fp8_ds_mla, indexer
from ropepool.reference import dsa as reference_dsa

BF16 = torch.bfloat16
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# DeepSeek V3.2: the attention rotates GPT-J pairs of its 64 rope features, the indexer NeoX pairs of
# the first 64 of its 128 (indexer_rope_interleave false); both with the model's YaRN.
MLA_ROPE = ropepool.RopeSpec(head_dim=64, style="gptj", max_position_embeddings=163840, scaling=YARN)
INDEXER_ROPE = ropepool.RopeSpec(head_dim=128, rotary_dim=64, max_position_embeddings=163840, scaling=YARN)
GEOMETRIES = {"ds_mla": {"dsv32-tp8": 16}, "indexer": {"dsv32": 64}}  # q heads
BLOCK = 64  # FlashMLA's sparse block size
MAX_POS = 4096


def table(spec):
    """vLLM's cos/sin cache: float32 angles, cos then sin, scaled, kept in the model's dtype."""
    rot = spec.rotation
    ang = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * torch.from_numpy(rot.freqs[0])
    return (torch.cat((ang.cos(), ang.sin()), -1) * rot.attention_scaling).to(BF16)


def rotate_native(x, cos_sin, positions, gptj):
    """RotaryEmbedding.forward_native on x's first ``2 * cos.shape[-1]`` features: products in x's dtype."""
    cos, sin = cos_sin.index_select(0, positions).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    r = 2 * cos.shape[-1]
    part = x[..., :r]
    x1, x2 = (part[..., 0::2], part[..., 1::2]) if gptj else part.chunk(2, dim=-1)
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = torch.stack((o1, o2), -1).flatten(-2) if gptj else torch.cat((o1, o2), -1)
    return torch.cat((rot, x[..., r:]), -1) if r < x.shape[-1] else rot


def eager_ds_mla(s, cache, cos_sin):
    q = rotate_native(s["q"], cos_sin, s["pos"], True)
    k = rotate_native(s["k"][:, None], cos_sin, s["pos"], True)[:, 0]
    cache.view(-1, cache.shape[-1]).index_copy_(0, s["slots"], fp8_ds_mla.rows(s["kv_c"], k, TorchOps))
    return q


def eager_indexer(s, cache, cos_sin):
    q = rotate_native(s["q"], cos_sin, s["pos"], False)
    k = rotate_native(s["k"][:, None], cos_sin, s["pos"], False)[:, 0]
    values, scales = indexer.rows(k, True, TorchOps)
    page, row = s["slots"] // BLOCK, s["slots"] % BLOCK
    at_v, at_s = indexer.offsets(row, k.shape[1], BLOCK, TorchOps)
    flat = cache.view(cache.shape[0], -1)
    flat.index_put_((page[:, None], at_v), values)
    flat.index_put_((page[:, None], at_s), scales)
    return q


def ropepool_ds_mla(s, cache, _):
    return ropepool.rope_latent_fused(s["q"], s["k"], s["kv_c"], s["pos"], s["slots"], cache, None, rope=MLA_ROPE,
                                      kv_layout="NHD", cache_format="fp8_ds_mla")[0]


def ropepool_indexer(s, cache, _):
    return ropepool.rope_indexer_fused(s["q"], s["k"], s["pos"], s["slots"], cache, rope=INDEXER_ROPE,
                                       kv_layout="NHD", scale_fmt="ue8m0")[0]


PROVIDERS = {"ds_mla": {"ropepool": ropepool_ds_mla, "eager": eager_ds_mla},
             "indexer": {"ropepool": ropepool_indexer, "eager": eager_indexer}}


def make_set(feature, T, H, pool, gen):
    pos = torch.randint(0, MAX_POS, (T,), generator=gen)
    slots = torch.randperm(pool, generator=gen)[:T]
    if feature == "ds_mla":
        latent = torch.randn(T, 576, generator=gen).to(BF16)  # kv_c and k_pe: views of one projection row
        return {"q": torch.randn(T, H, 64, generator=gen).to(BF16), "kv_c": latent[:, :512], "k": latent[:, 512:],
                "pos": pos, "slots": slots}
    return {"q": torch.randn(T, H, 128, generator=gen).to(BF16), "k": torch.randn(T, 128, generator=gen).to(BF16),
            "pos": pos, "slots": slots}


def as_np(x):
    return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if x.dtype == BF16 else x.numpy()


def check(feature, fn, s, cache, cos_sin):
    """kv_c's bytes and scales (ds_mla) or the dequantized keys (indexer) of the written rows against the
    oracle; every other row keeps its poison."""
    before = torch.randint(0, 256, cache.shape, dtype=torch.uint8)
    cache.copy_(before)
    fn(s, cache, cos_sin)
    rows, was = cache.view(-1, cache.shape[-1]).numpy(), before.view(-1, cache.shape[-1]).numpy()
    written = np.zeros(len(rows), bool)
    if feature == "ds_mla":
        written[s["slots"].numpy()] = True
        want = reference_dsa.ds_mla_rows(as_np(s["kv_c"]), as_np(s["k"]))
        assert (rows[s["slots"].numpy(), :528] == want[:, :528]).all(), "kv_c bytes or scales differ from the oracle"
    else:  # one page of the indexer cache is [BLOCK * 128 values | BLOCK scales]: compare whole pages
        pages = np.unique(s["slots"].numpy() // BLOCK)
        written.reshape(-1, BLOCK)[pages] = True
        _, k_rot, want = reference_dsa.rope_indexer(as_np(s["q"]), as_np(s["k"]), s["pos"].numpy(), s["slots"].numpy(),
                                                    before.numpy(), rope=INDEXER_ROPE, scale_fmt="ue8m0",
                                                    kv_layout="NHD")
        page, r = np.divmod(s["slots"].numpy(), BLOCK)
        at_v, at_s = r[:, None] * 128 + np.arange(128), BLOCK * 128 + r[:, None] * 4 + np.arange(4)

        def keys(c):  # the written rows' keys, dequantized: e4m3 values times their float32 scale
            c = c.reshape(-1, BLOCK * 132)
            v = c[page[:, None], at_v].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            return v * np.ascontiguousarray(c[page[:, None], at_s]).view("<f4").astype(np.float64)

        # vLLM's bf16 rotation vs the oracle's: a key may round to the next e4m3 step (7% of the group's amax)
        assert np.abs(keys(rows) - keys(want)).max() <= 0.08 * np.abs(k_rot).max(), "keys are off the oracle's"
    assert (rows[~written] == was[~written]).all(), "a row that was not written changed"


def run(tokens, rounds, pool_blocks):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for feature, geos in GEOMETRIES.items():
        cos_sin = table(MLA_ROPE if feature == "ds_mla" else INDEXER_ROPE)
        for geometry, H in geos.items():
            width = 656 if feature == "ds_mla" else 132
            cache = torch.zeros(pool_blocks, BLOCK, width, dtype=torch.uint8)
            provs = PROVIDERS[feature]
            for T in tokens:
                sets = [make_set(feature, T, H, pool_blocks * BLOCK, gen) for _ in range(4)]
                for fn in provs.values():
                    check(feature, fn, sets[0], cache, cos_sin)
                n = {name: batch_size(fn, sets, cache, cos_sin) for name, fn in provs.items()}
                times = {name: [] for name in provs}
                for _ in range(rounds):  # interleaved: every round times every provider
                    for name, fn in provs.items():
                        t = time.process_time_ns()
                        for i in range(n[name]):
                            fn(sets[i % 4], cache, cos_sin)
                        times[name].append((time.process_time_ns() - t) / 1e3 / n[name])
                for name, us in times.items():
                    q1, med, q3 = np.percentile(us, [25, 50, 75])
                    rows.append({"feature": feature, "geometry": geometry, "tokens": T, "provider": name,
                                 "mode": "eager", "us": med, "spread_pct": 100 * (q3 - q1) / med, "rounds": us})
                    print(f"{feature} {geometry} T={T} {name}: {med:.1f} us (IQR {100 * (q3 - q1) / med:.1f}%)")
    return rows


def batch_size(fn, sets, cache, cos_sin, budget_s=0.05):
    """Calls per timed batch, after a warm-up."""
    for _ in range(3):
        for s in sets * 4:
            fn(s, cache, cos_sin)
    t = time.process_time()
    fn(sets[0], cache, cos_sin)
    return int(min(500, max(4, budget_s / max(time.process_time() - t, 1e-6))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,16,128,1024")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--note", default="shared 2-core VM (about 6 sessions), flock /tmp/heavy.lock, OMP_NUM_THREADS=1")
    a = p.parse_args()
    torch.set_num_threads(1)
    env = environment(torch.device("cpu"), BF16)
    env.update(commit=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
               note=a.note, rounds=a.rounds)
    rows = run([int(t) for t in a.tokens.split(",")], a.rounds, a.pool_blocks)
    with open(a.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
