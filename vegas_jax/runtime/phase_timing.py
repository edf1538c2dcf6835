"""Where an iteration's time goes: the loop's draft, verify, accept and select phases, each jitted alone and timed
on the state right after prefill. Inside the one compiled while_loop the phases cannot be timed apart; timed alone,
each pays its own dispatch, so the sum exceeds a loop iteration by a little."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from vegas_jax.decode import iteration as loop
from vegas_jax.runtime.compilation import Programs, compile_jitted
from vegas_jax.runtime.engine import Engine, Started
from vegas_jax.inputs import InputError


def _time(programs: Programs, fn, *args, reps: int = 5, donate: bool = False):
    """Median seconds of fn(*args) -> (result, ...) where args[0] is threaded (donated if asked) through the
    calls; compiled as the engine compiles its loop (`programs`: at its dots' precision)."""
    with programs.tracing():
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
    """Milliseconds per phase of one iteration, each phase the loop's own function (loop.draft, verify, accept,
    select) on the state after the bootstrap step. Consumes `started` (its cache is donated to the timed phases).
    One device only: on a mesh the phases would each need their own sharded program.

    Every array a phase reads is an argument of its jitted function, as in the decode loop: closed-over arrays
    (the parameters above all) would be compiled in as constants, which times something else."""
    config, state, params, draft_params = started.config, started.state, engine.model.params, started.draft_params
    if config.placement.mesh is not None:
        raise InputError("{phase_times}: not on a {mesh} (run it on one device)")
    if config.tree is not None:
        raise InputError("{phase_times}: not with {draft_tree} (the phases timed are the chain's)")
    gamma, batch = config.gamma, state.committed.shape[0]
    keys = loop.step_keys(state.keys, loop.request_step(state), gamma + 2)
    num_drafts = jnp.full((batch,), gamma, jnp.int32)
    uncached = dataclasses.replace(state, cache=None)
    result = {"draft_ms": 0.0, "select_ms": 0.0}
    timed = functools.partial(_time, engine.programs)

    cache, drafts, draft_probs = state.cache, jnp.zeros((batch, 0), jnp.int32), None
    if gamma:
        def drafted(cache, params, draft_params, uncached, keys):
            cache, drafts, probs, _ = loop.draft(params, draft_params, dataclasses.replace(uncached, cache=cache),
                                                 keys, config, num_drafts)
            return cache, drafts, probs

        t, (cache, drafts, draft_probs) = timed(drafted, cache, params, draft_params, uncached, keys, donate=True)
        result["draft_ms"] = t * 1e3

    def verified(cache, params, uncached, drafts):
        logits, cache, scores = loop.verify(params, uncached, cache, drafts, config)
        return cache, logits, scores

    t, (cache, logits, scores) = timed(verified, cache, params, uncached, drafts, donate=True)
    result["verify_ms"] = t * 1e3

    def accepted(x, uncached, logits, drafts, draft_probs, keys):
        return x, loop.accept(uncached, logits, drafts, draft_probs, num_drafts, keys, config)

    t, (_, (num_accepted, _)) = timed(accepted, jnp.zeros(()), uncached, logits, drafts, draft_probs, keys)
    result["accept_ms"] = t * 1e3

    if config.policy is not None:
        def selected(x, uncached, cache, scores, num_accepted):
            after = dataclasses.replace(uncached, cache=cache, committed=uncached.committed + num_accepted + 1)
            return x, loop.select(uncached, after, scores, num_accepted, config).selection

        t, _ = timed(selected, jnp.zeros(()), uncached, cache, scores, num_accepted)
        result["select_ms"] = t * 1e3
    return result
