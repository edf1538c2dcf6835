"""Adaptive γ's choice rules in simulation (CPU, seconds): how close each rule's choices come to the best g over a
run, in scenarios whose costs are those the H200 warm-ups timed (suite records of code e611961; the useless drafts'
costs are a tiny model's, test_lossless_tiny.py) and whose drafts are accepted with fixed probabilities by
position, some starting from an unlucky first iteration. Each seed draws its own accepts and its own draws (the
loop keys its draws by the iteration's number; a seed folds into that key).

Rules: `symmetric` (what the loop does: a Thompson draw of each conditional acceptance, mean + z sd), `optimistic`
(mean + |z| sd: a draw never below its mean; fewer drafts teach nothing), `means` (the posterior means, no draw).
Each rule chooses through `adaptive_gamma.choose` (its probe included), given its own noise. A simulation, not a
measurement: it says which rule to measure on the device, not what it gains there (the H200 did not bear out
optimistic draws' gain: docs/experiments.md, adaptive-rules-ab-2026-12-04.jsonl).

    python benchmarks/simulate_adaptive_gamma.py [--iterations 90] [--seeds 8] [--results FOLDER]

prints a table of mean / worst value over the seeds (a run's mean of value(g) over the best value, value =
expected tokens over cost, in plain decoding's: the best's is in each record) and saves
benchmarks/results/adaptive-rules-simulation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from vegas_jax.decode import adaptive_gamma  # noqa: E402
from vegas_jax.decode.adaptive_gamma import GammaControl  # noqa: E402

# The noise each rule gives adaptive_gamma.choose, from the iteration's standard normals z.
NOISE = {"symmetric": lambda z: z, "optimistic": jnp.abs, "means": lambda z: None}
RULES = tuple(NOISE)
COSTS_7936_1 = [2.06, 2.81, 3.56, 4.3, 5.16, 5.9, 6.65, 7.4]  # 7,936 x 1, its first e611961 warm-up
RATES_7936_1 = [0.974, 0.97, 1.0, 1.0, 0.99, 0.99, 0.98, 0.98]  # a fixed γ 6's acceptance there, extended
USELESS = dict(rates=[0.15] * 5, costs=[1.1 + 0.3 * g for g in range(1, 6)])  # int4 drafts of a tiny random model

# name: (conditional acceptance by position, cost(g) for g = 1..γ_max, batch, first iteration's counts or None)
SCENARIOS = {
    "7936x1": (RATES_7936_1, COSTS_7936_1, 1, None),
    "7936x1, draft 2 rejected first": (RATES_7936_1, COSTS_7936_1, 1, ([1, 1, 0, 0, 0, 0, 0, 0], [1] + [0] * 7)),
    "7936x1, draft 1 rejected first": (RATES_7936_1, COSTS_7936_1, 1, ([1] + [0] * 7, [0] * 8)),
    "7936x8, draft 3 rejected in 5 rows first": ([0.97] * 8, [1.84, 2.42, 3.05, 3.63, 4.43, 5.02, 5.6, 6.18], 8,
                                                 ([8, 8, 8, 3, 3, 3, 3, 3], [8, 8, 3, 3, 3, 3, 3, 3])),
    "4096x8": ([0.98, 0.97, 0.96, 0.96, 0.96, 0.95, 0.95, 0.95], [1.88, 2.49, 2.99, 3.6, 4.65, 5.26, 5.86, 6.47], 8,
               None),
    "2048x1": ([0.93, 0.95, 0.92, 0.92, 0.93, 0.94, 0.94, 0.94], [1.8, 2.54, 3.09, 3.82, 4.33, 5.07, 5.8, 6.54], 1,
               None),
    "useless drafts, batch 1": (USELESS["rates"], USELESS["costs"], 1, None),
    "useless drafts, batch 2": (USELESS["rates"], USELESS["costs"], 2, None),
    "useless drafts, batch 4": (USELESS["rates"], USELESS["costs"], 4, None),
}


def simulate(rule: str, rates, costs, batch: int, first, iterations: int, seed: int) -> np.ndarray:
    gamma_max = len(costs)
    control = dataclasses.replace(GammaControl.create(gamma_max), costs=jnp.asarray(costs, jnp.float32))
    if first is not None:
        control = adaptive_gamma.update(control, gamma_max, *(jnp.asarray(c, jnp.float32) for c in first))
    rates = jnp.asarray(rates, jnp.float32)

    def step(control, key):
        z = jax.random.normal(jax.random.fold_in(control.iteration_key, seed), (gamma_max,))
        g = adaptive_gamma.choose(control, jnp.int32(gamma_max), NOISE[rule](z))
        drafted = jnp.arange(gamma_max) < g
        run = jnp.cumprod(drafted & (jax.random.uniform(key, (batch, gamma_max)) < rates), axis=1)
        reached = drafted & jnp.concatenate([jnp.ones((batch, 1), bool), run[:, :-1] > 0], axis=1)
        counts = (reached.sum(0).astype(jnp.float32), run.sum(0).astype(jnp.float32))
        return adaptive_gamma.update(control, g, *counts), g

    keys = jax.random.split(jax.random.key(seed), iterations)
    return np.asarray(jax.jit(lambda c: jax.lax.scan(step, c, keys))(control)[1])


def values(rates, costs) -> np.ndarray:
    beta = np.cumprod(rates)
    return np.asarray([1.0] + [(1 + beta[:g].sum()) / costs[g - 1] for g in range(1, len(costs) + 1)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=90, help="iterations a run (the suite's runs: 50-100)")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    check_writable("--results", args.results)
    records = []
    print(f"{'scenario':42} " + " ".join(f"{rule:>16}" for rule in RULES))
    for name, (rates, costs, batch, first) in SCENARIOS.items():
        value = values(rates, costs)
        record = {"scenario": name, "batch": batch, "best_gamma": int(value.argmax()), "best_value": float(value.max()),
                  "iterations": args.iterations}
        cells = []
        for rule in RULES:
            runs = [value[simulate(rule, rates, costs, batch, first, args.iterations, seed)].mean() / value.max()
                    for seed in range(args.seeds)]
            record[rule] = {"mean": float(np.mean(runs)), "worst": float(np.min(runs))}
            cells.append(f"{np.mean(runs):.3f} ({np.min(runs):.3f})")
        records.append(record)
        print(f"{name:42} " + " ".join(f"{c:>16}" for c in cells))
    save_results({**run_metadata(seeds=args.seeds), "records": records}, "adaptive-rules-simulation.json",
                 args.results)


if __name__ == "__main__":
    main()
