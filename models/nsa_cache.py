"""The per-layer cache of an NSA layer: raw K/V rows (after RoPE, row t = position t, as the dense cache) and the
compressed keys and values, one row per compressed block, written when the block completes.

A compressed key is the mean of its block's rotated raw keys (NSA-1B's mean pooling), recomputed from the raw
rows at the step that writes the block's last row, never kept as a running sum: the loop writes rows by position
and may overwrite rows (padding past a prompt, drafts later verified), so a sum carried across writes would keep
the stale rows, while a mean taken when the last row lands reads the rows as they are. Stale rows at or past a
sequence's length cannot reach a query either way: a compressed block is visible only to queries at or after its
last row, and a real query there has rewritten the whole block first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import ModelConfig, NSALayout
from models.kv_cache import set_layer, write_rows
from models.logical_axes import BATCH, KV_HEADS, axes_field


# Compressed rows are allocated in multiples of this, so kernels tile them in whole blocks (the rows past the last
# block that fits are never complete, hence never visible).
COMPRESSED_ALIGN = 128


def compressed_rows(layout: NSALayout, capacity: int) -> int:
    """Rows of the compressed cache for `capacity` raw rows: the compressed blocks that fit, rounded up to a
    multiple of COMPRESSED_ALIGN."""
    fits = max((capacity - layout.compress_block) // layout.compress_stride + 1, 1)
    return -(-fits // COMPRESSED_ALIGN) * COMPRESSED_ALIGN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSALayerCache:
    """One layer's cache as its attention sees it: k, v [B, T, H_kv, D]; k_cmp, v_cmp [B, C, H_kv, D]."""

    k: jax.Array
    v: jax.Array
    k_cmp: jax.Array
    v_cmp: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSACache:
    """Every layer's NSALayerCache arrays stacked along a leading layer axis [L, ...], as KVCache and for its
    reasons (one scanned layer body carries the whole cache)."""

    k: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    v: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    k_cmp: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    v_cmp: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> "NSACache":
        rows = compressed_rows(config.nsa, capacity)
        zeros = lambda n: jnp.zeros((config.num_layers, batch, n, config.num_kv_heads, config.head_dim), dtype)
        return cls(k=zeros(capacity), v=zeros(capacity), k_cmp=zeros(rows), v_cmp=zeros(rows))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, i) -> NSALayerCache:
        """Layer i's cache (i: a Python int or a traced int32)."""
        return NSALayerCache(self.k[i], self.v[i], self.k_cmp[i], self.v_cmp[i])

    def with_layer(self, i, layer: NSALayerCache) -> "NSACache":
        """This cache with layer i's arrays replaced by `layer`'s (models.kv_cache.set_layer)."""
        return NSACache(*(set_layer(getattr(self, f), i, getattr(layer, f)) for f in ("k", "v", "k_cmp", "v_cmp")))


def write_tokens(cache: NSALayerCache, k: jax.Array, v: jax.Array, positions: jax.Array,
                 layout: NSALayout) -> NSALayerCache:
    """Writes rotated k, v [B, S, H_kv, D] at positions [B, S], then the compressed row of every block whose last
    row is among them, pooled from the raw rows just written (positions past the end are dropped)."""
    written = NSALayerCache(write_rows(cache.k, k, positions), write_rows(cache.v, v, positions), cache.k_cmp,
                            cache.v_cmp)
    return pool_blocks(written, positions, layout)


def pool_blocks(cache: NSALayerCache, positions: jax.Array, layout: NSALayout) -> NSALayerCache:
    """The cache with the compressed row of every block whose last row is at one of positions [B, S] pooled from
    its raw rows as they are (positions past the end change nothing): what writing those rows does after the raw
    write, and what a committed draft path needs once its rows are copied into place."""
    l, d = layout.compress_block, layout.compress_stride
    start = positions + 1 - l  # [B, S] the first row of the block that ends here
    completes = (start >= 0) & (start % d == 0) & (positions < cache.capacity)
    block = jnp.where(completes, start // d, cache.k_cmp.shape[1])  # out of range: dropped
    rows = jnp.clip(start[..., None] + jnp.arange(l), 0, cache.capacity - 1)  # [B, S, l]
    batch_index = jnp.arange(positions.shape[0])[:, None, None]

    def pooled(raw):
        return jnp.mean(raw[batch_index, rows].astype(jnp.float32), axis=2)  # [B, S, H_kv, D]

    return NSALayerCache(cache.k, cache.v, write_rows(cache.k_cmp, pooled(cache.k), block),
                         write_rows(cache.v_cmp, pooled(cache.v), block))
