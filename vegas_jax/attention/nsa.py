"""NSA attention in plain jnp (any number of new tokens: prefill, decode, verification) over masks of the whole
cache, with the selection rules of models.nsa_selection, and the NSA family's attention object.

For a query at position t (a KV group's query heads share one selection):
- compressed branch: softmax over the compressed keys of the complete blocks, i*d + l - 1 <= t (none: zero);
- scores: those probabilities summed over the group's heads, spread onto selection blocks by overlap
  (selection_scores), the forced blocks first, blocks after t's own excluded, top_n kept (select_blocks);
- selected branch: softmax over the raw rows of the kept blocks up to t; window branch: over rows (t - w, t];
- "nsa": g_cmp o_cmp + g_slc o_slc + g_win o_win with the layer's sigmoid gates; "nsa-view": one softmax over
  the selected rows and the window together, no compressed branch and no gates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import NSALayout
from models.nsa_cache import NSALayerCache, write_tokens
from models.nsa_selection import compressed_visible, num_select_blocks, select_blocks, selection_scores
from pallas_kernels.nsa_decode import nsa_decode
from vegas_jax.sharding import Placement

def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    b, s, n, h = q.shape
    return q.reshape(b, s, num_kv_heads, n // num_kv_heads, h)


def _attend(qg, k, v, mask):
    """Softmax attention of grouped queries qg [B, S, K, G, D] over k, v [B, T, K, D] where mask (broadcast to
    [B, K, G, S, T]) holds, float32 [B, S, K, G, D]; a row with no visible key gives zero."""
    logits = jnp.einsum("BSKGD,BTKD->BKGST", qg, k, preferred_element_type=jnp.float32) * qg.shape[-1] ** -0.5
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("BKGST,BTKD->BSKGD", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def compressed_probabilities(qg, k_cmp, positions, layout: NSALayout):
    """(softmax probabilities [B, K, G, S, C] over each query's complete compressed blocks, visible [B, S, C])."""
    visible = compressed_visible(positions, k_cmp.shape[1], layout)
    logits = jnp.einsum("BSKGD,BCKD->BKGSC", qg, k_cmp, preferred_element_type=jnp.float32) * qg.shape[-1] ** -0.5
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0), visible


def selected_row_mask(indices: jax.Array, positions: jax.Array, capacity: int, layout: NSALayout) -> jax.Array:
    """[B, K, S, T]: row t lies in one of the query's selected blocks indices [B, K, S, n] and t <= its position.
    Marked per block, then widened to rows: no [.., T, n] comparison."""
    num_blocks = num_select_blocks(layout, capacity)
    marked = jnp.zeros(indices.shape[:-1] + (num_blocks + 1,), bool)
    lead = jnp.indices(indices.shape[:-1], sparse=True)
    marked = marked.at[(*(i[..., None] for i in lead), jnp.where(indices >= 0, indices, num_blocks))].set(True)
    rows = jnp.repeat(marked[..., :num_blocks], layout.select_block, axis=-1)[..., :capacity]
    return rows & (jnp.arange(capacity) <= positions[:, None, :, None])


def window_mask(positions: jax.Array, capacity: int, window: int) -> jax.Array:
    """[B, S, T]: row t is among the `window` rows ending at the query's position."""
    t = jnp.arange(capacity)[None, None, :]
    p = positions[:, :, None]
    return (t <= p) & (t > p - window)


def nsa_attention_jnp(q, cache: NSALayerCache, positions, gates, layout: NSALayout, kind: str):
    """NSA attention of rotated queries q [B, S, H_q, D] at positions [B, S] over a layer cache already holding
    their own rows. Returns (output [B, S, H_q, D] in q's dtype, selected blocks [B, H_kv, S, top_n])."""
    b, s, n, h = q.shape
    num_kv_heads, capacity = cache.k.shape[2], cache.capacity
    qg = _grouped(q, num_kv_heads)
    probs, visible = compressed_probabilities(qg, cache.k_cmp, positions, layout)
    scores = selection_scores(jnp.sum(probs, axis=2), num_select_blocks(layout, capacity), layout)
    indices = select_blocks(scores, positions[:, None, :], layout)  # [B, K, S, n]
    selected = selected_row_mask(indices, positions, capacity, layout)[:, :, None]  # [B, K, 1, S, T]
    window = window_mask(positions, capacity, layout.window)[:, None, None]
    if kind == "nsa-view":
        out = _attend(qg, cache.k, cache.v, selected | window)
    else:
        o_cmp = jnp.einsum("BKGSC,BCKD->BSKGD", probs.astype(cache.v_cmp.dtype), cache.v_cmp,
                           preferred_element_type=jnp.float32)
        o_slc = _attend(qg, cache.k, cache.v, selected)
        o_win = _attend(qg, cache.k, cache.v, window)
        g = gates.reshape(b, s, num_kv_heads, n // num_kv_heads, 3, 1)
        out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return out.reshape(b, s, n, h).astype(q.dtype), indices


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSAAttention:
    """An NSA layer's attention (models.attention.FamilyAttention): writes the new rows (and completed compressed
    blocks) into the layer cache, then attends. One new token per sequence on the kernel backend goes through the
    Pallas decode kernels (pallas_kernels.nsa_decode); everything else through nsa_attention_jnp. aux: the
    selected blocks [B, H_kv, S, top_n] with return_blocks, else None."""

    layout: NSALayout = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(default="nsa", metadata=dict(static=True))
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))
    return_blocks: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def scored_tokens_limit(self, group: int) -> None:
        """No limit: an NSA pass collects no selection scores (VerifyAttention's limit)."""
        return None

    def __call__(self, layer, new, positions, cache: NSALayerCache):
        """cache: the layer's (NSACache.at_layer: the stacks and the layer, written and read in place)."""
        q, k, v = new.rotated()
        cache = write_tokens(cache, k, v, positions, self.layout)
        if self.placement.uses_kernels and q.shape[1] == 1 and not self.return_blocks:
            gates = None if new.gates is None else new.gates[:, 0]
            out = nsa_decode(q[:, 0], cache.k, cache.v, cache.k_cmp, cache.v_cmp, positions[:, 0], gates,
                             layer=cache.layer, layout=self.layout, kind=self.kind,
                             interpret=self.placement.interpret)
            return out[:, None], cache, None
        out, blocks = nsa_attention_jnp(q, cache.reads(), positions, new.gates, self.layout, self.kind)
        return out, cache, blocks if self.return_blocks else None
