"""What each preset of the benchmark suite measures, and what that should cost on an H200.

The cost model counts what dominates: compiling a decode loop (once per method configuration, batch and length in
a process; 9 s for plain decoding and 13 s for a speculative method at SmolLM2's size on the H200, from the
compile_s of the committed e2e records) and each run's prefill and decode, from the H200's measured plain step of
SmolLM2 (1.15 ms + 5.2 ns per cached token of the batch; 3.75 ms at 64 x 7.9K) and prefill (about 480K tokens/s).
Speculative runs are costed as plain ones, which they beat, so estimates err long; a stage prefills once per batch
and length (its other runs copy that cache). Tuning's compilations are costed as measured side by side
(SIDE_BY_SIDE_COMPILE_S), the other stages' one at a time. `estimate` prints per stage.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from benchmarks.suite_tuning import NGRAM, Grid
from benchmarks.task_families import DEFAULT_FAMILY, FAMILIES, REGISTRY

SPECULATIVE = ("vegas", "streaming", "quest", "retrieval", NGRAM)
ABLATIONS = ("vegas-all", "last")
BASELINES = ("streaming", "quest", "retrieval", NGRAM)
SAMPLED_TEMPERATURE = 0.7
# In the order a call runs them; tune, heldout, adaptive and quantized per task family, the rest on summarise's.
STAGES = ("tune", "heldout", "adaptive", "quantized", "serve", "scale", "peer")
QUANTIZED = ("int8", "int4")  # draft weights the quantized stage measures Vegas with (GenerationOptions.draft_weights)


@dataclasses.dataclass(frozen=True)
class ServeCase:
    requests: int
    slots: int
    prompt_tokens: int
    all_baselines: bool  # False: only the baseline fastest at this length and batch (held-out, tuned)


@dataclasses.dataclass(frozen=True)
class ScaleCase:
    model: str  # a name of suite_scale.SHAPES
    context: int  # the cache's length (max_model_len); the prompt fills it but for the new tokens
    batches: tuple[int, ...]  # those whose run does not fit (vegas_jax.runtime.memory) are recorded as not fitting


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    lengths: tuple[int, ...]  # prompt tokens, chat template included
    batches: tuple[int, ...]
    grid: Grid
    tune_new_tokens: int
    tune_repeats: int
    new_tokens: int
    repeats: int
    sampled_batches: tuple[int, ...]  # batches also measured at SAMPLED_TEMPERATURE (tuned cells)
    sampled_defaults: bool  # and the default cells there
    ablation_batches: tuple[int, ...]
    serve: tuple[ServeCase, ...]
    scale: tuple[ScaleCase, ...]
    scale_iterations: int
    peer: tuple[tuple[int, int], ...]  # (batch, prompt tokens) of the transformers peer
    warmup: int = 1  # runs before the measured ones (compilation, allocation, CUDA graph instantiation)
    # (batch, batch whose tuned cells it takes): batches left out of tuning to save its compilations
    borrowed_tuning: tuple[tuple[int, int], ...] = ()
    # batches whose held-out prompts also run Vegas with `--gamma auto` at its tuned sparse ratio (issue 19)
    adaptive_batches: tuple[int, ...] = ()
    # task families (benchmarks/task_families.py) the tune, heldout, adaptive and quantized stages run, in order
    families: tuple[str, ...] = (DEFAULT_FAMILY,)
    # batches whose held-out prompts also run Vegas at its tuned cell with int8 and int4 draft weights (QUANTIZED)
    quantized_batches: tuple[int, ...] = ()
    # long generation's new tokens (None: the family's own, task_families.LONG_NEW_TOKENS)
    long_new_tokens: int | None = None

    def __post_init__(self):
        if not self.families or set(self.families) - set(FAMILIES):
            raise ValueError(f"preset {self.name}: families {self.families} must be among {FAMILIES}")
        # Everything measured at a batch takes that batch's tuned cells (serving: its slots').
        for name, batches in [("sampled_batches", self.sampled_batches), ("ablation_batches", self.ablation_batches),
                              ("adaptive_batches", self.adaptive_batches),
                              ("quantized_batches", self.quantized_batches),
                              ("serve slots", [c.slots for c in self.serve]),
                              ("borrowed_tuning", [b for pair in self.borrowed_tuning for b in pair])]:
            if set(batches) - set(self.batches):
                raise ValueError(f"preset {self.name}: {name} {sorted(batches)} must be among batches {self.batches}")
        if any(c.prompt_tokens not in self.lengths for c in self.serve):
            raise ValueError(f"preset {self.name}: serving lengths must be among lengths {self.lengths}")

    def tuning_batch(self, batch: int) -> int:
        """The batch whose tuning chooses this batch's cells (itself unless borrowed)."""
        return dict(self.borrowed_tuning).get(batch, batch)

    def narrowed(self, lengths: tuple[int, ...], batches: tuple[int, ...],
                 families: tuple[str, ...] | None = None) -> Preset:
        """This preset measuring only these of its lengths and batches (and the families named, which may be any):
        its serving cases, transformers peers, sampled, ablation, adaptive and quantized batches and borrowed
        tunings outside them dropped (its scale stage, on random weights of its own shapes, kept). Long generation's
        own prompt length is no length of the preset's and stays."""
        return dataclasses.replace(
            self, lengths=tuple(n for n in self.lengths if n in lengths),
            batches=tuple(b for b in self.batches if b in batches),
            sampled_batches=tuple(b for b in self.sampled_batches if b in batches),
            ablation_batches=tuple(b for b in self.ablation_batches if b in batches),
            adaptive_batches=tuple(b for b in self.adaptive_batches if b in batches),
            quantized_batches=tuple(b for b in self.quantized_batches if b in batches),
            serve=tuple(c for c in self.serve if c.prompt_tokens in lengths and c.slots in batches),
            peer=tuple((b, n) for b, n in self.peer if b in batches and n in lengths),
            borrowed_tuning=tuple(pair for pair in self.borrowed_tuning if set(pair) <= set(batches)),
            families=self.families if families is None else families)

    @property
    def tuned_batches(self) -> tuple[int, ...]:
        return tuple(b for b in self.batches if self.tuning_batch(b) == b)

    def lengths_of(self, family: str) -> tuple[int, ...]:
        """The prompt lengths a family runs at: the preset's, or the family's own (long generation's short one)."""
        own = REGISTRY[family].prompt_tokens
        return self.lengths if own is None else (own,)

    def new_tokens_of(self, family: str) -> int:
        own = REGISTRY[family].new_tokens
        return self.new_tokens if own is None else self.long_new_tokens or own

    def tune_new_tokens_of(self, family: str) -> int:
        """Tuning's new tokens: the preset's shorter runs, but all of a family's own (long generation's), whose
        point is the cache growing while it decodes."""
        return self.tune_new_tokens if REGISTRY[family].new_tokens is None else self.new_tokens_of(family)

    def context(self, family: str, length: int) -> int:
        """The cache (max_model_len) every run of the family at that prompt length shares (tuning's shorter runs
        too, so the stages reuse each other's compiled loops, and the families theirs)."""
        return length + self.new_tokens_of(family)


_QUICK_GRID = Grid(gammas=(4, 6, 8), ratios=(0.05, 0.07, 0.10),
                   knobs={"stream_sinks": (16, 64), "quest_page": (16, 32), "retrieval_chunk": (32, 64),
                          "retrieval_every": (4, 8), "tree_branching": (1, 2)})
_PAPER_GRID = Grid(gammas=(2, 3, 4, 6, 8), ratios=(0.03, 0.05, 0.07, 0.10, 0.15),
                   knobs={"stream_sinks": (4, 16, 64, 128), "quest_page": (8, 16, 32, 64),
                          "retrieval_chunk": (16, 32, 64), "retrieval_every": (1, 2, 4, 8),
                          "tree_branching": (1, 2, 3)},
                   refine=True)

PRESETS = {
    # Every stage but adaptive once, every task family, small (about 6 minutes of H200 time, mostly compilation; 30
    # on a CPU), numbers meaningless: a check of the pipeline before a long run. 1,024-token prompts: three chat
    # turns of code and their answers need that many.
    "smoke": Preset(
        name="smoke", lengths=(1024,), batches=(2,),
        grid=Grid(gammas=(4, 6), ratios=(0.07,),
                  knobs={"stream_sinks": (16,), "quest_page": (16,), "retrieval_chunk": (32,), "retrieval_every": (4, 2)}),
        tune_new_tokens=8, tune_repeats=1, new_tokens=16, repeats=3, sampled_batches=(), sampled_defaults=False,
        ablation_batches=(2,), serve=(ServeCase(6, 2, 1024, all_baselines=False),),
        scale=(ScaleCase("smollm2-135m", 4096, (1,)),), scale_iterations=4, peer=((2, 1024),),
        # no adaptive γ: timing its costs takes 55 iterations, more than 16 new tokens last
        families=FAMILIES, quantized_batches=(2,), long_new_tokens=32,
    ),
    # Every task family at 8K prompts (long generation: 512 and 2,048 new tokens), at batches 64 and 32 (those the
    # targets name), with the quantized drafts, adaptive γ at batch 64, serving, the scale stage and the peer, in
    # about an hour of H200 time (`--estimate`); batch 32 takes the cells tuned at batch 64, which halves the
    # compilations. No sampled runs (the paper preset's), which would compile every configuration again.
    "quick": Preset(
        name="quick", lengths=(7936,), batches=(64, 32), grid=_QUICK_GRID,
        tune_new_tokens=128, tune_repeats=1, new_tokens=256, repeats=3, sampled_batches=(), sampled_defaults=False,
        ablation_batches=(64,), serve=(ServeCase(128, 64, 7936, all_baselines=False),),
        scale=(ScaleCase("llama-3.1-8b", 32768, (1, 8)), ScaleCase("qwen3-8b", 32768, (1, 8))),
        scale_iterations=8, peer=((32, 7936), (64, 7936)), borrowed_tuning=((32, 64),), adaptive_batches=(64,),
        families=FAMILIES, quantized_batches=(64,), long_new_tokens=2048,
    ),
    # Everything the issue asks for; several sessions of device time.
    "paper": Preset(
        name="paper", lengths=(7936, 4096, 2048), batches=(64, 32, 8, 1), grid=_PAPER_GRID,
        tune_new_tokens=128, tune_repeats=2, new_tokens=256, repeats=3, sampled_batches=(64, 32, 8, 1),
        sampled_defaults=True, ablation_batches=(64, 32, 8, 1),
        serve=(ServeCase(128, 64, 7936, all_baselines=True), ServeCase(128, 64, 4096, all_baselines=True)),
        scale=tuple(ScaleCase(model, context, batches) for model in ("llama-3.1-8b", "qwen3-8b")
                    for context, batches in ((32768, (1, 2, 4, 8, 16)), (131072, (1, 2, 4, 8, 16)))),
        scale_iterations=8,
        peer=tuple((batch, length) for length in (7936, 4096, 2048) for batch in (1, 8, 32, 64)),
        adaptive_batches=(64, 32, 8, 1), families=FAMILIES, quantized_batches=(64,),
    ),
}


# ---- cost model (seconds on one H200, SmolLM2-135M bf16) ------------------------------------------------------

# Adaptive γ's loop holds a branch per g (nine for γ_max 8): 84-105 s on the H200 (compile_s of
# benchmarks/results/adaptive-branches-2026-12-04.jsonl, code cb195a7); at 13 s its cells overran --budget-s.
COMPILE_S = {"ar": 9.0, "speculative": 13.0, "adaptive": 105.0}
# A configuration's share of a round compiled side by side (benchmarks/suite.py, compile_ahead): 4.6-4.9 s in the
# paper preset's first tuning rounds of 13-21 configurations at 64 x 7.9K (suite-paper.jsonl, 2026-12-02).
SIDE_BY_SIDE_COMPILE_S = 5.0
RUN_OVERHEAD_S = 0.3  # state creation, host reads, the decode call's launch
# What the scale stage runs at each (model, context, batch); `head`: plain decoding verifying a chain drafted by an
# untrained EAGLE-style draft head (benchmarks/suite_scale.py), whose passes cost what a trained head's do.
SCALE_METHODS = ("ar", "vegas", "streaming", "head")
SCALE_CASE_S = 35.0  # an 8B-shaped method at one batch: compile, cache fill, timed and profiled iterations
SCALE_MODEL_S = 30.0  # random 8B weights, and the bandwidth measurement
PEER_MODEL_S = 20.0


def step_s(batch: int, tokens: int) -> float:
    return (1.15 + 5.2e-6 * batch * tokens) / 1e3


def prefill_s(batch: int, tokens: int) -> float:
    return batch * tokens / 480e3


def run_s(batch: int, tokens: int, new_tokens: int, prefilled: bool = False) -> float:
    """A static run; `prefilled`: from a kept prefill (vegas_jax.runtime.prefill_reuse), as the suite's runs but the first
    at each batch and length. Its steps read the cache at its mean length (long generation's grows 8-fold)."""
    return (0.02 + (0 if prefilled else prefill_s(batch, tokens)) + new_tokens * step_s(batch, tokens + new_tokens / 2)
            + RUN_OVERHEAD_S)


def hf_step_s(batch: int, tokens: int) -> float:
    # transformers' eager decode step: about 10 ms of launches plus its reads (3,325 tok/s at 32 x 4.1K measured)
    return (10.0 + 2e-5 * batch * tokens) / 1e3


@dataclasses.dataclass
class Cost:
    compiles: int = 0
    runs: int = 0
    seconds: float = 0.0

    def add(self, compiles: int, runs: int, seconds: float) -> None:
        self.compiles += compiles
        self.runs += runs
        self.seconds += seconds


# The fraction of a unit of measurements the log lacks: left(stage, length, batch, method, expected, family), where a
# unit is one method's tuning search (expected: its grid size), a held-out (length, batch), an adaptive or quantized
# (length, batch), each of a family, a served method, a scale case (length: its context, method: its model) or a
# peer (length, batch). From scratch, everything is left.
Left = Callable[[str, "int | None", int, "str | None", int, str], float]


def _everything_left(*_) -> float:
    return 1.0


def stage_costs(preset: Preset, left: Left = _everything_left) -> dict[str, Cost]:
    """The most each stage can cost (every search sweep measured, every cell distinct), of what `left` says the
    log lacks; a unit's compilations and runs count in proportion. A loop compiles once per process for every
    family at the same prompt length, batch and context: after a family whose stage has something left there (so
    compiles it in the same call), another compiles no plain decoding, no default cell and no cell of a search's
    first sweep (γ at the default cell, the same for all), and adaptive γ's loop (at Vegas's tuned ratio) compiles
    for as many families there as the grid has ratios."""
    p, costs = preset, {stage: Cost() for stage in STAGES}

    def add(stage: str, fraction: float, compiles: int, runs: int, seconds: float) -> None:
        costs[stage].add(round(fraction * compiles), round(fraction * runs), fraction * seconds)

    # Per unit (a stage, tuning's per method) and (length, batch, context): how many families before had something
    # of it left there.
    earlier: dict[tuple, int] = {}
    for family in p.families:
        new_tokens, tune_new_tokens = p.new_tokens_of(family), p.tune_new_tokens_of(family)
        for length in p.lengths_of(family):
            for batch in p.batches:
                shape = (length, batch, p.context(family, length))
                tuned_here = batch in p.tuned_batches
                if tuned_here:
                    tune_run = run_s(batch, length, tune_new_tokens, prefilled=True)
                    fractions = {method: left("tune", length, batch, method, p.grid.size(method), family)
                                 for method in ("ar",) + SPECULATIVE}
                    if any(fractions.values()):
                        costs["tune"].seconds += prefill_s(batch, length)  # once: the other runs copy its cache
                    for method, fraction in fractions.items():
                        cells, unit = p.grid.size(method), ("tune", method, *shape)
                        again = earlier.get(unit, 0) > 0
                        earlier[unit] = earlier.get(unit, 0) + bool(fraction)
                        compiles = cells - (len(p.grid.sweeps(method)[0][1]) if method != "ar" else 1) * again
                        runs = cells * (p.warmup + p.tune_repeats)
                        add("tune", fraction, compiles, runs, compiles * SIDE_BY_SIDE_COMPILE_S + runs * tune_run)
                run = run_s(batch, length, new_tokens, prefilled=True)
                per_record = p.warmup + p.repeats
                greedy = 1 + 2 * len(SPECULATIVE)  # ar; each method's tuned and default cells
                ablations = len(ABLATIONS) if batch in p.ablation_batches else 0
                sampled = (1 + len(SPECULATIVE) * (2 if p.sampled_defaults else 1) + ablations
                           if batch in p.sampled_batches else 0)
                fraction = left("heldout", length, batch, None, greedy + ablations + sampled, family)
                if fraction:
                    costs["heldout"].seconds += prefill_s(batch, length)
                again = earlier.get(("heldout", *shape), 0) > 0
                earlier[("heldout", *shape)] = earlier.get(("heldout", *shape), 0) + bool(fraction)
                # Tuning compiled the greedy cells at its own batch; a borrowing batch compiles them here, but for
                # plain decoding and the default cells when an earlier family did.
                compiles = ablations + (0 if tuned_here else greedy - (1 + len(SPECULATIVE)) * again)
                add("heldout", fraction, compiles, (greedy + ablations) * per_record,
                    compiles * COMPILE_S["speculative"] + (greedy + ablations) * per_record * run)
                if sampled:  # another sampling mode: every configuration compiles again
                    add("heldout", fraction, sampled - again, sampled * per_record,
                        COMPILE_S["ar"] * (not again) + (sampled - 1) * COMPILE_S["speculative"]
                        + sampled * per_record * run)
                if batch in p.adaptive_batches:  # one loop; a first run of its own prefill times the cost model
                    fraction = left("adaptive", length, batch, None, 1, family)
                    compiles = int(earlier.get(("adaptive", *shape), 0) < len(p.grid.ratios))
                    earlier[("adaptive", *shape)] = earlier.get(("adaptive", *shape), 0) + bool(fraction)
                    add("adaptive", fraction, compiles, per_record + 1,
                        compiles * COMPILE_S["adaptive"] + run_s(batch, length, new_tokens) + per_record * run)
                if batch in p.quantized_batches:  # Vegas's tuned cell with each quantized draft
                    add("quantized", left("quantized", length, batch, None, len(QUANTIZED), family),
                        len(QUANTIZED), len(QUANTIZED) * per_record,
                        len(QUANTIZED) * (COMPILE_S["speculative"] + per_record * run))
    for case in p.serve:  # the serving stage, the scale stage and the peer run summarise's prompts only
        methods = 2 + (len(BASELINES) if case.all_baselines else 1)
        # 128 requests through 64 slots: the prefill of every request, about twice a static batch's decode
        run = (0.02 + case.requests * case.prompt_tokens / 480e3
               + 2 * p.new_tokens * step_s(case.slots, case.prompt_tokens) + 2 * RUN_OVERHEAD_S)
        runs = methods * (p.warmup + p.repeats)
        add("serve", left("serve", case.prompt_tokens, case.slots, None, methods, DEFAULT_FAMILY), methods, runs,
            methods * COMPILE_S["speculative"] + runs * run)
    for model in dict.fromkeys(case.model for case in p.scale):
        fractions = [left("scale", case.context, batch, model, len(SCALE_METHODS), DEFAULT_FAMILY)
                     for case in p.scale if case.model == model for batch in case.batches]
        if any(fractions):
            costs["scale"].seconds += SCALE_MODEL_S
        for fraction in fractions:
            add("scale", fraction, len(SCALE_METHODS), len(SCALE_METHODS), len(SCALE_METHODS) * SCALE_CASE_S)
    for batch, length in p.peer:
        fraction = left("peer", length, batch, None, 1, DEFAULT_FAMILY)
        generate = p.new_tokens * hf_step_s(batch, length) + batch * length / 100e3
        add("peer", fraction, 0, p.repeats, generate * (p.repeats + 1) + batch * length / 100e3 * p.repeats)
    if costs["peer"].seconds:  # the peer's model loads once
        costs["peer"].seconds += PEER_MODEL_S
    return costs


def describe_costs(preset: Preset, stages, left: Left = _everything_left, log: str = "the log") -> str:
    costs = stage_costs(preset, left)
    lines = [f"preset {preset.name}: estimated H200 time of what {log} lacks (at most)"]
    total = 0.0
    for stage in stages:
        c = costs[stage]
        total += c.seconds
        lines.append(f"  {stage:9} {c.compiles:4d} compilations, {c.runs:4d} runs: {c.seconds / 60:6.1f} min")
    lines.append(f"  total     {total / 60:6.1f} min")
    return "\n".join(lines)
