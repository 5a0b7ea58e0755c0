"""transformers' ``PagedAttentionCache`` seen as ropepool pools, and its read-back for attention.

One layer of the cache is a K pool and a V pool ``[rows, num_kv_heads,
head_dim]`` that transformers' slot mapping (``write_index``, one tensor per
group of layers of one attention type) indexes directly: exactly ropepool's
flat layout, so the op writes transformers' own tensors at transformers' own
slots. Two layouts exist:

- transformers 5.17-5.2x: one K and one V tensor per layer of a group
  (``cache.key_cache[j]``, ``cache.value_cache[j]``);
- later 5.x: one byte tensor shared by every layer, each layer's K and V a
  shifted view of it (the allocator's ``_kv_token_views``), pages of K and V
  interleaved. The two views overlap in memory but never in the rows the slot
  mapping reaches.

The read-back is transformers' own rule (``PagedAttentionCache.update``):
a full-attention layer reads every cached row of a request after the write;
a sliding-window layer reads before the write (its ring buffer may overwrite
rows the step still needs) and puts this step's rows where ``read_index``
holds the sentinel.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ...core.step import STEP
from ...errors import RopePoolError


@dataclass(slots=True, eq=False)
class LayerKV:
    """One layer of the cache for one step (made per layer and step: plain slots, the cheapest to build)."""

    k_pool: torch.Tensor  # [rows, num_kv_heads, head_dim]
    v_pool: torch.Tensor
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] rows to write; transformers' write trash is turned into -1 (skip)
    read_index: torch.Tensor  # rows attention reads ([] when the step reads nothing from the cache)
    new: torch.Tensor | None  # sliding layers that read: where read_index stands for this step's tokens
    layout: tuple  # positions' and slots' dtypes and strides (the same for every layer of the step)
    top: int  # the step's largest position (0 without tokens, and on a GPU: only CPU layers read it)

    def read_before_write(self):
        """Sliding layers read the old rows first; a full-attention layer reads after the write."""
        if self.new is None:
            return None
        return self.k_pool.index_select(0, self.read_index), self.v_pool.index_select(0, self.read_index)

    def read(self, old, k_rot: torch.Tensor, v: torch.Tensor):
        """K and V of every row attention sees, ``[rows_read, num_kv_heads, head_dim]``."""
        if old is None:
            if not self.read_index.numel():
                return k_rot, v
            return self.k_pool.index_select(0, self.read_index), self.v_pool.index_select(0, self.read_index)
        return old[0].masked_scatter_(self.new, k_rot), old[1].masked_scatter_(self.new, v)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {layer: _layer_of(cache, layer)}


def layer_kv(cache, layer: int, kwargs: dict) -> LayerKV:
    """The K/V pools, slots and read rows of ``layer`` in this step (``kwargs``: the attention kwargs)."""
    views = _VIEWS.get(cache)
    if views is None:
        views = _VIEWS[cache] = {}
    found = views.get(layer)
    if found is None:
        found = views[layer] = _layer_of(cache, layer)
    k_pool, v_pool, group, sliding, trash, sentinel = found
    # Once per step, for all its layers: transformers builds a new write_index list of new views each step,
    # and _STEP keeps the last list and view alive, so no later step's can have their identities.
    writes = kwargs["write_index"]
    if _STEP[0] is not writes or _STEP[1] is not writes[0]:
        pos = kwargs["position_ids"].select(0, 0)
        # (the largest position sizes the CPU layers' cos/sin table; on a GPU reading it would wait for the GPU)
        _STEP[:] = [writes, writes[0], pos, {}, int(pos.max()) if pos.numel() and not pos.is_cuda else 0]
        STEP.begin(pos)
    step = _STEP[3].get((group, sliding))
    if step is None:
        step = _STEP[3][(group, sliding)] = _group_step(writes[group], trash, kwargs["read_index"][group],
                                                        sentinel if sliding else None)
    return LayerKV(k_pool, v_pool, _STEP[2], *step, _STEP[4])


def _group_step(write, trash, read_index, sentinel) -> tuple:
    """What every layer of a group shares in a step: its slots, the rows read, the sliding layers' mask of
    this step's rows among them, and the layout of positions and slots."""
    # Few slots are read as Python ints (0.3 us) to skip the two ops where no token goes to the trash (most steps);
    # not on a GPU, where reading them would wait for it
    slots = write.masked_fill(write == trash, -1) if write.shape[0] > 64 or write.is_cuda or trash in write.tolist() \
        else write
    STEP.add(slots)  # the step's arrays: values checked, cos/sin made once for all groups (core/step.py)
    new = None if sentinel is None or not read_index.numel() else (read_index == sentinel).view(-1, 1, 1)
    pos = _STEP[2]
    return slots, read_index, new, (pos.dtype, pos.stride(), slots.dtype, slots.stride())


# the step's write_index list, its first view, positions [T], {group: ...}, its largest position
_STEP: list = [None, None, None, {}, 0]


def _layer_of(cache, layer: int) -> tuple:
    """What a layer's steps read of the cache, looked up once per layer and cache: its K and V pools, its
    group, whether it slides, the group's write trash row and read sentinel."""
    if hasattr(cache, "layer_to_allocator"):
        alloc = cache.layer_to_allocator[layer]
        group, sliding, trash = alloc.index, alloc.layer_type == "sliding_attention", alloc.write_trash_index
        sentinel = alloc.sentinel_index
    elif hasattr(cache, "layer_index_to_group_indices"):
        group = cache.layer_index_to_group_indices[layer][0]
        sliding, trash, sentinel = cache.sliding_windows[layer] != 1, cache.write_trash_index, cache.sentinel_index
    else:
        raise RopePoolError(
            f"cannot read this PagedAttentionCache ({type(cache).__module__}): it has neither the per-layer "
            "tensors of transformers 5.17 nor the allocators of later 5.x. Fix: use transformers 5.17 to 5.25 "
            "(the versions tests/test_integration.py covers), or disable ropepool for this model.")
    return (*_pools(cache, layer), group, sliding, trash, sentinel)


def _pools(cache, layer: int):
    if hasattr(cache, "key_cache"):
        j = cache.layer_index_to_group_indices[layer][1]
        return cache.key_cache[j], cache.value_cache[j]
    alloc = cache.layer_to_allocator[layer]
    # The layer's K and V views start tokens_per_page rows apart; the rows any slot reaches end where the
    # group's last layer's V view ends, so every layer's views are cut to that length (one pool shape for
    # all layers of a group, which keeps ropepool's layout cache to one entry per group).
    k, v = alloc._kv_token_views[layer]
    last = alloc._kv_token_views[alloc.layer_indices[-1]][1]
    return k[:last.shape[0]], v[:last.shape[0]]
