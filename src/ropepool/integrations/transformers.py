"""Serve a Hugging Face decoder of the Llama family through ropepool.

The model stays transformers' own: embedding, norms, MLPs, projections and
LM head run unchanged, through the model's own forward. For the length of one
engine step, each decoder layer's ``self_attn`` is swapped for a
``PoolAttention`` that

1. projects q, k and v with that layer's ``q_proj`` / ``k_proj`` / ``v_proj``
   (and, for Qwen3, normalises q and k per head with ``q_norm`` / ``k_norm``),
2. calls ``rope_pool_fused(..., layer=i)``: RoPE on q and k, and the rotated
   k and v written into the layer-stacked pool at each token's slot,
3. attends each request's new queries to that request's rows of the pool
   (SDPA over the gathered rows, causal by position, with the layer's sliding
   window if it has one),
4. applies ``o_proj``.

All requests of a step travel as one flat sequence (``input_ids`` of shape
``[1, num_tokens]``); the ``Batch`` the engine builds carries what the op
needs per token (position, slot) and what attention needs per request (its
token range, the slots of its positions in order). transformers' own cos/sin
(``position_embeddings``) and causal mask are computed by its forward and
ignored.

``Engine`` is the continuous-batching loop around it: requests wait in a
queue, are admitted when the ``SlotAllocator`` can reserve their slots, get
their prompt prefilled in chunks beside other requests' decode tokens, and
give their slots back when they finish, for the next request to reuse.

Example
-------
>>> import torch, transformers
>>> from ropepool.integrations.transformers import Engine
>>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.AutoModelForCausalLM.from_config(cfg)
>>> engine = Engine(model, pool_size=64)
>>> outputs = engine.generate([[1, 5, 9], [7, 3]], max_new_tokens=4)
>>> [len(o) for o in outputs]
[4, 4]
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..api import rope_pool_fused
from ..errors import RopePoolError
from ..spec import RopeSpec


# --------------------------------------------------------------------------
# Which models: families as data
# --------------------------------------------------------------------------

def _no_window(config, attn) -> int | None:
    return None


def _config_window(config, attn) -> int | None:
    # Mistral: one window for every layer, read from the config.
    return getattr(config, "sliding_window", None)


def _layer_window(config, attn) -> int | None:
    # Qwen2 / Qwen3: per layer (layer_types), set on the attention module.
    return getattr(attn, "sliding_window", None)


@dataclass(frozen=True)
class Family:
    """What differs between the supported decoders' attention."""

    model_type: str
    qk_norm: bool  # q_norm / k_norm per head, before RoPE (Qwen3)
    window: Callable[[Any, nn.Module], int | None]  # (config, hf attention) -> sliding window


FAMILIES = {
    "llama": Family("llama", qk_norm=False, window=_no_window),
    "mistral": Family("mistral", qk_norm=False, window=_config_window),
    "qwen2": Family("qwen2", qk_norm=False, window=_layer_window),
    "qwen3": Family("qwen3", qk_norm=True, window=_layer_window),
}


@dataclass(frozen=True)
class ModelSpec:
    """The geometry of a supported model, read from its config."""

    family: Family
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope: RopeSpec


def _get(config, name, default=None):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def read_config(config) -> ModelSpec:
    """Read what the integration needs from a transformers config (or a dict of one).

    Raises
    ------
    RopePoolError
        The model family is not supported, a field is missing or invalid, or
        the RoPE cannot be read. The message names the field and the fix.
    """
    model_type = _get(config, "model_type")
    if not isinstance(model_type, str) or not model_type:
        raise RopePoolError(
            f"read_config expects a transformers config with a model_type (e.g. model.config); "
            f"got {type(config).__name__} without one. Fix: pass model.config, or a dict with 'model_type'.")
    family = FAMILIES.get(model_type)
    if family is None:
        archs = _get(config, "architectures") or []
        arch = f" ({', '.join(archs)})" if archs else ""
        raise RopePoolError(
            f"ropepool.integrations.transformers supports model_type {sorted(FAMILIES)}; got "
            f"{model_type!r}{arch}. Fix: use a Llama, Mistral, Qwen2 or Qwen3 model; a family whose attention "
            "is Llama's (q/k/v/o projections, rotate_half RoPE) can be added to FAMILIES.")

    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise RopePoolError(
                f"cannot read this {model_type} config: {name} must be a positive int; got {value!r}. "
                f"Fix: set config.{name} (a {model_type} config needs hidden_size, num_attention_heads, "
                "num_hidden_layers and vocab_size).")
        return value

    hidden = positive_int("hidden_size", _get(config, "hidden_size"))
    num_layers = positive_int("num_hidden_layers", _get(config, "num_hidden_layers"))
    vocab = positive_int("vocab_size", _get(config, "vocab_size"))
    hq = positive_int("num_attention_heads", _get(config, "num_attention_heads"))
    hkv = positive_int("num_key_value_heads", _get(config, "num_key_value_heads") or hq)
    head_dim = positive_int("head_dim", _get(config, "head_dim") or hidden // hq)
    if hq % hkv:
        raise RopePoolError(
            f"cannot read this {model_type} config: num_attention_heads ({hq}) must be a multiple of "
            f"num_key_value_heads ({hkv}). Fix: correct the head counts in the config.")
    try:
        rope = RopeSpec.from_hf_config(config)
    except RopePoolError as e:
        raise RopePoolError(f"cannot read the RoPE of this {model_type} config: {e}") from e
    if rope.rotary_dim != head_dim or rope.style != "neox":
        # transformers' Llama-family attention rotates the whole head, rotate_half style.
        raise RopePoolError(
            f"cannot read the RoPE of this {model_type} config: its attention rotates all head_dim={head_dim} "
            f"features NeoX-style; got rotary_dim={rope.rotary_dim}, style={rope.style!r} "
            f"(partial_rotary_factor={_get(config, 'partial_rotary_factor')!r}). "
            "Fix: remove partial_rotary_factor from the config.")
    return ModelSpec(family, num_layers, hq, hkv, head_dim, vocab, rope)


# --------------------------------------------------------------------------
# The slot pool's free list
# --------------------------------------------------------------------------

class SlotAllocator:
    """The free list of a pool's rows ("slots").

    ``allocate`` hands out the lowest free slots, so reuse of a finished
    request's rows is easy to see; ``free`` gives them back.
    """

    def __init__(self, pool_size: int):
        self.pool_size = pool_size
        self._free = list(range(pool_size))  # sorted
        self._held: set[int] = set()
        self.ever_freed: set[int] = set()  # slots some request has given back (for reporting reuse)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RopePoolError(
                f"SlotAllocator out of slots: asked for {n}, {len(self._free)} of pool_size={self.pool_size} "
                "are free. Fix: free finished requests' slots first, or raise pool_size.")
        slots, self._free = self._free[:n], self._free[n:]
        self._held.update(slots)
        return slots

    def free(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._held]
        if bad or len(set(slots)) != len(slots):
            raise RopePoolError(f"SlotAllocator.free: slots {bad[:8] or list(slots)[:8]} are not held (freed twice?). "
                                "Fix: free each request's slots once, when it finishes.")
        self._held.difference_update(slots)
        self.ever_freed.update(slots)
        self._free = sorted(self._free + list(slots))


# --------------------------------------------------------------------------
# Requests and the batch of one step
# --------------------------------------------------------------------------

@dataclass(eq=False)
class Request:
    """One generation. Position ``p`` of its tokens lives in pool row ``slots[p]``."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    slots: list[int] = field(default_factory=list)  # reserved on admission, one per position
    num_cached: int = 0  # tokens whose k/v are in the pool: positions 0 .. num_cached - 1
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 [vocab] per generated token (record_logits)
    reused_slots: int = 0  # how many of its slots an earlier request had held

    @property
    def num_slots_needed(self) -> int:
        # Every token but the last generated one is fed back and written.
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class Segment:
    """One request's tokens in a step: flat rows ``start:end``, positions ``first_pos`` on."""

    request: Request
    start: int
    end: int
    first_pos: int
    kv_slots: torch.Tensor  # [first_pos + n] pool rows of positions 0 .. first_pos + n - 1
    samples: bool  # its last token ends the known tokens: its logits give the next token
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """bool ``[n, first_pos + n]``: query at position p sees keys at p - window < j <= p."""
        if window not in self._masks:
            dev = self.kv_slots.device
            qpos = torch.arange(self.first_pos, self.first_pos + self.end - self.start, device=dev)[:, None]
            kpos = torch.arange(self.kv_slots.numel(), device=dev)[None, :]
            m = kpos <= qpos
            if window is not None:
                m &= kpos > qpos - window
            self._masks[window] = m
        return self._masks[window]


@dataclass
class Batch:
    """Everything one forward step sees: the flat tokens of all its requests."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: where each token's k/v go
    segments: list[Segment]
    num_prefill_tokens: int
    num_decode_tokens: int

    @property
    def sample_rows(self) -> list[int]:
        return [s.end - 1 for s in self.segments if s.samples]


# --------------------------------------------------------------------------
# The attention that runs through ropepool
# --------------------------------------------------------------------------

def attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """q ``[n, Hq, D]``; k, v ``[ctx, Hkv, D]``; mask bool ``[n, ctx]`` -> ``[n, Hq, D]``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class PoolAttention(nn.Module):
    """Stands in for one decoder layer's ``self_attn`` while the engine runs a step."""

    def __init__(self, attn: nn.Module, layer: int, engine: "Engine"):
        super().__init__()
        self.attn = attn
        self.layer = layer
        self.window = engine.spec.family.window(engine.model.config, attn)
        self._engine = engine

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        # position_embeddings (transformers' cos/sin) and attention_mask are not
        # used: the RoPE is rope_pool_fused's, the mask each request's pool rows.
        e, a, s = self._engine, self.attn, self._engine.spec
        batch = e.batch
        x = hidden_states[0]  # [T, hidden]: the flat batch
        T, D = x.shape[0], s.head_dim
        q = a.q_proj(x).view(T, s.num_qo_heads, D)
        k = a.k_proj(x).view(T, s.num_kv_heads, D)
        v = a.v_proj(x).view(T, s.num_kv_heads, D)
        if s.family.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)

        q, _, k_pool, v_pool = rope_pool_fused(
            q, k, v, batch.positions, batch.slots, e.k_pool, e.v_pool,
            head_dim=D, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
            rope=s.rope, layer=self.layer, backend=e.backend)

        # Each request reads its own rows back from the pool, this step's included.
        out = torch.empty_like(q)
        for seg in batch.segments:
            out[seg.start:seg.end] = attend(q[seg.start:seg.end], k_pool[self.layer, seg.kv_slots],
                                            v_pool[self.layer, seg.kv_slots], seg.mask(self.window), a.scaling)
        return a.o_proj(out.reshape(1, T, s.num_qo_heads * D)), None


# --------------------------------------------------------------------------
# The engine: continuous batching over the slot pool
# --------------------------------------------------------------------------

class Engine:
    """Continuous batching of a transformers Llama-family model over one ropepool slot pool.

    Parameters
    ----------
    model : a transformers ``*ForCausalLM`` of a family in ``FAMILIES``
        Used as it is; its attention is swapped only while a step runs.
    pool_size : int
        Rows of the KV pool (shared by all requests, all layers stacked):
        ``k_pool, v_pool`` are ``[num_layers, pool_size, num_kv_heads, head_dim]``
        in the model's dtype, on its device.
    max_batch_tokens : int
        Tokens per step: decode tokens first, then prefill chunks.
    backend : str, optional
        Passed to ``rope_pool_fused`` (None chooses automatically).
    record_logits : bool
        Keep the float32 logits of every generated token on its request.

    Scheduling: a request reserves ``len(prompt) + max_new_tokens - 1`` slots
    when admitted (first come, first served) and waits while they are not
    free; one that could never fit is refused by ``add_request``. A running
    request therefore never runs out of rows mid-generation.
    """

    def __init__(self, model, *, pool_size: int, max_batch_tokens: int = 64, backend: str | None = None,
                 record_logits: bool = False):
        self.spec = spec = read_config(model.config)
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.layers = list(self.decoder.layers)
        self._check_model()
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size <= 0:
            raise RopePoolError(f"Engine pool_size must be a positive int; got {pool_size!r}. "
                                "Fix: pass the number of KV rows to allocate, e.g. pool_size=4096.")
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens <= 0:
            raise RopePoolError(f"Engine max_batch_tokens must be a positive int; got {max_batch_tokens!r}. "
                                "Fix: pass the most tokens one step may hold, e.g. 64.")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (spec.num_layers, pool_size, spec.num_kv_heads, spec.head_dim)
        self.k_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.allocator = SlotAllocator(pool_size)
        self.max_batch_tokens = max_batch_tokens
        self.backend = backend
        self.record_logits = record_logits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.batch: Batch | None = None  # the step being run, read by PoolAttention
        self.stats = {"steps": 0, "mixed_steps": 0, "prefill_tokens": 0, "decode_tokens": 0}
        self._next_rid = 0
        self._wrappers = [PoolAttention(layer.self_attn, i, self) for i, layer in enumerate(self.layers)]

    def _check_model(self):
        s = self.spec
        if self.lm_head is None:
            raise RopePoolError(f"cannot read this model: {type(self.model).__name__} has no LM head. "
                                "Fix: load it with AutoModelForCausalLM (e.g. LlamaForCausalLM, not LlamaModel).")
        if len(self.layers) != s.num_layers:
            raise RopePoolError(f"cannot read this model: config.num_hidden_layers is {s.num_layers} but the "
                                f"decoder has {len(self.layers)} layers. Fix: load the model from its own config.")
        for i, layer in enumerate(self.layers):
            a = getattr(layer, "self_attn", None)
            want = {"q_proj": s.num_qo_heads * s.head_dim, "k_proj": s.num_kv_heads * s.head_dim,
                    "v_proj": s.num_kv_heads * s.head_dim}
            for name, width in want.items():
                proj = getattr(a, name, None)
                if getattr(proj, "out_features", None) != width:
                    raise RopePoolError(
                        f"cannot read this model: layer {i} self_attn.{name} should be a Linear with "
                        f"{width} outputs (heads x head_dim from the config); got {type(proj).__name__} with "
                        f"{getattr(proj, 'out_features', None)}. "
                        "Fix: load the model from its own config (head_dim, num_key_value_heads).")
            if s.family.qk_norm and not (hasattr(a, "q_norm") and hasattr(a, "k_norm")):
                raise RopePoolError(f"cannot read this model: layer {i} self_attn has no q_norm/k_norm, which a "
                                    f"{s.family.model_type} model has. Fix: load the model from its own config.")

    @property
    def pool_size(self) -> int:
        return self.allocator.pool_size

    # -- requests -----------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Queue a request. Raises, touching nothing, if it could never fit the pool."""
        return self._queue([self._check_request(prompt, max_new_tokens)])[0]

    def _check_request(self, prompt, max_new_tokens) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt or any(t < 0 or t >= self.spec.vocab_size for t in prompt):
            raise RopePoolError(f"Engine.add_request: prompt must be a non-empty list of token ids in "
                                f"[0, {self.spec.vocab_size}); got {prompt[:8]}. "
                                "Fix: tokenize with the model's tokenizer.")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RopePoolError(f"Engine.add_request: max_new_tokens must be an int >= 1; got {max_new_tokens!r}. "
                                "Fix: ask for at least one new token.")
        r = Request(-1, prompt, max_new_tokens)
        if r.num_slots_needed > self.pool_size:
            raise RopePoolError(
                f"Engine.add_request: a request needs {r.num_slots_needed} slots (prompt {len(prompt)} + "
                f"max_new_tokens {max_new_tokens} - 1) but pool_size is {self.pool_size}. Fix: raise pool_size "
                f"to at least {r.num_slots_needed}, or shorten the prompt or max_new_tokens.")
        return r

    def _queue(self, reqs: list[Request]) -> list[Request]:
        for r in reqs:
            r.rid, self._next_rid = self._next_rid, self._next_rid + 1
            self.waiting.append(r)
        return reqs

    def _admit(self) -> None:
        # First come, first served: the head of the queue waits for its slots.
        while self.waiting and self.waiting[0].num_slots_needed <= self.allocator.num_free:
            r = self.waiting.popleft()
            r.slots = self.allocator.allocate(r.num_slots_needed)
            r.reused_slots = sum(s in self.allocator.ever_freed for s in r.slots)
            self.running.append(r)

    def _retire(self, r: Request) -> None:
        self.allocator.free(r.slots)
        self.running.remove(r)
        self.finished.append(r)

    # -- one step -----------------------------------------------------------

    def schedule(self) -> Batch | None:
        """Admit what fits, then fill the step: decode tokens first, then prefill chunks."""
        self._admit()
        # A request's next tokens are those not yet in the pool: one in decode,
        # the rest of the prompt in prefill. Decodes go first (latency).
        order = sorted(self.running, key=lambda r: len(r.tokens) - r.num_cached > 1 or not r.output)
        budget, segs, ids, pos, slots = self.max_batch_tokens, [], [], [], []
        prefill = decode = 0
        for r in order:
            if budget == 0:
                break
            toks = r.tokens
            n = min(len(toks) - r.num_cached, budget)
            start, p0 = len(ids), r.num_cached
            ids += toks[p0:p0 + n]
            pos += range(p0, p0 + n)
            slots += r.slots[p0:p0 + n]
            kv = torch.tensor(r.slots[:p0 + n], dtype=torch.int64, device=self.device)
            segs.append(Segment(r, start, start + n, p0, kv, samples=p0 + n == len(toks)))
            if r.output:
                decode += n
            else:
                prefill += n
            budget -= n
        if not segs:
            return None

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return Batch(t(ids), t(pos), t(slots), segs, prefill, decode)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Run the model on a batch; float32 logits ``[len(batch.sample_rows), vocab]``."""
        with self._through_ropepool(batch):
            out = self.decoder(input_ids=batch.input_ids[None], position_ids=batch.positions[None],
                               use_cache=False)
        hidden = out.last_hidden_state[0, batch.sample_rows]
        return self.lm_head(hidden).float()

    @contextlib.contextmanager
    def _through_ropepool(self, batch: Batch):
        originals = [layer.self_attn for layer in self.layers]
        self.batch = batch
        try:
            for layer, w in zip(self.layers, self._wrappers):
                layer.self_attn = w
            yield
        finally:
            for layer, a in zip(self.layers, originals):
                layer.self_attn = a
            self.batch = None

    def step(self) -> list[Request]:
        """Schedule and run one step; returns the requests it finished."""
        batch = self.schedule()
        return [] if batch is None else self.execute(batch)

    def execute(self, batch: Batch) -> list[Request]:
        """Run a scheduled batch, sample greedily, retire finished requests (freeing their slots)."""
        logits = self.forward(batch)
        self.stats["steps"] += 1
        self.stats["mixed_steps"] += bool(batch.num_prefill_tokens and batch.num_decode_tokens)
        self.stats["prefill_tokens"] += batch.num_prefill_tokens
        self.stats["decode_tokens"] += batch.num_decode_tokens
        rows = iter(logits)
        done = []
        for seg in batch.segments:
            r = seg.request
            r.num_cached += seg.end - seg.start
            if seg.samples:
                row = next(rows)
                r.output.append(int(row.argmax()))
                if self.record_logits:
                    r.logits.append(row.cpu())
                if r.done:
                    done.append(r)
        for r in done:
            self._retire(r)
        return done

    def run(self) -> list[Request]:
        """Step until every queued request has finished; returns them in the order they finished."""
        start = len(self.finished)
        while self.waiting or self.running:
            self.step()
        return self.finished[start:]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation for several prompts at once; the new tokens of each, in prompt order."""
        reqs = self._queue([self._check_request(p, max_new_tokens) for p in prompts])  # all checked first
        self.run()
        return [r.output for r in reqs]
