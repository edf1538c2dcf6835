"""Drafters: what proposes a draft tree's tokens each iteration (vegas_jax.decode.tree_shapes), behind one small
interface (init_state, propose, record):

- `self`: the model itself with a cheaper attention, one forward per level over that level's nodes, a node's
  children its draft distribution's top choices (greedy) or draws from it without replacement (sampling: the
  Gumbel-top-k trick, so the first child is an ordinary draw and a chain drafts as the linear loop does). What
  the cheaper attention is comes from the model's attention family (vegas_jax.attention.family): a dense model
  attends to its KV selection (the selection policy's, as Vegas drafts a chain), the recent rows and its own
  path; an NSA model to its sink block, NSA's window and its own path (vegas_jax.attention.nsa_tree).
- `ngram`: prompt lookup. The longest (up to NGRAM_MAX tokens), most recent earlier occurrences of the sequence's
  last tokens and what followed each are merged into the tree: a node's children are the distinct next tokens of
  the continuations through it, best match first. No forward pass; nodes no match fills are invalid.
- `head`: a trained EAGLE-style draft head (models.draft_head): one decoder layer over the target's last hidden
  state and the next token, its own KV cache over the whole context, the target's final norm and LM head (or its
  rows of a draft vocabulary: models.draft_head.READOUT). Prefill
  writes the prompt's rows (`prefill_rows`, from the hidden states of each prefill chunk); the target's hidden
  states of the accepted tokens come from the verification pass that accepted them (`Verified.hidden`), and the
  head writes their rows at the start of the next proposal (so its first level costs one head pass over them),
  then drafts level by level from its own predicted hidden states, children chosen as the self drafter's are.

A proposal says whether its children are draws from the distributions it returns (`probs`) or fixed choices; the
sampled acceptance (vegas_jax.decode.tree_iteration.accept_sampled) keeps the output exact either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import draft_head
from models.logical_axes import BATCH, axes_field
from models.quantized import overlay
from vegas_jax.decode import sampling
from vegas_jax.attention.tree import DraftPrefix
from vegas_jax.decode.draft_kernel import with_kernel

DRAFTERS = ("self", "ngram", "head")
NGRAM_MAX = 3  # the longest suffix matched
NGRAM_CANDIDATES = 32  # earlier occurrences merged into one tree


@dataclasses.dataclass(frozen=True)
class Proposal:
    cache: Any  # the KV cache after drafting (draft K/V in the tree's scratch rows, overwritten by verification)
    tokens: jax.Array  # [B, R] int32 node tokens; node 0 the root (the newest emitted token)
    valid: jax.Array  # [B, R] bool: the node holds a draft (the root always)
    probs: jax.Array | None  # [B, P, V]: the distribution node p's children were drawn from; None: fixed choices
    finite: jax.Array  # [B] bool: the drafting logits were finite
    drafter_state: Any  # the drafter's memory after drafting


@dataclasses.dataclass(frozen=True)
class Verified:
    """What a verification settled, for the drafters to remember: the accepted path's rows, root first, at
    positions start, start + 1, ... ([B, W] each; rows from `count` on hold nothing)."""

    start: jax.Array  # [B] int32: the root's position
    count: jax.Array  # [B] int32: rows accepted (the root and the accepted drafts; 0: the request emitted nothing)
    tokens: jax.Array  # [B, W] int32: the path's tokens
    following: jax.Array  # [B, W] int32: the token after each row (the next path token; after the last, the bonus)
    hidden: jax.Array | None  # [B, W, D]: the target's last hidden state at each row (drafters that read it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """The n-gram drafter's memory: every token of each sequence so far, position t at column t."""

    tokens: jax.Array = axes_field(BATCH, None)  # [B, capacity] int32

    def record(self, positions: jax.Array, tokens: jax.Array) -> "Context":
        """tokens [B, W] written at positions [B, W] (positions past the capacity are dropped)."""
        rows = jnp.arange(tokens.shape[0])[:, None]
        return Context(self.tokens.at[rows, positions].set(tokens, mode="drop"))


def grow(tokens, probs, nodes, logits, keys, state, config, vocabulary=None):
    """tokens [B, R] with the children of `nodes` (a level's nodes that have children) chosen from their drafting
    logits [B, n, V]: the top choices (greedy) or draws without replacement, whose distributions go into probs
    [B, P, V] (sampling; None when greedy). vocabulary: the token ids [K] of the logits' last axis when the drafts
    read out a draft vocabulary (models.draft_head.READOUT): a token outside it has probability 0."""
    tree = config.tree
    width = tree.children.shape[1]
    if config.sampling.greedy:
        choices = jax.lax.top_k(logits, width)[1].astype(jnp.int32)  # [B, n, W]
        if vocabulary is not None:
            choices = vocabulary[choices]
    else:
        if vocabulary is not None:
            everywhere = jnp.full((*logits.shape[:-1], config.model.vocab_size), -jnp.inf, logits.dtype)
            logits = everywhere.at[..., vocabulary].set(logits)
        p = sampling.probabilities(logits, state.sampling, config.sampling)
        probs = probs.at[:, nodes].set(p)
        choices = _draw_children(keys, p, width)
    kids = tree.children[nodes]  # [n, W]
    has = kids >= 0
    return tokens.at[:, kids[has]].set(choices[:, has]), probs


def empty_draft(state, config):
    """(tokens [B, R] holding the root, draft distributions [B, P, V] or None when greedy) before drafting."""
    batch, tree = state.committed.shape[0], config.tree
    tokens = jnp.zeros((batch, tree.rows), jnp.int32).at[:, 0].set(state.last_token)
    greedy = config.sampling.greedy
    return tokens, None if greedy else jnp.zeros((batch, tree.num_parents, config.model.vocab_size), jnp.float32)


@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    name: str = "self"
    reads_hidden: bool = False

    def init_state(self, config, prompt_lengths, prompt_tokens, capacity, dtype):
        return ()

    def record(self, drafter_state, verified: Verified):
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
                                 selection.recent_start, config.policy.recent_span(config.gamma))
        family = config.family
        tokens, probs = empty_draft(state, config)
        ancestors = jnp.asarray(tree.ancestors)
        cache, finite = state.cache, jnp.ones((batch,), bool)
        for depth, level in enumerate(tree.levels[:-1]):
            nodes = np.asarray([n for n in level if tree.children[n, 0] >= 0])
            attention = family.tree_draft_attention(config.model, committed[:, None] + nodes, committed,
                                                    ancestors[nodes], prefix)
            positions = jnp.broadcast_to((committed + depth)[:, None], (batch, len(nodes)))
            logits, cache, _ = config.forward(weights, tokens[:, nodes], positions, cache, attention)
            finite = finite & (jnp.all(jnp.isfinite(logits), axis=(1, 2)) | (depth >= num_drafts))
            tokens, probs = grow(tokens, probs, nodes, logits, keys[depth], state, config)
        return Proposal(cache, tokens, jnp.ones((batch, tree.rows), bool), probs, finite, state.drafter_state)


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
    reads_hidden: bool = False

    def init_state(self, config, prompt_lengths, prompt_tokens, capacity, dtype):
        return Context(prompt_tokens.astype(jnp.int32))

    def record(self, drafter_state: Context, verified: Verified) -> Context:
        row = jnp.arange(verified.tokens.shape[1])[None, :]
        positions = jnp.where(row < verified.count[:, None], verified.start[:, None] + row,
                              drafter_state.tokens.shape[1])
        return drafter_state.record(positions, verified.tokens)

    def propose(self, params, draft_params, state, keys, config, num_drafts) -> Proposal:
        tree = config.tree
        context = state.drafter_state.record(state.committed[:, None], state.last_token[:, None]).tokens
        tokens, valid = ngram_tree(context, state.committed + 1, tree)
        return Proposal(state.cache, tokens.at[:, 0].set(state.last_token), valid,
                        None, jnp.ones_like(state.done), state.drafter_state)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadMemory:
    """The head drafter's memory: its K/V rows and the verified rows it has yet to write.

    Slot t of k / v holds the head row of position t: prefill writes the prompt's rows (`prefill_rows`), the
    proposals the generated ones, so the head attends to the whole context as in training
    (vegas_jax.train_draft_head). The last `scratch` slots hold the current proposal's tree nodes, slot
    context + node, never read by a later proposal."""

    k: jax.Array = axes_field(BATCH, None, None, None)  # [B, T, K, H]
    v: jax.Array = axes_field(BATCH, None, None, None)
    start: jax.Array = axes_field(BATCH)  # [B] int32: the position of the first pending row
    count: jax.Array = axes_field(BATCH)  # [B] int32: pending rows
    hidden: jax.Array = axes_field(BATCH, None, None)  # [B, W, D]: the target's hidden state at each pending row
    following: jax.Array = axes_field(BATCH, None)  # [B, W] int32: the token after each pending row


# The head's attention runs through float32 score arrays [B, H, rows, T] over its whole cache (about three live at
# once): prefill runs the head over a chunk's rows in pieces that keep them under this many bytes (as
# vegas_jax.runtime.prefill_chunks bounds the target's own jnp attention).
HEAD_PREFILL_SCORE_BYTES = 2**32


def head_prefill_piece(rows: int, chunk: int, num_heads: int, slots: int) -> int:
    """The rows of a chunk the head runs over at once in prefill: the largest divisor of `chunk` whose score
    arrays over `rows` batch rows fit HEAD_PREFILL_SCORE_BYTES (at least 1)."""
    most = max(1, HEAD_PREFILL_SCORE_BYTES // (3 * 4 * rows * num_heads * slots))
    return max(d for d in range(1, min(chunk, most) + 1) if chunk % d == 0)


def prefill_rows(head, params, memory: HeadMemory, hidden: jax.Array, following: jax.Array, positions: jax.Array,
                 model) -> HeadMemory:
    """The head's K/V of a prefill chunk's rows written into memory: hidden [B, C, D] the target's last hidden
    states at positions [B, C] (the same in every sequence), following [B, C] the token after each. Row p attends
    causally to the slots up to p, as in decoding, though a row's K/V depend on its own inputs alone (the head is
    one layer), whatever its window. The chunk runs in pieces (head_prefill_piece) so that the head's score arrays
    stay bounded whatever the context; rows past a prompt write slots that its own rows overwrite before any
    proposal reads them."""
    batch, chunk = following.shape
    slots = memory.k.shape[1]
    piece = head_prefill_piece(batch, chunk, model.num_heads, slots)
    split = lambda x: jnp.moveaxis(x.reshape(batch, chunk // piece, piece, *x.shape[2:]), 1, 0)

    def step(kv, rows):
        h, f, p = rows
        visible = jnp.arange(slots)[None, None, :] <= p[:, :, None]
        _, k, v = draft_head.features(head, params, model, h, f, p, *kv, p, visible)
        return (k, v), None

    (k, v), _ = jax.lax.scan(step, (memory.k, memory.v), (split(hidden.astype(memory.hidden.dtype)),
                                                           split(following), split(positions)))
    return dataclasses.replace(memory, k=k, v=v)


def in_window(slot: jax.Array, position: jax.Array, window: int) -> jax.Array:
    """Whether a head row at `position` sees the slot (of position `slot`): causally, and within the last
    `window` positions when window > 0 (what the head saw in training: vegas_jax.train_draft_head)."""
    seen = slot <= position
    return seen & (slot > position - window) if window else seen


def window_slots(last: jax.Array, width: int, slots: int) -> jax.Array:
    """[B, width] the slot indices of a window of `width` slots ending at last [B] (inclusive), starting at 0
    while the history is shorter, never past the cache's `slots`."""
    start = jnp.clip(last - width + 1, 0, max(slots - width, 0))
    return start[:, None] + jnp.arange(width)[None, :]


def head_slots(capacity: int, tree) -> int:
    """The head's K/V slots per sequence: one for every position of a cache of `capacity` rows (prompt and
    generation), then the scratch slots of a proposal's tree nodes (what the memory plan counts, too)."""
    return capacity + tree.rows


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    name: str = "head"
    reads_hidden: bool = True

    def init_state(self, config, prompt_lengths, prompt_tokens, capacity, dtype) -> HeadMemory:
        batch, tree, model = prompt_lengths.shape[0], config.tree, config.model
        k, v = draft_head.empty_cache(model, batch, head_slots(capacity, tree), dtype)
        zeros = jnp.zeros((batch,), jnp.int32)
        return HeadMemory(k, v, zeros, zeros,
                          jnp.zeros((batch, tree.depth + 1, model.hidden_size), dtype),
                          jnp.zeros((batch, tree.depth + 1), jnp.int32))

    def record(self, memory: HeadMemory, verified: Verified) -> HeadMemory:
        """The rows to write at the next proposal (the bootstrap step's one row is padded to the path's width)."""
        pad = memory.following.shape[1] - verified.following.shape[1]
        return dataclasses.replace(
            memory, start=verified.start, count=verified.count,
            hidden=jnp.pad(verified.hidden.astype(memory.hidden.dtype), ((0, 0), (0, pad), (0, 0))),
            following=jnp.pad(verified.following, ((0, 0), (0, pad))))

    def propose(self, params, head, state, keys, config, num_drafts) -> Proposal:
        """head: the draft head's params (the loop's draft_params), with a draft vocabulary's readout or without."""
        tree, model, memory = config.tree, config.model, state.drafter_state
        readout = head.get(draft_head.READOUT)
        batch, slots = state.committed.shape[0], memory.k.shape[1]
        context = slots - tree.rows  # slots before the scratch
        # With a window shorter than the context each pass reads only the window's slots (read), so a draft's
        # attention costs the window, not the context.
        window = config.head_window if 0 < config.head_window < context else 0
        slot = jnp.arange(slots)
        k, v = memory.k, memory.v

        # The verified rows: written into the context; the last one's output drafts the root's children.
        width = memory.following.shape[1]
        row = jnp.arange(width)[None, :]
        at = memory.start[:, None] + row
        write = jnp.where((row < memory.count[:, None]) & (at < context), at, slots)
        read = window_slots(memory.start + width - 1, window + width - 1, context) if window else None
        seen = slot[None, :] if read is None else read  # [B or 1, R]: the slots each pass reads
        visible = in_window(seen[:, None, :], at[:, :, None], window) & (seen[:, None, :] < context)
        out, k, v = draft_head.features(head, params, model, memory.hidden, memory.following,
                                        memory.start[:, None] + row, k, v, write, visible, read)
        last = jnp.maximum(memory.count - 1, 0)[:, None, None]
        predicted = jnp.zeros((batch, tree.rows, model.hidden_size), out.dtype)
        predicted = predicted.at[:, 0].set(jnp.take_along_axis(out, last, axis=1)[:, 0])

        tokens, probs = empty_draft(state, config)
        finite = jnp.ones((batch,), bool)
        committed = state.committed[:, None]
        # The drafted rows read the verified history (its window) and the scratch slots after the context.
        read = jnp.concatenate([window_slots(state.committed - 1, window, context),
                                jnp.broadcast_to(context + jnp.arange(tree.rows), (batch, tree.rows))],
                               axis=1) if window else None
        seen = slot[None, :] if read is None else read  # [B or 1, R]
        for depth, level in enumerate(tree.levels[:-1]):
            nodes = np.asarray([n for n in level if tree.children[n, 0] >= 0])
            if depth:  # node n's row: its parent's predicted hidden state and its token, at its parent's position
                parents = np.asarray(tree.parents)[nodes]
                position = committed + depth - 1
                # its drafted ancestors' (and its own) scratch rows, and the verified rows in its window
                scratch = np.zeros((len(nodes), tree.rows), bool)
                scratch[:, 1:] = tree.ancestors[nodes][:, 1:]
                on_path = jnp.take(jnp.asarray(scratch), jnp.clip(seen - context, 0, tree.rows - 1), axis=1)
                on_path = jnp.moveaxis(on_path, 0, 1) & (seen >= context)[:, None, :]  # [B, S, R]
                history = (seen < committed) & in_window(seen, position, window)
                visible = history[:, None, :] | on_path
                write = jnp.broadcast_to(jnp.asarray(context + nodes), (batch, len(nodes)))
                positions = jnp.broadcast_to(position, (batch, len(nodes)))
                out, k, v = draft_head.features(head, params, model, predicted[:, parents], tokens[:, nodes],
                                                positions, k, v, write, visible, read)
                predicted = predicted.at[:, nodes].set(out)
            logits = draft_head.logits(params, model, predicted[:, nodes], readout)
            finite = finite & (jnp.all(jnp.isfinite(logits), axis=(1, 2)) | (depth >= num_drafts))
            tokens, probs = grow(tokens, probs, nodes, logits, keys[depth], state, config,
                                 None if readout is None else readout["tokens"])
        memory = dataclasses.replace(memory, k=k, v=v)
        return Proposal(state.cache, tokens, jnp.ones((batch, tree.rows), bool), probs, finite, memory)


def make_drafter(name: str):
    if name == "self":
        return SelfDrafter()
    if name == "ngram":
        return NgramDrafter()
    if name == "head":
        return HeadDrafter()
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")
