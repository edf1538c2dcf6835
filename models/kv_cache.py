"""The KV cache: every layer's keys and values in one stacked array, token rows contiguous so kernels can gather
rows by position."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.logical_axes import BATCH, KV_HEADS, axes_field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values `[L, B, T, H_kv, D]` (layer l's row t holds position t, already RoPE-rotated).

    One stacked array rather than one per layer, so the decoder's scanned layer body (models.decoder) carries the
    whole cache through `lax.scan` and every layer runs the same compiled program; the layer axis is never split
    over a mesh. A layer's attention takes both stacks and the layer index: it reads its layer's rows in place
    (kernels index the stack, jnp reads index it inside the consuming dot) and writes only the new tokens' rows
    (`write_layer_rows`), which XLA scatters into the carried (donated) buffer in place. A layer's [B, T, H, D]
    slice is never taken out and written back: that copied each layer's cache on every pass (issue 52).
    """

    k: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    v: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def write_layer_rows(stacked: jax.Array, layer, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """stacked[layer, b, positions[b, s]] = rows[b, s] for a stacked cache [L, B, T, ...] (layer: a Python int or
    a traced int32; None: `stacked` is one layer's [B, T, ...], write_rows): one scatter of the new rows alone, in
    place on a carried or donated buffer; positions past the end are dropped, never clamped onto valid rows."""
    if layer is None:
        return write_rows(stacked, rows, positions)
    batch_index = jnp.arange(stacked.shape[1])[:, None]
    return stacked.at[layer, batch_index, positions].set(rows.astype(stacked.dtype), mode="drop")


def write_rows(cache: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """cache[b, positions[b, s]] = rows[b, s]; positions past the end are dropped, never clamped onto valid rows."""
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, positions].set(rows.astype(cache.dtype), mode="drop")
