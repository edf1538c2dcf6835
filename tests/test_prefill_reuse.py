"""Runs that start from a kept prefill (`Engine.start(reuse_prefill=...)`) start from exactly the state, and decode
exactly the tokens, of runs with their own prefill, whatever method, settings and sampling mode came before."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_lossless_tiny import GREEDY, prompts, tiny_engine
from vegas_jax.runtime import memory
from vegas_jax.runtime.prefill_reuse import PrefillReuse

OPTIONS = dataclasses.replace(GREEDY, max_new_tokens=24)
RUNS = [("ar", 0.0), ("vegas", 0.0), ("streaming", 0.0), ("quest", 0.0), ("retrieval", 0.0), ("vegas", 0.8)]


def decoded(engine, started):
    state = started.decode(engine.model.params, started.draft_params, started.state, jnp.int32(2**31 - 1),
                           jnp.int32(started.state.committed.shape[0]))
    return np.asarray(state.output), np.asarray(state.num_generated)


def host(state):
    keys = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    return [np.asarray(keys(x)) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def test_every_method_starts_from_a_kept_prefill_as_from_its_own(engine):
    batch = prompts([45, 70, 33], engine.config.vocab_size)
    reuse = PrefillReuse()
    first = engine.start(batch, OPTIONS, reuse_prefill=reuse)  # prefills, and keeps the cache
    assert not first.timings["prefill_reused"]
    decoded(engine, first)  # donates its own cache: the kept copy must outlive that
    for method, temperature in RUNS:
        options = dataclasses.replace(OPTIONS, method=method, temperature=temperature, seed=3)
        fresh = engine.start(batch, options)
        fresh_state = host(fresh.state)
        fresh_output, _ = decoded(engine, fresh)
        for attempt in range(2):  # the second after the first has decoded (and donated its state)
            reused = engine.start(batch, options, reuse_prefill=reuse)
            assert reused.timings["prefill_reused"], (method, attempt)
            for a, b in zip(fresh_state, host(reused.state), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{method} T={temperature}: the bootstrapped state")
            np.testing.assert_array_equal(decoded(engine, reused)[0], fresh_output, err_msg=f"{method} T={temperature}")


def test_other_prompts_or_another_layout_prefill_again(engine):
    reuse = PrefillReuse()
    batch = prompts([45, 70, 33], engine.config.vocab_size)
    engine.start(batch, OPTIONS, reuse_prefill=reuse)
    other = prompts([45, 70, 33], engine.config.vocab_size, seed=1)
    assert not engine.start(other, OPTIONS, reuse_prefill=reuse).timings["prefill_reused"]
    # Another capacity is another cache; another chunk, other numerics: neither may take the kept prefill.
    for changed in (dict(max_model_len=384), dict(prefill_chunk=16)):
        started = engine.start(other, dataclasses.replace(OPTIONS, **changed), reuse_prefill=reuse)
        assert not started.timings["prefill_reused"], changed
    again = engine.start(other, dataclasses.replace(OPTIONS, prefill_chunk=16), reuse_prefill=reuse)
    assert again.timings["prefill_reused"]


def test_the_memory_plan_counts_the_kept_cache(engine):
    batch = prompts([45, 70, 33], engine.config.vocab_size)
    captured = {}
    real_estimate = memory.estimate

    def spy(*args, **kwargs):
        captured[kwargs["kept_prefill"]] = parts = real_estimate(*args, **kwargs)
        return parts

    with pytest.MonkeyPatch.context() as m:
        m.setattr(memory, "estimate", spy)
        engine.start(batch, OPTIONS)
        engine.start(batch, OPTIONS, reuse_prefill=PrefillReuse())
    assert captured[False]["kept_prefill"] == 0
    assert captured[True]["kept_prefill"] == captured[True]["kv_cache"] > 0
    assert captured[True]["total"] == captured[False]["total"] + captured[True]["kv_cache"]


def test_generate_takes_a_kept_prefill(engine):
    """`generate(reuse_prefill=...)` (through `stream`) starts from the kept prefill, says so in its metrics, and
    gives the tokens of a run with its own prefill."""
    batch = prompts([45, 70, 33], engine.config.vocab_size)
    reuse = PrefillReuse()
    plain = engine.generate(batch, OPTIONS, reuse_prefill=reuse)
    assert not plain.metrics["prefill_reused"]
    options = dataclasses.replace(OPTIONS, method="vegas")
    reused, fresh = engine.generate(batch, options, reuse_prefill=reuse), engine.generate(batch, options)
    assert reused.metrics["prefill_reused"] and not fresh.metrics["prefill_reused"]
    assert [r.tokens for r in reused.requests] == [r.tokens for r in fresh.requests] == [
        r.tokens for r in plain.requests]
