"""The GPU lossless check: speculative decoding against plain decoding on the device (issue 49).

CI has no GPU, so run it after every change to a kernel or the decode loop: greedy speculative output against plain
greedy decoding on held-out prompts, in float32 for every method and option, and in bf16 beside plain decoding's own
identity across batch sizes; what float32's dots cost; and sampled decoding's distribution on the GPU.

    python benchmarks/check_lossless_gpu.py --quick --results benchmarks/results/lossless-gpu-quick.json
    python benchmarks/check_lossless_gpu.py --parts float32 --batches 64      # the full check, a part per call
    python benchmarks/check_lossless_gpu.py --smoke --results /tmp/lossless.json  # a tiny random model on a CPU

--model: a GGUF / HF / Orbax checkpoint (default: the embedded SmolLM2-135M-Instruct). Prompts: the held-out split
(benchmarks/prompt_splits.py), each exactly --prompt-tokens long; greedy, γ 6, sparse ratio 7 %, --new-tokens new
tokens. Parts (--parts, comma-separated):

- float32: plain greedy decoding at each batch (1, 8, and 64 without --quick; batch 1 over the first
  --batch1-prompts prompts, one at a time) and, at the same batch, every selection method (both score modes for
  Vegas), int8 / int4 draft weights (int4 also with int8 activations), adaptive γ, dense draft trees (self and
  n-gram drafters) and SSV's exact class on the model's NSA view (trees of both drafters, against plain decoding of
  the view); --quick runs adaptive γ and SSV at batch 8 only (their loops take minutes to compile). Target:
  identical to plain decoding on 100 % of sequences, and τ >= 2 for the chains the model drafts for itself (a broken
  draft product stays lossless, only slower: verification rejects its drafts).
- bf16: plain decoding of the same prompts at each batch size (the noise floor: plain against plain, batch 1 vs 8
  vs 64) and Vegas and Stream against plain decoding at their own batch. Target: speculative-vs-plain identity no
  worse than plain-vs-plain, every divergence a near-tie.
- cost: decode tokens/s of plain decoding and Vegas at the largest batch, float32 at the engine's precision
  (highest), float32 at JAX's default (TF32 on NVIDIA GPUs: the engine before issue 49) and bf16; with each
  one's identity to its own plain decoding.
- sampled: tests/test_sampling_distribution.py's and the draft-tree tests' sampled-distribution checks (chains,
  int4 drafts with int8 activations and adaptive γ, dense trees of both drafters, an NSA-view tree) at their seed
  budgets, on this device's kernels: Pearson's p against the exact float64 joint (p > 1e-3 passes).

Each divergence is reported with its first position, plain decoding's top-2 log-probability margin there (the top-2
logit margin: both share one normalizer), the speculative token's rank among plain decoding's 8 most likely there
and its gap (plain decoding's best log-probability less the speculative token's). A divergence is a near-tie when
its gap is within the dtype's rounding as measured here: at most twice the largest difference of a token's
log-probability between plain runs of the same prompts at two batch sizes (over the tokens they agree on), which
is rounding alone. Three near-equal candidates make a near-tie of the third (seen in bf16 on SmolLM2), so the gap,
not the second choice, decides. Anything else is a bug (issue 49).

Every record is saved when made (--results, and $OUT; "complete": false until the end); a case is not started past
--budget-s (default 420: --quick ends within about 8 minutes); the cases not run are listed.
Ends with a short table. Exit status 0 when every target was met, 1 when one was missed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_decode import first_differences  # noqa: E402
from benchmarks.parallel_starts import parallel_starts  # noqa: E402
from benchmarks.random_model import TINY, TINY_NSA_LAYOUT, cache_as_allocated, random_model  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from models.config import NSALayout  # noqa: E402
from vegas_jax.attention.backend import default_backend  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.runtime.compilation import Programs  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PARTS = ("float32", "bf16", "cost", "sampled")
COMMON = dict(gamma=6, sparse_ratio=0.07)
# name: (attention, GenerationOptions fields). Trees are 4x2 (30 drafted nodes, depth 4).
CASES = {
    "vegas": ("dense", dict(method="vegas")),
    "vegas-weight": ("dense", dict(method="vegas", score_mode="weight")),
    "vegas-all": ("dense", dict(method="vegas-all")),
    "last": ("dense", dict(method="last")),
    "streaming": ("dense", dict(method="streaming")),
    "quest": ("dense", dict(method="quest")),
    "retrieval": ("dense", dict(method="retrieval")),
    "vegas-int8": ("dense", dict(method="vegas", draft_weights="int8")),
    "vegas-int4": ("dense", dict(method="vegas", draft_weights="int4")),
    "vegas-int4-a8": ("dense", dict(method="vegas", draft_weights="int4", draft_activations="int8")),
    "vegas-auto": ("dense", dict(method="vegas", gamma="auto")),
    "tree-self": ("dense", dict(method="vegas", gamma=4, draft_tree="4x2")),
    "tree-ngram": ("dense", dict(method="ar", gamma=4, draft_tree="4x2", drafter="ngram")),
    "ssv-self": ("nsa-view", dict(method="ar", gamma=4, draft_tree="4x2")),
    "ssv-ngram": ("nsa-view", dict(method="ar", gamma=4, draft_tree="4x2", drafter="ngram")),
}
# Chains the model drafts for itself (sparse attention, quantized weights): their drafts are the model's own
# tokens but for the sparse cache and rounding, so nearly all are accepted (τ about 6 of 7 on SmolLM2). Below this
# acceptance rate a draft product is broken: the output stays lossless, verification rejecting every draft, and only
# slower (an integer kernel wrong on the GPU alone gave τ 1.00). The rate, not τ: adaptive γ may draft as few as one
# token a pass where drafting costs nearly a step (batch 1), capping a healthy τ below 2 (1.80 on an H100).
SELF_DRAFTED = tuple(c for c, (_, fields) in CASES.items() if "drafter" not in fields and "draft_tree" not in fields)
MIN_SELF_DRAFT_ACCEPTANCE = 0.5
# Left out at batch 1 by --quick: the loops that take longest to compile (adaptive γ's passes about 105 s, an NSA
# view's tree about 100 s on the H200: benchmarks/suite_presets.py, check_planner.py); they run at batch 8.
SLOW_TO_COMPILE = ("vegas-auto", "ssv-self", "ssv-ngram")
BF16_CASES = ("vegas", "streaming")  # the two
COST_METHODS = ("ar", "vegas")
SAMPLED_CASES = ("ar", "vegas", "streaming", "quest", "retrieval", "vegas-int4-a8-auto", "vegas-int4-a8-auto-4",
                 "tree-self", "tree-ngram", "nsa-view-tree")
P_VALUE_OK = 1e-3  # the tests' threshold
# The NSA tree test's layout (one free selection block) with blocks of 16, the least the GPU kernels take, over a
# prompt twice the test's: five selection blocks to choose from.
KERNEL_SAMPLER_LAYOUT = NSALayout(16, 16, 16, 2, 16, forced_initial=0, forced_local=1)
# Loops compiled side by side before a batch's cases run, at most this many: as many as the device's free memory
# holds (benchmarks/parallel_starts.py).
PARALLEL_COMPILES = 6


class BadFlag(ValueError):
    """A flag's value the check cannot run: one `error:` line, exit status 2."""


class Check:
    """The run's engines, prompts, records and clock."""

    def __init__(self, args):
        self.args, self.started = args, time.perf_counter()
        self.engines: dict[tuple, Engine] = {}
        self._prompts = None
        self.not_run: list[str] = []
        self.log = RecordLog(run_metadata(model=self.model_name, attention_backend=default_backend(),
                                          settings=settings(args)),
                             args.results.name if args.results else "lossless-gpu-smoke.json",
                             args.results.parent if args.results else None)

    @property
    def model_name(self) -> str:
        return "tiny (random weights, smoke)" if self.args.smoke else (self.args.model or "embedded SmolLM2")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def has_time(self, what: str) -> bool:
        if self.elapsed() < self.args.budget_s:
            return True
        self.not_run.append(what)
        print(f"[{self.elapsed():5.0f} s] not run (past --budget-s): {what}", flush=True)
        return False

    def add(self, record: dict) -> dict:
        self.log.add(record)
        return record

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    # ---- engines and prompts -----------------------------------------------------------------------------------
    def engine(self, dtype: str, attention: str = "dense", precision: str = "engine") -> Engine:
        """The model in `dtype` attending as `attention` (one load per dtype); precision "jax-default": its programs
        traced at JAX's default precision (TF32 for float32 on NVIDIA GPUs), as every engine was before issue 49."""
        key = (dtype, attention, precision)
        if key not in self.engines:
            base = (dtype, "dense", "engine")
            if base not in self.engines:
                t0 = time.perf_counter()
                loaded = (random_model(TINY, getattr(jnp, dtype)) if self.args.smoke
                          else load_model(self.args.model, getattr(jnp, dtype)))
                self.engines[base] = Engine(loaded)
                self.say(f"loaded {self.model_name} in {dtype} in {time.perf_counter() - t0:.1f} s")
            model = self.engines[base].model
            if attention != "dense":
                layout = {"layout": TINY_NSA_LAYOUT} if self.args.smoke else {}
                model = dataclasses.replace(model, config=with_attention(model.config, attention, **layout))
            engine = Engine(model) if key != base else self.engines[base]
            if precision == "jax-default":
                engine.programs = Programs(matmul_precision=None)
            self.engines[key] = engine
        return self.engines[key]

    def prompts(self, count: int) -> list[list[int]]:
        """The first `count` held-out prompts (random ids for --smoke), each --prompt-tokens long: the same slices
        of the split whatever the count (`PromptSet.head`)."""
        if self.args.smoke:
            return np.random.default_rng(0).integers(0, TINY.vocab_size, (count, self.args.prompt_tokens)).tolist()
        from benchmarks.prompt_splits import split_prompts

        if self._prompts is None or len(self._prompts.prompts) < count:
            tokenizer = self.engine("float32" if "float32" in self.args.parts else "bfloat16").tokenizer
            self._prompts = split_prompts(tokenizer, "heldout", count, self.args.prompt_tokens)
            self.log.meta["prompts"] = {k: v for k, v in self._prompts.provenance.items() if k != "files"}
        return self._prompts.head(count).prompts


def settings(args) -> dict:
    return {"quick": args.quick, "smoke": args.smoke, "parts": list(args.parts), "batches": list(args.batches),
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "batch1_prompts": args.batch1_prompts, "bf16_prompts": args.bf16_prompts, "cases": list(args.cases),
            "sampled": list(args.sampled), "sampled_seeds_scale": args.sampled_seeds_scale,
            "prompts": "random ids" if args.smoke else "heldout split", **COMMON}


def options(args, fields: dict, logprobs: int | None = None) -> GenerationOptions:
    return GenerationOptions(max_new_tokens=args.new_tokens, logprobs=logprobs, **(COMMON | fields))


def decode(engine: Engine, prompts, opts: GenerationOptions, batch: int) -> dict:
    """`prompts` decoded `batch` at a time (each group one call): every request in order, and the decode's tokens,
    seconds, τ and acceptance rate (over the groups)."""
    requests, tokens, seconds, iterations, accepted, drafted = [], 0, 0.0, 0, 0, 0
    for start in range(0, len(prompts), batch):
        result = engine.generate(prompts[start:start + batch], opts, steps_per_call=None)
        requests += result.requests
        tokens += result.metrics["decode_tokens"]
        seconds += result.metrics["decode_s"]
        iterations += result.metrics["iterations"]
        accepted += result.metrics["drafts_accepted"]
        drafted += result.metrics["drafts_counted"]
    failed = [i for i, r in enumerate(requests) if r.status != "ok"]
    if failed:
        raise RuntimeError(f"requests {failed} did not finish: {requests[failed[0]].reason}")
    return {"requests": requests, "decode_tokens_per_s": tokens / seconds if seconds else None,
            "tau": 1 + accepted / iterations if iterations else None,
            "acceptance_rate": accepted / drafted if drafted else None}


def compile_ahead(check: Check, jobs: list[tuple[Engine, GenerationOptions]], prompts) -> None:
    """Compiles the loops of these (engine, options) at this batch side by side (`Engine.start` with the cache as
    allocated: the decode loop and the bootstrap step, no prefill), so that the runs after find them compiled; a
    failure shows when its case runs. Nothing past the budget, where the cases will not run."""
    if check.elapsed() >= check.args.budget_s:
        return
    workers = parallel_starts(jobs, prompts, PARALLEL_COMPILES)
    if workers < 2 or len(jobs) < 2:
        return
    t0 = time.perf_counter()
    check.say(f"compiling {len(jobs)} loops at batch {len(prompts)}, {workers} at a time")
    for engine, opts in jobs:  # the model keeps its drafts: made once here, not by several threads at once
        engine.model.draft_params(opts.draft_weights)

    def start(job):
        engine, opts = job
        try:
            engine.start(prompts, opts, fill_cache=cache_as_allocated)  # no prefill: 64 x 7.9K float32 takes minutes
        except Exception:  # noqa: BLE001 (reported when the case runs)
            pass

    start(jobs[0])  # alone: what every case shares (the GEMM autotuning of the batch's shapes) is done once
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(start, jobs[1:]))
    check.say(f"compiled {len(jobs)} loops at batch {len(prompts)}, {workers} at a time, in "
              f"{time.perf_counter() - t0:.0f} s")


def attempt(check: Check, record: dict, run, *args):
    """run(*args), or None after recording its failure under `record`: one case's failure is a result, and the
    cases after it still run."""
    try:
        return run(*args)
    except Exception as e:  # noqa: BLE001
        check.add({**record, "error": f"{type(e).__name__}: {e}"})
        check.say(f"{record['part']} {record['case']} at batch {record.get('batch')}: error {type(e).__name__}: {e}")
        return None


# ---- comparisons --------------------------------------------------------------------------------------------------


TOP_LOGPROBS = 8  # plain decoding's candidates kept at each position: a divergence's token is looked up among them


def margin_at(request, position: int) -> float | None:
    """The top-2 log-probability margin of a request (run with logprobs >= 2) at an output position."""
    if request.logprobs is None or position >= len(request.logprobs):
        return None
    (_, first), (_, second) = request.logprobs[position].top[:2]
    return first - second


def rounding(requests, reference, firsts) -> float | None:
    """The largest difference of the emitted token's log-probability between two runs over the tokens they agree
    on: what rounding alone moves a log-probability by between them. None unless both runs have logprobs."""
    differences = [abs(a.logprob - b.logprob) for got, want, first in zip(requests, reference, firsts)
                   if got.logprobs is not None and want.logprobs is not None
                   for a, b in zip(got.logprobs[:first], want.logprobs[:first])]  # [:None]: all of them
    return max(differences, default=None)


def compare(requests, reference) -> dict:
    """Requests against reference requests of the same prompts: how many are identical, and each divergence's
    first position, the reference's top-2 margin there, and the token taken's rank among the reference's candidates
    there and gap to its best (None: not among them)."""
    firsts = first_differences([np.asarray(r.tokens) for r in requests], [np.asarray(r.tokens) for r in reference])
    divergences = []
    for i, first in enumerate(firsts):
        if first is None:
            continue
        want = reference[i]
        got_token = requests[i].tokens[first] if first < len(requests[i].tokens) else None
        top = want.logprobs[first].top if want.logprobs is not None and first < len(want.logprobs) else []
        rank = next((k for k, (token, _) in enumerate(top) if token == got_token), None)
        divergences.append({"sequence": i, "position": first, "margin": margin_at(want, first),
                            "token": got_token, "reference_token": want.tokens[first] if first < len(want.tokens)
                            else None, "rank": rank, "gap": None if rank is None else top[0][1] - top[rank][1]})
    return {"sequences": len(firsts), "identical": firsts.count(None), "divergences": divergences,
            "rounding": rounding(requests, reference, firsts)}


def judge(comparison: dict, noise: float | None) -> dict:
    """Marks each divergence a near-tie (the token taken among the reference's candidates, its gap to their best at
    most twice the noise floor `noise`) or not; None: no noise floor measured."""
    for d in comparison["divergences"]:
        d["near_tie"] = None if noise is None else d["gap"] is not None and d["gap"] <= 2 * noise
    return comparison


# ---- parts --------------------------------------------------------------------------------------------------------


def float32_part(check: Check, args) -> None:
    """Every case against plain decoding of the same prompts at the same batch (batch 1: one prompt at a time over
    the first --batch1-prompts); then plain decoding against itself across batch sizes, the float32 noise floor
    each divergence is judged against."""
    plain, records = {}, []
    for batch in args.batches:
        prompts = check.prompts(args.batch1_prompts if batch == 1 else batch)
        cases = [c for c in args.cases if not (args.quick and batch == 1 and c in SLOW_TO_COMPILE)]
        views = sorted({CASES[c][0] for c in cases} | {"dense"})
        jobs = [(check.engine("float32", view), options(args, {"method": "ar"}, TOP_LOGPROBS)) for view in views]
        jobs += [(check.engine("float32", CASES[c][0]), options(args, CASES[c][1])) for c in cases]
        compile_ahead(check, jobs, prompts[:batch])
        for view in views:
            if not check.has_time(f"float32 plain ({view}) at batch {batch}"):
                continue  # (its cases are skipped with it)
            t0 = time.perf_counter()
            check.say(f"float32 plain ({view}) at batch {batch}: {len(prompts)} prompts of {args.prompt_tokens} tokens")
            run = attempt(check, {"part": "float32", "case": f"plain ({view})", "batch": batch}, decode,
                          check.engine("float32", view), prompts, options(args, {"method": "ar"}, TOP_LOGPROBS), batch)
            if run is not None:
                plain[view, batch] = run
                check.say(f"float32 plain ({view}) at batch {batch}: {run['decode_tokens_per_s']:.0f} tok/s "
                          f"({time.perf_counter() - t0:.0f} s)")
        for case in cases:
            view, fields = CASES[case]
            if (view, batch) not in plain or not check.has_time(f"float32 {case} at batch {batch}"):
                continue
            record = {"part": "float32", "case": case, "attention": view, "batch": batch, **fields}
            t0 = time.perf_counter()
            run = attempt(check, record, decode, check.engine("float32", view), prompts, options(args, fields), batch)
            if run is None:
                continue
            comparison = compare(run["requests"], plain[view, batch]["requests"])
            records.append(check.add({**record, **comparison, "decode_tokens_per_s": run["decode_tokens_per_s"],
                                      "tau": run["tau"], "acceptance_rate": run["acceptance_rate"],
                                      "seconds": time.perf_counter() - t0,
                                      "plain_decode_tokens_per_s": plain[view, batch]["decode_tokens_per_s"]}))
            check.say(f"float32 {case} at batch {batch}: {comparison['identical']}/{comparison['sequences']} "
                      f"identical, τ {run['tau']:.2f}")
    noise = plain_against_plain(check, "float32", {b: run["requests"] for (view, b), run in plain.items()
                                                    if view == "dense"})
    for record in records:
        judge(record, noise)
    check.log.finish(complete=False)  # saved again, with the judgements


def plain_against_plain(check: Check, part: str, plain: dict[int, list]) -> float | None:
    """Records plain decoding at each pair of batch sizes over the prompts both decoded; returns the noise floor:
    the largest log-probability difference between any two of them over the tokens they agree on."""
    pairs = {(a, b): compare(plain[a][:len(plain[b])], plain[b][:len(plain[a])]) for a in plain for b in plain
             if a < b}
    noise = max((c["rounding"] for c in pairs.values() if c["rounding"] is not None), default=None)
    for (a, b), comparison in pairs.items():
        check.add({"part": part, "case": f"plain@{a} vs plain@{b}", "batch": b, "noise_floor": noise,
                   **judge(comparison, noise)})
    return noise


def bf16_part(check: Check, args) -> None:
    """Plain decoding and the bf16 cases at every batch size, over the first --batch1-prompts prompts at batch 1
    and the first max(--bf16-prompts, batch) at a larger batch (decoded `batch` at a time); each case against
    plain decoding at its batch, plain decoding against itself across batch sizes, and every divergence judged
    against that noise floor."""
    engine = check.engine("bfloat16")
    plain, cases = {}, {}
    for batch in args.batches:
        prompts = check.prompts(args.batch1_prompts if batch == 1 else max(args.bf16_prompts, batch))
        jobs = [(engine, options(args, {"method": "ar"}, TOP_LOGPROBS))]
        jobs += [(engine, options(args, CASES[c][1])) for c in BF16_CASES]
        compile_ahead(check, jobs, prompts[:batch])
        if not check.has_time(f"bf16 plain at batch {batch}"):
            continue
        run = attempt(check, {"part": "bf16", "case": "plain", "batch": batch}, decode, engine, prompts,
                      options(args, {"method": "ar"}, TOP_LOGPROBS), batch)
        if run is None:
            continue
        plain[batch] = run["requests"]
        for case in BF16_CASES:
            if check.has_time(f"bf16 {case} at batch {batch}"):
                run = attempt(check, {"part": "bf16", "case": case, "batch": batch}, decode, engine, prompts,
                              options(args, CASES[case][1]), batch)
                if run is not None:
                    cases[case, batch] = run["requests"]
        check.say(f"bf16 at batch {batch}: plain and {', '.join(c for c, b in cases if b == batch)} over "
                  f"{len(prompts)} prompts")
    noise = plain_against_plain(check, "bf16", plain)
    for (case, batch), requests in cases.items():
        comparison = judge(compare(requests, plain[batch]), noise)
        check.add({"part": "bf16", "case": f"{case}@{batch} vs plain@{batch}", "batch": batch, "noise_floor": noise,
                   **comparison})
        check.say(f"bf16 {case} at batch {batch}: {comparison['identical']}/{comparison['sequences']} identical to "
                  f"plain decoding")


def cost_part(check: Check, args) -> None:
    """Decode tokens/s of plain decoding and Vegas at the largest batch (the best of two runs of the compiled
    loop) for float32 at the engine's precision and at JAX's default, and bf16."""
    batch = max(args.batches)
    prompts = check.prompts(batch)
    for dtype, precision in (("float32", "engine"), ("float32", "jax-default"), ("bfloat16", "engine")):
        engine = check.engine(dtype, precision=precision)
        runs = {}
        for method in COST_METHODS:
            if not check.has_time(f"cost {dtype} {precision} {method} at batch {batch}"):
                return
            label = "highest" if dtype == "float32" and precision == "engine" else "jax-default"
            record = {"part": "cost", "case": f"{method} {dtype} {label}", "dtype": dtype, "dot_precision": label,
                      "method": method, "batch": batch}
            opts = options(args, {"method": method})
            both = attempt(check, record, lambda: [decode(engine, prompts, opts, batch) for _ in range(2)])
            if both is None:
                break
            first, second = runs[method] = both
            rate = max(first["decode_tokens_per_s"], second["decode_tokens_per_s"])
            # Vegas against this engine's plain decoding; plain decoding against its own first run.
            comparison = compare(second["requests"], (runs["ar"][1] if method != "ar" else first)["requests"])
            check.add({**record, "decode_tokens_per_s": rate, "tau": second["tau"],
                       "identical": comparison["identical"], "sequences": comparison["sequences"],
                       "divergences": comparison["divergences"]})
            check.say(f"cost {method} {dtype} {label} at batch {batch}: {rate:.0f} tok/s, "
                      f"{comparison['identical']}/{comparison['sequences']} identical to its plain decoding")


def sampled_part(check: Check, args) -> None:
    """The tests' sampled-distribution checks, here: the same models, prompts, seeds and exact joints (computed at
    float32's full precision: a reference is no place for TF32)."""
    import tests.test_sampling_distribution as chains
    from tests.test_draft_trees import sampled_counts, tree_sampler
    from tests.test_nsa_trees import PROMPT_LENGTH, nsa_tree_sample

    scale = args.sampled_seeds_scale
    with jax.default_matmul_precision("highest"):  # this script's own reference computations
        model, exact, trees = None, None, None
        for case in args.sampled:
            if not check.has_time(f"sampled {case}"):
                return
            t0 = time.perf_counter()
            record = {"part": "sampled", "case": case}
            try:
                if case.startswith("tree-"):
                    trees = trees or tree_sampler()
                    seeds = int((20_000 if case == "tree-self" else 10_000) * scale)
                    counts, histogram = sampled_counts(trees, case.removeprefix("tree-"), seeds)
                    p_value = chains.chi_square_p_value(counts, trees[2])
                    exercised = min(histogram) > 0.02 * sum(histogram)
                elif case == "nsa-view-tree":
                    seeds = int(4_000 * scale)
                    counts, joint, histogram = nsa_tree_sample(seeds, KERNEL_SAMPLER_LAYOUT, 2 * PROMPT_LENGTH)
                    p_value = chains.chi_square_p_value(counts, joint)
                    exercised = min(histogram) > 0.02 * sum(histogram)
                else:
                    if model is None:
                        model = chains.tiny_sampler(), chains.prompts([chains.PROMPT_LENGTH], chains.VOCAB, seed=5)[0]
                        exact = chains.exact_joints(chains.continuation_logits(*model, chains.NEW), model[1])
                    method, setting, seeds = next((c for c in chains.CASES if c[0] == case),
                                                  ("vegas", "t1.0-k3-p0.9", 10_000))
                    opts = chains.options(method, setting)
                    if case.startswith("vegas-int4-a8-auto"):
                        gamma_max = chains.GAMMA + 1 if case.endswith("-4") else chains.GAMMA
                        opts = dataclasses.replace(opts, **chains.quantized_auto(gamma_max))
                    seeds = int(seeds * scale)
                    counts, outcomes, _ = chains.sample(model[0], model[1], opts, seeds)
                    p_value = chains.chi_square_p_value(counts, exact[setting])
                    exercised = None  # plain sampling, or adaptive γ (whose iterations vary in drafts)
                    if method != "ar" and "auto" not in case:
                        try:
                            chains.assert_speculation_exercised(outcomes)
                            exercised = True
                        except AssertionError:
                            exercised = False
            except Exception as e:  # noqa: BLE001
                check.add({**record, "error": f"{type(e).__name__}: {e}"})
                check.say(f"sampled {case}: error {type(e).__name__}: {e}")
                continue
            check.add({**record, "seeds": seeds, "p_value": p_value, "passed": p_value > P_VALUE_OK,
                       "speculation_exercised": exercised, "seconds": time.perf_counter() - t0})
            check.say(f"sampled {case}: {seeds} seeds, p = {p_value:.3g}")


# ---- verdict and table --------------------------------------------------------------------------------------------


def verdict(records: list[dict]) -> list[str]:
    """Each target missed, in words (none: every target met). Plain decoding against itself is the yardstick, not a
    target: its records are reported, never missed."""
    missed = []
    for r in records:
        speculative = not r["case"].startswith("plain")
        if "error" in r:
            missed.append(f"{r['part']} {r['case']}: {r['error']}")
        elif r["part"] == "float32" and speculative and r["identical"] < r["sequences"]:
            missed.append(f"float32 {r['case']} at batch {r['batch']}: {r['identical']}/{r['sequences']} identical")
        elif (r["part"] == "float32" and r["case"] in SELF_DRAFTED
              and (r["acceptance_rate"] or 0) < MIN_SELF_DRAFT_ACCEPTANCE):
            missed.append(f"float32 {r['case']} at batch {r['batch']}: acceptance rate {r['acceptance_rate'] or 0:.2f} "
                          f"(τ {r['tau']:.2f}), drafts rejected")
        elif r["part"] == "cost" and r["dot_precision"] == "highest" and r["identical"] < r["sequences"]:
            missed.append(f"cost {r['case']}: {r['identical']}/{r['sequences']} identical to its plain decoding")
        elif r["part"] == "bf16" and speculative and any(d["near_tie"] is False for d in r["divergences"]):
            missed.append(f"bf16 {r['case']}: a divergence beyond rounding")
        elif r["part"] == "sampled" and not r["passed"]:
            missed.append(f"sampled {r['case']}: p = {r['p_value']:.2e}")
    bf16 = [r for r in records if r["part"] == "bf16" and "error" not in r]
    floor = min((r["identical"] / r["sequences"] for r in bf16 if r["case"].startswith("plain@")), default=None)
    for r in bf16:
        if floor is not None and not r["case"].startswith("plain@") and r["identical"] / r["sequences"] < floor:
            missed.append(f"bf16 {r['case']}: identity {r['identical']}/{r['sequences']} below plain-vs-plain's "
                          f"{floor:.0%}")
    return missed


def table(records: list[dict]) -> str:
    """One line a record; then each part's noise floor and float32's speed at highest against TF32."""
    number = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    lines = [f"{'part':8} {'case':30} {'batch':>5} {'identical':>9} {'max margin':>10} {'near-ties':>9} {'tok/s':>7}"]
    for r in records:
        if r["part"] == "sampled":
            result = r.get("error") or f"p = {r['p_value']:.3g} ({r['seeds']} seeds)"
            lines.append(f"{'sampled':8} {r['case']:30} {'':>5} {result}")
            continue
        if "error" in r:
            lines.append(f"{r['part']:8} {r['case']:30} {r.get('batch', ''):>5} error: {r['error'][:70]}")
            continue
        margins = [d["margin"] for d in r["divergences"] if d["margin"] is not None]
        ties = [d.get("near_tie") for d in r["divergences"]]
        lines.append(f"{r['part']:8} {r['case'][:30]:30} {r['batch']:>5} {r['identical']:>4}/{r['sequences']:<4} "
                     f"{number(max(margins, default=None), '.4f'):>10} {sum(t is True for t in ties):>4}/"
                     f"{len(ties):<4} {number(r.get('decode_tokens_per_s'), '.0f'):>7}")
    for part in ("float32", "bf16"):
        floor = next((r["noise_floor"] for r in records if r["part"] == part and "noise_floor" in r), None)
        if floor is not None:
            lines.append(f"{part} noise floor (largest log-probability difference between plain runs at two batch "
                         f"sizes, agreed tokens): {floor:.3g}")
    rates = {r["case"]: r["decode_tokens_per_s"] for r in records if r["part"] == "cost"}
    for method in COST_METHODS:
        highest, default = rates.get(f"{method} float32 highest"), rates.get(f"{method} float32 jax-default")
        if highest and default:
            lines.append(f"float32 {method}: at highest {highest / default:.2f}x the speed at JAX's default (TF32 on "
                         f"NVIDIA GPUs): {highest:.0f} vs {default:.0f} tok/s")
    return "\n".join(lines)


# Per mode, what a flag left out means.
DEFAULTS = {
    "full": dict(batches="1,8,64", cases=",".join(CASES), prompt_tokens=7936, new_tokens=256, batch1_prompts=8,
                 bf16_prompts=64, sampled=",".join(SAMPLED_CASES), sampled_seeds_scale=1.0),
    "quick": dict(batches="1,8", cases=",".join(CASES), prompt_tokens=4096, new_tokens=256, batch1_prompts=2,
                  bf16_prompts=8, sampled="vegas,vegas-int4-a8-auto,tree-self,tree-ngram,nsa-view-tree",
                  sampled_seeds_scale=1.0),
    # A CPU's minute: the tiny model, one dense case and one SSV case, 2 % of two sampled cases' seeds.
    "smoke": dict(batches="1,2", cases="vegas,ssv-ngram", prompt_tokens=48, new_tokens=12, batch1_prompts=1,
                  bf16_prompts=2, sampled="vegas,tree-self", sampled_seeds_scale=0.02),
}


def parse(argv) -> argparse.Namespace:
    """The flags, each left out taken from its mode's DEFAULTS; BadFlag for a value the check cannot run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF / HF / Orbax checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--results", type=Path, default=None,
                   help="the JSON to write (default benchmarks/results/lossless-gpu-<date>[-quick].json)")
    p.add_argument("--quick", action="store_true", help="batches 1 and 8 at 4K prompts, fewer cases at batch 1 and "
                                                        "sampled; about 7 minutes on an H100")
    p.add_argument("--smoke", action="store_true", help="a tiny random model on a CPU: checks this script")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
    p.add_argument("--batches", help="comma-separated (default 1,8,64; --quick 1,8)")
    p.add_argument("--cases", help="float32 cases, comma-separated, of " + ", ".join(CASES) + " (default all)")
    p.add_argument("--prompt-tokens", type=int, help="default 7936 (--quick 4096)")
    p.add_argument("--new-tokens", type=int, help="default 256")
    p.add_argument("--batch1-prompts", type=int, help="prompts decoded at batch 1 (default 8; --quick 2)")
    p.add_argument("--bf16-prompts", type=int, help="prompts of the bf16 part (default 64; --quick 8)")
    p.add_argument("--sampled", help="sampled cases, comma-separated, of " + ", ".join(SAMPLED_CASES)
                   + " (default all; --quick 5 of them)")
    p.add_argument("--sampled-seeds-scale", type=float, help="times the tests' seed counts (default 1)")
    p.add_argument("--budget-s", type=float, default=420.0, help="no case starts after this many seconds")
    args = p.parse_args(argv)
    for name, value in DEFAULTS["smoke" if args.smoke else "quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.parts, args.cases, args.sampled = (tuple(v.split(",")) for v in (args.parts, args.cases, args.sampled))
    for flag, values, known in (("--parts", args.parts, PARTS), ("--cases", args.cases, CASES),
                                ("--sampled", args.sampled, SAMPLED_CASES)):
        unknown = [v for v in values if v not in known]
        if unknown:
            raise BadFlag(f"{flag}: unknown {unknown[0]!r} (known: {', '.join(known)})")
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise BadFlag(f"--batches {args.batches!r}: comma-separated whole numbers") from None
    for flag, value in (("--batches", min(args.batches)), ("--prompt-tokens", args.prompt_tokens),
                        ("--new-tokens", args.new_tokens), ("--batch1-prompts", args.batch1_prompts),
                        ("--bf16-prompts", args.bf16_prompts)):
        if value < 1:
            raise BadFlag(f"{flag} must be >= 1, got {value}")
    if args.sampled_seeds_scale <= 0:
        raise BadFlag(f"--sampled-seeds-scale must be > 0, got {args.sampled_seeds_scale}")
    if args.results is None and not args.smoke:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
        args.results = RESULTS / f"lossless-gpu-{stamp}{'-quick' if args.quick else ''}.json"
    check_writable("--results", args.results.parent if args.results else None)
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except BadFlag as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    check = Check(args)
    print(f"{check.model_name} on {jax.devices()[0].device_kind} ({default_backend()} attention), parts "
          f"{', '.join(args.parts)}, batches {args.batches}, prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new", flush=True)
    for part, run in (("float32", float32_part), ("bf16", bf16_part), ("cost", cost_part),
                      ("sampled", sampled_part)):
        if part in args.parts:
            run(check, args)
    missed = verdict(check.log.records)
    check.log.meta.update(not_run=check.not_run, missed=missed, seconds=check.elapsed())
    check.log.finish(complete=not check.not_run)
    print(table(check.log.records))
    for line in missed:
        print(f"MISSED: {line}")
    for what in check.not_run:
        print(f"not run: {what}")
    print(f"{'every target met' if not missed else f'{len(missed)} target(s) missed'}"
          f"{'' if not check.not_run else f'; {len(check.not_run)} case(s) not run'}; {check.elapsed():.0f} s"
          + (f"; JSON: {args.results}" if args.results else ""), flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
