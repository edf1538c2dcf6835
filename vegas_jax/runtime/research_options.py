"""The research knobs of a generation request, one frozen value per method or mechanism they tune, nested in
`GenerationOptions` (vegas_jax.runtime.options) beside the options every user sets: the draft KV selection's budget
and Vegas's scores, each baseline's own knobs, adaptive γ's γ_max and costs, the draft tree, and SSV's precision and
plan. Each value checks its own fields (type, then range) and names them by their flat option name (`quest_page`,
not `page`): the name its CLI flag and GenerationOptions' flat keyword carry. What depends on other options (a
knob of a method not run, costs without `gamma auto`) is GenerationOptions.validate's to check. Every field of an
option carries its help (`option`), from which its CLI flag is made (vegas_jax.cli.option_flags)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from vegas_jax import inputs
from vegas_jax.attention.verify import SCORE_MODES
from vegas_jax.decode.tree_shapes import TreeShape, check_rates, parse_tree, shaped_by_rates
from vegas_jax.inputs import InputError
from vegas_jax.ssv.precision import ApproxMode, parse_precision

# The cache's capacity is a multiple of this many rows (vegas_jax.runtime.run_plan), which Quest's pages and
# retrieval's chunks must tile.
CAPACITY_ALIGN = 128
# Drafts per iteration: beyond a few dozen every verification pass mostly checks tokens that are rejected anyway,
# and the draft probabilities ([batch, γ, vocabulary] float32 when sampling) grow with γ.
MAX_GAMMA = 64


def option(default, help: str):
    """An option's field: its default, and its help (its CLI flag's)."""
    return dataclasses.field(default=default, metadata={"help": help})


class ResearchOptions:
    """What every nested value shares: its fields' flat option names (FLAT_NAMES: those that differ) and the check
    that returns it with plain Python values in range."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {}

    @classmethod
    def flat_name(cls, field: str) -> str:
        return cls.FLAT_NAMES.get(field, field)

    def checked(self):
        """This value with plain Python values of its fields' types (InputError naming the flat option), each in
        range (`_problems`)."""
        value = dataclasses.replace(self, **inputs.plain_fields(self, self.FLAT_NAMES))
        for ok, template, *values in value._problems():
            if not ok:
                raise InputError(template, *values)
        return value

    def _problems(self) -> list[tuple]:
        """(in range, InputError template, its values) for each field."""
        return []


@dataclasses.dataclass(frozen=True)
class SelectionConfig(ResearchOptions):
    """The draft's KV selection (every method but ar): its budget, a fraction of the current length with a floor
    in tokens, and how Vegas scores the cache's tokens (logit | weight; vegas_jax.attention.verify)."""

    sparse_ratio: float = option(0.07, "draft KV budget as a fraction of the current length")
    min_sparse_tokens: int = option(256, "the draft KV budget's floor, in tokens")
    score_mode: str = option("logit", "logit | weight")

    def _problems(self) -> list[tuple]:
        return [
            (0 < self.sparse_ratio <= 1, "{sparse_ratio} must be in (0, 1], got {}", self.sparse_ratio),
            (self.min_sparse_tokens >= 1, "{min_sparse_tokens} must be >= 1, got {}", self.min_sparse_tokens),
            (self.score_mode in SCORE_MODES, "{score_mode} must be one of {}, got {!r}", SCORE_MODES,
             self.score_mode),
        ]


# The baselines' own knobs, each for its method only (so that they can be tuned as Vegas's γ and ratio are). Their
# field names are the selection policy's (vegas_jax.decode.selection.make_policy).

@dataclasses.dataclass(frozen=True)
class StreamingConfig(ResearchOptions):
    """MagicDec-Stream: sink tokens of the budget (the rest is the recent window)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"sinks": "stream_sinks"}
    sinks: int = option(16, "--method streaming: sink tokens of the budget (the rest is the recent window)")

    def _problems(self) -> list[tuple]:
        return [(self.sinks >= 1, "{stream_sinks} must be >= 1, got {}", self.sinks)]


@dataclasses.dataclass(frozen=True)
class QuestConfig(ResearchOptions):
    """Quest: tokens per page; pages tile the cache, whose capacity is a multiple of CAPACITY_ALIGN."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"page": "quest_page"}
    page: int = option(16, "--method quest: tokens per page (divides 128)")

    def _problems(self) -> list[tuple]:
        return [(self.page >= 1 and CAPACITY_ALIGN % self.page == 0,
                 "{quest_page} must divide " + str(CAPACITY_ALIGN) + ", got {}", self.page)]


@dataclasses.dataclass(frozen=True)
class RetrievalConfig(ResearchOptions):
    """Retrieval: tokens per chunk (chunks tile the cache as Quest's pages do), and how many iterations it keeps
    its chunks before ranking them afresh."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"chunk": "retrieval_chunk", "every": "retrieval_every"}
    chunk: int = option(32, "--method retrieval: tokens per chunk (divides 128)")
    every: int = option(4, "--method retrieval: iterations between rankings of the chunks")

    def _problems(self) -> list[tuple]:
        return [(self.chunk >= 1 and CAPACITY_ALIGN % self.chunk == 0,
                 "{retrieval_chunk} must divide " + str(CAPACITY_ALIGN) + ", got {}", self.chunk),
                (self.every >= 1, "{retrieval_every} must be >= 1, got {}", self.every)]


@dataclasses.dataclass(frozen=True)
class AdaptiveGammaConfig(ResearchOptions):
    """With gamma "auto" (vegas_jax.decode.adaptive_gamma): the most drafts of an iteration (None: its default of
    8), and what an iteration of g = 1..γ_max drafts costs, in plain steps (>= 1 each; None: timed at the start of a
    run, and reported in its metrics as `gamma_costs`)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"costs": "gamma_costs"}
    gamma_max: int | None = option(None, "with --gamma auto: the most drafts of an iteration (8)")
    costs: tuple[float, ...] | None = option(
        None, "with --gamma auto: what an iteration of 1, 2, .., --gamma-max drafts costs in plain steps, "
              "comma-separated (default: timed at the start; a run's metrics report them)")

    def _problems(self) -> list[tuple]:
        return [
            (self.gamma_max is None or 1 <= self.gamma_max <= MAX_GAMMA,
             "{gamma_max} must be in [1, " + str(MAX_GAMMA) + "], got {}", self.gamma_max),
            (self.costs is None or all(1 <= c < math.inf for c in self.costs),
             "{gamma_costs} must be finite numbers >= 1 (plain steps per iteration), got {}", self.costs),
        ]


@dataclasses.dataclass(frozen=True)
class TreeConfig(ResearchOptions):
    """A draft tree `DEPTHxBRANCHING` (vegas_jax.decode.tree_shapes; 6x1 is a chain) verified in one pass, and what
    drafts it (vegas_jax.decode.drafters): self (the model's cheaper draft: a dense model's sparse draft, with a
    selection method; an NSA model's sink-and-window draft, with method ar), ngram (prompt lookup, with method ar:
    no draft pass, no selection) or head (a trained draft head, with method ar: docs/draft-head.md; the Engine's
    draft_head); with an SSV profile also auto (the planner chooses the drafter)."""

    draft_tree: str | None = option(None, "verify a draft tree instead of a chain of --gamma drafts: DEPTHxBRANCHING "
                                          "(e.g. 4x2; 6x1 is a chain), or NODES[dDEPTH] (e.g. 16, 24d6: that many "
                                          "nodes, at most that deep, shaped for the most accepted drafts under "
                                          "--tree-rates); at most 64 nodes")
    tree_rates: tuple[float, ...] | None = option(
        None, "with --draft-tree NODES: the chance that a node's first, second, .. child is the accepted one, "
              "comma-separated (default 0.70,0.12: the shipped SmolLM2 head's; a run's acceptance_by_position "
              "measures them: a chain's gives the first, a DEPTHx2 tree's the sum of two)")
    drafter: str = option("self", "with --draft-tree: self (the model's cheaper draft: a dense model's sparse draft, "
                                  "with --method; an NSA model's sink and window), ngram (prompt lookup) or head (a "
                                  "trained draft head, --draft-head); with --ssv-profile also auto (the planner's "
                                  "choice)")

    def _problems(self) -> list[tuple]:
        if self.tree_rates is not None:
            check_rates(self.tree_rates)
            if self.draft_tree is None or not shaped_by_rates(self.draft_tree):
                raise InputError("{tree_rates}: only with {draft_tree} NODES[dDEPTH] (a tree they shape), got "
                                 "{draft_tree} {}", self.draft_tree)
        self.shape()  # the tree's syntax and size, InputError naming draft_tree
        return []

    def shape(self) -> TreeShape | None:
        """The tree draft_tree names (under tree_rates), None without one."""
        return None if self.draft_tree is None else parse_tree(self.draft_tree, rates=self.tree_rates)


@dataclasses.dataclass(frozen=True)
class SsvConfig(ResearchOptions):
    """SSV on NSA models, and the planner on dense ones (vegas_jax.ssv.choice): the precision class
    (vegas_jax.ssv.precision: exact never changes the output; approximate allows the approximate modes whose measured
    top-1 disagreement with the exact target is at most precision_tolerance, default 0.05), an approximate mode
    pinned by its label (s<span>w<widen>r<refresh>; with precision approximate), and a device profile from which the
    planner chooses the tree and the mode."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"profile": "ssv_profile"}
    precision: str = option("exact", "NSA models: exact (never changes the output) | approximate (allows "
                                     "approximate modes whose measured top-1 disagreement is at most "
                                     "--precision-tolerance)")
    precision_tolerance: float | None = option(
        None, "with --precision approximate: the largest top-1 disagreement allowed, in [0, 0.5] (0.05)")
    approx_mode: str | None = option(None, "with --precision approximate and no --ssv-profile: run this approximate "
                                           "mode's modified target (s<span>w<widen>r<refresh>, e.g. s8w1r2)")
    profile: str | None = option(None, "a device profile of the model's family (benchmarks/profile_ssv.py --model): "
                                       "the planner chooses the draft tree (and, NSA models, the mode within "
                                       "--precision); with --drafter auto also the drafter")

    def _problems(self) -> list[tuple]:
        precision = parse_precision(self.precision, self.precision_tolerance)
        if self.approx_mode is None:
            return []
        try:
            mode = ApproxMode.from_name(self.approx_mode)
        except InputError:
            raise InputError("{approx_mode} must be 'exact' or s<span>w<widen>r<refresh> (e.g. s8w2r2), got {!r}",
                             self.approx_mode) from None
        return [(mode.is_exact or precision.name == "approximate",
                 "{approx_mode} {}: an approximate mode changes the output; only with {precision} approximate",
                 self.approx_mode)]
