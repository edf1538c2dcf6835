"""NSA's selection rules (models.config.NSALayout), shared by the jnp attention and the kernels: which compressed
blocks a query sees, how compressed scores become selection-block scores, and the top-n rule with its forced
blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import NSALayout

NO_BLOCK = -1  # padding of a selection that has fewer than top_n candidate blocks


def num_select_blocks(layout: NSALayout, capacity: int) -> int:
    return -(-capacity // layout.select_block)


def compressed_visible(positions: jax.Array, num_compressed: int, layout: NSALayout) -> jax.Array:
    """[..., C] bool: compressed block i is complete at each position of positions [...]."""
    last_row = jnp.arange(num_compressed) * layout.compress_stride + layout.compress_block - 1
    return last_row <= positions[..., None]


def overlap_weights(layout: NSALayout) -> tuple[int, ...]:
    """w[m]: how many (stride chunk of a compressed block, stride chunk of a selection block) pairs meet at offset
    m, for m < l/d + l'/d - 1: selection block j's score is the sum over m of w[m] * compressed score
    [j l'/d + m - (l/d - 1)] (NSA Eq. 9; XunhaoLai's transform_score)."""
    a, r = layout.compress_block // layout.compress_stride, layout.select_block // layout.compress_stride
    return tuple(sum(1 for u in range(a) for v in range(r) if u + v == m) for m in range(a + r - 1))


def selection_scores(compressed: jax.Array, num_blocks: int, layout: NSALayout) -> jax.Array:
    """Selection-block scores [..., num_blocks] from compressed-block scores [..., C]."""
    a = layout.compress_block // layout.compress_stride
    r = layout.select_block // layout.compress_stride
    weights = overlap_weights(layout)
    if a == r == 1:
        c = compressed.shape[-1]
        return jnp.pad(compressed, [(0, 0)] * (compressed.ndim - 1) + [(0, max(num_blocks - c, 0))])[..., :num_blocks]
    need = num_blocks * r + len(weights)
    pad_right = max(need - (a - 1) - compressed.shape[-1], 0)
    padded = jnp.pad(compressed, [(0, 0)] * (compressed.ndim - 1) + [(a - 1, pad_right)])
    return sum(w * padded[..., m:m + num_blocks * r:r] for m, w in enumerate(weights))


def select_blocks(scores: jax.Array, positions: jax.Array, layout: NSALayout, top_k=jax.lax.top_k) -> jax.Array:
    """[..., top_n] int32 selection blocks of each query from its block scores [..., NS] (positions [...] its
    position): the forced blocks, then the best-scored ones, none after the query's own block; NO_BLOCK pads.
    Ties go to the lower block. top_k(ranked, k) -> (values, indices) with lax.top_k's contract: lax.top_k, or
    the kernels' pallas_kernels.top_n."""
    block = jnp.arange(scores.shape[-1])
    own = (positions // layout.select_block)[..., None]
    forced = (block < layout.forced_initial) | ((block <= own) & (block > own - layout.forced_local))
    ranked = jnp.where(forced, jnp.inf, scores.astype(jnp.float32))
    ranked = jnp.where(block <= own, ranked, -jnp.inf)
    top = min(layout.top_n, scores.shape[-1])
    best, index = top_k(ranked, top)
    index = jnp.where(best > -jnp.inf, index, NO_BLOCK).astype(jnp.int32)
    if top < layout.top_n:
        index = jnp.pad(index, [(0, 0)] * (index.ndim - 1) + [(0, layout.top_n - top)], constant_values=NO_BLOCK)
    return index
