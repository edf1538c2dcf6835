"""The shared selection of the approximate NSA modes (V2, vegas_jax.ssv.precision.ApproxMode): every query of an
aligned span of `span` positions takes the selection its span's first query (the anchor) derived. A pass (plain
decoding, a prefill chunk, or a draft tree) finds each row's anchor among the rows it sees (its causal prefix, or a
tree node's ancestors and itself); an anchor before the pass is the one the cache stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BEFORE_PASS = -1  # anchor_rows: the row's anchor precedes the pass (the cache's stored selection)


def anchor_rows(positions: jax.Array, sees: jax.Array, span: int) -> jax.Array:
    """[B, S] int32: for each row (positions [B, S]), the row of the same pass at its anchor position
    floor(p / span) * span among the rows it sees (sees [B, S, S]: row i sees row j), else BEFORE_PASS."""
    anchor = positions - positions % span
    hit = sees & (positions[:, None, :] == anchor[:, :, None])
    return jnp.where(hit.any(axis=-1), jnp.argmax(hit, axis=-1), BEFORE_PASS).astype(jnp.int32)


def chain_sees(positions: jax.Array) -> jax.Array:
    """[B, S, S]: the rows of a chain pass (prefill, plain decoding) each see the rows at or before them."""
    return positions[:, None, :] <= positions[:, :, None]


def shared_blocks(own: jax.Array, anchors: jax.Array, stored: jax.Array) -> jax.Array:
    """Each row's shared selection [B, K, S, n]: the selection its anchor row derived (own [B, K, S, n], every
    row's own top-n) or, for an anchor before the pass (anchors [B, S] == BEFORE_PASS), the row's stored one
    (stored [B, K, S or 1, n]: its span's, from the cache)."""
    rows = jnp.maximum(anchors, 0)[:, None, :, None]  # [B, 1, S, 1]
    taken = jnp.take_along_axis(own, jnp.broadcast_to(rows, own.shape), axis=2)
    return jnp.where((anchors == BEFORE_PASS)[:, None, :, None], stored, taken)
