"""The modified NSA targets of the approximate kernel modes (vegas_jax.ssv.precision.ApproxMode defines them) as an
attention over an NSA cache, for plain decoding of such a target: refresh layers derive selections (the span
anchors', top_n widened), reuse layers take the nearest refresh layer's and attend with them.

Refresh layers hand their selection to the next layers through `after_layer` (models.decoder threads the attention
object through its layer loop). The cache keeps, per layer, the shared selection of every span whose anchor was
written (`ApproxNSACache.spans`, span j at row j): a later pass whose rows' anchor precedes it reads it there. A
table by span, not just the latest span's: a ragged batch prefills padding rows past a short prompt, and the
selections they derive land in spans that the real anchor rows later overwrite before anything reads them.

This attention runs chain passes (prefill, plain decoding); tree verification of a modified target is
pallas_kernels.nsa_verify with `tree_reselect` (the anchors found through the tree's ancestor mask), in the loop
vegas_jax.attention.nsa_tree.NSATreeVerify, whose committed path's anchor selections `record_spans` stores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, NSALayout
from models.logical_axes import BATCH, KV_HEADS, axes_field
from models.nsa_cache import NSACache, NSALayerCache, write_tokens
from models.nsa_selection import NO_BLOCK, num_select_blocks, select_blocks, selection_scores
from models.nsa_shared_selection import BEFORE_PASS, anchor_rows, chain_sees, shared_blocks
from pallas_kernels.nsa_reuse import nsa_reuse_decode
from vegas_jax.attention.nsa import _attend, _grouped, compressed_probabilities, selected_row_mask, window_mask
from vegas_jax.ssv.precision import ApproxMode
from vegas_jax.sharding import Placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ApproxLayerCache:
    """One layer's: its NSALayerCache and its stored span selections, [B, num_spans, H_kv, n'] when nsa holds one
    layer's arrays, every layer's [L, B, num_spans, H_kv, n'] when it holds the stacks (read and written at its
    layer in place)."""

    nsa: NSALayerCache
    spans: jax.Array  # the shared selection of each span whose anchor was written

    def layer_spans(self) -> jax.Array:
        """[B, num_spans, H_kv, n'] the layer's span selections (small int32 tables, read where consumed)."""
        return self.spans if self.nsa.layer is None else self.spans[self.nsa.layer]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ApproxNSACache:
    """An NSACache plus, per layer, the stored span selections [B, num_spans, H_kv, n'] (n' = widen * top_n;
    num_spans = capacity / share_span, and 1 unread column when share_span is 1: every row is its own anchor)."""

    nsa: NSACache
    spans: jax.Array = axes_field(None, BATCH, None, KV_HEADS, None)  # [L, B, num_spans, H_kv, n'] stacked

    @classmethod
    def create(cls, config: ModelConfig, mode: ApproxMode, batch: int, capacity: int, dtype=jnp.bfloat16):
        width = mode.selection_layout(config.nsa).top_n
        num_spans = -(-capacity // mode.share_span) if mode.share_span > 1 else 1
        spans = jnp.full((config.num_layers, batch, num_spans, config.num_kv_heads, width), NO_BLOCK, jnp.int32)
        return cls(NSACache.create(config, batch, capacity, dtype), spans)

    @property
    def capacity(self) -> int:
        return self.nsa.capacity

    @property
    def batch(self) -> int:
        return self.nsa.batch

    def at_layer(self, i) -> ApproxLayerCache:
        """Layer i's cache as its attention takes it: the stacks and the layer (NSACache.at_layer)."""
        return ApproxLayerCache(self.nsa.at_layer(i), self.spans)

    @classmethod
    def of(cls, layer: ApproxLayerCache) -> "ApproxNSACache":
        return cls(NSACache.of(layer.nsa), layer.spans)


def stored_blocks(spans: jax.Array, positions: jax.Array, span: int) -> jax.Array:
    """[B, S, H_kv, n']: the stored selection of each row's span (positions [B, S])."""
    slot = jnp.clip(positions // span, 0, spans.shape[1] - 1)
    return jnp.take_along_axis(spans, slot[:, :, None, None], axis=1)


def record_spans(spans: jax.Array, blocks: jax.Array, positions: jax.Array, span: int, layer=None) -> jax.Array:
    """spans with the selections blocks [B, S, H_kv, n'] of the rows at anchor positions (positions [B, S] that
    span divides; positions past the spans dropped) stored at their span; with `layer`, into that layer of
    stacked spans [L, B, num_spans, H_kv, n']."""
    if span == 1:
        return spans
    num_spans, batch = spans.shape[-3], spans.shape[-4]
    slot = jnp.where((positions % span == 0) & (positions // span < num_spans), positions // span, num_spans)
    index = (jnp.arange(batch)[:, None], slot)
    return spans.at[index if layer is None else (layer, *index)].set(blocks, mode="drop")


def refreshed_blocks(qg, cache: NSALayerCache, positions, spans, layout: NSALayout, mode: ApproxMode):
    """A refresh layer's selections [B, K, S, n'] of a chain pass: each row's top-n' (NSA's rule, top_n
    widened), then each row takes its span anchor's (from this pass, or its span's stored in `spans`). A pass
    without an anchor row (plain decoding between anchors) derives nothing: the stored selection serves it."""
    def own():  # the layer's compressed keys read inside the branch: a cond's operand would be a buffer (a copy)
        probs, _ = compressed_probabilities(qg, cache.reads().k_cmp, positions, layout)
        scores = selection_scores(jnp.sum(probs, axis=2), num_select_blocks(layout, cache.capacity), layout)
        return select_blocks(scores, positions[:, None, :], mode.selection_layout(layout))

    if mode.share_span == 1:
        return own()
    anchors = anchor_rows(positions, chain_sees(positions), mode.share_span)
    stored = jnp.moveaxis(stored_blocks(spans, positions, mode.share_span), 1, 2)  # [B, K, S, n']
    return jax.lax.cond(jnp.any(anchors != BEFORE_PASS), lambda: shared_blocks(own(), anchors, stored),
                        lambda: stored)


def branches_with_blocks(q, cache: NSALayerCache, positions, gates, indices, layout: NSALayout, kind: str):
    """NSA attention of rotated q [B, S, H_q, D] at positions [B, S] with the selection given (indices
    [B, K, S, n], any n, NO_BLOCK pads): the compressed branch of each query's own probabilities, the selected rows
    up to the query, the window, the gates ("nsa"), or selected and window rows in one softmax ("nsa-view").
    Also the jnp twin of pallas_kernels.nsa_reuse."""
    b, s, n, h = q.shape
    num_kv_heads, capacity = cache.k.shape[2], cache.capacity
    qg = _grouped(q, num_kv_heads)
    selected = selected_row_mask(indices, positions, capacity, layout)[:, :, None]
    window = window_mask(positions, capacity, layout.window)[:, None, None]
    if kind == "nsa-view":
        out = _attend(qg, cache.k, cache.v, selected | window)
    else:
        probs, _ = compressed_probabilities(qg, cache.k_cmp, positions, layout)
        o_cmp = jnp.einsum("BKGSC,BCKD->BSKGD", probs.astype(cache.v_cmp.dtype), cache.v_cmp,
                           preferred_element_type=jnp.float32)
        g = gates.reshape(b, s, num_kv_heads, n // num_kv_heads, 3, 1)
        out = (g[..., 0, :] * o_cmp + g[..., 1, :] * _attend(qg, cache.k, cache.v, selected)
               + g[..., 2, :] * _attend(qg, cache.k, cache.v, window))
    return out.reshape(b, s, n, h).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ApproxNSAAttention:
    """The modified target's attention (models.attention.FamilyAttention) over ApproxLayerCaches. `carried`: the
    last refresh layer's selections [B, K, S, n'] in this pass (None before layer 0). aux: this layer's
    selections. One new token per sequence on the kernel backend attends through the fused kernel
    (pallas_kernels.nsa_reuse); everything else through branches_with_blocks."""

    layout: NSALayout = dataclasses.field(metadata=dict(static=True))
    mode: ApproxMode = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(default="nsa", metadata=dict(static=True))
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))
    carried: jax.Array | None = None

    # Refresh and reuse layers differ and hand selections on (after_layer): the decoder runs them unrolled.
    layer_specific = True

    def scored_tokens_limit(self, group: int) -> None:
        """No limit: the modified target's passes collect no selection scores (VerifyAttention's limit)."""
        return None

    def __call__(self, layer, new, positions, cache: ApproxLayerCache):
        q, k, v = new.rotated()
        nsa = write_tokens(cache.nsa, k, v, positions, self.layout)  # in place at the stacks' layer
        if self.mode.refreshes(layer):
            qg = _grouped(q, nsa.k.shape[-2])
            indices = refreshed_blocks(qg, nsa, positions, cache.layer_spans(), self.layout, self.mode)
            spans = record_spans(cache.spans, jnp.moveaxis(indices, 2, 1), positions, self.mode.share_span,
                                 nsa.layer)
        else:
            indices, spans = self.carried, cache.spans  # a reuse layer's spans are never read
        if self.placement.uses_kernels and q.shape[1] == 1:
            gates = None if new.gates is None else new.gates[:, 0]
            out = nsa_reuse_decode(q[:, 0], nsa.k, nsa.v, nsa.k_cmp, nsa.v_cmp, indices[:, :, 0], positions[:, 0],
                                   gates, layer=nsa.layer, layout=self.layout, kind=self.kind,
                                   interpret=self.placement.interpret)[:, None]
        else:
            out = branches_with_blocks(q, nsa.reads(), positions, new.gates, indices, self.layout, self.kind)
        return out, ApproxLayerCache(nsa, spans), indices

    def after_layer(self, layer: int, aux) -> "ApproxNSAAttention":
        """The attention of the next layer: a refresh layer's selections carried on."""
        return dataclasses.replace(self, carried=aux) if self.mode.refreshes(layer) else self


def tree_reselect(mode: ApproxMode, stored: jax.Array | None = None, injected: jax.Array | None = None):
    """nsa_tree_verify's reselect hook (pallas_kernels.nsa_verify) for one layer of mode's target and one sequence,
    verified with layout mode.selection_layout(layout): a refresh layer's nodes take their span anchor's blocks
    (the node's own, an ancestor's, or stored [H_kv, n'] for an anchor before the tree); a reuse layer's take
    injected [T, H_kv, n'] (its refresh layer's)."""
    def reselect(blocks, sees, positions):
        if injected is not None:
            return injected
        if mode.share_span == 1:
            return blocks
        anchors = anchor_rows(positions[None], sees[None], mode.share_span)
        return shared_blocks(blocks.transpose(1, 0, 2)[None], anchors, stored[None, :, None])[0].transpose(1, 0, 2)
    return reselect


def modified_target(config: ModelConfig, mode: ApproxMode, placement: Placement = Placement()) -> ApproxNSAAttention:
    if config.nsa is None:
        raise ValueError(f"approximate modes are modes of NSA models; attention is {config.attention!r}")
    mode.selection_layout(config.nsa)  # checks the span against the layout
    return ApproxNSAAttention(config.nsa, mode, config.attention, placement)


def greedy_decode(params, config: ModelConfig, prompt, steps: int, mode: ApproxMode, *, backend: str = "reference"):
    """Plain greedy decoding of the modified target: the prompt [B, P] (token ids) in one pass, then one token per
    sequence per pass, the cache in the parameters' dtype. Returns (tokens [B, steps], logits [B, steps, V] of the
    steps' inputs' successors: row i predicts token i)."""
    from models.decoder import forward

    prompt = np.asarray(prompt, np.int32)
    batch, length = prompt.shape
    sel = config.nsa.select_block
    capacity = -(-(length + steps) // sel) * sel
    cache = ApproxNSACache.create(config, mode, batch, capacity, params["embed"].dtype)
    attention = modified_target(config, mode, Placement(backend=backend))
    run = jax.jit(forward, static_argnames=("config",))
    positions = jnp.arange(length, dtype=jnp.int32)[None].repeat(batch, 0)
    rows = jnp.full((batch, 1), length - 1, jnp.int32)
    logits, cache, _ = run(params, jnp.asarray(prompt), positions, cache, attention, config=config, logit_rows=rows)
    tokens, kept = [], []
    for t in range(steps):
        kept.append(logits[:, -1])
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        tokens.append(token)
        if t + 1 < steps:
            position = jnp.full((batch, 1), length + t, jnp.int32)
            logits, cache, _ = run(params, token[:, None], position, cache, attention, config=config)
    return np.stack([np.asarray(t) for t in tokens], axis=1), np.stack([np.asarray(x) for x in kept], axis=1)


def prefill_logits(params, config: ModelConfig, tokens, mode: ApproxMode) -> jax.Array:
    """Logits [B, T, V] of the modified target over tokens [B, T] in one pass (the cache in the parameters'
    dtype): row t is what plain decoding of the target predicts after tokens[:, :t + 1] (every rule is causal)."""
    from models.decoder import forward

    tokens = jnp.asarray(tokens, jnp.int32)
    batch, length = tokens.shape
    sel = config.nsa.select_block
    cache = ApproxNSACache.create(config, mode, batch, -(-length // sel) * sel, params["embed"].dtype)
    positions = jnp.arange(length, dtype=jnp.int32)[None].repeat(batch, 0)
    logits, _, _ = jax.jit(forward, static_argnames=("config",))(params, tokens, positions, cache,
                                                                 modified_target(config, mode), config=config)
    return logits
