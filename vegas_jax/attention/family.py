"""Attention families: the static value that says, for a model's attention kind (models.config), what its cache
is, which attention its full passes (prefill, plain decoding, verification) run, and how a draft tree is drafted
by the model itself, verified, and its accepted path committed. Dense is one family, NSA (the "nsa" and "nsa-view"
kinds) the other; sparse chain drafts and their selection policies exist for the dense family only.

Committing a tree's accepted path (node j's K/V in scratch row base + j; vegas_jax.attention.tree) copies its rows
to base + depth, as plain decoding of its tokens would have written them; NSA then pools the compressed rows of
the blocks those rows complete (models.nsa_cache.pool_blocks), so its cache equals plain decoding's too.

The NSA family carries the approximate mode whose modified target it runs (vegas_jax.ssv.precision.ApproxMode; the
exact target by default): its cache adds the stored span selections, its full passes are the modified target's
(vegas_jax.attention.nsa_approx), its tree verification verifies that target, and committing a path also stores
the selections of the anchors on it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.config import NSA_VIEW_LAYOUT, ModelConfig, NSALayout
from models.kv_cache import KVCache
from models.nsa_cache import NSACache, NSALayerCache, pool_blocks
from vegas_jax.attention.nsa import NSAAttention
from vegas_jax.attention.nsa_approx import ApproxNSACache, modified_target, record_spans
from vegas_jax.attention.nsa_tree import NSATreeVerify, SinkWindowDraft
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode
from vegas_jax.attention.tree import DraftPrefix, TreeAttention, copy_path_rows, path_positions
from vegas_jax.attention.verify import ScoreRequest, VerifyAttention
from vegas_jax.inputs import InputError
from vegas_jax.sharding import Placement


@dataclasses.dataclass(frozen=True)
class DenseFamily:
    def create_cache(self, config: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
        return KVCache.create(config, batch, capacity, dtype)

    def full_attention(self, config: ModelConfig, placement: Placement, request: ScoreRequest | None = None,
                       active=None, last_draft=None) -> VerifyAttention:
        return VerifyAttention(request, config.num_layers, placement, active, last_draft)

    def tree_verify_attention(self, config: ModelConfig, placement: Placement, tree, base,
                              request: ScoreRequest | None = None) -> TreeAttention:
        """The verification pass over every node of `tree` (vegas_jax.decode.tree_shapes.TreeShape), roots at rows base [B]."""
        rows = base[:, None] + jnp.arange(tree.rows)[None, :]
        return TreeAttention(rows, base, jnp.asarray(tree.ancestors), None, request, config.num_layers,
                             tuple(tree.levels[-1]), placement)

    def tree_draft_attention(self, config: ModelConfig, rows, base, ancestors,
                             prefix: DraftPrefix | None) -> TreeAttention:
        """The self drafter's pass over one level's nodes (rows [B, S], ancestors [S, R]): sparse attention over
        the KV selection `prefix` and the recent rows (vegas_jax.decode.drafters)."""
        if prefix is None:
            raise ValueError("the dense self drafter drafts with a selection policy's KV selection")
        return TreeAttention(rows, base, ancestors, prefix)

    def commit_path(self, config: ModelConfig, cache: KVCache, base, path, accepted, ok, aux=None) -> KVCache:
        """The cache with path [B, D+1] (node indices, root first) committed up to depth accepted [B] where ok [B]
        (the module docstring); aux: the verification pass's per-layer aux (unused here)."""
        move = functools.partial(copy_every_layer, base=base, path=path, accepted=accepted, ok=ok)
        return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v))


@dataclasses.dataclass(frozen=True)
class NSAFamily:
    mode: ApproxMode = EXACT_MODE

    def create_cache(self, config: ModelConfig, batch: int, capacity: int, dtype) -> NSACache | ApproxNSACache:
        if self.mode.is_exact:
            return NSACache.create(config, batch, capacity, dtype)
        return ApproxNSACache.create(config, self.mode, batch, capacity, dtype)

    def full_attention(self, config: ModelConfig, placement: Placement, request: ScoreRequest | None = None,
                       active=None, last_draft=None):
        if request is not None:
            raise ValueError("NSA models verify without selection scores (no dense draft policy serves them)")
        if self.mode.is_exact:
            return NSAAttention(config.nsa, config.attention, placement)
        return modified_target(config, self.mode, placement)

    def tree_verify_attention(self, config: ModelConfig, placement: Placement, tree, base,
                              request: ScoreRequest | None = None) -> NSATreeVerify:
        """Exact NSA verification of every node of `tree` (vegas_jax.attention.nsa_tree)."""
        if request is not None:
            raise ValueError("NSA models verify without selection scores (no dense draft policy serves them)")
        return NSATreeVerify(base, tree.parents, config.nsa, config.attention, placement,
                             mode=None if self.mode.is_exact else self.mode)

    def tree_draft_attention(self, config: ModelConfig, rows, base, ancestors,
                             prefix: DraftPrefix | None) -> SinkWindowDraft:
        """The self drafter of an NSA model: the sink block (the first selection block) and NSA's window before
        the tree, plus the node's path, in one softmax (vegas_jax.attention.nsa_tree.SinkWindowDraft)."""
        if prefix is not None:
            raise ValueError("an NSA model's self drafter reads no KV selection")
        return SinkWindowDraft(rows, base, ancestors, config.nsa.select_block, config.nsa.window)

    def commit_path(self, config: ModelConfig, cache, base, path, accepted, ok, aux=None):
        """DenseFamily.commit_path, then the compressed rows of the blocks the committed rows complete; with an
        approximate mode also the selections of the path's anchor nodes (aux: each layer's node selections
        [B, R, H_kv, n'], NSATreeVerify's) stored at their spans."""
        nsa = cache if self.mode.is_exact else cache.nsa
        move = functools.partial(copy_every_layer, base=base, path=path, accepted=accepted, ok=ok)
        moved = NSALayerCache(move(nsa.k), move(nsa.v), nsa.k_cmp, nsa.v_cmp)  # every layer's arrays, stacked
        positions = path_positions(base, path.shape[1], accepted, ok, nsa.capacity)
        pooled = jax.vmap(lambda layer: pool_blocks(layer, positions, config.nsa))(moved)
        pooled = NSACache(pooled.k, pooled.v, pooled.k_cmp, pooled.v_cmp)
        if self.mode.is_exact:
            return pooled
        rows = jnp.arange(path.shape[0])[:, None]
        spans = cache.spans
        for layer, blocks in enumerate(aux):  # only refresh layers select, so only theirs are recorded
            if self.mode.refreshes(layer):
                spans = record_spans(spans, blocks[rows, path], positions, self.mode.share_span, layer)
        return ApproxNSACache(pooled, spans)


def copy_every_layer(stacked: jax.Array, *, base, path, accepted, ok) -> jax.Array:
    """copy_path_rows on every layer of a stacked cache array [L, B, T, ...], as one scatter."""
    return jax.vmap(copy_path_rows, in_axes=(0, None, None, None, None))(stacked, base, path, accepted, ok)


def family_of(config: ModelConfig, mode: ApproxMode = EXACT_MODE) -> DenseFamily | NSAFamily:
    """The family of config's attention kind; an NSA model's runs `mode`'s modified target (exact: the model)."""
    if config.attention == "dense":
        if not mode.is_exact:
            raise ValueError("approximate modes are modes of NSA models")
        return DenseFamily()
    return NSAFamily(mode)


ATTENTION_CHOICES = ("dense", "nsa-view")  # what --attention may ask of a model (an NSA checkpoint runs as NSA)


def with_attention(config: ModelConfig, attention: str | None, layout: NSALayout = NSA_VIEW_LAYOUT) -> ModelConfig:
    """`config` attending as `attention` asks (None: as it is): "nsa-view" turns a dense model into its
    training-free NSA view with `layout`; "dense" keeps a dense model. InputError naming attention otherwise."""
    if attention is None or attention == config.attention:
        return config
    if attention not in ATTENTION_CHOICES:
        raise InputError("{attention} must be one of {}, got {!r}", ", ".join(ATTENTION_CHOICES), attention)
    if config.attention != "dense":
        raise InputError("{attention} {}: the model is an {} checkpoint and runs only as one", attention,
                         config.attention)
    return dataclasses.replace(config, attention="nsa-view", nsa=layout)
