"""Where an iteration's time goes: draft, verify, accept and select, each jitted alone and timed on the state right
after prefill. Inside the one compiled while_loop the phases cannot be timed apart; timed alone, each pays its own
dispatch, so the sum exceeds a loop iteration by a little."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import forward
from vegas_jax import loop, sampling
from vegas_jax.compilation import compile_jitted
from vegas_jax.engine import Engine, Started
from vegas_jax.selection import SelectContext


def _time(fn, *args, reps: int = 5, donate: bool = False):
    """Median seconds of fn(*args) -> (result, ...) where args[0] is threaded (donated if asked) through the
    calls; compiled as the engine compiles its loop."""
    fn = compile_jitted(fn, *args, donate=(0,) if donate else ())
    times = []
    out = None
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        args = (out[0],) + args[1:]
    return float(np.median(times[1:])), out


def time_phases(engine: Engine, started: Started) -> dict:
    """Milliseconds per phase of one iteration. Consumes `started` (its cache is donated to the timed phases).

    Every array a phase reads is an argument of its jitted function, as in the decode loop: closed-over arrays
    (the parameters above all) would be compiled in as constants, which times something else."""
    config, state, params = started.config, started.state, engine.model.params
    gamma, batch = config.gamma, state.committed.shape[0]
    keys = loop.step_keys(state.keys, loop.request_step(state), gamma + 2)
    uncached = dataclasses.replace(state, cache=None)
    result = {"draft_ms": 0.0, "select_ms": 0.0}

    cache, drafts, draft_probs = state.cache, jnp.zeros((batch, 0), jnp.int32), None
    if gamma:
        def drafted(cache, params, uncached, keys):
            cache, drafts, probs, _ = loop.draft(
                params, dataclasses.replace(uncached, cache=cache), keys, config, jnp.full((batch,), gamma)
            )
            return cache, drafts, probs

        t, (cache, drafts, draft_probs) = _time(drafted, cache, params, uncached, keys, donate=True)
        result["draft_ms"] = t * 1e3

    tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    positions = state.committed[:, None] + jnp.arange(gamma + 1)[None, :]

    def verified(cache, params, tokens, positions):
        logits, cache, scores = forward(params, tokens, positions, cache, config.verify_attention(), config=config.model)
        return cache, logits, scores

    t, (cache, logits, scores) = _time(verified, cache, params, tokens, positions, donate=True)
    result["verify_ms"] = t * 1e3

    num_drafts = jnp.full((batch,), gamma, jnp.int32)

    def accepted(x, logits, drafts, draft_probs, num_drafts, uncached, keys):
        if config.sampling.greedy or not gamma:
            return x, sampling.accept_greedy(drafts, logits, num_drafts)
        target = sampling.probabilities(logits, uncached.sampling, config.sampling)
        return x, sampling.accept_speculative(keys[gamma], drafts, draft_probs, target, num_drafts)

    t, (_, (num_accepted, _)) = _time(accepted, jnp.zeros(()), logits, drafts, draft_probs, num_drafts, uncached, keys)
    result["accept_ms"] = t * 1e3

    if config.policy is not None:
        def selected(x, scores, num_accepted, cache, uncached):
            committed = uncached.committed + num_accepted + 1
            ctx = SelectContext(scores, committed, uncached.committed + 1, num_accepted, cache, first=False)
            return x, config.policy.select(ctx, uncached.selection, uncached.policy_state)

        t, _ = _time(selected, jnp.zeros(()), scores, num_accepted, cache, uncached)
        result["select_ms"] = t * 1e3
    return result
