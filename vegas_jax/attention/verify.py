"""Verification attention: full causal attention for the γ+1 verified tokens that also collects, per layer, how
much each cached position mattered to chosen query rows. Those scores guide the next draft's KV selection."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.kv_cache import write_layer_rows
from pallas_kernels import MAX_QUERY_ROWS, verify_attention
from pallas_kernels.verify_attention import default_scored_row
from vegas_jax.attention.core import causal_mask, masked_attention
from vegas_jax.sharding import Placement

SCORE_MODES = ("logit", "weight")
# Which verification rows are scored: 'boundary' = rows 0 and γ (Vegas), 'all' = every row (mean),
# 'each' = every row kept apart ([B, γ+1, T]; the policy picks one after acceptance). With fewer drafts than the
# pass is wide (adaptive γ), γ is the last real draft's row (VerifyAttention.last_draft).
SCORE_ROWS = ("boundary", "all", "each")


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    mode: str  # 'logit': raw q.k; 'weight': softmax probability through the row's log-sum-exp
    rows: str = "boundary"
    last_layer_only: bool = False

    def __post_init__(self):
        if self.mode not in SCORE_MODES:
            raise ValueError(f"score mode must be one of {SCORE_MODES}, got {self.mode!r}")
        if self.rows not in SCORE_ROWS:
            raise ValueError(f"score rows must be one of {SCORE_ROWS}, got {self.rows!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyAttention:
    """Candidates for selection are the positions up to and including row 0's (the last committed token); later
    positions hold this pass's own drafts and are never selectable (they are attended as recent tokens anyway).
    aux per layer: scores float32 [B, T] ('each': [B, S, T]) with -inf at non-candidates, or None. On a mesh the
    scores are the mean over this shard's heads: Placement.mean_over_model makes them every head's."""

    request: ScoreRequest | None = dataclasses.field(default=None, metadata=dict(static=True))
    num_layers: int = dataclasses.field(default=0, metadata=dict(static=True))
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))
    # [B] bool or None (all). The kernel skips the keys of inactive sequences (finished ones, whose results the
    # loop discards): their outputs and scores are unspecified. The jnp path computes them anyway.
    active: jax.Array | None = None
    # [B] int32 or None (S - 1): the row of each sequence's last draft. Adaptive γ drafts g tokens into the
    # narrowest compiled pass that holds them; its rows after g hold placeholders whose queries must not steer
    # the selection.
    last_draft: jax.Array | None = None

    @property
    def layer_specific(self) -> bool:
        """Only the last layer collects scores: the layers differ, so the decoder runs them unrolled."""
        return self.request is not None and self.request.last_layer_only

    def collects(self, layer: int) -> bool:
        if self.request is None:
            return False
        return not self.request.last_layer_only or layer == self.num_layers - 1

    def scored_tokens_limit(self, group: int) -> int | None:
        """The most new tokens per sequence this attention can verify when each KV head has `group` query heads:
        where the kernel collects scores, all of a KV head's query rows must fit its one block. None: no limit."""
        if self.request is None or not self._kernel_serves(self.num_layers - 1):
            return None
        return MAX_QUERY_ROWS // group

    def _kernel_serves(self, layer: int) -> bool:
        """The kernel collects the Vegas rows (0 and γ); other row sets (ablations) take the jnp path."""
        if not self.placement.uses_kernels:
            return False
        return not self.collects(layer) or self.request.rows == "boundary"

    def __call__(self, layer, new, positions, k_cache, v_cache):
        q, k, v = new.rotated()
        k_cache = write_layer_rows(k_cache, layer, k, positions)
        v_cache = write_layer_rows(v_cache, layer, v, positions)
        if self._kernel_serves(layer):
            mode = self.request.mode if self.collects(layer) else None
            start = positions[:, 0]
            if self.active is not None:
                start = jnp.where(self.active, start, 0)  # reads only the first S rows
            out, scores = verify_attention(
                q, k_cache, v_cache, start, self.last_draft, layer=layer, score_mode=mode,
                interpret=self.placement.interpret)
            return out, k_cache, v_cache, scores
        capacity = k_cache.shape[2]
        mask = causal_mask(positions, capacity)
        # The layer's rows are read inside the attention's dots (k_cache[layer] fuses into them): no slice copy.
        if not self.collects(layer):
            return masked_attention(q, k_cache[layer], v_cache[layer], mask), k_cache, v_cache, None
        out, raw, lse = masked_attention(q, k_cache[layer], v_cache[layer], mask, return_logits=True)
        per_row = row_scores(self.request.mode, raw, lse, mask, q.shape[-1])
        num_rows = per_row.shape[1]
        last = default_scored_row(self.last_draft, per_row.shape[0], num_rows)
        if self.request.rows == "boundary":
            scores = 0.5 * (per_row[:, 0] + jnp.take_along_axis(per_row, last[:, None, None], axis=1)[:, 0])
        elif self.request.rows == "all":
            drafted = jnp.arange(num_rows)[None, :] <= last[:, None]  # [B, S]
            scores = jnp.sum(jnp.where(drafted[..., None], per_row, 0), axis=1) / (last[:, None] + 1)
        else:
            scores = per_row
        candidate = jnp.arange(capacity)[None, :] <= positions[:, :1]  # [B, T]
        if scores.ndim == 3:
            candidate = candidate[:, None, :]
        return out, k_cache, v_cache, jnp.where(candidate, scores, -jnp.inf)


def row_scores(mode: str, raw: jax.Array, lse: jax.Array, mask: jax.Array, head_dim: int) -> jax.Array:
    """[B, S, T] each query row's score of every cache position, the mean over all query heads: raw q.k ('logit')
    or the softmax probability ('weight'), from masked_attention's raw logits [B, K, G, S, T] and lse."""
    if mode == "logit":
        per_head = raw
    else:
        scaled = jnp.where(mask[:, None, None], raw * (head_dim**-0.5), -jnp.inf)
        per_head = jnp.exp(scaled - lse[..., None])
    return jnp.mean(per_head, axis=(1, 2))
