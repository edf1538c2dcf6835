"""The KV cache: explicit per-layer arrays, token rows contiguous so kernels can gather rows by position."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.logical_axes import BATCH, KV_HEADS, axes_field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per layer, keys and values `[B, T, H_kv, D]` (row t holds position t, already RoPE-rotated).

    One array per layer rather than one stacked array: each layer's update is an in-place scatter into its own
    donated buffer, and no loop over layers ever slices (and copies) a stacked cache.
    """

    k: tuple[jax.Array, ...] = axes_field(BATCH, None, KV_HEADS, None)
    v: tuple[jax.Array, ...] = axes_field(BATCH, None, KV_HEADS, None)

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = (batch, capacity, config.num_kv_heads, config.head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=zeros(), v=zeros())

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """Layer i's cache as dense attentions take it: (k, v)."""
        return self.k[i], self.v[i]

    @classmethod
    def from_layers(cls, layers: list[tuple[jax.Array, jax.Array]]) -> "KVCache":
        return cls(k=tuple(k for k, _ in layers), v=tuple(v for _, v in layers))


def write_rows(cache: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """cache[b, positions[b, s]] = rows[b, s]; positions past the end are dropped, never clamped onto valid rows."""
    batch_index = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch_index, positions].set(rows.astype(cache.dtype), mode="drop")
