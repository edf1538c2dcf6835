"""One decode iteration over a draft tree (vegas_jax.decode.tree_shapes): a drafter proposes the tree's tokens
(vegas_jax.decode.drafters), one target pass verifies every node (tree attention: node j's K/V in scratch row committed + j,
RoPE at committed + its depth), acceptance picks a root-to-node path, and committing the path copies its K/V rows
to the contiguous positions committed + depth, as if its tokens had been decoded one by one (the model's attention
family says how: vegas_jax.attention.family; NSA also pools the compressed blocks the path completes).

Acceptance is exact. Greedy: the deepest path whose every token is its parent's target argmax, then the argmax at
its end. Sampling: recursive rejection sampling down the tree. At a node with target distribution p, child i (token
c_i, drawn from q_i: the drafter's distribution without the siblings before it, or a fixed choice, q_i one-hot) is
accepted with probability min(1, p_i(c_i) / q_i(c_i)); on rejection p_{i+1} = norm(max(0, p_i - q_i)). That is
speculative sampling of p_i with the draft q_i at each sibling, so by induction from the last sibling (after which
the token is drawn from the residual) the node emits a token distributed exactly as p, whether its drafts were
drawn with or without replacement, as long as each q_i is the distribution its c_i was drawn from given the
siblings before it (Jeon et al. 2024, recursive speculative decoding; SpecInfer's multi-step rule is the case with
replacement). A child that could not have been drawn (q_i(c_i) = 0) or holds no draft is skipped: p stays as it is.
On acceptance the walk continues at the child, whose subtree was drafted given its path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vegas_jax.decode import iteration as loop
from vegas_jax.decode import sampling
from vegas_jax.decode.drafters import Verified, make_drafter


def verify(params, state, cache, tokens, config, with_hidden=False):
    """The full-attention pass over every node [B, R] (the model family's tree verification: dense tree attention,
    or exact NSA tree verification of the loop's target): (logits [B, R, V], cache with the tree in its scratch
    rows, per-layer aux: with a selection policy its scores averaged over every head, else the family's own), and
    with `with_hidden` every node's last hidden state [B, R, D] (a draft head's input)."""
    request = config.policy.score_request(config.score_mode) if config.policy else None
    positions = state.committed[:, None] + jnp.asarray(config.tree.depths)[None, :]
    attention = config.family.tree_verify_attention(config.model, config.placement, config.tree, state.committed,
                                                    request)
    logits, cache, aux, *hidden = config.forward(params, tokens, positions, cache, attention, with_hidden=with_hidden)
    aux = config.placement.mean_over_model(aux) if request is not None else aux
    return (logits, cache, aux, *hidden)


def accept_greedy(tree, tokens, counted, logits):
    """(last accepted node [B], the token after it [B]) from the target logits [B, R, V]: the deepest node whose
    path holds only counted drafts equal to their parent's argmax (the first such node of its depth)."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, R]
    parents = np.maximum(np.asarray(tree.parents), 0)
    match = counted & (tokens == target[:, parents])
    match = match.at[:, 0].set(True)
    on_path = ~jnp.any(jnp.asarray(tree.ancestors)[None] & ~match[:, None, :], axis=2)  # [B, R]
    best = jnp.argmax(jnp.where(on_path, jnp.asarray(tree.depths)[None], -1), axis=1).astype(jnp.int32)
    return best, jnp.take_along_axis(target, best[:, None], axis=1)[:, 0]


def residual(p, q):
    """norm(max(0, p - q)) [B, V]: what speculative sampling draws from after rejecting a draft drawn from q."""
    rest = jnp.maximum(p - q, 0.0)
    return rest / jnp.maximum(jnp.sum(rest, axis=-1, keepdims=True), 1e-30)


def accept_sampled(key, tree, tokens, counted, target_probs, draft_probs):
    """(last accepted node [B], the token after it [B]) by recursive rejection sampling (the module's rule) from
    per-request keys [B], target_probs [B, R, V] and the drafter's draft_probs [B, P, V] (None: fixed choices)."""
    batch, vocab = tokens.shape[0], target_probs.shape[-1]
    accept_keys, residual_keys = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k))(key), 1, 0)
    # Node i's uniform is u[:, i - 1]: a chain's are the linear rule's (sampling.accept_speculative).
    u = jax.vmap(lambda k: jax.random.uniform(k, (tree.num_nodes,)))(accept_keys)
    u = jnp.concatenate([jnp.ones((batch, 1)), u], axis=1)
    children = jnp.asarray(tree.children)
    rows = jnp.arange(batch)

    def level(_, carry):
        node, p, stopped = carry
        p_here = target_probs[rows, node]
        p = jnp.where(stopped[:, None], p, p_here)
        q = None if draft_probs is None else draft_probs[rows, jnp.minimum(node, tree.num_parents - 1)]
        moved, nxt = jnp.zeros((batch,), bool), node
        for slot in range(children.shape[1]):
            child = children[node, slot]  # [B]
            c = jnp.maximum(child, 0)
            token = tokens[rows, c]
            one_hot = jax.nn.one_hot(token, vocab, dtype=p.dtype)
            q_i = one_hot if q is None else q
            q_token = q_i[rows, token]
            tried = ~stopped & ~moved & (child >= 0) & counted[rows, c] & (q_token > 0)
            accept = tried & (u[rows, c] * q_token < p[rows, token])
            reject = tried & ~accept
            p = jnp.where(reject[:, None], residual(p, q_i), p)
            if q is not None:  # the next sibling is drawn without this one
                rest = q * (1.0 - one_hot)
                mass = jnp.sum(rest, axis=-1, keepdims=True)
                q = jnp.where(tried[:, None], jnp.where(mass > 0, rest / jnp.maximum(mass, 1e-30), 0.0), q)
            nxt = jnp.where(accept, child, nxt)
            moved = moved | accept
        return nxt, p, stopped | ~moved

    init = (jnp.zeros((batch,), jnp.int32), target_probs[:, 0], jnp.zeros((batch,), bool))
    node, p, _ = jax.lax.fori_loop(0, tree.depth + 1, level, init)
    return node, sampling.sample_rows(residual_keys, p)


def _rank_counts(tree, path, accepted, counted):
    """(offered, accepted) [B, most children] by rank (loop.Metrics): each node of the accepted path (root
    included) offers its counted children's ranks; each accepted draft counts its own rank."""
    on_path = jnp.arange(tree.depth + 1)[None, :] <= accepted[:, None]  # [B, D+1]
    children = jnp.asarray(tree.children)[path]  # [B, D+1, W]
    rows = jnp.arange(path.shape[0])[:, None, None]
    offered = (children >= 0) & counted[rows, jnp.maximum(children, 0)] & on_path[:, :, None]
    ranks = jax.nn.one_hot(jnp.asarray(tree.ranks)[path[:, 1:]], tree.children.shape[1], dtype=jnp.int32)
    return offered.sum(1, dtype=jnp.int32), (ranks * on_path[:, 1:, None]).sum(1)


def iteration(params, draft_params, state, config):
    """One draft-tree round for every unfinished sequence (loop.chain_iteration's tree twin)."""
    tree, drafter = config.tree, make_drafter(config.drafter)
    num_drafts = loop.counted_drafts(state, tree.depth)  # the deepest path that may count
    keys = loop.step_keys(state.keys, loop.request_step(state), tree.depth + 2)
    proposal = drafter.propose(params, draft_params, state, keys, config, num_drafts)
    counted = proposal.valid & (jnp.asarray(tree.depths)[None, :] <= num_drafts[:, None])

    logits, cache, scores, *hidden = verify(params, state, proposal.cache, proposal.tokens, config,
                                            drafter.reads_hidden)
    finite = proposal.finite & jnp.all(jnp.all(jnp.isfinite(logits), axis=-1) | ~counted, axis=1)
    if config.sampling.greedy:
        last, next_token = accept_greedy(tree, proposal.tokens, counted, logits)
    else:
        target_probs = sampling.probabilities(logits, state.sampling, config.sampling)
        last, next_token = accept_sampled(keys[tree.depth], tree, proposal.tokens, counted, target_probs,
                                          proposal.probs)
    accepted = jnp.asarray(tree.depths)[last]
    path = jnp.asarray(tree.path_nodes)[last]  # [B, D+1] the accepted path's nodes by depth, root first
    rows = jnp.arange(path.shape[0])[:, None]
    rank_counts = _rank_counts(tree, path, accepted, counted)
    path_tokens = proposal.tokens[rows, path]

    emit_ok = ~state.done & finite
    cache = config.family.commit_path(config.model, cache, state.committed, path, accepted, emit_ok, scores)
    # The drafter remembers the root and the accepted drafts (the bonus token is the next iteration's root).
    following = jnp.concatenate([path_tokens[:, 1:], next_token[:, None]], axis=1)
    following = jnp.where(jnp.arange(tree.depth + 1)[None, :] == accepted[:, None], next_token[:, None], following)
    verified = Verified(state.committed, jnp.where(emit_ok, accepted + 1, 0), path_tokens, following,
                        hidden[0][rows, path] if hidden else None)
    # The path's node j holds the distribution of its candidate j (the draft at depth j + 1, or the bonus token).
    return loop.conclude(state, config, cache=cache, drafts=path_tokens[:, 1:], accepted=accepted,
                         next_token=next_token, finite=finite, num_drafts=num_drafts, logits=logits[rows, path],
                         scores=scores, last_row=last, rank_counts=rank_counts,
                         drafter_state=drafter.record(proposal.drafter_state, verified))
