"""The op as array math, written once for every array framework (PyTorch, MLX).

The Triton kernel does this per token in registers; here it is whole-array
code over an ``ops`` adapter (``torch_arrays.TorchOps``, ``mlx_arrays.MlxOps``,
shared with the formats, formats/) that names the few functions
whose spelling differs. The NumPy oracle (``ropepool.reference``) is not
written over it: it is the independent float64 definition these are checked
against. It reads only the Call's records: the
rotation (frequencies or the engine's table, pair style, MRoPE rows, attention
scaling) and the norm. Everything is float32 until the one cast at the end.
"""
from __future__ import annotations

from ..rotation.spec import Rotation

_CONSTANTS: dict = {}


def constant(values, convert, *where):
    """``convert(values, *where)`` made once: a Rotation's NumPy frequencies or rows as a framework array.

    Keyed by the array's identity; the entry keeps the array alive, so the id stays its own. Only a
    Rotation's own small arrays come here (a RopeSpec's frequencies, MRoPE rows: a few hundred bytes),
    never an engine's table: at most 1,025 entries, past which the cache is emptied.
    """
    key = (id(values), convert, where)
    hit = _CONSTANTS.get(key)
    if hit is None:
        if len(_CONSTANTS) > 1024:
            _CONSTANTS.clear()
        hit = _CONSTANTS[key] = (values, convert(values, *where))
    return hit[1]


def cos_sin(rot: Rotation, positions, freqs, table, ops):
    """float32 ``cos, sin [T, rotary_dim // 2]`` and ``ok [T]`` (False: a position outside the table).

    ``freqs``: the rotation's frequency sets as a float32 array of the framework;
    ``table``: the engine's cos/sin cache (either is None).
    """
    half = rot.rotary_dim // 2
    mrope = positions.ndim == 2
    if mrope:  # [3, T] -> each frequency's row: [T, half]
        pos = ops.take(positions, ops.const(rot.rows, positions), 0).T
    else:
        pos = positions[:, None]
    if table is None:
        inv = freqs[0]
        if rot.long_from is not None and ops.numel(positions):
            # Decided inside the graph (no sync): a call whose largest position
            # reaches the original context uses the long factors throughout.
            inv = ops.where(positions.max() >= rot.long_from, freqs[1], freqs[0])
        ang = ops.f32(pos) * inv[None, :]
        cos, sin = ops.cos(ang), ops.sin(ang)
        if rot.attention_scaling != 1.0:
            cos, sin = cos * rot.attention_scaling, sin * rot.attention_scaling
        return cos, sin, None
    # The engine's table, read as given. A position outside it is never read:
    # its token is rotated by zero (and its pool write skipped by the caller).
    inside = (pos >= 0) & (pos < table.shape[0])
    idx = ops.where(inside, pos, 0)
    if mrope:
        cos = ops.take_along(table[:, :half], idx, 0)
        sin = ops.take_along(table[:, half:2 * half], idx, 0)
    else:
        cos, sin = ops.take(table[:, :half], idx[:, 0], 0), ops.take(table[:, half:2 * half], idx[:, 0], 0)
    ok = ops.all_last(inside)
    cos = ops.where(ok[:, None], ops.f32(cos), 1.0)
    sin = ops.where(ok[:, None], ops.f32(sin), 0.0)
    return cos, sin, ok


def normalize(x, weight, norm, ops):
    """RMS-normalise float32 ``x [T, H, D]`` over D, times ``weight_offset + weight`` (no weight: 1)."""
    y = x * ops.rsqrt(ops.mean_last(x * x) + norm.eps)
    return y if weight is None else y * (ops.f32(weight) + norm.weight_offset)


def rotate(x, cos, sin, rot: Rotation, ops):
    """float32 ``x [T, H, D]`` with its first rotary_dim features rotated by ``cos, sin [T, half]``."""
    r = rot.rotary_dim
    if r == 0:
        return x
    c, s = cos[:, None, :], sin[:, None, :]
    if rot.gptj:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        out = ops.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(*x.shape[:-1], r)
    else:
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
        out = ops.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return ops.cat([out, x[..., r:]], -1) if r < x.shape[-1] else out


def rope_and_norm(x, cos, sin, rot, norm, weight, ops):
    """float32: ``x`` normalised (if a norm) and rotated, in the norm's order."""
    x = ops.f32(x)
    if norm is not None and not norm.after_rope:
        x = normalize(x, weight, norm, ops)
    x = rotate(x, cos, sin, rot, ops)
    if norm is not None and norm.after_rope:
        x = normalize(x, weight, norm, ops)
    return x


def quantize(x, scale, fp8_max, ops):
    """float32 ``x / scale`` saturated to the fp8 range (the caller casts once). ``scale``: a float,
    one element, or one per head (``[H]``, broadcast over ``x [T, H, D]``)."""
    if hasattr(scale, "shape") and ops.numel(scale) > 1:
        scale = scale[:, None]
    return ops.clip(x / scale, -fp8_max, fp8_max)
