"""ropepool without torch: the MLX path, the oracle, validate_slots and ``ropepool env`` (issue 14).

Each check runs in a fresh interpreter in which importing torch or triton
raises ModuleNotFoundError (a finder placed first on ``sys.meta_path``),
whether or not this venv has them. So the test means the same in CI's torch
job and in its no-torch job, and a module that imports torch fails it instead
of being skipped. (The finder answers ``find_spec("torch")`` with a spec, as
if torch were installed, so code that imports torch whenever it is installed
fails here too: stricter than a machine without torch.) At the end the child
reports which modules of torch and triton got loaded: none may be.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import ropepool
from tests.harness import HAS

BLOCK = """
import importlib.abc, importlib.machinery, sys


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # First on sys.meta_path: torch and triton are found by no other finder, and importing them raises.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (blocked by test_torch_free)", name=spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Absent())
try:
    import torch  # noqa: F401
    raise SystemExit("the torch blocker failed: torch imported")
except ModuleNotFoundError:
    pass
"""

LOADED = """
loaded = sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in ("torch", "triton"))
print("LOADED:", loaded)
"""


def run_without_torch(code: str) -> str:
    src = os.path.dirname(os.path.dirname(ropepool.__file__))  # this checkout's ropepool, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code) + LOADED], env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"failed without torch (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "LOADED: []" in proc.stdout, f"torch or triton got loaded:\n{proc.stdout}"
    return proc.stdout


def test_oracle_and_validate_slots_without_torch():
    run_without_torch("""
        import numpy as np
        import ropepool
        from ropepool import RopeSpec, reference, validate_slots

        gen = np.random.default_rng(0)
        T, Hq, Hkv, D, P = 5, 4, 2, 64, 16
        q, k, v = (gen.standard_normal((T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
        pos, slots = np.arange(T) * 100, np.array([3, -1, 7, 0, 15])
        pools = [gen.standard_normal((P, Hkv, D)).astype(np.float32) for _ in range(2)]
        spec = RopeSpec(head_dim=D, base=1e6, scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 4096})
        q_rot, k_rot, kp, vp = reference.rope_pool_fused(q, k, v, pos, slots, *pools, head_dim=D,
                                                         num_qo_heads=Hq, num_kv_heads=Hkv, rope=spec)
        assert np.array_equal(vp[7], v[2]) and np.array_equal(kp[1], pools[0][1])
        validate_slots(slots, P, positions=pos)
        try:
            validate_slots(np.array([1, 1]), P)
            raise SystemExit("validate_slots accepted a repeated slot")
        except ropepool.RopePoolError as e:
            assert "unique" in str(e)
    """)


def test_mlx_call_without_torch():
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'ropepool[mlx]')")
    run_without_torch("""
        import mlx.core as mx
        import numpy as np
        import ropepool
        from ropepool import QKNorm, reference, validate_slots
        from ropepool.backends import paths

        gen = np.random.default_rng(0)
        T, Hq, Hkv, D, P = 5, 4, 2, 64, 16
        q, k, v = (gen.standard_normal((T, h, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
        pos, slots = np.arange(T) * 100, np.array([3, -1, 7, 0, 15])
        pools = [gen.standard_normal((P, Hkv, D)).astype(np.float32) for _ in range(2)]
        w = gen.standard_normal(D).astype(np.float32)
        kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=500000.0)
        arrays = [mx.array(a) for a in (q, k, v, pos, slots, *pools)]
        assert ropepool.backends.pick("mlx", arrays[0]).name == "mlx"
        with paths.counting() as seen:
            out = ropepool.rope_pool_fused(*arrays, **kw, qk_norm=QKNorm(mx.array(w), mx.array(w)))
        assert seen["mlx.compiled"] == 1, f"the call did not run MLX's compiled graph: {dict(seen)}"
        mx.eval(*out)
        ref = reference.rope_pool_fused(q, k, v, pos, slots, *pools, **kw, qk_norm=QKNorm(w, w))
        for got, want in zip(out, ref):
            assert np.abs(np.array(got) - want).max() < 1e-4
        validate_slots(mx.array(slots), P, positions=mx.array(pos))
    """)


def test_env_without_torch():
    out = run_without_torch("""
        from ropepool.cli import main
        assert main(["env"]) == 0
    """)
    assert "ropepool" in out and "backends" in out, out
    rows = [line.split(maxsplit=3) for line in out.split("backends (in order of preference):")[1].splitlines()
            if line.strip() and not line.startswith("LOADED:")]  # name, framework, module, ready or why not
    mlx = "ready" if HAS["mlx"] else "mlx is not installed (pip install 'ropepool[mlx]')"
    assert {(name, why) for name, _, _, why in rows} == {("triton", "torch is not installed"),
                                                          ("torch", "torch is not installed"), ("mlx", mlx)}, out
    assert len({module for _, _, module, _ in rows}) == len(rows), out  # one row a backend module


def test_version_from_one_source(capsys):
    """``ropepool --version`` prints the package's one version (src/ropepool/_version.py)."""
    from ropepool import __version__
    from ropepool.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ropepool {__version__}"
