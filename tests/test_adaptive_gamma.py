"""Adaptive γ's choice against a brute-force reference of its cost model, its running estimates (decay, prior,
probing after a fall-back to plain steps), and the warm-up's cost fit. That the loop's output does not depend on
the choice is tested in test_lossless_tiny.py (greedy), test_sampling_distribution.py (sampled) and test_mesh.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax import adaptive_gamma
from vegas_jax.adaptive_gamma import GammaControl, Warmup


def pass_drafts(g: int, gamma_max: int) -> int:
    """The drafts the verification pass of g drafts holds, written out: 2, 4, 8, ... up to γ_max - 2, then γ_max."""
    width = 2
    while width < g and width <= gamma_max - 2:
        width *= 2
    return width if g <= width <= gamma_max - 2 else gamma_max


def rates_by_gamma(beta, draft_cost, verify_cost, row_cost=0.0) -> list[float]:
    """(1 + sum_{k<=g} beta_k) / cost(g) for g = 0..γ_max, cost(0) = 1, cost(g) = max(verify - row (γ_max -
    w(g)), 1) + g draft; float64."""
    gamma_max = len(beta)
    fixed = lambda g: max(verify_cost - row_cost * (gamma_max - pass_drafts(g, gamma_max)), 1.0)  # noqa: E731
    return [1.0] + [(1 + sum(beta[:g])) / (fixed(g) + g * draft_cost) for g in range(1, gamma_max + 1)]


def brute_force_gamma(beta, draft_cost, verify_cost, row_cost=0.0) -> int:
    return int(np.argmax(rates_by_gamma(beta, draft_cost, verify_cost, row_cost)))


def test_pass_widths():
    assert [adaptive_gamma.pass_widths(n) for n in (1, 2, 3, 4, 5, 8, 9, 10, 16)] == [
        (1,), (2,), (3,), (2, 4), (2, 5), (2, 4, 8), (2, 4, 9), (2, 4, 8, 10), (2, 4, 8, 16)]
    for gamma_max in range(1, 17):
        got = [adaptive_gamma.pass_width(g, gamma_max) for g in range(1, gamma_max + 1)]
        assert got == [pass_drafts(g, gamma_max) for g in range(1, gamma_max + 1)], gamma_max


def test_best_gamma_against_brute_force(rng):
    choose = jax.jit(adaptive_gamma.best_gamma)
    seen = set()
    for _ in range(300):
        gamma_max = int(rng.integers(1, 13))
        beta = np.cumprod(rng.uniform(0.0, 1.0, gamma_max) ** rng.uniform(0.05, 3))  # non-increasing
        draft, verify, row = rng.uniform(0.01, 1.0), rng.uniform(1.0, 2.0), rng.uniform(0.0, 0.1)
        want = brute_force_gamma(beta, draft, verify, row)
        got = int(choose(jnp.asarray(beta, jnp.float32), jnp.float32(draft), jnp.float32(verify), jnp.float32(row)))
        rates = rates_by_gamma(beta, draft, verify, row)
        assert got == want or abs(rates[got] - rates[want]) < 1e-6 * rates[want]  # a float32 near-tie
        seen.add(min(got, 2))
    assert seen == {0, 1, 2}  # plain steps, single drafts and longer ones all chosen


def test_narrower_passes_make_fewer_drafts_pay():
    """β 0.9^k, a draft step 0.3 and the widest pass's fixed part 1.6 plain steps, γ_max 8: without a saving per
    row 7 drafts are best; at 0.05 a plain step per draft a pass holds less, the 4-draft pass (0.2 cheaper) wins."""
    beta = 0.9 ** np.arange(1, 9)
    assert brute_force_gamma(beta, 0.3, 1.6) == 7 and brute_force_gamma(beta, 0.3, 1.6, 0.05) == 4
    choose = jax.jit(adaptive_gamma.best_gamma)
    assert int(choose(jnp.asarray(beta, jnp.float32), 0.3, 1.6, 0.05)) == 4


def test_choose_forces_and_caps():
    control = GammaControl.create(6)
    assert int(adaptive_gamma.choose(control, jnp.int32(6))) == 6  # the prior's good drafts, nearly free
    assert int(adaptive_gamma.choose(control, jnp.int32(2))) == 2  # never more than a request may still take
    forced = GammaControl(control.drafted, control.accepted, control.costs, jnp.int32(3), control.chosen)
    assert int(adaptive_gamma.choose(forced, jnp.int32(6))) == 3
    # With no counts the probe asks for 2 drafts at least; a request's cap and a force both come before it.
    useless = dataclasses.replace(control, costs=jnp.asarray([0.9, 2.0, 0.0]))  # no g pays under the prior
    assert int(adaptive_gamma.choose(useless, jnp.int32(6))) == 2
    assert int(adaptive_gamma.choose(useless, jnp.int32(1))) == 1
    for force in (0, 1):
        assert int(adaptive_gamma.choose(dataclasses.replace(useless, force=jnp.int32(force)), jnp.int32(6))) == force


def test_estimates_decay_towards_the_prior_and_probe_again():
    """A batch of 4 whose drafts are always rejected: adaptive γ falls back to plain steps, the counts decay until
    the prior makes drafts worth a try again, which are rejected again: rare probes at a steady rhythm."""
    gamma_max, batch = 4, 4
    control = GammaControl(jnp.zeros(gamma_max), jnp.zeros(gamma_max), jnp.asarray([0.3, 1.1, 0.0]), jnp.int32(-1),
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
    control = GammaControl(jnp.zeros(gamma_max), jnp.zeros(gamma_max), jnp.asarray([draft, verify, 0.0]),
                           jnp.int32(-1), jnp.zeros(gamma_max + 1, jnp.int32))
    settled = simulate(control, rate, batch, 300)[-100:]
    assert np.mean([value(g) for g in settled]) >= 0.99 * value(best), np.bincount(settled)
    assert settled.min() >= best - 1, np.bincount(settled)  # above it only probes and near-ties (7: 0.3 % off)


def simulate(control: GammaControl, rate: float, batch: int, iterations: int) -> np.ndarray:
    """The g chosen at each of `iterations` iterations whose drafts are each accepted with probability `rate`."""
    gamma_max = control.drafted.shape[0]

    def step(control, key):
        g = adaptive_gamma.choose(control, jnp.int32(gamma_max))
        accepts = jax.random.uniform(key, (batch, gamma_max)) < rate
        run = jnp.cumprod(accepts & (jnp.arange(gamma_max) < g), axis=1)  # each row's leading accepted drafts
        drafted = jnp.where(jnp.arange(gamma_max) < g, batch, 0).astype(jnp.float32)
        return adaptive_gamma.update(control, g, drafted, run.sum(0).astype(jnp.float32)), g

    keys = jax.random.split(jax.random.key(0), iterations)
    return np.asarray(jax.jit(lambda c: jax.lax.scan(step, c, keys))(control)[1])


def test_a_run_with_no_evidence_probes_and_finds_the_drafts_pay():
    """Costs under which the prior (0.9^k) says no draft pays (draft 0.70, fixed part 1.55 plain steps, SmolLM2's
    batch 8 x 4,096 on the H200 as the warm-up timed them), drafts in fact accepted at 0.97: the run's first
    iteration probes the narrowest pass, and the evidence keeps it speculating (2 drafts: 1.01 plain steps' worth
    of tokens per plain step's time, against the prior's 0.93). Without the probe g = 0 gave no evidence, for good."""
    gamma_max = 8
    control = GammaControl(jnp.zeros(gamma_max), jnp.zeros(gamma_max), jnp.asarray([0.70, 1.55, 0.0]),
                           jnp.int32(-1), jnp.zeros(gamma_max + 1, jnp.int32))
    assert int(adaptive_gamma.best_gamma(adaptive_gamma.acceptance(control), 0.70, 1.55)) == 0  # the prior's view
    chosen = simulate(control, 0.97, batch=8, iterations=200)
    assert chosen[0] == 2 and np.mean(chosen > 0) > 0.9, np.bincount(chosen)


def test_warmup_plan_and_cost_fit():
    """The warm-up forces γ_max, the fewest drafts of the widest pass (5 of γ_max 8's 2 / 4 / 8), 1 and 0, each in
    an untimed call, a short and a long one. Seconds per iteration t(g) = 1 ms x cost(g), cost(g) = 1.5 - 0.05 x
    (8 - w(g)) + 0.25 g (the widest pass's fixed part 1.5 plain steps, 0.05 saved per draft a pass holds less),
    every call paying 3 ms of its own (the H200's dispatch and transfers): the fit gives back draft 0.25, verify
    1.5 and row 0.05, the calls' own time no part of an iteration's."""
    warm = Warmup(8, None)
    forced = []
    while not warm.done:
        g, most = warm.next_call()
        forced.append((g, most))
        per_iteration = 1e-3 * (1.0 if g == 0 else 1.5 - 0.05 * (8 - pass_drafts(g, 8)) + 0.25 * g)
        warm.record(most, 3e-3 + per_iteration * most)
    short, long = Warmup.SHORT, Warmup.LONG
    assert forced == [(g, n) for g in (8, 5, 1, 0) for n in (1, short, long)]
    assert warm.next_call() == (-1, None)
    assert warm.costs == pytest.approx((0.25, 1.5, 0.05))
    one_pass = Warmup(3, None)  # γ_max 3: one pass, so no row cost to time
    while not one_pass.done:
        g, most = one_pass.next_call()
        one_pass.record(most, 3e-3 + 1e-3 * most * (1.0 if g == 0 else 1.5 + 0.4 * g))
    assert one_pass.costs == pytest.approx((0.4, 1.5, 0.0))
    given = Warmup(5, (0.4, 1.2, 0.0))
    assert given.done and given.next_call() == (-1, None) and given.costs == (0.4, 1.2, 0.0)


def test_warmup_falls_back_to_call_means_for_every_g_alike():
    """The batch ends during γ_max's long call (3 iterations instead of 8: too few beyond the short call's to
    time a difference): every g is then timed by its long call's mean, the 3 ms of each call included alike,
    rather than one g with its call's time and the others without."""
    warm = Warmup(8, None)
    means = {}
    while not warm.done:
        g, most = warm.next_call()
        ran = 3 if (g == 8 and most == Warmup.LONG) else most
        per_iteration = 1e-3 * (1.0 if g == 0 else 1.5 + 0.25 * g)
        warm.record(ran, 3e-3 + per_iteration * ran)
        if most == Warmup.LONG:
            means[g] = (3e-3 + per_iteration * ran) / ran
    plain = means[0]
    draft = (means[8] - means[5]) / 3  # the fit on those means, its bounds included: a fixed part >= a plain step
    widest, narrowest = max(means[8] - 8 * draft, plain), max(means[1] - draft, plain)
    want = (draft / plain, widest / plain, max(widest - narrowest, 0.0) / 6 / plain)
    assert warm.costs == pytest.approx(want) and warm.costs != pytest.approx((0.25, 1.5, 0.0))
