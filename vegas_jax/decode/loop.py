"""The compiled decode loop: one `lax.while_loop` of iterations of the configured kind. A chain of γ drafts
(vegas_jax.decode.iteration.chain_iteration); with adaptive γ a chain of the g drafts chosen for that iteration, verified in
the narrowest compiled pass that holds them, g = 0 being a plain step (vegas_jax.decode.adaptive_gamma); or a draft tree
(vegas_jax.decode.tree_iteration). Trees build on the chain's phases, so the choice between them is made here, above both."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from vegas_jax.decode import adaptive_gamma
from vegas_jax.decode import tree_iteration as tree_decode
from vegas_jax.decode.iteration import DecodeConfig, DecodeState, chain_iteration


def iteration(params, draft_params, state: DecodeState, *, config: DecodeConfig) -> DecodeState:
    """One draft -> verify -> accept -> select round for every unfinished sequence."""
    if config.tree is not None:
        return tree_decode.iteration(params, draft_params, state, config)
    if not config.adaptive_gamma:
        return chain_iteration(params, draft_params, state, config, config.gamma)
    control = state.gamma_control
    owed = jnp.where(state.done, 0, state.max_new - state.num_generated - 1)
    g = adaptive_gamma.choose(control, config.placement.max_over_data(jnp.max(owed)), control.draws)
    # Branch g: a plain step for 0, else g drafts, a number fixed at compile time, verified in the narrowest pass
    # that holds them. A traced count of drafts made the draft loop wait on the host for its condition at every
    # step (an iteration of g 2 cost 3.53 ms against a fixed γ 2's 3.30 at batch 8 x 7,936 on the H200, code
    # a9efb6e). Every device takes the same branch: g comes from statistics that every device holds alike.
    plain = [lambda s: chain_iteration(params, None, s, config.plain(), 0)]
    speculative = [functools.partial(lambda g, s: chain_iteration(params, draft_params, s, config, g,
                                                                  adaptive_gamma.pass_width(g, config.gamma)), g)
                   for g in range(1, config.gamma + 1)]
    after = jax.lax.switch(g, plain + speculative, state)
    drafted = after.metrics.drafted - state.metrics.drafted  # [B, γ_max] this iteration's, 0 or 1
    accepted = after.metrics.accepted - state.metrics.accepted
    # A draft reached its position when the drafts before it were accepted (the first always does).
    reached = drafted * jnp.concatenate([jnp.ones_like(accepted[:, :1]), accepted[:, :-1]], axis=1)
    pooled = lambda counts: config.placement.sum_over_data(jnp.sum(counts, axis=0)).astype(jnp.float32)  # noqa: E731
    control = adaptive_gamma.update(control, g, pooled(reached), pooled(accepted))
    return dataclasses.replace(after, gamma_control=control)


def decode(
    params, draft_params, state: DecodeState, step_limit: jax.Array, finished_limit: jax.Array, *,
    config: DecodeConfig
) -> DecodeState:
    """Iterates until `finished_limit` sequences are done (the batch size: all of them) or `step_limit` iterations
    have run in total. Streaming runs the loop in slices of steps; continuous batching returns as soon as enough
    slots have finished to admit new requests; a plain call passes limits it never reaches before the end. On a
    mesh every data shard counts the whole batch's finished sequences, so all of them run the same iterations."""

    def cond(s: DecodeState):
        finished = config.placement.sum_over_data(jnp.sum(s.done, dtype=jnp.int32))
        return (finished < finished_limit) & (s.step < step_limit)

    return jax.lax.while_loop(cond, lambda s: iteration(params, draft_params, s, config=config), state)
