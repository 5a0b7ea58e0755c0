"""The CPU runner's QK norm: q and k as one tensor, RMS-normalised and rotated in the norm's order.

``torch_cpu.Fast`` takes these methods from here; the norm is torch_eager's (arraymath.normalize),
so its results are torch_eager's bit for bit (tests/test_cpu_path.py).
"""
from __future__ import annotations

import torch

from . import arraymath


class Normed:
    """The norm as methods of ``Fast`` (its call, ``pairs_of``, ``rotate``, ``cos_sin``, ``ops`` and ``gain_kept``)."""

    def normed(self, x, Hq, positions):
        """``[T, Hq + Hkv, D]`` x (q's heads, then k's: a tensor of ours) RMS-normalised and rotated in the
        norm's order, in place: q and k as one tensor, half the torch ops of two. The norm is torch_eager's
        (arraymath.normalize), with each head's gain: its results bit for bit."""
        norm = self.call.norm
        x32 = x.float()  # float32: x itself
        if not norm.after_rope:
            x32 = self.normalize(x32, Hq)
        # Normalised after the rotation: rotated in float32 (x32 is ours), rounded once at the end.
        rotated, xp, yp = self.pairs_of(x32, x32 if norm.after_rope else x)
        if xp is not None:
            self.rotate(xp, self.cos_sin(positions)[:2], yp)
        if norm.after_rope:
            x.copy_(self.normalize(rotated, Hq))
        return x

    def normalize(self, x32, Hq):
        """arraymath.normalize's ``y * (offset + w)``, its product taken with ``gain``'s rows."""
        y = arraymath.normalize(x32, None, self.call.norm, self.ops)
        gain = self.gain(Hq, x32.shape[1] - Hq)
        return y if gain is None else y.mul_(gain)

    def gain(self, Hq, Hkv):
        """The norm's weights as one ``[Hq + Hkv, D]`` float32 gain (``offset + w``; 1 for a head whose
        weight is None), or None without weights; kept while the weights are unchanged (their versions)."""
        weights = self.call.norm.weights  # the QKNorm's own tensors: the call keeps them alive, ids stay theirs
        if weights[0] is None and weights[1] is None:
            return None
        try:
            key = (Hq, Hkv, *(None if w is None else w._version for w in weights))
        except RuntimeError:  # an inference tensor keeps no version: made per call
            key = None
        if key is None or self.gain_kept[0] != key:
            weights = [None if w is None else w.detach() for w in weights]
            D = next(w for w in weights if w is not None).shape[0]
            rows = [torch.ones(D) if w is None else self.ops.f32(w) + self.call.norm.weight_offset for w in weights]
            self.gain_kept = (key, torch.cat((rows[0].expand(Hq, D), rows[1].expand(Hkv, D))))
        return self.gain_kept[1]
