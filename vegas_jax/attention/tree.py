"""Tree attention: new tokens that are nodes of a draft tree, each attending to a prefix of the cache and to its own
root-to-node path among the tree's scratch rows.

The tree of a sequence lives in scratch rows base, base + 1, ...: node j's K/V at row base + j (base = the root's
row, the sequence's committed length), while its RoPE position is base + its depth (the model rotates by the
positions it is given; this attention writes by rows). A node sees the prefix rows and the rows of its ancestors
and itself (`TreeShape.ancestors`), so its output is the one plain decoding of its path computes.

The interface any attention family's tree verification plugs into is this one: new tokens, their positions by depth
(the model's `positions`), the rows they are written to and the ancestor mask over the tree's rows. Verification
sees the whole prefix (rows < base) and may collect selection scores; a draft pass sees a KV selection of it
(`selected`) plus its recent rows [recent_start, base). Verification runs the tree kernel
(pallas_kernels.tree_attention) where the placement uses kernels and the scores asked for are logits of the
boundary or all rows (weights and per-row scores, and draft passes, are jnp, as are the linear verifier's
ablations); jnp elsewhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.kv_cache import write_layer_rows
from pallas_kernels.tree_attention import tree_attention
from vegas_jax.attention.core import masked_attention
from vegas_jax.attention.sparse_draft import selected_mask
from vegas_jax.attention.verify import ScoreRequest, row_scores
from vegas_jax.sharding import Placement


def path_positions(base: jax.Array, width: int, accepted: jax.Array, ok: jax.Array, capacity: int) -> jax.Array:
    """[B, width]: where the accepted path's nodes go when committed, base + depth for depths up to accepted [B]
    in sequences where ok [B], else capacity (dropped)."""
    depth = jnp.arange(width)[None, :]
    return jnp.where((depth <= accepted[:, None]) & ok[:, None], base[:, None] + depth, capacity)


def copy_path_rows(layer: jax.Array, base: jax.Array, path: jax.Array, accepted: jax.Array,
                   ok: jax.Array) -> jax.Array:
    """One layer's cache array [B, T, ...] with the rows of path [B, D+1] (node indices, root first; node j in
    row base + j) copied to base + depth for depths up to accepted [B], in sequences where ok [B]: the rows plain
    decoding of the path would hold."""
    capacity = layer.shape[1]
    source = jnp.minimum(base[:, None] + path, capacity - 1)
    target = path_positions(base, path.shape[1], accepted, ok, capacity)
    rows = jnp.arange(path.shape[0])[:, None]
    return layer.at[rows, target].set(layer[rows, source], mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftPrefix:
    """The part of the cache before the tree that a draft pass reads: a KV selection (vegas_jax.decode.selection.Selection's
    arrays) and the recent rows from recent_start."""

    indices: jax.Array  # [layers, B, K_max]
    counts: jax.Array  # [layers, B]
    recent_start: jax.Array  # [B]
    # The most recent rows there can be (base - recent_start: the policy's Policy.recent_span), so that a draft
    # pass gathers its rows instead of reading the whole cache; None: unbounded (a mask over every row).
    recent_span: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def visible(self, layer: int, base: jax.Array, capacity: int) -> jax.Array:
        t = jnp.arange(capacity)[None, :]
        recent = (t >= self.recent_start[:, None]) & (t < base[:, None])
        return selected_mask(self.indices[layer], self.counts[layer], capacity) | recent

    def rows(self, layer: int, base: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(rows [B, K_max + recent_span], valid [B, same]): the selected rows, then the recent rows before base."""
        k_max = self.indices.shape[-1]
        selected = jnp.arange(k_max)[None, :] < self.counts[layer][:, None]
        recent = self.recent_start[:, None] + jnp.arange(self.recent_span)[None, :]
        return (jnp.concatenate([self.indices[layer], recent], axis=1),
                jnp.concatenate([selected, recent < base[:, None]], axis=1))


def score_weights(rows: str, num_queries: int, deepest: tuple[int, ...]) -> np.ndarray:
    """[S] each new token's weight in the 'boundary' (root 1/2, the deepest nodes 1/2 between them) or 'all' (the
    mean) scores: the tree kernel's score_weights for TreeAttention's row means."""
    if rows == "all":
        return np.full(num_queries, 1.0 / num_queries, np.float32)
    weights = np.zeros(num_queries, np.float32)
    weights[list(deepest)] = 0.5 / len(deepest)
    weights[0] += 0.5
    return weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeAttention:
    """aux per layer, when `request` asks for scores: float32 [B, T] ('boundary': the mean of the root's row and the
    deepest nodes' rows, which for a chain are rows 0 and γ as in linear verification; 'all': every row's mean) or
    [B, S, T] ('each'), -inf past the root's row, averaged over this shard's heads."""

    rows: jax.Array  # [B, S] int32 cache rows of the new tokens (base + their node indices)
    base: jax.Array  # [B] int32 the root's row
    ancestors: jax.Array  # [S, R] bool: new token s sees tree row base + r
    prefix: DraftPrefix | None = None  # None: every row before base (verification)
    request: ScoreRequest | None = dataclasses.field(default=None, metadata=dict(static=True))
    num_layers: int = dataclasses.field(default=0, metadata=dict(static=True))
    deepest: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # rows of the deepest nodes
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))

    def mask(self, layer: int, capacity: int) -> jax.Array:
        """[B, S, T] what each new token attends to."""
        t = jnp.arange(capacity)[None, :]
        if self.prefix is None:
            before = t < self.base[:, None]
        else:
            before = self.prefix.visible(layer, self.base, capacity)
        offset = t - self.base[:, None]  # [B, T]: the tree row each cache row would be
        width = self.ancestors.shape[1]
        in_tree = (offset >= 0) & (offset < width)
        on_path = jnp.take(self.ancestors, jnp.clip(offset, 0, width - 1), axis=1)  # [S, B, T]
        return before[:, None, :] | (in_tree[:, None, :] & jnp.moveaxis(on_path, 0, 1))

    @property
    def layer_specific(self) -> bool:
        """Only the last layer collects scores: the layers differ, so the decoder runs them unrolled."""
        return self.request is not None and self.request.last_layer_only

    def collects(self, layer: int) -> bool:
        if self.request is None:
            return False
        return not self.request.last_layer_only or layer == self.num_layers - 1

    def _kernel_serves(self, layer: int) -> bool:
        """Verification passes whose scores, if any, are logits of the boundary or all rows: the kernel's weighted
        row sums (score_weights)."""
        if self.prefix is not None or not self.placement.uses_kernels:
            return False
        return not self.collects(layer) or (self.request.mode == "logit" and self.request.rows != "each")

    def _gathered_draft(self, layer, q, k_cache, v_cache):
        """A draft pass over the rows it may see, gathered: the prefix's selection and recent rows, then the tree's
        rows under the ancestor mask; the work of the selection's size, not of the cache's (`mask`'s rows)."""
        prefix_rows, prefix_valid = self.prefix.rows(layer, self.base)
        width = self.ancestors.shape[1]
        rows = jnp.concatenate([prefix_rows, self.base[:, None] + jnp.arange(width)[None, :]], axis=1)  # [B, N]
        mask = jnp.concatenate([jnp.broadcast_to(prefix_valid[:, None, :], (*self.rows.shape, prefix_rows.shape[1])),
                                jnp.broadcast_to(self.ancestors[None], (self.rows.shape[0], *self.ancestors.shape))],
                               axis=2)  # [B, S, N]
        gather = lambda cache: jnp.take_along_axis(cache[layer], rows[:, :, None, None], axis=1, mode="clip")
        return masked_attention(q, gather(k_cache), gather(v_cache), mask)

    def __call__(self, layer, new, positions, k_cache, v_cache):
        q, k, v = new.rotated()
        k_cache = write_layer_rows(k_cache, layer, k, self.rows)
        v_cache = write_layer_rows(v_cache, layer, v, self.rows)
        if self._kernel_serves(layer):
            weights = None
            if self.collects(layer):
                weights = jnp.asarray(score_weights(self.request.rows, self.ancestors.shape[0], self.deepest))
            out, scores = tree_attention(q, k_cache, v_cache, self.base, self.ancestors, layer=layer,
                                         score_weights=weights, interpret=self.placement.interpret)
            return out, k_cache, v_cache, scores
        if self.prefix is not None and self.prefix.recent_span is not None:
            return self._gathered_draft(layer, q, k_cache, v_cache), k_cache, v_cache, None
        capacity = k_cache.shape[2]
        mask = self.mask(layer, capacity)
        if not self.collects(layer):
            return masked_attention(q, k_cache[layer], v_cache[layer], mask), k_cache, v_cache, None
        out, raw, lse = masked_attention(q, k_cache[layer], v_cache[layer], mask, return_logits=True)
        per_row = row_scores(self.request.mode, raw, lse, mask, q.shape[-1])  # [B, S, T]
        if self.request.rows == "boundary":
            scores = 0.5 * (per_row[:, 0] + jnp.mean(per_row[:, list(self.deepest)], axis=1))
        elif self.request.rows == "all":
            scores = jnp.mean(per_row, axis=1)
        else:
            scores = per_row
        candidate = jnp.arange(capacity)[None, :] <= self.base[:, None]  # [B, T]
        if scores.ndim == 3:
            candidate = candidate[:, None, :]
        return out, k_cache, v_cache, jnp.where(candidate, scores, -jnp.inf)
