"""kv_layout="amx": vLLM's CPU AMX-packed cache (isa amx: bfloat16 on an AMX CPU), on both torch rows and the
Triton kernel (on CUDA, else under TRITON_INTERPRET=1).

Each (block, head) run of ``block_size * head_dim`` elements holds the keys in tiles of 16 tokens x 2
features and the values in tiles of 2 tokens x 16 features (docs/layouts.md). Checks as
tests.harness.run_checked, whose slot formula spells vLLM's packing out independently of ropepool:
q_rot / k_rot against the float64 oracle, written elements bit for bit the returned k_rot and the given
v, NaN / inf canaries in the rest of their blocks, in neighbouring blocks and in other layers untouched.
``test_amx_bytes_are_vllms`` (tests/engines) checks the bytes against vLLM's own write.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ropepool  # noqa: E402
from ropepool import RopeSpec, plan  # noqa: E402
from ropepool.backends import paths  # noqa: E402
from tests.harness import (  # noqa: E402
    Backend,
    Cache,
    backend_for,
    crossed,
    make_cache,
    make_positions,
    make_slots,
    poison,
    randn,
    run_checked,
)

X = Backend("torch", "cpu")
HQ, HKV = 4, 2


@pytest.fixture(params=["torch", "torch-general", "triton"])
def row(request, monkeypatch):
    """The CPU path (torch_native, its calls counted), the general torch code (torch_eager, any device) and the
    Triton kernel: the Backend that runs the call."""
    from ropepool import backends

    plan.forget()
    if request.param == "torch-general":
        monkeypatch.setattr(backends, "BACKENDS", tuple(b for b in backends.BACKENDS if b.module != ".torch_native"))
    if request.param == "triton":  # under the CPU interpreter one dtype per case (crossed's big mark)
        return backend_for("triton", big=request.node.get_closest_marker("big") is not None)
    return X


def _run(row, rng, dtype, T, D, bs, slots, layers=None, layer=None, rope=None, **kw):
    q, k, v = (randn(rng, T, h, D, dtype=dtype, scale=2.0) for h in (HQ, HKV, HKV))
    cache = make_cache(rng, dtype, 3 * bs, HKV, D, kv_layout="amx", page_size=bs, layers=layers, layer=layer)
    before = paths.count("torch_native.call")
    result = run_checked(row, q, k, v, make_positions(rng, T, high=100_000), slots, poison(cache, slots),
                         rope=rope, **kw)
    return result, paths.count("torch_native.call") - before


@pytest.mark.parametrize("shape,dtype", crossed([
    pytest.param((7, 64, 32, None), id="T7-D64-bs32"), pytest.param((5, 128, 16, -1), id="T5-D128-bs16-layer-1"),
    pytest.param((1, 16, 64, 1), id="T1-D16-bs64-layer1"), pytest.param((33, 32, 32, None), id="T33-D32-bs32")]))
def test_amx_matches_oracle(row, shape, dtype, rng):
    """Odd token counts, one token (decode), a layer of a stack, slots -1 skipped and spread over blocks."""
    T, D, bs, layer = shape
    slots = make_slots(rng, T, 3 * bs, skip_every=3)
    _, fast = _run(row, rng, dtype, T, D, bs, slots, layers=3 if layer is not None else None, layer=layer,
                   rope=RopeSpec(head_dim=D, rotary_dim=D // 2, style="gptj") if D == 128 else None)
    cpu_path = row.name == "torch" and plan.backends.pick("torch", None, "torch").module == ".torch_native"
    assert fast == (1 if cpu_path else 0), "the call by the CPU kernel (else torch_eager or the Triton kernel)"


def test_amx_every_row_of_a_block(row, rng):
    """A whole block written in shuffled order, its neighbours' canaries untouched: each tile's every place."""
    bs, D = 32, 32
    slots = bs + rng.permutation(bs)
    _run(row, rng, "bfloat16", bs, D, bs, slots)


def test_amx_bytes_are_the_formula(row):
    """Index-coded values (no RoPE, so keys are stored as given): key (t, d) lands at element
    ((t // 16) * D/2 + d // 2) * 32 + t % 16 * 2 + d % 2 of its (block, head) run and value (t, d) at
    ((d // 16) * bs/2 + t // 2) * 32 + d % 16 * 2 + t % 2 (vLLM's formula, docs/engines.md), in both heads,
    and nothing else of the cache changes. (Breaking the keys' tile to 16 x 4 fails this.)"""
    bs, D, blocks = 32, 64, 2
    t, d = torch.meshgrid(torch.arange(bs), torch.arange(D), indexing="ij")
    where = {0: ((t // 16) * (D // 2) + d // 2) * 32 + t % 16 * 2 + d % 2,
             1: ((d // 16) * (bs // 2) + t // 2) * 32 + d % 16 * 2 + t % 2}
    bf16 = dict(dtype=torch.bfloat16, device=row.device)
    for code in (t, d):  # small integers: exact in bfloat16
        kv = code[:, None].expand(bs, HKV, D).to(**bf16).contiguous()
        cache = torch.full((blocks, HKV, 2 * bs, D), -1.0, **bf16)  # cpu_attn.py's split of a layer's cache
        k_pool, v_pool = cache.chunk(2, dim=2)
        q, positions = torch.zeros(bs, HQ, D, **bf16), torch.zeros(bs, dtype=torch.long, device=row.device)
        ropepool.rope_pool_fused(q, kv, kv, positions, bs + torch.arange(bs, device=row.device), k_pool, v_pool,
                                 head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, backend=row.name,
                                 rope=RopeSpec(head_dim=D, rotary_dim=0), kv_layout="amx")
        for which, pool in enumerate((k_pool, v_pool)):
            stored = pool[1].reshape(HKV, bs * D).cpu()
            for h in range(HKV):
                assert torch.equal(stored[h][where[which].flatten()], code.flatten().to(torch.bfloat16)), (which, h)
        assert (cache[0] == -1).all().item(), "block 0 was not written"


def test_amx_halves_of_vllms_cache(row, rng):
    """The pools as vLLM's CPU backend passes them (halves of one [blocks, heads, 2 * block_size, head_size]
    tensor, each block's keys then values): every byte of the one tensor checked."""
    bs, D, T = 32, 64, 9
    base = randn(rng, 3, HKV, 2 * bs, D, dtype="bfloat16")
    slots = make_slots(rng, T, 3 * bs, skip_every=4)
    cache = poison(Cache([base], "amx", bs, None, lambda o: (o[0][:, :, :bs], o[0][:, :, bs:])), slots)
    run_checked(row, *(randn(rng, T, h, D, dtype="bfloat16") for h in (HQ, HKV, HKV)), make_positions(rng, T),
                slots, cache)


def test_amx_registry_rows():
    """The registry: every torch row takes the layout; MLX refuses it while the call is checked
    (tests/test_errors.py has the message)."""
    from ropepool import backends

    for b in backends.BACKENDS:
        assert ("layout.amx" in b.supports) == (b.framework == "torch"), b.module


def test_amx_matches_hnd_values(rng):
    """The same call into an HND pool and an AMX pool stores the same values, only placed apart: each
    written (slot, head) row read back through the formula equals the HND row, bit for bit."""
    bs, D, T = 16, 32, 5
    q, k, v = (torch.from_numpy(randn(rng, T, h, D)) for h in (HQ, HKV, HKV))
    positions, slots = torch.from_numpy(make_positions(rng, T)), torch.tensor([3, 17, -1, 40, 16])
    pools = {lay: [torch.zeros(3, HKV, bs, D) for _ in range(2)] for lay in ("HND", "amx")}
    for lay, (kp, vp) in pools.items():
        ropepool.rope_pool_fused(q, k, v, positions, slots, kp, vp, head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV,
                                 kv_layout=lay)
    ids = np.arange(3 * HKV * bs * D).reshape(3, HKV, bs, D)
    cache = Cache([ids], "amx", bs)
    for which in (0, 1):
        flat = pools["amx"][which].reshape(-1)
        for s in (3, 17, 40, 16):
            got = flat[torch.from_numpy(cache.rows(ids, [s], which)[0])]
            assert torch.equal(got, pools["HND"][which][s // bs, :, s % bs]), (which, s)


@pytest.mark.parametrize("layer", [None, 2])
def test_oracle_writes_amx_as_the_torch_path(rng, layer):
    """The oracle's own AMX write (ropepool.reference.amx_offset; run_checked reads only its q_rot / k_rot):
    without RoPE its pools are the torch path's bit for bit, and the torch path's follow the formula above."""
    from ropepool import reference

    bs, D, T = 32, 48, 11
    q, k, v = (randn(rng, T, h, D, dtype="bfloat16") for h in (HQ, HKV, HKV))
    positions, slots = make_positions(rng, T), make_slots(rng, T, 3 * bs, skip_every=3)
    shape = (3, 3, HKV, bs, D) if layer is not None else (3, HKV, bs, D)
    kp, vp = randn(rng, *shape, dtype="bfloat16"), randn(rng, *shape, dtype="bfloat16")
    kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, rope=RopeSpec(head_dim=D, rotary_dim=0),
              kv_layout="amx", layer=layer)
    ref = reference.rope_pool_fused(q, k, v, positions, slots, kp, vp, **kw)
    got = ropepool.rope_pool_fused(*(X.array(a) for a in (q, k, v, positions, slots, kp, vp)), **kw)
    for want, pool in zip(ref[2:], got[2:]):
        assert np.array_equal(X.numpy(pool).view(np.uint16), want.view(np.uint16))
