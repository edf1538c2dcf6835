"""Adaptive γ's choice against a brute-force reference, its posterior against float64, its running estimates
(decay, prior, Thompson draws, probing after a fall-back to plain steps), and the warm-up's cost fit. That the
loop's output does not depend on the choice is tested in test_lossless_tiny.py (greedy),
test_sampling_distribution.py (sampled) and test_mesh.py."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vegas_jax.decode import adaptive_gamma
from vegas_jax.decode.adaptive_gamma import GammaControl, Warmup


def pass_drafts(g: int, gamma_max: int) -> int:
    """The drafts the verification pass of g drafts holds, written out: 2, 4, 8, ... up to γ_max - 2, then γ_max."""
    width = 2
    while width < g and width <= gamma_max - 2:
        width *= 2
    return width if g <= width <= gamma_max - 2 else gamma_max


def rates_by_gamma(beta, costs) -> list[float]:
    """(1 + sum_{k<=g} beta_k) / cost(g) for g = 0..γ_max, cost(0) = 1, float64."""
    return [1.0] + [(1 + sum(beta[:g])) / costs[g - 1] for g in range(1, len(beta) + 1)]


def brute_force_gamma(beta, costs) -> int:
    return int(np.argmax(rates_by_gamma(beta, costs)))


def linear_costs(gamma_max: int, draft: float, fixed: float) -> jax.Array:
    """An iteration of g drafts costing a fixed part and g draft steps."""
    return jnp.asarray([fixed + g * draft for g in range(1, gamma_max + 1)], jnp.float32)


def control_with(gamma_max: int, costs) -> GammaControl:
    return dataclasses.replace(GammaControl.create(gamma_max), costs=jnp.asarray(costs, jnp.float32))


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
        costs = rng.uniform(1.0, 2.0) + np.cumsum(rng.uniform(0.01, 1.0, gamma_max))
        want = brute_force_gamma(beta, costs)
        got = int(choose(jnp.asarray(beta, jnp.float32), jnp.asarray(costs, jnp.float32)))
        rates = rates_by_gamma(beta, costs)
        assert got == want or abs(rates[got] - rates[want]) < 1e-6 * rates[want]  # a float32 near-tie
        seen.add(min(got, 2))
    assert seen == {0, 1, 2}  # plain steps, single drafts and longer ones all chosen


def posterior_reference(reached, accepted, z=None):
    """float64: each conditional acceptance's posterior mean (PRIOR_WEIGHT pseudo-observations at the position
    before's mean, FIRST_PRIOR_WEIGHT at PRIOR_RATE for position 1), a draw mean + z sd clipped to [0, 1], and β
    the draws' running product."""
    prior, draws = adaptive_gamma.PRIOR_RATE, []
    for k, (n, a) in enumerate(zip(reached, accepted)):
        w = adaptive_gamma.FIRST_PRIOR_WEIGHT if k == 0 else adaptive_gamma.PRIOR_WEIGHT
        mean = (a + w * prior) / (n + w)
        sd = np.sqrt(mean * (1 - mean) / (n + w))
        draws.append(min(max(mean + (0.0 if z is None else z[k]) * sd, 0.0), 1.0))
        prior = mean
    return np.cumprod(draws)


def test_acceptance_against_a_float64_posterior(rng):
    """Posterior means without noise; with standard normals z, a draw per position mean + z sd."""
    for _ in range(20):
        gamma_max = int(rng.integers(1, 10))
        reached = np.sort(rng.uniform(0, 50, gamma_max))[::-1] * (rng.uniform(size=gamma_max) < 0.8)
        accepted = reached * rng.uniform(0.3, 1.0, gamma_max)
        control = dataclasses.replace(GammaControl.create(gamma_max), reached=jnp.asarray(reached, jnp.float32),
                                      accepted=jnp.asarray(accepted, jnp.float32))
        np.testing.assert_allclose(adaptive_gamma.acceptance(control), posterior_reference(reached, accepted),
                                   rtol=1e-5)
        z = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (gamma_max,))
        np.testing.assert_allclose(adaptive_gamma.acceptance(control, z),
                                   posterior_reference(reached, accepted, np.asarray(z, np.float64)),
                                   rtol=1e-5, atol=1e-7)


def test_a_position_little_drafted_takes_its_neighbours_acceptance():
    """Batch 1: 200 drafts accepted at positions 1 to 3, then one draft at position 4, rejected. Counted on its
    own, position 4 would look useless; with its prior at position 3's acceptance it stays above 0.85."""
    control = dataclasses.replace(GammaControl.create(8), reached=jnp.asarray([200, 200, 200, 1, 0, 0, 0, 0.0]),
                                  accepted=jnp.asarray([200, 200, 200, 0, 0, 0, 0, 0.0]))
    beta = np.asarray(adaptive_gamma.acceptance(control))
    assert beta[2] > 0.99 and 0.85 < beta[3] / beta[2] < 0.9 and beta[4] / beta[3] > 0.85, beta


def test_choose_forces_and_caps():
    control = GammaControl.create(6)
    assert int(adaptive_gamma.choose(control, jnp.int32(6))) == 6  # the prior's good drafts, nearly free
    assert int(adaptive_gamma.choose(control, jnp.int32(2))) == 2  # never more than a request may still take
    forced = dataclasses.replace(control, force=jnp.int32(3))
    assert int(adaptive_gamma.choose(forced, jnp.int32(6))) == 3
    # With no counts the probe asks for 2 drafts at least; a request's cap and a force both come before it.
    useless = dataclasses.replace(control, costs=linear_costs(6, 0.9, 2.0))  # no g pays under the prior
    assert int(adaptive_gamma.choose(useless, jnp.int32(6))) == 2
    assert int(adaptive_gamma.choose(useless, jnp.int32(1))) == 1
    for force in (0, 1):
        assert int(adaptive_gamma.choose(dataclasses.replace(useless, force=jnp.int32(force)), jnp.int32(6))) == force


def simulate(control: GammaControl, rate: float, batch: int, iterations: int, thompson: bool = True) -> np.ndarray:
    """The g chosen at each of `iterations` iterations whose drafts are each accepted with probability `rate`,
    chosen as the loop does (a Thompson draw, keyed by the iteration) or from the posterior means."""
    gamma_max = control.reached.shape[0]

    def step(control, key):
        g = adaptive_gamma.choose(control, jnp.int32(gamma_max), control.draws if thompson else None)
        drafted = jnp.arange(gamma_max) < g
        run = jnp.cumprod(drafted & (jax.random.uniform(key, (batch, gamma_max)) < rate), axis=1)  # leading accepts
        reached = drafted & jnp.concatenate([jnp.ones((batch, 1), bool), run[:, :-1] > 0], axis=1)
        return adaptive_gamma.update(control, g, reached.sum(0).astype(jnp.float32), run.sum(0).astype(jnp.float32)), g

    keys = jax.random.split(jax.random.key(0), iterations)
    return np.asarray(jax.jit(lambda c: jax.lax.scan(step, c, keys))(control)[1])


def test_estimates_decay_towards_the_prior_and_probe_again():
    """A batch of 4 whose drafts are always rejected: adaptive γ falls back to plain steps, the counts decay until
    a draw says drafts are worth a try again, which are rejected again: rare probes, never stopping."""
    gamma_max, batch = 4, 4
    control = control_with(gamma_max, linear_costs(gamma_max, 0.3, 1.1))
    chosen = simulate(control, 0.0, batch, 2000)
    assert chosen[0] >= 3  # before any evidence the prior says drafts are mostly right
    probes = np.flatnonzero(chosen[50:]) + 50
    assert 4 <= len(probes) <= 40, probes  # fell back to plain steps, but keeps probing: at most 2 % of iterations
    assert np.diff(probes).max() <= 400, probes
    control = control_with(gamma_max, linear_costs(gamma_max, 0.3, 1.1))
    for g in chosen:  # the counts of that run, replayed
        reached = jnp.where(jnp.arange(gamma_max) < 1, batch * (g > 0), 0).astype(jnp.float32)
        control = adaptive_gamma.update(control, g, reached, jnp.zeros(gamma_max))
    assert float(adaptive_gamma.acceptance(control)[0]) < 0.4
    np.testing.assert_array_equal(np.asarray(control.chosen), np.bincount(chosen, minlength=gamma_max + 1))


def value_of(beta, costs):
    return lambda g: rates_by_gamma(beta, costs)[g]


def test_climbs_to_the_best_gamma_from_no_evidence():
    """A later run of a configuration starts from its kept costs and no counts. Drafts accepted with probability
    0.95 each (β_k = 0.95^k), batch 8, a draft step 0.578 and the fixed part 1.392 plain steps (SmolLM2 at
    batch 8 x 7,936 tokens on the H200): the best g is 6. The prior that continues the acceptance seen before each
    position, and draws that try what may be better, climb one position further at a time and settle within 1 %
    of the best rate."""
    gamma_max, batch = 8, 8
    beta, costs = 0.95 ** np.arange(1, gamma_max + 1), np.asarray(linear_costs(gamma_max, 0.578, 1.392))
    best, value = brute_force_gamma(beta, costs), value_of(beta, costs)
    assert best == 6
    settled = simulate(control_with(gamma_max, costs), 0.95, batch, 300)[-100:]
    assert np.mean([value(g) for g in settled]) >= 0.99 * value(best), np.bincount(settled)


def test_unlucky_early_samples_do_not_stop_the_drafts():
    """Batch 8, drafts accepted at 0.97 each, costs for which 5 drafts are best: the run's first iteration drafted
    8, and in 5 of its 8 rows the third draft was rejected (the H200 suite's 7,936 x 8 cell at code cb195a7 saw
    such a start, then drafted 2 for the rest of the run). From the posterior means alone the loop keeps to 2
    drafts, 13 % below the best (position 3's mean stays low until its counts decay, hundreds of iterations); with
    Thompson draws it drafts position 3 and beyond again, and settles at the best."""
    gamma_max = 8
    costs = np.asarray([2.05, 2.8, 3.49, 4.1, 4.6, 5.87, 6.6, 7.3])
    beta = 0.97 ** np.arange(1, gamma_max + 1)
    best, value = brute_force_gamma(beta, costs), value_of(beta, costs)
    assert best == 5
    unlucky = adaptive_gamma.update(control_with(gamma_max, costs), 8, jnp.asarray([8, 8, 8, 3, 3, 3, 3, 3.0]),
                                    jnp.asarray([8, 8, 3, 3, 3, 3, 3, 3.0]))
    means = simulate(unlucky, 0.97, 8, 150, thompson=False)[50:]
    draws = simulate(unlucky, 0.97, 8, 150)[50:]
    assert np.mean(means == 2) > 0.8 and np.mean([value(g) for g in means]) < 0.9 * value(best), np.bincount(means)
    assert np.mean([value(g) for g in draws]) >= 0.99 * value(best), np.bincount(draws)


def test_a_run_with_no_evidence_probes_and_finds_the_drafts_pay():
    """Costs under which the prior (0.9^k) says no draft pays (draft 0.70, fixed part 1.55 plain steps, SmolLM2's
    batch 8 x 4,096 on the H200 as the warm-up timed them), drafts in fact accepted at 0.97: the run's first
    iteration probes the narrowest pass, and the evidence keeps it speculating (2 drafts: 1.01 plain steps' worth
    of tokens per plain step's time, against the prior's 0.93). Without the probe g = 0 gave no evidence, for good."""
    gamma_max = 8
    control = control_with(gamma_max, linear_costs(gamma_max, 0.70, 1.55))
    assert int(adaptive_gamma.best_gamma(adaptive_gamma.acceptance(control), control.costs)) == 0  # the prior's view
    chosen = simulate(control, 0.97, batch=8, iterations=200)
    assert chosen[0] == 2 and np.mean(chosen > 0) > 0.9, np.bincount(chosen)


def pass_cost(g: int) -> float:
    """An iteration's cost in plain steps for γ_max 8, not linear in the pass's rows: the passes of 2, 4 and 8
    drafts cost 1.3, 1.35 and 1.6, a draft step 0.25."""
    return {2: 1.3, 4: 1.35, 8: 1.6}[pass_drafts(g, 8)] + 0.25 * g


def test_warmup_plan_and_cost_fit():
    """The warm-up forces γ_max, the fewest drafts of the widest pass (5 of γ_max 8's 2 / 4 / 8), the full widths
    of the narrower passes (4, 2) and 0, each in an untimed call, a short and a long one. Seconds per iteration
    t(g) = 1 ms x pass_cost(g), every call paying 3 ms of its own (the H200's dispatch and transfers): the fit
    gives back every g's cost, the calls' own time no part of an iteration's."""
    warm = Warmup(8, None)
    forced = []
    while not warm.done:
        g, most = warm.next_call()
        forced.append((g, most))
        warm.record(most, 3e-3 + 1e-3 * (1.0 if g == 0 else pass_cost(g)) * most)
    short, long = Warmup.SHORT, Warmup.LONG
    assert forced == [(g, n) for g in (8, 5, 4, 2, 0) for n in (1, short, long)]
    assert warm.next_call() == (-1, None)
    assert warm.costs == pytest.approx([pass_cost(g) for g in range(1, 9)])
    one_pass = Warmup(3, None)  # γ_max 3: one pass, timed at 3 and 1 drafts
    while not one_pass.done:
        g, most = one_pass.next_call()
        one_pass.record(most, 3e-3 + 1e-3 * most * (1.0 if g == 0 else 1.5 + 0.4 * g))
    assert one_pass.costs == pytest.approx([1.9, 2.3, 2.7])
    given = Warmup(5, (1.6, 2.0, 2.4, 2.8, 3.2))
    assert given.done and given.next_call() == (-1, None) and given.costs == (1.6, 2.0, 2.4, 2.8, 3.2)


def test_warmup_falls_back_to_call_means_for_every_g_alike():
    """The batch ends during γ_max's long call (3 iterations instead of 8: too few beyond the short call's to
    time a difference): every g is then timed by its long call's mean, the 3 ms of each call included alike,
    rather than one g with its call's time and the others without."""
    warm = Warmup(8, None)
    means = {}
    while not warm.done:
        g, most = warm.next_call()
        ran = 3 if (g == 8 and most == Warmup.LONG) else most
        seconds = 3e-3 + 1e-3 * (1.0 if g == 0 else pass_cost(g)) * ran
        warm.record(ran, seconds)
        if most == Warmup.LONG:
            means[g] = seconds / ran
    draft = (means[8] - means[5]) / 3
    want = [(means[g] if g in means else means[pass_drafts(g, 8)] - (pass_drafts(g, 8) - g) * draft) / means[0]
            for g in range(1, 9)]
    assert warm.costs == pytest.approx([max(c, 1.0) for c in want])
    assert warm.costs != pytest.approx([pass_cost(g) for g in range(1, 9)])


def test_the_rules_simulation_runs_and_reports_every_scenario(tmp_path, monkeypatch):
    """benchmarks/simulate_adaptive_gamma.py, short: a record per scenario, each rule's value a fraction of the
    best, the best g the brute force's."""
    from benchmarks import simulate_adaptive_gamma as simulation

    monkeypatch.delenv("OUT", raising=False)
    simulation.main(["--iterations", "6", "--seeds", "1", "--results", str(tmp_path)])
    records = json.loads((tmp_path / "adaptive-rules-simulation.json").read_text())["records"]
    assert [r["scenario"] for r in records] == list(simulation.SCENARIOS)
    for record, (rates, costs, _, _) in zip(records, simulation.SCENARIOS.values()):
        assert record["best_gamma"] == brute_force_gamma(np.cumprod(rates), costs)
        for rule in simulation.RULES:
            assert 0 < record[rule]["worst"] <= record[rule]["mean"] <= 1 + 1e-9
