"""KV selection policies: which cached positions each layer's draft attention reads.

Every policy is a static (hashable) value with pure methods; whatever it remembers between iterations lives in
an explicit state pytree carried by the decode loop. All policies share one budget rule and one output form
(`Selection`), so comparisons between them are fair:

- vegas      top positions by verification scores of rows 0 and γ (the paper's Collect-2-Query)
- vegas-all  same from all γ+1 verification rows (ablation: what two rows lose)
- last       same from the last accepted token's row only (ablation)
- streaming  MagicDec-Stream: 16 sink tokens plus the most recent window
- quest      MagicDec-Quest: pages of 16 scored at every draft step by the step's query against per-page key
             min/max bounds; top pages plus the trailing partial page
- retrieval  SpecExtend-style: every n iterations, the last layer's attention of the last accepted token ranks
             32-token chunks; top chunks, new tokens always included
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.logical_axes import BATCH, KV_HEADS, axes_field
from pallas_kernels import select_topk
from vegas_jax.attention.sparse_draft import SparseDraftAttention, sparse_attend
from vegas_jax.attention.verify import ScoreRequest
from vegas_jax.sharding import Placement

POLICIES = ("vegas", "vegas-all", "last", "streaming", "quest", "retrieval")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Per layer, selected positions (all < recent_start) and how many are valid; positions from recent_start on
    are attended too."""

    indices: jax.Array = axes_field(None, BATCH, None)  # [layers, B, K_max] int32
    counts: jax.Array = axes_field(None, BATCH)  # [layers, B] int32
    recent_start: jax.Array = axes_field(BATCH)  # [B] int32


@dataclasses.dataclass(frozen=True)
class Budget:
    ratio: float = 0.07
    min_tokens: int = 256
    k_max: int = 256  # static bound on any budget: ceil(ratio * max_model_len), at least min_tokens

    @classmethod
    def for_length(cls, ratio: float, min_tokens: int, max_model_len: int) -> "Budget":
        k_max = min(max(min_tokens, math.ceil(ratio * max_model_len)), max_model_len)
        return cls(ratio, min_tokens, k_max)

    def tokens(self, length: jax.Array, candidates: jax.Array) -> jax.Array:
        """Budget for a sequence of `length` tokens: ratio of the current length, at least min_tokens, never more
        than the candidates there are."""
        k = jnp.ceil(self.ratio * length.astype(jnp.float32)).astype(jnp.int32)
        return jnp.minimum(jnp.clip(k, self.min_tokens, self.k_max), candidates)


def top_k_indices(scores: jax.Array, k: jax.Array, k_max: int, placement: Placement = Placement()):
    """Per row, the positions of the k[r] largest finite scores: (indices [R, k_max], counts [R]).

    On GPU `lax.top_k` with k >= 256 is a full sort; the kernel finds the k-th value by radix counting instead."""
    if placement.uses_kernels:
        return select_topk(scores, k, k_max=k_max, interpret=placement.interpret)
    k_max = min(k_max, scores.shape[-1])
    values, indices = jax.lax.top_k(scores, k_max)
    counts = jnp.minimum(k, jnp.sum(jnp.isfinite(values), axis=-1)).astype(jnp.int32)
    return indices.astype(jnp.int32), counts


@dataclasses.dataclass(frozen=True)
class SelectContext:
    """What a policy may look at when it selects after a verification (on a mesh: this program's rows and KV
    heads, with scores already averaged over every head)."""

    scores: tuple  # per layer: [B, T] or [B, S, T] float32 (-inf at non-candidates), or None
    committed: jax.Array  # [B] tokens with verified KV after acceptance (L')
    candidates_end: jax.Array  # [B] the verified candidates are positions [0, candidates_end)
    accepted: jax.Array  # [B] drafts accepted this iteration (the last accepted token is row `accepted`)
    cache: Any  # KVCache after verification
    first: bool  # the bootstrap selection right after prefill


class Policy:
    """What every policy provides: the scores it needs from verification, its state, its selection after each
    verification, and the draft attention that reads the selection."""

    name: str
    budget: Budget
    placement: Placement

    def score_request(self, mode: str) -> ScoreRequest | None:
        raise NotImplementedError

    def init_state(self, config, batch: int, capacity: int, dtype) -> Any:
        """Whatever the policy carries between iterations: a pytree of dataclasses whose arrays declare their
        logical axes (models.logical_axes), so the loop can shard it and admit requests into it."""
        return ()

    def empty_selection(self, num_layers: int, batch: int) -> Selection:
        return Selection(
            indices=jnp.zeros((num_layers, batch, self.budget.k_max), jnp.int32),
            counts=jnp.zeros((num_layers, batch), jnp.int32),
            recent_start=jnp.zeros((batch,), jnp.int32),
        )

    def select(self, ctx: SelectContext, selection: Selection, state) -> tuple[Selection, Any]:
        raise NotImplementedError

    def recent_span(self, gamma: int) -> int | None:
        """The most rows a selection's recent range [recent_start, committed) can hold when a draft reads it after
        a verification of `gamma` drafts; None: no bound this policy states (a tree's draft passes then mask the
        whole cache, vegas_jax.attention.tree.DraftPrefix)."""
        return None

    def draft_attention(self, selection: Selection, state):
        return SparseDraftAttention(selection.indices, selection.counts, selection.recent_start, self.placement)


def _row_of(scores: jax.Array, accepted: jax.Array) -> jax.Array:
    """[B, S, T] -> [B, T]: the row of the last accepted token."""
    return jnp.take_along_axis(scores, accepted[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class ScoredTokens(Policy):
    """Top positions per layer by verification scores of `rows` ('boundary' = Vegas, 'all', or 'last')."""

    name: str
    budget: Budget
    placement: Placement
    rows: str

    def score_request(self, mode):
        return ScoreRequest(mode=mode, rows={"last": "each"}.get(self.rows, self.rows))

    def recent_span(self, gamma):
        return gamma  # the candidates end at the verified root's row + 1: the recent rows are the accepted drafts

    def select(self, ctx, selection, state):
        k = self.budget.tokens(ctx.committed, ctx.candidates_end)
        scores = jnp.stack([s if s.ndim == 2 else _row_of(s, ctx.accepted) for s in ctx.scores])  # [layers, B, T]
        num_layers, batch, capacity = scores.shape
        # One selection call for every (layer, sequence) row.
        indices, counts = top_k_indices(
            scores.reshape(num_layers * batch, capacity), jnp.tile(k, num_layers), self.budget.k_max, self.placement
        )
        indices = _pad_k(indices, self.budget.k_max).reshape(num_layers, batch, -1)
        return Selection(indices, counts.reshape(num_layers, batch), ctx.candidates_end), state


def _pad_k(indices: jax.Array, k_max: int) -> jax.Array:
    """Index lists are k_max wide even when the cache holds fewer positions."""
    return jnp.pad(indices, [(0, 0)] * (indices.ndim - 1) + [(0, k_max - indices.shape[-1])])


@dataclasses.dataclass(frozen=True)
class Streaming(Policy):
    """Sink tokens plus the most recent window; the window is the recent range, which grows while drafting."""

    name: str
    budget: Budget
    placement: Placement
    sinks: int = 16

    def score_request(self, mode):
        return None

    def recent_span(self, gamma):
        return self.budget.k_max  # the window: the budget less the sinks

    def select(self, ctx, selection, state):
        num_layers, batch = selection.counts.shape
        k = self.budget.tokens(ctx.committed, ctx.committed)
        sinks = jnp.minimum(self.sinks, k)
        window_start = jnp.maximum(ctx.committed - (k - sinks), sinks)
        # Sinks beyond the largest budget could never be kept (k <= k_max).
        first = jnp.arange(min(self.sinks, self.budget.k_max), dtype=jnp.int32)
        indices = jnp.broadcast_to(_pad_k(first, self.budget.k_max), selection.indices.shape)
        counts = jnp.broadcast_to(jnp.minimum(sinks, window_start), (num_layers, batch))
        return Selection(indices, counts.astype(jnp.int32), window_start.astype(jnp.int32)), state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetrievalState:
    since_refresh: jax.Array = axes_field(BATCH)  # [B] int32: the request's iterations since its last refresh


@dataclasses.dataclass(frozen=True)
class Retrieval(Policy):
    """Chunks ranked by the last layer's attention weights of the last accepted token, refreshed every
    `every` iterations of each request (counted per request, so a request admitted into a running batch keeps its
    own rhythm); between refreshes the old chunks stay and everything newer is the recent range."""

    name: str
    budget: Budget
    placement: Placement
    chunk: int = 32
    every: int = 4

    def score_request(self, mode):
        # Attention weights of one row, as SpecExtend computes them, whatever the score mode.
        return ScoreRequest(mode="weight", rows="each", last_layer_only=True)

    def init_state(self, config, batch, capacity, dtype):
        return RetrievalState(jnp.zeros((batch,), jnp.int32))

    def select(self, ctx, selection, state):
        since_refresh = state.since_refresh
        refresh = jnp.logical_or(ctx.first, since_refresh + 1 >= self.every)  # [B]
        scores = _row_of(ctx.scores[-1], ctx.accepted)  # [B, T]
        batch, capacity = scores.shape
        num_chunks = capacity // self.chunk
        complete = ctx.candidates_end // self.chunk  # chunks entirely inside the candidates
        weights = jnp.where(jnp.isfinite(scores), scores, 0.0)[:, : num_chunks * self.chunk]
        chunk_scores = weights.reshape(batch, num_chunks, self.chunk).mean(-1)
        chunk_scores = jnp.where(jnp.arange(num_chunks)[None] < complete[:, None], chunk_scores, -jnp.inf)
        k_chunks = self.budget.tokens(ctx.committed, complete * self.chunk) // self.chunk
        max_chunks = self.budget.k_max // self.chunk
        chunks, chunk_counts = top_k_indices(chunk_scores, k_chunks, max_chunks)
        tokens = (chunks[:, :, None] * self.chunk + jnp.arange(self.chunk)).reshape(batch, -1)
        num_layers = selection.counts.shape[0]
        fresh = Selection(
            indices=jnp.broadcast_to(_pad_k(tokens, self.budget.k_max), selection.indices.shape),
            counts=jnp.broadcast_to(chunk_counts * self.chunk, (num_layers, batch)),
            recent_start=(complete * self.chunk).astype(jnp.int32),
        )
        new = Selection(
            indices=jnp.where(refresh[None, :, None], fresh.indices, selection.indices),
            counts=jnp.where(refresh[None, :], fresh.counts, selection.counts),
            recent_start=jnp.where(refresh, fresh.recent_start, selection.recent_start),
        )
        return new, RetrievalState(jnp.where(refresh, 0, since_refresh + 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuestState:
    # [layers, B, pages, H_kv, D] element-wise min (max) of the keys of each complete page
    page_min: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    page_max: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)
    complete_pages: jax.Array = axes_field(BATCH)  # [B] pages entirely inside the verified KV


@dataclasses.dataclass(frozen=True)
class Quest(Policy):
    name: str
    budget: Budget
    placement: Placement
    gamma: int
    page: int = 16

    def score_request(self, mode):
        return None

    def init_state(self, config, batch, capacity, dtype):
        shape = (config.num_layers, batch, capacity // self.page, config.num_kv_heads, config.head_dim)
        return QuestState(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    def _page_bounds(self, keys: jax.Array, first_page: jax.Array, num_pages: int):
        """min/max of num_pages pages of one layer's keys [B, T, H, D] starting at first_page [B]."""

        def one(k, p):
            rows = jax.lax.dynamic_slice_in_dim(k, p * self.page, num_pages * self.page, axis=0)
            rows = rows.reshape((num_pages, self.page) + k.shape[1:])
            return rows.min(axis=1), rows.max(axis=1)

        return jax.vmap(one)(keys, first_page)

    def select(self, ctx, selection, state):
        pages = ctx.cache.capacity // self.page
        complete = ctx.committed // self.page
        if ctx.first:
            start, span = jnp.zeros_like(complete), pages
        else:
            # Only pages completed since the last iteration change: at most this many.
            span = min(pages, 2 + self.gamma // self.page)
            start = jnp.minimum(state.complete_pages, pages - span)
        # Every layer at once over the stacked cache [L, B, T, H, D]: one program whatever the depth.
        lo, hi = jax.vmap(self._page_bounds, in_axes=(0, None, None))(ctx.cache.k, start, span)
        if not ctx.first:
            update = jax.vmap(jax.vmap(lambda old, new, s: jax.lax.dynamic_update_slice_in_dim(old, new, s, axis=0)),
                              in_axes=(0, 0, None))
            lo, hi = update(state.page_min, lo, start), update(state.page_max, hi, start)
        recent_start = (complete * self.page).astype(jnp.int32)
        new_state = QuestState(lo, hi, complete.astype(jnp.int32))
        return dataclasses.replace(selection, recent_start=recent_start), new_state

    def draft_attention(self, selection, state):
        return QuestDraftAttention(
            state.page_min, state.page_max, state.complete_pages, selection.recent_start,
            page=self.page, budget=self.budget, placement=self.placement,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuestDraftAttention:
    """At every draft step and layer, scores complete pages by Quest's upper bound sum_d max(q_d min_d, q_d max_d)
    (mean over query heads: one token set per layer, as every policy here; on a mesh each shard bounds with its
    own heads and the means are combined), attends to the top pages plus the trailing partial page and everything
    newer."""

    page_min: jax.Array
    page_max: jax.Array
    complete_pages: jax.Array
    recent_start: jax.Array
    page: int = dataclasses.field(metadata=dict(static=True))
    budget: Budget = dataclasses.field(metadata=dict(static=True))
    placement: Placement = dataclasses.field(metadata=dict(static=True))

    def __call__(self, layer, new, positions, k_cache, v_cache):
        q, _, _ = new.rotated()
        b, _, n, h = q.shape
        lo, hi = self.page_min[layer], self.page_max[layer]  # [B, P, K, D]
        qg = q[:, 0].reshape(b, lo.shape[2], n // lo.shape[2], h).astype(jnp.float32)  # [B, K, G, D]
        bound = jnp.maximum(
            jnp.einsum("BKGD,BPKD->BPKGD", qg, lo.astype(jnp.float32)),
            jnp.einsum("BKGD,BPKD->BPKGD", qg, hi.astype(jnp.float32)),
        ).sum(-1).mean(axis=(2, 3))  # [B, P]
        bound = self.placement.mean_over_model(bound)
        num_pages = bound.shape[1]
        bound = jnp.where(jnp.arange(num_pages)[None] < self.complete_pages[:, None], bound, -jnp.inf)
        committed = self.recent_start  # complete pages end where the recent range starts
        k_pages = self.budget.tokens(positions[:, 0], committed) // self.page
        pages, page_counts = top_k_indices(bound, k_pages, max(1, self.budget.k_max // self.page))
        indices = (pages[:, :, None] * self.page + jnp.arange(self.page)).reshape(b, -1)
        out, k_cache, v_cache = sparse_attend(
            new, k_cache, v_cache, layer, indices, page_counts * self.page, self.recent_start, positions,
            self.placement,
        )
        return out, k_cache, v_cache, None


def make_policy(name: str, budget: Budget, gamma: int, placement: Placement = Placement(), **knobs) -> Policy:
    """The policy `name`; `knobs` set its own fields (streaming: sinks; quest: page; retrieval: chunk, every)."""
    if name == "vegas":
        policy = ScoredTokens(name, budget, placement, "boundary")
    elif name == "vegas-all":
        policy = ScoredTokens(name, budget, placement, "all")
    elif name == "last":
        policy = ScoredTokens(name, budget, placement, "last")
    elif name == "streaming":
        policy = Streaming(name, budget, placement)
    elif name == "quest":
        policy = Quest(name, budget, placement, gamma)
    elif name == "retrieval":
        policy = Retrieval(name, budget, placement)
    else:
        raise ValueError(f"unknown selection policy {name!r}; choose from {', '.join(POLICIES)}")
    return dataclasses.replace(policy, **knobs)
