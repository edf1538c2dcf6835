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
    over a mesh. A layer reads its slice with `layer(i)` and writes it back with `with_layer(i, ...)`, a
    dynamic_update_slice of the carried (donated) buffer that XLA performs in place.
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

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer i's cache as dense attentions take it: (k, v). i: a Python int or a traced int32 (scanned)."""
        return self.k[i], self.v[i]

    def with_layer(self, i, layer: tuple[jax.Array, jax.Array]) -> "KVCache":
        """This cache with layer i's slice replaced by `layer` (a `layer(i)` after the attention wrote to it)."""
        k, v = layer
        return KVCache(k=set_layer(self.k, i, k), v=set_layer(self.v, i, v))


def set_layer(stacked: jax.Array, i, layer: jax.Array) -> jax.Array:
    """stacked[i] = layer, as a dynamic_update_slice (in place on a carried or donated buffer) for a static or a
    traced layer index alike."""
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), i, axis=0)


def write_rows(cache: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """cache[b, positions[b, s]] = rows[b, s]; positions past the end are dropped, never clamped onto valid rows."""
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, positions].set(rows.astype(cache.dtype), mode="drop")
