"""Draft precision: what bf16 / int8 / int4 draft weights (and adaptive γ) do to acceptance on real prompts, and to
the cost of a draft step and of a Vegas iteration at the scale of an 8B model.

    python benchmarks/bench_draft_precision.py --part real        # SmolLM2 (the embedded GGUF), real prompts
    python benchmarks/bench_draft_precision.py --part random --models llama-3.1-8b --batches 1,8,16 --contexts 32K \
        --tau-from benchmarks/results/draft-precision-<date>-<time>-real.json
    python benchmarks/bench_draft_precision.py --smoke --out /tmp/dp  # a tiny random model on a CPU: checks this script

Part `real`: SmolLM2-135M-Instruct on real long prompts (benchmarks/prompts.py), greedy, γ 6: τ and acceptance by
position per draft precision, with plain decoding's ms per step, a draft step's ms (the draft phase timed alone,
vegas_jax.runtime.phase_timing, divided by γ) and ms per iteration. With --auto also `--gamma auto` (its chosen γ per iteration).

Part `random`: random bf16 weights of Llama-3.1-8B / Qwen3-8B shapes (benchmarks/random_model.py), timing only: the
cache is left as allocated (`Engine.start(fill_cache=...)`: no prefill of 32K-128K tokens) at the given context,
every sequence at its full length. Per precision: a plain step, a draft step, a Vegas iteration (γ 6). Each
configuration is checked against the memory plan first and skipped if it does not fit. With a τ per precision
(from this run's real part or --tau-from), a projected throughput: batch x τ / iteration time, labelled
`projection` (random weights accept nothing, so their own τ means nothing).

Records: model, batch, context, draft_weights, gamma, ms_per_iteration, plain_ms_per_step, draft_ms_per_step, and
tau for real-weight runs. Every record is saved as it is made (benchmarks/results/draft-precision-<date>-<time>-<part>
[-tag].json or --out, and $OUT; "complete": false until the part ends; --smoke: --out and $OUT only); a run stops
starting configurations after --budget-s seconds (default 480, under the device tool's 10 minutes per command).
Prints a table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prompts import long_prompts  # noqa: E402
from benchmarks.random_model import SHAPES, TINY, cache_as_allocated, random_engine  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from vegas_jax.attention.backend import default_backend  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError  # noqa: E402
from vegas_jax.cli.option_flags import token_count  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.runtime.phase_timing import time_phases  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("bf16", "int8", "int4", "int8-a8", "int4-a8")  # -a8: int8 activations (GenerationOptions)


def draft_fields(precision: str) -> dict:
    """GenerationOptions' draft fields of a --precisions entry: weights, and activations after -a8."""
    weights, _, activations = precision.partition("-a")
    return {"draft_weights": weights, "draft_activations": "int8" if activations == "8" else "bf16"}
GAMMA = 6
WARM_ITERATIONS, TIMED_ITERATIONS = 2, 8  # random part: iterations per configuration


class Recorder:
    """Records, saved after every one ("complete": false until finish()); the time budget for starting new
    configurations. --smoke writes only to --out and $OUT: its records are no measurements."""

    def __init__(self, args, part: str):
        self.args, self.started = args, time.perf_counter()
        # The time too: a second run the same day must not overwrite the first.
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
        name = f"draft-precision-{stamp}-{part}" + (f"-{args.tag}" if args.tag else "") + ".json"
        folder = args.out or (None if args.smoke else RESULTS)
        self.log = RecordLog(run_metadata(attention_backend=default_backend()), name, folder)
        self.records = self.log.records

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.args.budget_s

    def add(self, record: dict) -> None:
        print(json.dumps({k: v for k, v in record.items() if k != "acceptance_by_position"}), flush=True)
        self.log.add(record)

    def finish(self) -> None:
        """Complete unless the budget stopped configurations from starting."""
        self.log.finish(complete=not self.over_budget())


def loop_iterations(result) -> int:
    """Iterations the loop ran: the slowest request's."""
    return max(r.metrics["iterations"] for r in result.requests)


def real_part(args, recorder: Recorder) -> dict[str, float]:
    """SmolLM2 on real prompts; returns τ per precision (and 'auto-<precision>'). --smoke: the tiny random model on
    random prompts (the script's path on a CPU; its τ means nothing)."""
    if args.smoke:
        engine, model = random_engine(TINY, jnp.float32), "tiny (random weights, smoke)"
        rng = np.random.default_rng(0)
        prompts_of = lambda n: rng.integers(0, TINY.vocab_size, (args.real_batch, n)).tolist()  # noqa: E731
    else:
        engine, model = Engine(load_model(args.model, jnp.bfloat16)), "smollm2-135m-instruct (real weights)"
        prompts_of = lambda n: long_prompts(engine.tokenizer, args.real_batch, n)  # noqa: E731
    taus = {}
    for prompt_tokens in args.prompt_tokens:
        prompts = prompts_of(prompt_tokens)
        base = GenerationOptions(max_new_tokens=args.max_new_tokens, min_sparse_tokens=args.min_sparse_tokens)
        plain = None
        for _ in range(2):  # the second run is reported: the first pays for allocations
            plain = engine.generate(prompts, base, steps_per_call=None)
        plain_ms = 1e3 * plain.metrics["decode_s"] / loop_iterations(plain)
        runs = [(p, GAMMA) for p in args.precisions] + ([(p, "auto") for p in args.precisions] if args.auto else [])
        draft_ms = {}  # per precision, from its fixed-γ run
        for precision, gamma in runs:
            if recorder.over_budget():
                return taus
            options = dataclasses.replace(base, method="vegas", gamma=gamma, **draft_fields(precision),
                                          gamma_max=GAMMA if gamma == "auto" else None)
            result = None
            for _ in range(2):
                result = engine.generate(prompts, options, steps_per_call=None)
            m = result.metrics
            if gamma == GAMMA:
                draft_ms[precision] = time_phases(engine, engine.start(prompts, options))["draft_ms"] / GAMMA
            record = {
                "model": model, "batch": args.real_batch, "context": prompt_tokens,
                **draft_fields(precision), "precision": precision, "gamma": gamma, "tau": m["tau"],
                "acceptance_by_position": m["acceptance_by_position"],
                "ms_per_iteration": 1e3 * m["decode_s"] / loop_iterations(result),
                "plain_ms_per_step": plain_ms, "draft_ms_per_step": draft_ms.get(precision),
                "decode_tokens_per_s": m["decode_tokens_per_s"],
                "plain_tokens_per_s": plain.metrics["decode_tokens_per_s"],
                "speedup_vs_plain": m["decode_tokens_per_s"] / plain.metrics["decode_tokens_per_s"],
                "identical_to_plain": [a.tokens == b.tokens for a, b in zip(result.requests, plain.requests)],
                "draft_weights_source": engine.plan(prompts, options)["draft_weights_source"],
            }
            if gamma == "auto":
                record.update({k: m[k] for k in ("gamma_chosen_mean", "gamma_chosen_histogram", "gamma_costs")})
            taus[precision if gamma == GAMMA else f"auto-{precision}"] = m["tau"]
            recorder.add(record)
    return taus


def timed_iterations(engine: Engine, started) -> tuple[float, object]:
    """(ms per loop iteration over TIMED_ITERATIONS after WARM_ITERATIONS, the state after them)."""
    params, draft, state = engine.model.params, started.draft_params, started.state
    everyone = np.int32(state.committed.shape[0])
    state = started.decode(params, draft, state, np.int32(WARM_ITERATIONS), everyone)
    jax.block_until_ready(state.output)
    t0 = time.perf_counter()
    state = started.decode(params, draft, state, np.int32(WARM_ITERATIONS + TIMED_ITERATIONS), everyone)
    jax.block_until_ready(state.output)
    ran = int(state.step) - WARM_ITERATIONS
    if ran < 1:  # every request finished during the warm-up: nothing was timed
        raise SystemExit(f"error: --random-new-tokens {started.options.max_new_tokens}: the requests finished after "
                         f"{int(state.step)} iterations, within the {WARM_ITERATIONS} warm-up ones; give them more")
    return 1e3 * (time.perf_counter() - t0) / ran, state


def random_part(args, recorder: Recorder, taus: dict[str, float]) -> None:
    for model_name in args.models:
        config = SHAPES[model_name]
        engine = random_engine(config, jnp.float32 if args.smoke else jnp.bfloat16)
        for context in args.contexts:
            for batch in args.batches:
                if recorder.over_budget():
                    return
                prompts = [[1] * (context - args.random_new_tokens - GAMMA - 1)] * batch
                base = GenerationOptions(max_new_tokens=args.random_new_tokens, max_model_len=context)
                vegas = lambda p: dataclasses.replace(base, method="vegas", gamma=GAMMA, **draft_fields(p))  # noqa: E731
                shape = {"model": f"{model_name} (random weights, timing only)", "batch": batch, "context": context}
                try:  # the largest run of this configuration must fit before anything is allocated
                    engine.plan(prompts, vegas("int8"))
                except InputError as e:
                    recorder.add({**shape, "skipped": str(e)})
                    continue
                plain_ms, _ = timed_iterations(engine, engine.start(prompts, base, fill_cache=cache_as_allocated))
                for precision in args.precisions:
                    options = vegas(precision)
                    # One precision's copies at a time: the plan above counted one.
                    for other in set(engine.model.drafts) - {options.draft_weights}:
                        del engine.model.drafts[other]
                    ms, _ = timed_iterations(engine, engine.start(prompts, options, fill_cache=cache_as_allocated))
                    record = {**shape, **draft_fields(precision), "precision": precision, "gamma": GAMMA,
                              "ms_per_iteration": ms,
                              "plain_ms_per_step": plain_ms, "iteration_over_plain_step": ms / plain_ms}
                    if not args.no_phases:
                        phases = time_phases(engine, engine.start(prompts, options, fill_cache=cache_as_allocated))
                        record.update(draft_ms_per_step=phases["draft_ms"] / GAMMA, verify_ms=phases["verify_ms"],
                                      select_ms=phases["select_ms"])
                    tau = taus.get(precision)
                    if tau is not None:
                        record["projection"] = {
                            "tau": tau, "tau_from": "SmolLM2 real prompts",
                            "tokens_per_s": batch * tau / ms * 1e3,
                            "plain_tokens_per_s": batch / plain_ms * 1e3,
                            "speedup_vs_plain": tau * plain_ms / ms,
                        }
                    recorder.add(record)
                    if args.auto and "draft_ms_per_step" in record:
                        recorder.add(auto_record(engine, prompts, options, record, shape))
        engine.model.drafts.clear()  # the next model's memory
        del engine


def auto_record(engine: Engine, prompts, options: GenerationOptions, fixed: dict, shape: dict) -> dict:
    """Adaptive γ with the cost model this configuration measured (passed in, so no warm-up and no prefill):
    random drafts are never right, so it should run plain steps, probing now and then, at about plain decoding's
    cost per step."""
    plain, draft = fixed["plain_ms_per_step"], fixed["draft_ms_per_step"]
    # From the fixed-γ iteration: its fixed part, the same for every g (what narrower passes save is not measured
    # here), and a draft step per draft.
    fixed_part = max(1.0, (fixed["ms_per_iteration"] - GAMMA * draft) / plain)
    costs = [fixed_part + g * draft / plain for g in range(1, GAMMA + 1)]
    auto = dataclasses.replace(options, gamma="auto", gamma_max=GAMMA, gamma_costs=tuple(costs))
    ms, state = timed_iterations(engine, engine.start(prompts, auto, fill_cache=cache_as_allocated))
    chosen = np.asarray(state.gamma_control.chosen).tolist()
    return {**shape, "draft_weights": options.draft_weights, "draft_activations": options.draft_activations,
            "precision": fixed["precision"], "gamma": "auto", "ms_per_iteration": ms,
            "plain_ms_per_step": plain, "auto_over_plain_step": ms / plain, "gamma_costs": costs,
            "gamma_chosen_histogram": chosen}


def taus_from(path: Path | None) -> dict[str, float]:
    if path is None:
        return {}
    doc = json.loads(path.read_text())
    return {r.get("precision", r["draft_weights"]): r["tau"] for r in doc["records"]
            if r.get("gamma") == GAMMA and "tau" in r}


def print_table(records: list[dict]) -> None:
    print(f"\n{'model':42} {'batch':>5} {'context':>7} {'draft':>7} {'gamma':>5} {'tau':>5} {'iter ms':>8} "
          f"{'plain ms':>8} {'draft ms':>8} {'iter/plain':>10} {'projection':>10}")
    for r in records:
        if "skipped" in r:
            print(f"{r['model']:42} {r['batch']:>5} {r['context']:>7} skipped: {r['skipped'][:60]}")
            continue
        iteration = r.get("ms_per_iteration", r.get("ms_per_token_step"))
        projected = r.get("projection", {}).get("speedup_vs_plain")
        fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        print(f"{r['model']:42} {r['batch']:>5} {r['context']:>7} {r.get('precision', r['draft_weights']):>7} {str(r['gamma']):>5} "
              f"{fmt(r.get('tau'), '5.2f')} {fmt(iteration, '8.2f')} {fmt(r['plain_ms_per_step'], '8.2f')} "
              f"{fmt(r.get('draft_ms_per_step'), '8.3f')} {fmt(iteration / r['plain_ms_per_step'], '10.2f')} "
              f"{fmt(projected, '9.2f') + ('x' if projected else ''):>10}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("real", "random", "both"), default="both")
    p.add_argument("--model", default=None, help="real part: a GGUF / HF / Orbax checkpoint (default: SmolLM2)")
    p.add_argument("--real-batch", type=int, default=8)
    p.add_argument("--prompt-tokens", default="7936", help="real part: comma-separated prompt lengths")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--min-sparse-tokens", type=int, default=256)
    p.add_argument("--models", default="llama-3.1-8b,qwen3-8b", help=f"random part: of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--contexts", default="32K,128K")
    p.add_argument("--random-new-tokens", type=int, default=32)
    p.add_argument("--tau-from", type=Path, default=None, help="random part's projections: a real part's JSON")
    p.add_argument("--precisions", default="bf16,int8,int4",
                   help=f"comma-separated, of {', '.join(PRECISIONS)} (-a8: int8 activations)")
    p.add_argument("--auto", action="store_true", help="also --gamma auto")
    p.add_argument("--no-phases", action="store_true", help="random part: skip the draft phase timing")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in float32: checks the script on a CPU")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    args.precisions = args.precisions.split(",")
    if set(args.precisions) - set(PRECISIONS):
        print(f"error: --precisions {','.join(args.precisions)}: choose from {', '.join(PRECISIONS)}", file=sys.stderr)
        return 2
    args.prompt_tokens = [token_count(t) for t in args.prompt_tokens.split(",")]
    args.models = args.models.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [token_count(t) for t in args.contexts.split(",")]
    if args.smoke:
        args.real_batch, args.prompt_tokens, args.max_new_tokens, args.min_sparse_tokens = 2, [96], 8, 32
        # A tiny random model's drafts are all accepted: enough tokens for the warm-up and the timed iterations.
        args.models, args.batches, args.contexts = ["tiny"], [2], [256]
        args.random_new_tokens = (WARM_ITERATIONS + TIMED_ITERATIONS) * (GAMMA + 1)

    records = []
    taus = taus_from(args.tau_from)
    if args.part in ("real", "both"):
        recorder = Recorder(args, "real")
        taus |= real_part(args, recorder)
        recorder.finish()
        records += recorder.records
    if args.part in ("random", "both"):
        recorder = Recorder(args, "random")
        random_part(args, recorder, taus)
        recorder.finish()
        records += recorder.records
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
