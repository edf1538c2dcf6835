"""Sparse draft attention: each layer attends to its selected positions plus every position written since the
selection (accepted tokens, the newest token, this iteration's drafts)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.kv_cache import write_layer_rows
from pallas_kernels import sparse_decode_attention
from vegas_jax.attention.core import masked_attention
from vegas_jax.sharding import Placement


def selected_mask(indices: jax.Array, counts: jax.Array, capacity: int) -> jax.Array:
    """[B, T] bool from an index list [B, K] of which the first counts[b] entries are valid."""
    valid = jnp.arange(indices.shape[1])[None, :] < counts[:, None]
    rows = jnp.arange(indices.shape[0])[:, None]
    # max, not set: a padding entry may repeat a valid index and must not clear it.
    return jnp.zeros((indices.shape[0], capacity), bool).at[rows, indices].max(valid, mode="drop")


def recent_mask(recent_start: jax.Array, positions: jax.Array, capacity: int) -> jax.Array:
    """[B, S, T]: positions from recent_start up to each query's own position."""
    t = jnp.arange(capacity)[None, None, :]
    return (t >= recent_start[:, None, None]) & (t <= positions[:, :, None])


def sparse_attend(new, k_cache, v_cache, layer, indices, counts, recent_start, positions, placement: Placement):
    """One new token per sequence (`new`: NewTokens with S = 1) of layer `layer` over the selected rows
    indices[b, :counts[b]] (all < recent_start[b]; indices [B, K_max], counts [B], or every layer's [L, B, K_max],
    [L, B] read at `layer`) and the positions from recent_start[b] to its own; also writes its K/V into the stacked
    caches [L, B, T, H_kv, D] at `layer`. Returns (out [B, 1, H_q, D], k_cache, v_cache). The kernel rotates q and
    k, reads the layer's rows straight from the stacks and writes the new row in the same launch; the reference
    scatters, then masks a dense pass over the layer's cache."""
    if placement.uses_kernels:
        out, k_cache, v_cache = sparse_decode_attention(
            new.heads[:, 0], new.rope_cos[:, 0], new.rope_sin[:, 0], k_cache, v_cache, indices, counts,
            recent_start, positions[:, 0], layer=layer, interpret=placement.interpret,
        )
        return out[:, None], k_cache, v_cache
    q, k, v = new.rotated()
    k_cache = write_layer_rows(k_cache, layer, k, positions)
    v_cache = write_layer_rows(v_cache, layer, v, positions)
    capacity = k_cache.shape[2]
    if indices.ndim == 3:
        indices, counts = indices[layer], counts[layer]
    selected = selected_mask(indices, counts, capacity)
    mask = selected[:, None, :] | recent_mask(recent_start, positions, capacity)
    return masked_attention(q, k_cache[layer], v_cache[layer], mask), k_cache, v_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseDraftAttention:
    indices: jax.Array  # [layers, B, K_max] int32 selected positions (< recent_start)
    counts: jax.Array  # [layers, B] int32
    recent_start: jax.Array  # [B] int32
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))

    def __call__(self, layer, new, positions, k_cache, v_cache):
        out, k_cache, v_cache = sparse_attend(
            new, k_cache, v_cache, layer, self.indices, self.counts, self.recent_start, positions, self.placement
        )
        return out, k_cache, v_cache, None
