"""Adaptive γ's choice against a brute-force reference of its cost model, its running estimates (decay, prior,
probing after a fall-back to plain steps), and the warm-up's cost fit. That the loop's output does not depend on
the choice is tested in test_lossless_tiny.py (greedy), test_sampling_distribution.py (sampled) and test_mesh.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import adaptive_gamma
from vegas_jax.adaptive_gamma import GammaControl, Warmup


def brute_force_gamma(beta, draft_cost, verify_cost) -> int:
    """argmax over g of (1 + sum_{k<=g} beta_k) / cost(g), cost(0) = 1, cost(g) = verify + g * draft; float64."""
    rates = [1.0] + [(1 + sum(beta[:g])) / (verify_cost + g * draft_cost) for g in range(1, len(beta) + 1)]
    return int(np.argmax(rates))


def test_best_gamma_against_brute_force(rng):
    choose = jax.jit(adaptive_gamma.best_gamma)
    seen = set()
    for _ in range(300):
        gamma_max = int(rng.integers(1, 13))
        beta = np.cumprod(rng.uniform(0.0, 1.0, gamma_max) ** rng.uniform(0.05, 3))  # non-increasing
        draft, verify = rng.uniform(0.01, 1.0), rng.uniform(1.0, 2.0)
        want = brute_force_gamma(beta, draft, verify)
        got = int(choose(jnp.asarray(beta, jnp.float32), jnp.float32(draft), jnp.float32(verify)))
        rates = [1.0] + [(1 + beta[:g].sum()) / (verify + g * draft) for g in range(1, gamma_max + 1)]
        assert got == want or abs(rates[got] - rates[want]) < 1e-6 * rates[want]  # a float32 near-tie
        seen.add(min(got, 2))
    assert seen == {0, 1, 2}  # plain steps, single drafts and longer ones all chosen


def test_choose_forces_and_caps():
    control = GammaControl.create(6)
    assert int(adaptive_gamma.choose(control, jnp.int32(6))) == 6  # the prior's good drafts, nearly free
    assert int(adaptive_gamma.choose(control, jnp.int32(2))) == 2  # never more than a request may still take
    forced = GammaControl(control.drafted, control.accepted, control.costs, jnp.int32(3), control.chosen)
    assert int(adaptive_gamma.choose(forced, jnp.int32(6))) == 3


def test_estimates_decay_towards_the_prior_and_probe_again():
    """A batch of 4 whose drafts are always rejected: adaptive γ falls back to plain steps, the counts decay until
    the prior makes drafts worth a try again, which are rejected again: rare probes at a steady rhythm."""
    gamma_max, batch = 4, 4
    control = GammaControl(jnp.zeros(gamma_max), jnp.zeros(gamma_max), jnp.asarray([0.3, 1.1]), jnp.int32(-1),
                           jnp.zeros(gamma_max + 1, jnp.int32))

    def step(control, _):
        g = adaptive_gamma.choose(control, jnp.int32(gamma_max))
        drafted = jnp.where(jnp.arange(gamma_max) < g, batch, 0).astype(jnp.float32)
        return adaptive_gamma.update(control, g, drafted, jnp.zeros(gamma_max)), g

    control, chosen = jax.jit(lambda c: jax.lax.scan(step, c, None, length=2000))(control)
    chosen = np.asarray(chosen)
    assert chosen[0] >= 3  # before any evidence the prior says drafts are mostly right
    probes = np.flatnonzero(chosen[1:]) + 1
    assert 4 <= len(probes) <= 20, probes  # fell back to plain steps, but keeps probing
    gaps = np.diff(probes)
    assert gaps.min() >= 100 and gaps.max() <= 2 * gaps.min(), gaps  # a steady rhythm
    beta = adaptive_gamma.acceptance(control)
    assert np.all(np.diff(np.asarray(beta)) <= 0) and float(beta[0]) < 0.4
    np.testing.assert_array_equal(np.asarray(control.chosen), np.bincount(chosen, minlength=gamma_max + 1))


def test_climbs_to_the_best_gamma_from_no_evidence():
    """A later run of a configuration starts from its kept costs and no counts. Drafts accepted with probability
    0.95 each (β_k = 0.95^k), batch 8, a draft step 0.578 and the fixed part 1.392 plain steps (SmolLM2 at
    batch 8 x 7,936 tokens on the H200): the best g is 6. A prior of 0.9^k at positions never drafted would stop
    at g 3 (β_4's prior 0.66 says a fourth draft does not pay; it does at 0.81), and without optimism a few
    unlucky early samples at a position stop it there for hundreds of iterations; the prior that continues the
    acceptance seen before each position, with optimism for what is little sampled, explores one position further
    at a time and settles within 1 % of the best rate."""
    gamma_max, batch, rate, draft, verify = 8, 8, 0.95, 0.578, 1.392
    beta = rate ** np.arange(1, gamma_max + 1)
    best = brute_force_gamma(beta, draft, verify)
    value = lambda g: (1 + beta[:g].sum()) / (verify + g * draft) if g else 1.0  # noqa: E731
    assert best == 6
    control = GammaControl(jnp.zeros(gamma_max), jnp.zeros(gamma_max), jnp.asarray([draft, verify]),
                           jnp.int32(-1), jnp.zeros(gamma_max + 1, jnp.int32))

    def step(control, key):
        g = adaptive_gamma.choose(control, jnp.int32(gamma_max))
        accepts = jax.random.uniform(key, (batch, gamma_max)) < rate
        run = jnp.cumprod(accepts & (jnp.arange(gamma_max) < g), axis=1)  # each row's leading accepted drafts
        drafted = jnp.where(jnp.arange(gamma_max) < g, batch, 0).astype(jnp.float32)
        return adaptive_gamma.update(control, g, drafted, run.sum(0).astype(jnp.float32)), g

    keys = jax.random.split(jax.random.key(0), 300)
    _, chosen = jax.jit(lambda c: jax.lax.scan(step, c, keys))(control)
    settled = np.asarray(chosen)[-100:]
    assert np.mean([value(g) for g in settled]) >= 0.99 * value(best), np.bincount(settled)
    assert settled.min() >= best - 1, np.bincount(settled)  # above it only probes and near-ties (7: 0.3 % off)


def test_warmup_plan_and_cost_fit():
    """The warm-up forces γ_max, 1 and 0, each in an untimed call, a short and a long one; seconds per
    iteration t(g) = 1 ms x cost(g) with cost(g) = 1.25 + 0.25 g, and every call paying 3 ms of its own (the
    H200's dispatch and transfers), give back draft 0.25 and verify 1.25 plain steps: the calls' own time is no
    part of an iteration's."""
    warm = Warmup(5, None)
    forced = []
    while not warm.done:
        g, most = warm.next_call()
        forced.append((g, most))
        per_iteration = 1e-3 * (1.0 if g == 0 else 1.25 + 0.25 * g)
        warm.record(most, 3e-3 + per_iteration * most)
    short, long = Warmup.SHORT, Warmup.LONG
    assert forced == [(g, n) for g in (5, 1, 0) for n in (1, short, long)]
    assert warm.next_call() == (-1, None)
    assert warm.costs == pytest.approx((0.25, 1.25))
    given = Warmup(5, (0.4, 1.2))
    assert given.done and given.next_call() == (-1, None) and given.costs == (0.4, 1.2)
