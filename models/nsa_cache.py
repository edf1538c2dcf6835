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
from models.kv_cache import write_layer_rows
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
    """One layer's cache as its attention sees it. layer None: that layer's own arrays, k, v [B, T, H_kv, D] and
    k_cmp, v_cmp [B, C, H_kv, D]. layer an int or a traced int32: every layer's arrays stacked [L, ...] (NSACache's,
    as the decoder carries them) and the layer to read and write in place: the attentions and kernels take the
    stacks and index the layer, and writes scatter only the rows written into the stacks, so a scanned layer body
    never takes a layer's slice out and writes it back (a copy of the layer's cache per pass, issue 52)."""

    k: jax.Array
    v: jax.Array
    k_cmp: jax.Array
    v_cmp: jax.Array
    layer: jax.Array | int | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[-3]

    @property
    def compressed_rows(self) -> int:
        return self.k_cmp.shape[-3]

    @property
    def stacked(self) -> bool:
        return self.layer is not None

    def as_stacked(self) -> "NSALayerCache":
        """This cache with stacked arrays: as it is, or one layer's arrays as a stack of one (a reshape)."""
        if self.stacked:
            return self
        return NSALayerCache(self.k[None], self.v[None], self.k_cmp[None], self.v_cmp[None], jnp.int32(0))

    def like(self, stacked: "NSALayerCache") -> "NSALayerCache":
        """`stacked` (as_stacked's result, updated) in this cache's form: one layer's arrays for layer None."""
        if self.stacked:
            return stacked
        return NSALayerCache(stacked.k[0], stacked.v[0], stacked.k_cmp[0], stacked.v_cmp[0])

    def reads(self) -> "NSALayerCache":
        """The layer's arrays [B, ...] for jnp code that reads them whole (masks over every row): with stacks,
        indexed by the layer where they are consumed, which XLA fuses into the consuming dot or gather (no
        buffer); a kernel operand must take the stacks instead (a kernel's operand is a buffer)."""
        if not self.stacked:
            return self
        return NSALayerCache(self.k[self.layer], self.v[self.layer], self.k_cmp[self.layer], self.v_cmp[self.layer])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSACache:
    """Every layer's NSALayerCache arrays stacked along a leading layer axis [L, ...], as KVCache and for its
    reasons (one scanned layer body carries the whole cache). Layer i's attention takes `at_layer(i)`: the stacks
    and the layer, read and written in place (NSALayerCache)."""

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

    def at_layer(self, i) -> NSALayerCache:
        """Layer i's cache as its attention takes it (i: a Python int or a traced int32): the stacks themselves."""
        return NSALayerCache(self.k, self.v, self.k_cmp, self.v_cmp, i)

    @classmethod
    def of(cls, layer: NSALayerCache) -> "NSACache":
        """The stacks of an attention's returned NSALayerCache (at_layer's, written in place)."""
        if not layer.stacked:
            raise ValueError("an NSACache is made of stacked arrays, not of one layer's")
        return cls(layer.k, layer.v, layer.k_cmp, layer.v_cmp)


def write_tokens(cache: NSALayerCache, k: jax.Array, v: jax.Array, positions: jax.Array,
                 layout: NSALayout) -> NSALayerCache:
    """Writes rotated k, v [B, S, H_kv, D] at positions [B, S], then the compressed row of every block whose last
    row is among them, pooled from the raw rows just written (positions past the end are dropped). With stacks,
    only those rows are scattered into the layer's (in place)."""
    written = dataclasses.replace(cache, k=write_layer_rows(cache.k, cache.layer, k, positions),
                                  v=write_layer_rows(cache.v, cache.layer, v, positions))
    return pool_blocks(written, positions, layout)


def pool_blocks(cache: NSALayerCache, positions: jax.Array, layout: NSALayout) -> NSALayerCache:
    """The cache with the compressed row of every block whose last row is at one of positions [B, S] pooled from
    its raw rows as they are (positions past the end change nothing): what writing those rows does after the raw
    write, and what a committed draft path needs once its rows are copied into place. With stacks, the block's
    raw rows are gathered from the layer's and only the pooled rows scattered into its compressed stacks."""
    l, d = layout.compress_block, layout.compress_stride
    start = positions + 1 - l  # [B, S] the first row of the block that ends here
    completes = (start >= 0) & (start % d == 0) & (positions < cache.capacity)
    block = jnp.where(completes, start // d, cache.compressed_rows)  # out of range: dropped
    rows = jnp.clip(start[..., None] + jnp.arange(l), 0, cache.capacity - 1)  # [B, S, l]
    batch_index = jnp.arange(positions.shape[0])[:, None, None]

    def pooled(raw):
        taken = raw[batch_index, rows] if cache.layer is None else raw[cache.layer, batch_index, rows]
        return jnp.mean(taken.astype(jnp.float32), axis=2)  # [B, S, H_kv, D]

    return dataclasses.replace(cache, k_cmp=write_layer_rows(cache.k_cmp, cache.layer, pooled(cache.k), block),
                               v_cmp=write_layer_rows(cache.v_cmp, cache.layer, pooled(cache.v), block))
