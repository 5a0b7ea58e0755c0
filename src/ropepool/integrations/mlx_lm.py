"""mlx-lm's own model classes served through ropepool: one slot pool per layer, batched decode.

Each attention layer of an mlx-lm model (Llama, Mistral, Qwen2, Qwen3 and
the others whose attention has ``q_proj``/``k_proj``/``v_proj``/``o_proj``
and a ``rope``) is wrapped: its RoPE and KV-cache write become one
``ropepool.rope_pool_fused`` call into that layer's slot pool, as sglang's MLX
backend does it, and attention reads each sequence's rows back from the pool
through its slot table. Qwen3's per-head q/k norms are fused into the same
call (``ropepool.QKNorm`` with the module's own weights). The pools are
donated: each call's returned pools replace the held ones, so a decode step
costs time in proportion to its tokens, not to the pool.

    from mlx_lm.utils import load
    from ropepool.integrations.mlx_lm import PooledModel

    model, tokenizer = load("Qwen/Qwen3-0.6B")
    pooled = PooledModel(model, model.args, pool_rows=8192)
    outs = pooled.generate([tokenizer.encode("Hello"), tokenizer.encode("RoPE is")], max_tokens=32)

A wrapped layer called with one of mlx-lm's own caches (or none) runs the
original module, so ``mlx_lm.generate`` still works on the same model.
Install with ``pip install 'ropepool[mlx-lm]'``; docs/mlx.md has more.
"""
from __future__ import annotations

from dataclasses import asdict, is_dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from .. import QKNorm, RopeSpec, rope_pool_fused
from ..errors import RopePoolError


def rope_spec(attn, config) -> RopeSpec:
    """The RopeSpec of an mlx-lm attention module: the config's rotation, with the pair style its ``rope`` uses."""
    rope = attn.rope
    style = "gptj" if getattr(rope, "traditional", False) else "neox"
    spec = RopeSpec.from_hf_config(config, style=style)
    dims = getattr(rope, "dims", getattr(rope, "dim", spec.rotary_dim))
    if spec.rotary_dim != dims:
        raise RopePoolError(
            f"the config's RoPE rotates {spec.rotary_dim} features; the mlx-lm module's rope rotates {dims}. "
            "Fix: pass the config the model was built from (model.args).")
    return spec


def qk_norm(attn) -> QKNorm | None:
    """Qwen3-style per-head RMS norms of q and k (``q_norm``/``k_norm`` nn.RMSNorm), or None."""
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if qn is None and kn is None:
        return None
    if not (isinstance(qn, nn.RMSNorm) and isinstance(kn, nn.RMSNorm)):
        raise RopePoolError(f"the attention's q_norm/k_norm must be nn.RMSNorm; got {type(qn).__name__} and "
                            f"{type(kn).__name__}. Fix: serve this model with mlx-lm's own cache.")
    return QKNorm(qn.weight, kn.weight, eps=qn.eps)


class LayerView:
    """What one layer sees as its ``cache`` during a step: the step's tokens and that layer's pools."""

    def __init__(self, step: Step, layer: int):
        self.step, self.layer = step, layer

    def make_mask(self, N, return_array=False, window_size=None):  # mlx-lm asks the first layer's cache
        if window_size is not None:
            raise RopePoolError("sliding-window layers are not served by ropepool.integrations.mlx_lm; got "
                                f"window_size={window_size}. Fix: use mlx-lm's own cache for this model.")
        return self.step.mask


class Step:
    """One forward: ``B`` sequences of ``L`` tokens, their positions and slots, and each sequence's slot table.
    ``first``: the sequence's first forward (with quantized pools it attends over its own unquantized rows)."""

    def __init__(self, pools: SlotPools, positions, slots, table, mask, first=False):
        self.pools, self.positions, self.slots, self.table, self.mask = pools, positions, slots, table, mask
        self.first = first
        self.layers = [LayerView(self, i) for i in range(len(pools.k))]


class PooledAttention(nn.Module):
    """An mlx-lm attention module whose RoPE and KV write run through rope_pool_fused into a slot pool."""

    def __init__(self, inner: nn.Module, config):
        super().__init__()
        self.inner = inner
        self._rope = rope_spec(inner, config)
        self._norm = qk_norm(inner)
        self.head_dim = self._rope.head_dim

    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, LayerView):  # mlx-lm's own cache, or none: the original module
            return self.inner(x, mask=mask, cache=cache)
        a, step, i = self.inner, cache.step, cache.layer
        B, L, _ = x.shape
        q = a.q_proj(x).reshape(B * L, a.n_heads, -1)
        k = a.k_proj(x).reshape(B * L, a.n_kv_heads, -1)
        v = a.v_proj(x).reshape(B * L, a.n_kv_heads, -1)
        pools = step.pools
        q, k_rot, pools.k[i], pools.v[i] = rope_pool_fused(
            q, k, v, step.positions, step.slots, pools.k[i], pools.v[i], head_dim=self.head_dim,
            num_qo_heads=a.n_heads, num_kv_heads=a.n_kv_heads, rope=self._rope, qk_norm=self._norm)
        queries = q.reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        if pools.bits and not step.first:  # mlx-lm's attention over its quantized cache (QuantizedKVCache)
            from mlx_lm.models.base import quantized_scaled_dot_product_attention

            keys, values = (tuple(p[step.table].transpose(0, 2, 1, 3) for p in pool) for pool in (pools.k[i],
                                                                                                pools.v[i]))
            out = quantized_scaled_dot_product_attention(queries, keys, values, scale=a.scale, mask=mask,
                                                         group_size=pools.group_size, bits=pools.bits)
        else:
            if pools.bits:  # a first forward: mlx-lm attends over the new rows before it quantizes them
                keys, values = (x.reshape(B, L, a.n_kv_heads, -1) for x in (k_rot, v))
            else:  # each sequence's rows, in order, from the pool just written
                keys, values = pools.k[i][step.table], pools.v[i][step.table]
            keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)  # [B, heads, S, head_dim]
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=a.scale, mask=mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SlotPools:
    """One ``[rows, num_kv_heads, head_dim]`` K and V pool per layer, and the slots each sequence holds.

    With ``bits`` (mlx-lm's ``kv_bits``, 4 or 8) each pool is the tuple mlx-lm's ``QuantizedKVCache`` keeps,
    ``(words uint32, scales, biases)``, rows as ``mx.quantize`` stores them (groups of ``group_size``)."""

    def __init__(self, attentions, rows: int, dtype, slot_order=None, bits=None, group_size=64):
        self.bits, self.group_size = bits, group_size

        def pool(a):
            shape = (rows, a.inner.n_kv_heads)
            if bits is None:
                return mx.zeros((*shape, a.head_dim), dtype=dtype)
            groups = (*shape, a.head_dim // group_size)
            return (mx.zeros((*shape, a.head_dim * bits // 32), dtype=mx.uint32), mx.zeros(groups, dtype=dtype),
                    mx.zeros(groups, dtype=dtype))

        self.k = [pool(a) for a in attentions]
        self.v = [pool(a) for a in attentions]
        mx.eval(self.k, self.v)
        order = np.arange(rows) if slot_order is None else np.asarray(slot_order)
        self.free = list(order[::-1])
        self.seqs: dict = {}

    def allocate(self, seq, n: int) -> list:
        if n > len(self.free):
            raise RopePoolError(f"the slot pools have {len(self.free)} free rows; sequence {seq!r} needs {n}. "
                                "Fix: build PooledModel with a larger pool_rows, or release finished sequences.")
        got = [int(self.free.pop()) for _ in range(n)]
        self.seqs.setdefault(seq, []).extend(got)
        return got

    def release(self, seq):
        self.free.extend(reversed(self.seqs.pop(seq, [])))


def _attention_layers(model):
    layers = getattr(getattr(model, "model", None), "layers", None) or getattr(
        getattr(model, "language_model", None), "model", None).layers
    return layers


def _config_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if is_dataclass(config):
        return asdict(config)
    return dict(vars(config))


class PooledModel:
    """An mlx-lm model whose attention layers write a ropepool slot pool per layer; greedy batched decode.

    Parameters
    ----------
    model : an mlx-lm ``Model`` (``mlx_lm.utils.load`` or built from a config)
    config : the model's config (``model.args`` or the config dict it was built from)
    pool_rows : slots per layer pool
    slot_order : optional order in which free slots are handed out (default 0, 1, 2, ...)
    kv_bits, kv_group_size : mlx-lm's quantized KV cache (``kv_bits`` 4 or 8): the pools hold each row as
        ``mx.quantize`` stores it, written by rope_pool_fused, and attention reads them as mlx-lm's
        ``QuantizedKVCache`` does (mlx-lm's ``generate_step(..., kv_bits=, quantized_kv_start=0)``)
    """

    def __init__(self, model, config, pool_rows: int = 4096, slot_order=None, kv_bits=None, kv_group_size=64):
        self.model, config = model, _config_dict(config)
        layers = _attention_layers(model)
        for layer in layers:
            if not isinstance(layer.self_attn, PooledAttention):
                layer.self_attn = PooledAttention(layer.self_attn, config)
        attentions = [layer.self_attn for layer in layers]
        proj = attentions[0].inner.q_proj
        dtype = getattr(proj, "scales", proj.weight).dtype  # a quantized layer's weight is packed ints
        self.pools = SlotPools(attentions, pool_rows, dtype, slot_order, kv_bits, kv_group_size)
        self.lengths: dict = {}

    def forward(self, seqs, tokens) -> mx.array:
        """Logits ``[B, L, vocab]`` for ``tokens [B, L]`` appended to the sequences ``seqs`` (new ones start)."""
        B, L = tokens.shape
        first = [s not in self.lengths for s in seqs]
        if self.pools.bits and any(first) and B > 1:
            raise RopePoolError(f"with quantized pools each sequence's first forward runs alone; got new sequences "
                                f"{[s for s, f in zip(seqs, first) if f]} in a step of {B}. Fix: forward each new "
                                "sequence alone first (generate() does).")
        positions, slots = [], []
        for s in seqs:
            start = self.lengths.get(s, 0)
            positions.append(np.arange(start, start + L))
            slots.append(self.pools.allocate(s, L))
            self.lengths[s] = start + L
        # Slot tables padded to the longest sequence; a padding entry repeats a real slot and is masked out.
        held = [self.pools.seqs[s] for s in seqs]
        S = max(map(len, held))
        table = np.array([h + [h[0]] * (S - len(h)) for h in held], dtype=np.int32)
        if B == 1:
            mask = "causal" if L > 1 else None
        else:
            if L != 1:
                raise RopePoolError(f"a step of several sequences decodes one token each; got {L} tokens per "
                                    "sequence. Fix: prefill each sequence alone, then decode them together.")
            mask = mx.array(np.arange(S)[None, :] < np.array([len(h) for h in held])[:, None])[:, None, None, :]
        step = Step(self.pools, mx.array(np.concatenate(positions).astype(np.int32)),
                    mx.array(np.array(slots, dtype=np.int32).reshape(-1)), mx.array(table), mask, all(first))
        return self.model(tokens, cache=step.layers)

    def generate(self, prompts, max_tokens: int) -> list:
        """Greedy continuations of ``prompts`` (lists of token ids): each prefilled alone, then decoded together.

        With quantized pools, as mlx-lm's generate_step: a prompt's last token is decoded (attending to the
        quantized rows) rather than prefilled, since mlx-lm quantizes its cache after the first forward."""
        seqs = list(range(len(prompts)))
        for s in seqs:
            self.pools.release(s)
            self.lengths.pop(s, None)
        out, pending = [[] for _ in seqs], []
        for s, prompt in zip(seqs, prompts):
            head = list(prompt[:-1]) if self.pools.bits and len(prompt) > 1 else list(prompt)
            logits = self.forward([s], mx.array([head]))
            if len(head) < len(prompt):
                pending.append(prompt[-1])
            else:
                out[s].append(int(mx.argmax(logits[0, -1])))
                pending.append(out[s][-1])
        tokens = mx.array(pending)
        while min(map(len, out)) < max_tokens:
            tokens = mx.argmax(self.forward(seqs, tokens[:, None])[:, -1], axis=-1)
            mx.eval(tokens)
            for o, t in zip(out, tokens.tolist()):
                if len(o) < max_tokens:
                    o.append(t)
        return out
