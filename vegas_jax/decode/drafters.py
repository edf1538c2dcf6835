"""Drafters: what proposes a draft tree's tokens each iteration (vegas_jax.decode.tree_shapes). Behind one small interface, so
another drafter (an EAGLE-style head, say) plugs in beside these two:

- `self`: the model itself with a cheaper attention, one forward per level over that level's nodes, a node's
  children its draft distribution's top choices (greedy) or draws from it without replacement (sampling: the
  Gumbel-top-k trick, so the first child is an ordinary draw and a chain drafts as the linear loop does). What
  the cheaper attention is comes from the model's attention family (vegas_jax.attention.family): a dense model
  attends to its KV selection (the selection policy's, as Vegas drafts a chain), the recent rows and its own
  path; an NSA model to its sink block, NSA's window and its own path (vegas_jax.attention.nsa_tree).
- `ngram`: prompt lookup. The longest (up to NGRAM_MAX tokens), most recent earlier occurrences of the sequence's
  last tokens and what followed each are merged into the tree: a node's children are the distinct next tokens of
  the continuations through it, best match first. No forward pass; nodes no match fills are invalid.

A proposal says whether its children are draws from the distributions it returns (`probs`) or fixed choices; the
sampled acceptance (vegas_jax.decode.tree_iteration.accept_sampled) keeps the output exact either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.logical_axes import BATCH, axes_field
from models.quantized import overlay
from vegas_jax.decode import sampling
from vegas_jax.attention.tree import DraftPrefix
from vegas_jax.decode.draft_kernel import with_kernel

DRAFTERS = ("self", "ngram")
NGRAM_MAX = 3  # the longest suffix matched
NGRAM_CANDIDATES = 32  # earlier occurrences merged into one tree


@dataclasses.dataclass(frozen=True)
class Proposal:
    cache: Any  # the KV cache after drafting (draft K/V in the tree's scratch rows, overwritten by verification)
    tokens: jax.Array  # [B, R] int32 node tokens; node 0 the root (the newest emitted token)
    valid: jax.Array  # [B, R] bool: the node holds a draft (the root always)
    probs: jax.Array | None  # [B, P, V]: the distribution node p's children were drawn from; None: fixed choices
    finite: jax.Array  # [B] bool: the drafting logits were finite


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """The n-gram drafter's memory: every token of each sequence so far, position t at column t."""

    tokens: jax.Array = axes_field(BATCH, None)  # [B, capacity] int32

    def record(self, positions: jax.Array, tokens: jax.Array) -> "Context":
        """tokens [B, W] written at positions [B, W] (positions past the capacity are dropped)."""
        rows = jnp.arange(tokens.shape[0])[:, None]
        return Context(self.tokens.at[rows, positions].set(tokens, mode="drop"))


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    name: str = "self"

    def init_state(self, prompt_tokens):
        return ()

    def record(self, drafter_state, positions, tokens):
        return drafter_state

    def propose(self, params, draft_params, state, keys, config, num_drafts) -> Proposal:
        tree = config.tree
        batch, committed = state.committed.shape[0], state.committed
        weights = params if draft_params is None else overlay(
            params, with_kernel(draft_params, config.placement, config.draft_activations))
        prefix = None  # an NSA model's self draft reads no selection (its family's draft attention)
        if config.policy is not None:
            selection = state.selection  # a finished sequence reads no selected rows (as in loop.draft)
            prefix = DraftPrefix(selection.indices, jnp.where(state.done[None, :], 0, selection.counts),
                                 selection.recent_start)
        family = config.family
        greedy = config.sampling.greedy
        tokens = jnp.zeros((batch, tree.rows), jnp.int32).at[:, 0].set(state.last_token)
        probs = None if greedy else jnp.zeros((batch, tree.num_parents, config.model.vocab_size), jnp.float32)
        ancestors = jnp.asarray(tree.ancestors)
        cache, finite = state.cache, jnp.ones((batch,), bool)
        for depth, level in enumerate(tree.levels[:-1]):
            nodes = np.asarray([n for n in level if tree.children[n, 0] >= 0])
            attention = family.tree_draft_attention(config.model, committed[:, None] + nodes, committed,
                                                    ancestors[nodes], prefix)
            positions = jnp.broadcast_to((committed + depth)[:, None], (batch, len(nodes)))
            logits, cache, _ = config.forward(weights, tokens[:, nodes], positions, cache, attention)
            finite = finite & (jnp.all(jnp.isfinite(logits), axis=(1, 2)) | (depth >= num_drafts))
            width = tree.children.shape[1]
            if greedy:
                choices = jax.lax.top_k(logits, width)[1].astype(jnp.int32)  # [B, n, W]
            else:
                p = sampling.probabilities(logits, state.sampling, config.sampling)
                probs = probs.at[:, nodes].set(p)
                choices = _draw_children(keys[depth], p, width)
            kids = tree.children[nodes]  # [n, W]
            has = kids >= 0
            tokens = tokens.at[:, kids[has]].set(choices[:, has])
        return Proposal(cache, tokens, jnp.ones((batch, tree.rows), bool), probs, finite)


def _draw_children(keys: jax.Array, probs: jax.Array, width: int) -> jax.Array:
    """[B, n, W] draws without replacement from probs [B, n, V] (Gumbel top-k): node i of the level uses its
    request's key folded with i, node 0 the key itself (so a chain's draft is `sampling.sample_rows`'s)."""

    def node(key, p, i):
        key = jax.lax.cond(i == 0, lambda: key, lambda: jax.random.fold_in(key, i))
        return jax.random.categorical(key, jnp.log(p), shape=(width,), replace=False).astype(jnp.int32)

    index = jnp.arange(probs.shape[1])
    return jax.vmap(lambda k, rows: jax.vmap(lambda p, i: node(k, p, i))(rows, index))(keys, probs)


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    name: str = "ngram"

    def init_state(self, prompt_tokens):
        return Context(prompt_tokens.astype(jnp.int32))

    def record(self, drafter_state: Context, positions, tokens) -> Context:
        return drafter_state.record(positions, tokens)

    def propose(self, params, draft_params, state, keys, config, num_drafts) -> Proposal:
        tree = config.tree
        context = state.drafter_state.record(state.committed[:, None], state.last_token[:, None]).tokens
        tokens, valid = ngram_tree(context, state.committed + 1, tree)
        return Proposal(state.cache, tokens.at[:, 0].set(state.last_token), valid,
                        None, jnp.ones_like(state.done))


def ngram_tree(context: jax.Array, length: jax.Array, tree) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, R], valid [B, R]) of the tree of continuations of the sequences context[b, :length[b]]."""
    batch, capacity = context.shape
    end = jnp.arange(capacity)[None, :]  # an occurrence ending at column `end`, continued from end + 1
    run = jnp.ones((batch, capacity), bool)
    matched = jnp.zeros((batch, capacity), jnp.int32)
    for k in range(NGRAM_MAX):
        shifted = jnp.roll(context, k, axis=1)  # shifted[:, e] = context[:, e - k]
        suffix = jnp.take_along_axis(context, jnp.maximum(length - 1 - k, 0)[:, None], axis=1)
        run = run & (shifted == suffix) & (end >= k) & (length[:, None] - 1 - k >= 0)
        matched = matched + run
    eligible = (matched > 0) & (end <= length[:, None] - 2)
    score = jnp.where(eligible, matched * capacity + end, -1)  # longest first, then the most recent
    count = min(NGRAM_CANDIDATES, capacity)
    best, ends = jax.lax.top_k(score, count)  # [B, M]
    found = best >= 0
    depth = tree.depth
    follow = ends[:, :, None] + 1 + jnp.arange(depth)[None, None, :]  # [B, M, D]
    known = found[:, :, None] & (follow <= length[:, None, None] - 1)
    continuation = jnp.take_along_axis(context, jnp.minimum(follow, capacity - 1).reshape(batch, -1), axis=1)
    continuation = continuation.reshape(batch, count, depth)

    tokens = jnp.zeros((batch, tree.rows), jnp.int32)
    valid = jnp.zeros((batch, tree.rows), bool).at[:, 0].set(True)
    through = {0: found}  # node -> [B, M]: the candidates whose continuation passes through the node
    earlier = jnp.tril(jnp.ones((count, count), bool), -1)  # earlier[m, m']: m' ranks before m
    for node in range(tree.rows):
        kids = [int(c) for c in tree.children[node] if c >= 0]
        if not kids:
            continue
        d = int(tree.depths[node])
        tok, ok = continuation[:, :, d], through[node] & known[:, :, d]  # [B, M]
        seen = jnp.any(earlier[None] & ok[:, None, :] & (tok[:, None, :] == tok[:, :, None]), axis=2)
        first = ok & ~seen  # the best-ranked candidate of each distinct next token
        rank = jnp.cumsum(first, axis=1) - 1
        for slot, child in enumerate(kids):
            pick = first & (rank == slot)
            exists = jnp.any(pick, axis=1)
            token = jnp.sum(jnp.where(pick, tok, 0), axis=1)
            tokens = tokens.at[:, child].set(token)
            valid = valid.at[:, child].set(exists)
            through[child] = ok & (tok == token[:, None]) & exists[:, None]
    return tokens, valid


def make_drafter(name: str):
    if name == "self":
        return SelfDrafter()
    if name == "ngram":
        return NgramDrafter()
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")
