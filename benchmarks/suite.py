"""The benchmark suite: symmetric tuning on a tuning split, evaluation on a held-out split with repeats, serving,
the paper's model scale and a transformers peer, in device calls that each end inside a time budget.

    python -m benchmarks.suite --preset quick --stage tune --model smollm2.gguf     # then heldout, serve, scale, peer
    python -m benchmarks.suite --preset quick --estimate                           # device time the log lacks
    python -m benchmarks.suite --preset paper --families quote,retrieval --lengths 7936 --batches 64,32

Stages (`--stage`, comma-separated, or `all`); tune, heldout, adaptive and quantized run per task family
(benchmarks/task_families.py: `--families`, the preset's by default), each family tuned on its own tuning prompts
and measured on its own held-out ones, every record naming its family:
- tune: per (length, batch) of the preset, plain decoding once and every speculative method's coordinate search
  (benchmarks/suite_tuning.py) on the tuning split, greedy, with the preset's shorter runs (long generation's runs
  whole: its point is the cache growing while it decodes);
- heldout: per (length, batch), on the held-out split, plain decoding and each method at its tuned cell and at the
  common default (γ 6, 7 %, default knobs), greedy and (preset's batches) at temperature 0.7, each measured
  `repeats` times after a warm-up (median, min, max); the ablations vegas-all and last at Vegas's tuned cell;
- adaptive: per (length, batch) of the preset's adaptive batches, Vegas with `--gamma auto` (γ_max 8) at its tuned
  sparse ratio on the held-out prompts, greedy, against plain decoding and the best fixed γ measured there;
- quantized: per (length, batch) of the preset's quantized batches, Vegas at its tuned cell with int8 and int4 draft
  weights on the held-out prompts, greedy: acceptance (τ, by draft position) and tokens/s beside bf16's;
- serve (summarise's prompts, as the peer's): continuous batching (128 requests through 64 slots) of plain
  decoding, Vegas and the baselines, tuned;
- scale: Llama-3.1-8B and Qwen3-8B shapes, random weights (benchmarks/suite_scale.py);
- peer: transformers' generate on the same GGUF and prompts (benchmarks/suite_peer.py; run it in its own call).

Every record is appended to the log (--results, JSON Lines, also copied to $OUT, and appended to --keep) as soon
as it is measured; a record already in the log is skipped, so the same command resumes where a call stopped. A
call stops before a measurement its estimate says would pass --budget-s, and exits with status 3 ("run again to
resume"); 4 when it skipped measurements that need another stage first (held-out cells not tuned yet: listed as
"not run"); 0 when its stages are complete. Each call ends by plotting the log (next to it and in $OUT);
`python -m benchmarks.report` turns the log into the results of docs/benchmarks.md (and the README's headline table) and the same plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.parallel_starts import parallel_starts  # noqa: E402
from benchmarks.prompt_splits import PromptSet  # noqa: E402
from benchmarks.suite_presets import (  # noqa: E402
    ABLATIONS, BASELINES, COMPILE_S, PRESETS, QUANTIZED, SAMPLED_TEMPERATURE, SPECULATIVE, STAGES, Preset,
    describe_costs, run_s,
)
from benchmarks.suite_records import (  # noqa: E402
    RecordLog, find as find_records, key_fields_differing, latest_per_key, read_logs, record_key,
)
from benchmarks.suite_tuning import Cell, next_cells, rates_of, tuned_cell  # noqa: E402
from benchmarks.task_families import DEFAULT_FAMILY, FAMILIES, family_prompts  # noqa: E402
from vegas_jax.decode.adaptive_gamma import AUTO  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
STOPPED = 3  # exit status of a call that stopped for its budget
INCOMPLETE = 4  # ... that skipped measurements needing another stage first (listed as "not run")


class OutOfTime(Exception):
    """The next measurement would pass the call's budget."""


class CostsNotTimed(RuntimeError):
    """Adaptive γ's first run ended (every request done) before its cost model was timed."""


class BadFlag(ValueError):
    """A flag's value the suite cannot run: one `error:` line, exit status 2."""


def source_digest() -> str:
    """A hash of the code that ran (every .py file of the packages and benchmarks), for when git is not there."""
    h = hashlib.sha256()
    for folder in ("vegas_jax", "models", "pallas_kernels", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    """$VEGAS_CODE if set (a device machine's copy of the tree has no .git), else `git describe`."""
    if os.environ.get("VEGAS_CODE"):
        return os.environ["VEGAS_CODE"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def summarize_runs(runs: list[dict], rate: str = "decode_tokens_per_s") -> dict:
    """Median, min and max of the runs' rates, and their other figures from the median run."""
    rates = [r[rate] for r in runs]
    middle = sorted(runs, key=lambda r: r[rate])[(len(runs) - 1) // 2]
    out = {
        "repeats": len(runs),
        rate: statistics.median(rates),
        rate + "_min": min(rates),
        rate + "_max": max(rates),
        rate + "_runs": rates,
        "tau": statistics.median(r["tau"] for r in runs),
        "ms_per_iteration": statistics.median(r["ms_per_iteration"] for r in runs),
        # A run that started from a kept prefill (Session.reuse) timed a copy: the prefill time is the others'.
        "prefill_s": statistics.median(prefills) if (prefills := [r["prefill_s"] for r in runs
                                                                   if not r.get("prefill_reused")]) else None,
        "prefills_reused": sum(bool(r.get("prefill_reused")) for r in runs),
        "acceptance_by_position": middle["acceptance_by_position"],
    }
    for extra in ("decode_tokens", "batch_occupancy", "decode_calls", "refill", "gamma_chosen_mean",
                  "gamma_chosen_histogram"):
        if extra in middle:
            out[extra] = middle[extra]
    return out


class Session:
    """One call of the suite: the preset, the log, the clock, and what it loaded (lazily: a peer-only call never
    starts JAX on the GPU, whose allocator would take most of its memory). `dtype` "auto" is resolved when the
    model loads (bfloat16 on GPU, float32 on CPU)."""

    def __init__(self, preset: Preset, log: RecordLog, budget_s: float, model_path: str | None, dtype: str):
        self.preset, self.log, self.budget_s = preset, log, budget_s
        self.model_path, self.dtype = model_path, dtype
        self.started = time.perf_counter()
        self._engine = None
        self._tokenizer = None
        self._reuse = None
        self._prompts: dict[tuple[str, str, int], PromptSet] = {}
        self.compiled: set = set()  # loop_key()s of the loops this process compiled
        self.ar_tokens: dict = {}  # (family, split, batch, length) -> plain greedy tokens, to compare with
        self.incomplete: list[str] = []  # what could not run yet (untuned cells)
        self._provenance = {"code": git_commit(), "source_digest": source_digest(), "model": model_path}

    # ---- what it loads -------------------------------------------------------------------------------------
    @property
    def engine(self):
        if self._engine is None:
            import jax
            import jax.numpy as jnp

            from vegas_jax.runtime.engine import Engine
            from vegas_jax.loading import load_model

            if self.dtype == "auto":
                self.dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
            self._engine = Engine(load_model(self.model_path, {"bfloat16": jnp.bfloat16,
                                                                 "float32": jnp.float32}[self.dtype]))
        return self._engine

    @property
    def reuse(self):
        """What lets every static run of a split's prompts at a batch and length start from one prefill (its cache
        copied, vegas_jax.runtime.prefill_reuse): a prefill was 60 % of a tuning run's time at 64 x 7.9K on the H200."""
        if self._reuse is None:
            from vegas_jax.runtime.prefill_reuse import PrefillReuse

            self._reuse = PrefillReuse()
        return self._reuse

    @property
    def tokenizer(self):
        if self._engine is not None:
            return self._engine.tokenizer
        if self._tokenizer is None:
            from vegas_jax.loading.gguf import open_gguf
            from vegas_jax.loading.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_gguf(open_gguf(self.model_path))
        return self._tokenizer

    def prompts(self, split: str, count: int, length: int, family: str = DEFAULT_FAMILY) -> PromptSet:
        """`count` prompts of the family's split; a smaller count takes the first prompts of a larger one (same
        slices)."""
        cached = self._prompts.get((family, split, length))
        if cached is None or len(cached.prompts) < count:
            cached = family_prompts(family, self.tokenizer, split, count, length)
            self._prompts[(family, split, length)] = cached
            fields = {"stage": "prompts", "split": split, "prompt_tokens": length, "requests": count,
                      "family": family}
            if record_key(fields) not in self.log:
                self.log.append({**fields, **cached.provenance})
        return cached.head(count)

    # ---- time and records -------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def check_time(self, estimate_s: float, what: str) -> None:
        if self.elapsed() + estimate_s > self.budget_s:
            raise OutOfTime(f"{what}: about {estimate_s:.0f} s more would pass --budget-s {self.budget_s:.0f} "
                            f"({self.elapsed():.0f} s used)")

    def missing(self, fields: dict) -> bool:
        return record_key(fields) not in self.log

    def provenance(self, result: dict) -> dict:
        out = {**self._provenance, "dtype": self.dtype}
        out["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if "device" not in result:  # the peer names its own (torch's) device; asking JAX would start it
            import jax

            out.update(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__)
        return out

    def recorded(self, fields: dict) -> dict | None:
        """The log's record of `fields`, keyed as a record is written: the session's provenance (its model above
        all) under the fields."""
        return self.log.get(record_key({**self._provenance, **fields}))

    def measure(self, fields: dict, estimate_s: float, run) -> dict:
        """The log's record of `fields`, or run() measured now and appended (after checking the budget)."""
        existing = self.recorded(fields)
        if existing is not None:
            return existing
        what = " ".join(f"{k}={v}" for k, v in fields.items() if k in ("stage", "family", "method", "batch",
                                                                          "prompt_tokens", "model", "context",
                                                                          "split"))
        self.check_time(estimate_s, what)
        t0 = time.perf_counter()
        result = run()
        # What the measurement says of itself (the peer's device, the scale runs' dtype) wins over the session's.
        record = {**self.provenance(result), **fields, **result, "seconds": time.perf_counter() - t0}
        # A result that changed a key field would be filed under another key than the one looked up above, and
        # every later call would measure it again instead of resuming.
        changed = key_fields_differing(record, {**self._provenance, **fields})
        if changed:
            raise ValueError(f"{what}: its result sets {', '.join(changed)}, which key its record: put them in the "
                             f"fields it is measured under")
        self.log.append(record)
        shown = {k: record.get(k) for k in ("decode_tokens_per_s", "tau", "ms_per_iteration", "roofline_fraction")
                 if record.get(k) is not None}
        print(f"[{self.elapsed():6.0f} s] {what} {fields.get('knobs') or ''} γ={fields.get('gamma')} "
              f"r={fields.get('sparse_ratio')} T={fields.get('temperature')}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)
        return record

    def estimate(self, method: str, cell: Cell, batch: int, length: int, context: int, new_tokens: int, runs: int, *,
                 sampled: bool, served: bool = False) -> float:
        compiled = loop_key(method, cell, batch, length, context, sampled, served) in self.compiled
        kind = "ar" if method == "ar" else "adaptive" if cell.auto_gamma else "speculative"
        compile_s = 0.0 if compiled else COMPILE_S[kind]
        return compile_s + runs * run_s(batch, length, new_tokens) * (3 if served else 1)


# ---- measurements of SmolLM2 ----------------------------------------------------------------------------------


def loop_key(method: str, cell: Cell, batch: int, length: int, context: int, sampled: bool,
             served: bool = False) -> tuple:
    """What tells one compiled decode loop from another within a session (Session.compiled): not the family, whose
    prompts of one length and context run the same loops."""
    return method, cell, batch, length, context, sampled, served


def options_for(method: str, cell: Cell, context: int, new_tokens: int, temperature: float):
    from vegas_jax.runtime.engine import GenerationOptions

    return GenerationOptions(max_new_tokens=new_tokens, temperature=temperature, max_model_len=context,
                             **cell.option_fields(method))


def _cell_fields(method: str, cell: Cell) -> dict:
    return {"method": method, "gamma": cell.gamma, "sparse_ratio": cell.sparse_ratio, "knobs": dict(cell.knobs)}


def _static_fields(stage: str, split: str, method: str, cell: Cell, batch: int, length: int,
                   temperature: float, family: str = DEFAULT_FAMILY) -> dict:
    return {"stage": stage, "family": family, "split": split, "batch": batch, "prompt_tokens": length,
            "temperature": temperature, **_cell_fields(method, cell)}


# Loops compiled at once before a round of sweeps' (or a held-out batch's) measurements, at most. Compiling is most
# of the tuning stage's time (about 10 s per speculative configuration against about 2 s of runs at 64 x 7.9K), and
# XLA compiles on the host's cores without holding Python's lock, so a round's cells compile side by side on the
# H200 machine's 16 cores; the measured runs stay one at a time. On the H200 at 64 x 7.9K (random SmolLM2 weights),
# configurations compiled in 8.8 s one at a time, 4.1 s each four at a time and 3.5 s eight at a time (tracing and
# lowering hold the lock). Every thread's Engine.start holds a cache, so fewer run where the device's free memory
# holds fewer (benchmarks/parallel_starts.py).
PARALLEL_COMPILES = 6


def compile_ahead(session: Session, stage: str, split: str, configurations: list[tuple[str, Cell]], batch: int,
                  length: int, temperature: float, new_tokens: int,
                  family: str = DEFAULT_FAMILY) -> dict[tuple[str, Cell], float]:
    """Compiles the loops of these (method, cell) configurations (`Engine.start`: prefill and bootstrap too, no
    decoding), skipping those the log has or this process compiled; returns each one's compile seconds, for its
    record. The first compiles alone, so that the programs every configuration of a batch and length shares
    (prefill) and the GEMM autotuning of their shapes are done once, undisturbed by other threads' work on the
    GPU; the rest compile concurrently and find those in XLA's caches."""
    from concurrent.futures import ThreadPoolExecutor

    sampled, context = temperature > 0, session.preset.context(family, length)
    todo = [(method, cell) for method, cell in configurations
            if loop_key(method, cell, batch, length, context, sampled) not in session.compiled
            and session.recorded(_static_fields(stage, split, method, cell, batch, length, temperature,
                                                family)) is None]
    if len(todo) < 2:
        return {}
    prompts = session.prompts(split, batch, length, family).prompts
    engine = session.engine
    options = {c: options_for(c[0], c[1], context, new_tokens, temperature) for c in todo}
    workers = parallel_starts([(engine, o) for o in options.values()], prompts, PARALLEL_COMPILES)
    rounds = 1 + -(-(len(todo) - 1) // workers)
    session.check_time(rounds * COMPILE_S["speculative"], f"compiling {len(todo)} configurations at {length} x {batch}")

    def start(configuration):
        return engine.start(prompts, options[configuration], reuse_prefill=session.reuse).timings["compile_s"]

    seconds = {todo[0]: start(todo[0])}
    with ThreadPoolExecutor(workers) as pool:
        seconds |= dict(zip(todo[1:], pool.map(start, todo[1:])))
    session.compiled.update(loop_key(method, cell, batch, length, context, sampled) for method, cell in todo)
    return seconds


def measure_static(session: Session, stage: str, split: str, method: str, cell: Cell, batch: int, length: int,
                   temperature: float, *, new_tokens: int, repeats: int, extra: dict | None = None,
                   family: str = DEFAULT_FAMILY) -> dict:
    """One static batch of the family's prompts of the split: warm-up runs, then `repeats` measured runs of the same
    config. A loop compiled ahead (`compile_ahead`) reports its compile time through `extra`."""
    from benchmarks.bench_decode import first_differences, run_one

    prompts = session.prompts(split, batch, length, family)
    fields = _static_fields(stage, split, method, cell, batch, length, temperature, family)
    sampled, context = temperature > 0, session.preset.context(family, length)
    runs_needed = session.preset.warmup + repeats

    def run() -> dict:
        engine = session.engine
        options = options_for(method, cell, context, new_tokens, temperature)
        measured_costs = {}
        if options.auto_gamma:
            options, measured_costs = with_measured_costs(engine, prompts.prompts, options)
        runs, tokens = [], None
        for _ in range(runs_needed):
            record, tokens = run_one(engine, prompts.prompts, options, False, 1, reuse_prefill=session.reuse)
            runs.append(record)
        session.compiled.add(loop_key(method, cell, batch, length, context, sampled))
        out = {**summarize_runs(runs[session.preset.warmup:]), "compile_s": runs[0]["compile_s"],
               "new_tokens": new_tokens, "prompts_sha256": prompts.provenance["prompts_sha256"], **measured_costs,
               **(extra or {})}
        same = (family, split, batch, length)
        if method == "ar" and not sampled:
            session.ar_tokens[same] = tokens
        elif not sampled and same in session.ar_tokens:
            # Greedy speculative decoding reproduces plain greedy decoding, up to bf16's near-ties.
            differences = first_differences(tokens, session.ar_tokens[same])
            out["sequences_identical_to_ar"] = differences.count(None)
        return out

    estimate = session.estimate(method, cell, batch, length, context, new_tokens, runs_needed + cell.auto_gamma,
                                sampled=sampled)
    return session.measure(fields, estimate, run)


def with_measured_costs(engine, prompts, options) -> tuple:
    """Adaptive γ's options with the cost model that a first run of theirs measures and keeps
    (vegas_jax.decode.adaptive_gamma.Warmup: what `generate` does for a new configuration), given to the measured runs,
    which then decode in one call as every other method's do (bench_decode.run_one); and, for the record, that
    cost model and the first run's compile time (the measured runs find its loop compiled)."""
    metrics = engine.generate(prompts, options, steps_per_call=None).metrics
    costs = metrics["gamma_costs"]
    if costs is None:
        raise CostsNotTimed(f"its first run ended before its cost model was timed ({options.max_new_tokens} new "
                            "tokens at most, every request done within vegas_jax.decode.adaptive_gamma.Warmup's forced "
                            "iterations)")
    return (dataclasses.replace(options, gamma_costs=tuple(costs)),
            {"gamma_costs": costs, "compile_s": metrics["compile_s"]})


def tune(session: Session, length: int, batch: int, family: str = DEFAULT_FAMILY) -> None:
    """Every method's search, side by side: each round takes the current sweep of every method not done (the
    searches are independent), so that a round's compilations fill the threads (`compile_ahead`)."""
    p = session.preset
    new_tokens = p.tune_new_tokens_of(family)
    while True:
        todo = []
        for method in ("ar",) + SPECULATIVE:
            records = search_records(session.log.find, method, batch, length, family)
            todo += [(method, cell) for cell in next_cells(method, p.grid, rates_of(records))]
        if not todo:
            return
        compiled = compile_ahead(session, "tune", "tuning", todo, batch, length, 0.0, new_tokens, family)
        for method, cell in todo:
            measure_static(session, "tune", "tuning", method, cell, batch, length, 0.0, new_tokens=new_tokens,
                           repeats=p.tune_repeats, extra={"tuned": False, **_compile_time(compiled, method, cell)},
                           family=family)


def tuned_cells(session: Session, length: int, batch: int,
                family: str = DEFAULT_FAMILY) -> dict[str, Cell | None]:
    """Each speculative method's tuned cell for this family, length and batch (from the batch it borrows tuning
    from)."""
    p, source = session.preset, session.preset.tuning_batch(batch)
    cells = {}
    for method in SPECULATIVE:
        records = search_records(session.log.find, method, source, length, family)
        cells[method] = tuned_cell(method, p.grid, rates_of(records))
    return cells


def search_records(find, method: str, batch: int, length: int, family: str = DEFAULT_FAMILY) -> list[dict]:
    """The records of one method's tuning search for this family at this batch and length; `find(**fields)` is
    RecordLog.find or suite_records.find over other records."""
    return find(stage="tune", split="tuning", method=method, batch=batch, prompt_tokens=length, temperature=0.0,
                family=family)


def _where(family: str, length: int, batch: int) -> str:
    """A cell of a stage, as the not-run lines name it (summarise's as before families existed)."""
    return f"{length} x {batch}" + ("" if family == DEFAULT_FAMILY else f" ({family})")


def heldout(session: Session, length: int, batch: int, family: str = DEFAULT_FAMILY) -> None:
    p = session.preset
    tuned = tuned_cells(session, length, batch, family)
    temperatures = [0.0] + ([SAMPLED_TEMPERATURE] if batch in p.sampled_batches else [])
    new_tokens = p.new_tokens_of(family)
    for temperature in temperatures:
        planned = [("ar", Cell.default("ar"), {"tuned": True, "default": True})]
        for method in SPECULATIVE:
            chosen, default = tuned[method], Cell.default(method)
            if chosen is None:
                session.incomplete.append(f"{method} at {_where(family, length, batch)}: not tuned yet (--stage tune)")
                continue
            planned.append((method, chosen, {"tuned": True, "default": chosen == default}))
            if chosen != default and (temperature == 0 or p.sampled_defaults):
                planned.append((method, default, {"tuned": False, "default": True}))
        if batch in p.ablation_batches and tuned["vegas"] is not None:
            vegas = tuned["vegas"]
            planned += [(method, vegas, {"tuned": False, "default": vegas == Cell.default("vegas"),
                                         "at_cell_of": "vegas"}) for method in ABLATIONS]
        compiled = compile_ahead(session, "heldout", "heldout", [(m, c) for m, c, _ in planned], batch, length,
                                 temperature, new_tokens, family)
        for method, cell, extra in planned:
            measure_static(session, "heldout", "heldout", method, cell, batch, length, temperature,
                           new_tokens=new_tokens, repeats=p.repeats,
                           extra={"tuned_at_batch": p.tuning_batch(batch), **extra,
                                  **_compile_time(compiled, method, cell)}, family=family)


def adaptive(session: Session, length: int, batch: int, family: str = DEFAULT_FAMILY) -> None:
    """Vegas with adaptive γ at the sparse ratio (and knobs) of its tuned cell, so that what differs from the
    fixed-γ runs of `heldout` is how many drafts each iteration makes; greedy, held-out prompts."""
    p = session.preset
    tuned = tuned_cells(session, length, batch, family)["vegas"]
    if tuned is None:
        session.incomplete.append(f"adaptive γ at {_where(family, length, batch)}: Vegas not tuned yet "
                                  "(--stage tune)")
        return
    try:
        measure_static(session, "adaptive", "heldout", "vegas", dataclasses.replace(tuned, gamma=AUTO), batch,
                       length, 0.0, new_tokens=p.new_tokens_of(family), repeats=p.repeats,
                       extra={"tuned": False, "at_cell_of": "vegas", "tuned_at_batch": p.tuning_batch(batch)},
                       family=family)
    except CostsNotTimed as e:  # greedy: a rerun would end the same way; the other cells still run
        session.incomplete.append(f"adaptive γ at {_where(family, length, batch)}: {e}")


def quantized(session: Session, length: int, batch: int, family: str = DEFAULT_FAMILY) -> None:
    """Vegas at its tuned cell with each quantized draft (QUANTIZED: int8, int4 weights; the target stays bf16, so
    the output does not change), greedy, held-out prompts: what quantizing the drafts costs in acceptance, beside
    the bf16 drafts of the heldout stage's record of the same cell."""
    p = session.preset
    tuned = tuned_cells(session, length, batch, family)["vegas"]
    if tuned is None:
        session.incomplete.append(f"quantized drafts at {_where(family, length, batch)}: Vegas not tuned yet "
                                  "(--stage tune)")
        return
    for weights in QUANTIZED:
        measure_static(session, "quantized", "heldout", "vegas", tuned.with_value("draft_weights", weights), batch,
                       length, 0.0, new_tokens=p.new_tokens_of(family), repeats=p.repeats,
                       extra={"tuned": False, "at_cell_of": "vegas", "tuned_at_batch": p.tuning_batch(batch)},
                       family=family)


def _compile_time(compiled: dict, method: str, cell: Cell) -> dict:
    """A record's compile_s when its loop was compiled ahead (its own warm-up then compiles nothing)."""
    return {"compile_s": compiled[method, cell]} if (method, cell) in compiled else {}


def fastest_baseline(session: Session, length: int, batch: int) -> str | None:
    records = [r for r in session.log.find(stage="heldout", split="heldout", batch=batch, prompt_tokens=length,
                                           temperature=0.0, family=DEFAULT_FAMILY)
               if r.get("tuned") and r["method"] in BASELINES]
    return max(records, key=lambda r: r["decode_tokens_per_s"])["method"] if records else None


def serve(session: Session) -> None:
    from benchmarks.bench_decode import run_served

    p = session.preset
    for case in p.serve:
        tuned = tuned_cells(session, case.prompt_tokens, case.slots)
        fastest = fastest_baseline(session, case.prompt_tokens, case.slots)
        baselines = BASELINES if case.all_baselines else ((fastest,) if fastest else ())
        if not case.all_baselines and fastest is None:
            session.incomplete.append(f"serve {case.prompt_tokens}: no held-out baseline at batch {case.slots} yet")
        for method in ("ar", "vegas", *baselines):
            cell = Cell.default("ar") if method == "ar" else tuned[method]
            if cell is None:
                session.incomplete.append(f"serve {method} at {case.prompt_tokens} x {case.slots}: not tuned yet")
                continue
            prompts = session.prompts("heldout", case.requests, case.prompt_tokens)
            context = p.context(DEFAULT_FAMILY, case.prompt_tokens)
            fields = {"stage": "serve", "family": DEFAULT_FAMILY, "split": "heldout", "batch": case.slots,
                      "requests": case.requests, "prompt_tokens": case.prompt_tokens, "temperature": 0.0,
                      **_cell_fields(method, cell)}

            def run(method=method, cell=cell, prompts=prompts) -> dict:
                options = options_for(method, cell, context, p.new_tokens, 0.0)
                runs = [run_served(session.engine, prompts.prompts, options, case.slots, None)[0]
                        for _ in range(p.warmup + p.repeats)]
                session.compiled.add(loop_key(method, cell, case.slots, case.prompt_tokens, context, False,
                                              served=True))
                measured = runs[p.warmup:]
                steady = [r["steady_decode_tokens_per_s"] for r in measured if r["steady_decode_tokens_per_s"]]
                return {**summarize_runs(measured), "compile_s": runs[0]["compile_s"], "tuned": True,
                        "default": cell == Cell.default(method), "new_tokens": p.new_tokens,
                        "steady_decode_tokens_per_s": statistics.median(steady) if steady else None,
                        "steady_decode_tokens_per_s_runs": steady,
                        "prompts_sha256": prompts.provenance["prompts_sha256"]}

            estimate = session.estimate(method, cell, case.slots, case.prompt_tokens, context, p.new_tokens,
                                        p.warmup + p.repeats, sampled=False, served=True)
            session.measure(fields, estimate, run)


def run_stages(session: Session, stages: list[str]) -> None:
    p = session.preset
    for family in p.families:  # one family's cells done before the next's: a call cut short leaves whole families
        for length in p.lengths_of(family):
            for batch in p.batches:
                if "tune" in stages and batch in p.tuned_batches:
                    tune(session, length, batch, family)
                if "heldout" in stages:
                    heldout(session, length, batch, family)
                if "adaptive" in stages and batch in p.adaptive_batches:
                    adaptive(session, length, batch, family)
                if "quantized" in stages and batch in p.quantized_batches:
                    quantized(session, length, batch, family)
    if "serve" in stages:
        serve(session)
    if "scale" in stages:
        from benchmarks.suite_scale import run_scale

        run_scale(session, p)
    if "peer" in stages:
        from benchmarks.suite_peer import run_peer

        run_peer(session, p)


def configure_compilation_cache(folder: str) -> None:
    """XLA's persistent cache: a later call on the same (warm) machine compiles each configuration from disk."""
    if folder:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(Path(folder).resolve()))


def parse_stages(text: str, flag: str = "--stage") -> list[str]:
    stages = list(STAGES) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise BadFlag(f"{flag} {text}: choose from {', '.join(STAGES)} or all (comma-separated)")
    return stages


def write_plots(records: list[dict], folders: list[Path]) -> None:
    """The report's plots of the log so far, into each folder (the results folder, $OUT), if matplotlib is here."""
    try:
        from benchmarks import suite_plots
    except ImportError:
        print("matplotlib is not installed: no plots (python -m benchmarks.report makes them from the log)")
        return
    for folder in folders:
        try:
            written = suite_plots.write_all(records, folder, "suite")
        except Exception as e:  # noqa: BLE001  (a plot must not cost the call its exit status or its records)
            print(f"plots into {folder} failed: {type(e).__name__}: {e}")
            return
        for path in written.values():
            print(f"wrote {path}")


def narrowed(preset: Preset, flag: str, text: str | None) -> Preset:
    """The preset with its lengths or batches (`flag`) cut to those listed, which must be the preset's own."""
    if not text:
        return preset
    field = flag.lstrip("-")
    allowed = getattr(preset, field)
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise BadFlag(f"{flag} {text}: a comma-separated list of integers") from None
    if not values or set(values) - set(allowed):
        raise BadFlag(f"{flag} {text}: preset {preset.name} has {', '.join(map(str, allowed))}")
    if field == "batches":  # a batch that borrows tuning keeps what it borrows from only if listed
        lent = {b for b in values if preset.tuning_batch(b) not in values}
        if lent:
            raise BadFlag(f"{flag} {text}: batch {min(lent)} takes its tuning from batch "
                          f"{preset.tuning_batch(min(lent))}: list both")
    return preset.narrowed(**{"lengths": preset.lengths, "batches": preset.batches, field: values})


def with_families(preset: Preset, text: str | None) -> Preset:
    """The preset running these task families (any of task_families.FAMILIES, in the order given)."""
    if not text:
        return preset
    families = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    if not families or set(families) - set(FAMILIES):
        raise BadFlag(f"--families {text}: choose from {', '.join(FAMILIES)} (comma-separated)")
    return preset.narrowed(preset.lengths, preset.batches, families)


def log_progress(preset: Preset, records: list[dict], model_path: str | None):
    """suite_presets.Left from a log's records (one per key), those of `model_path` as the session keys them (the
    scale stage's name their shapes instead): a tuning search the log completes lacks nothing, a partial one the
    grid cells it has not measured (at most: the search visits fewer); any other unit, the share of its records
    the log lacks."""
    find = functools.partial(find_records, [r for r in records if r.get("stage") == "scale"
                                            or r.get("model") == model_path])

    def left(stage: str, length: int | None, batch: int, method: str | None, expected: int, family: str) -> float:
        if stage == "tune":
            if tuned(method, batch, length, family) is not None:
                return 0.0
            found = search_records(find, method, batch, length, family)
        elif stage == "scale":  # a scale case's unit is (context, batch, model)
            found = find(stage=stage, context=length, batch=batch, model=method)
        else:
            found = find(stage=stage, prompt_tokens=length, batch=batch, family=family)
            if stage == "heldout":  # a method tuned to the default cell has one record for both
                same = sum(tuned(m, preset.tuning_batch(batch), length, family) == Cell.default(m)
                           for m in SPECULATIVE)
                expected -= same * (2 if batch in preset.sampled_batches and preset.sampled_defaults else 1)
        return max(0.0, 1.0 - len(found) / expected)

    def tuned(method: str, batch: int, length: int, family: str) -> Cell | None:
        return tuned_cell(method, preset.grid, rates_of(search_records(find, method, batch, length, family)))

    return left


def check_model(model: str | None, read_here: bool) -> None:
    """BadFlag naming --model unless the stages that measure SmolLM2 can read it: a GGUF file that exists (the
    embedded one when None; checked only if `read_here`: --estimate reads the log alone, whose records may name a
    path on the device machine), and the gguf package to read it with."""
    import importlib.util

    if read_here and model is not None and not Path(model).expanduser().is_file():
        raise BadFlag(f"--model {model}: no such file")
    if importlib.util.find_spec("gguf") is None:
        raise BadFlag(f"--model {model or '(the embedded SmolLM2)'}: reading a GGUF needs the gguf package "
                      "(pip install gguf), which this Python lacks")


def check_appendable(path: Path) -> None:
    """BadFlag naming --keep unless records could be appended to `path`: a writable file, or none yet in a folder
    that exists or can be made (nothing is created here: --estimate writes nothing)."""
    path = path.expanduser()
    if path.is_dir():
        raise BadFlag(f"--keep {path}: is a folder; name a file")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise BadFlag(f"--keep {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise BadFlag(f"--keep {path}: {existing} is not writable")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    p.add_argument("--stage", default="all", help=f"comma-separated: {', '.join(STAGES)}; or all")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no measurement that its estimate says would end after this many seconds")
    p.add_argument("--model", default=None, help="the GGUF (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--results", type=Path, default=None, help="the log (default benchmarks/results/suite-PRESET.jsonl)")
    p.add_argument("--compilation-cache", default=str(REPO / ".jax-cache"),
                   help="XLA's persistent compilation cache folder ('' for none)")
    p.add_argument("--keep", type=Path, default=None,
                   help="a second log outside the working tree (on the device machine: ~/suite-paper.jsonl), "
                        "appended to as the log is; records there the log lacks are added to it first")
    p.add_argument("--lengths", default=None, help="only these of the preset's prompt lengths (comma-separated)")
    p.add_argument("--batches", default=None, help="only these of the preset's batches (comma-separated)")
    p.add_argument("--families", default=None,
                   help=f"the task families that tune, heldout, adaptive and quantized run (comma-separated, of "
                        f"{', '.join(FAMILIES)}; default: the preset's)")
    p.add_argument("--estimate", action="store_true",
                   help="print the estimated device time of what the log lacks and exit (runs nothing)")
    p.add_argument("--remeasure", default=None,
                   help="comma-separated stages whose records other code measured (another source digest) leave "
                        "the log (and --keep) to be measured again; records this code made stay, so the same "
                        "command resumes")
    args = p.parse_args(argv)

    try:
        preset = narrowed(narrowed(PRESETS[args.preset], "--lengths", args.lengths), "--batches", args.batches)
        preset = with_families(preset, args.families)
        stages = parse_stages(args.stage)
        remeasured = parse_stages(args.remeasure, "--remeasure") if args.remeasure else []
        if args.budget_s <= 0:
            raise BadFlag(f"--budget-s {args.budget_s:g}: must be > 0")
        if args.keep is not None:
            check_appendable(args.keep)
        if set(stages) - {"scale"}:
            check_model(args.model, read_here=not args.estimate)
    except BadFlag as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The scale stage builds random weights of its own shapes: only the other stages need the GGUF (and the gguf
    # package, which a machine running only the scale stage may lack).
    model_path = args.model
    if model_path is None and set(stages) - {"scale"}:
        from vegas_jax.loading.gguf import embedded_smollm2_path

        model_path = str(embedded_smollm2_path())
    log_path = args.results or RESULTS / f"suite-{preset.name}.jsonl"
    digest = source_digest()

    def stale(record: dict) -> bool:
        return record.get("stage") in remeasured and record.get("source_digest") != digest

    # The kept log holds a copy of the log: one record per key.
    logged = [r for r in latest_per_key(read_logs([path.expanduser() for path in (log_path, args.keep) if path]))
              if not stale(r)]
    print(describe_costs(preset, stages, log_progress(preset, logged, model_path), log_path.name), flush=True)
    if args.estimate:
        return 0
    configure_compilation_cache(args.compilation_cache)
    out = os.environ.get("OUT")
    log = RecordLog(log_path, Path(out) if out else None, args.keep)
    if remeasured:
        print(f"--remeasure: {log.drop(stale)} record(s) of {', '.join(remeasured)} from other code left "
              f"{log.path.name}", flush=True)
    session = Session(preset, log, args.budget_s, model_path, args.dtype)
    try:
        run_stages(session, stages)
    except OutOfTime as stop:
        print(f"\nstopped: {stop}. Run the same command again to resume ({len(log.records)} records in {log.path}).")
        return STOPPED
    finally:
        write_plots(log.records, [log.path.parent] + ([Path(out)] if out else []))
    for line in session.incomplete:
        print(f"not run: {line}")
    print(f"\n{'incomplete' if session.incomplete else 'done'}: {', '.join(stages)} of preset {preset.name} in "
          f"{session.elapsed():.0f} s ({len(log.records)} records in {log.path})")
    return INCOMPLETE if session.incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
