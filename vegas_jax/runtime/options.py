"""What a generation request asks for: `GenerationOptions`, one frozen value per request, its fields checked for type
and range before anything compiles (InputError names the field), and what follows from them (the compiled γ, the
draft tree, the selection policy's knobs). The engine (vegas_jax.runtime.engine) runs them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.quantized import PRECISIONS
from vegas_jax.decode import adaptive_gamma
from vegas_jax import inputs
from vegas_jax.ssv import choice as ssv
from vegas_jax.decode import stops
from vegas_jax.attention.verify import SCORE_MODES
from vegas_jax.decode.draft_kernel import ACTIVATIONS
from vegas_jax.decode.drafters import DRAFTERS
from vegas_jax.inputs import InputError
from vegas_jax.decode.selection import POLICIES
from vegas_jax.decode.tree_shapes import TreeShape, parse_tree

METHODS = ("ar",) + POLICIES
# The cache's capacity is a multiple of this many rows (vegas_jax.runtime.engine), which Quest's pages and retrieval's
# chunks must tile.
CAPACITY_ALIGN = 128
INT32_MAX = 2**31 - 1
# Drafts per iteration: beyond a few dozen every verification pass mostly checks tokens that are rejected anyway,
# and the draft probabilities ([batch, γ, vocabulary] float32 when sampling) grow with γ.
MAX_GAMMA = 64
# GenerationOptions' policy knobs: the method each belongs to, and its name as a field of that selection policy.
METHOD_KNOBS = {"stream_sinks": "streaming", "quest_page": "quest", "retrieval_chunk": "retrieval",
                "retrieval_every": "retrieval"}
POLICY_FIELDS = {"stream_sinks": "sinks", "quest_page": "page", "retrieval_chunk": "chunk", "retrieval_every": "every"}


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    method: str = "ar"
    gamma: int | str = 6  # or "auto" (vegas_jax.decode.adaptive_gamma)
    sparse_ratio: float = 0.07
    min_sparse_tokens: int = 256
    score_mode: str = "logit"
    # The baselines' own knobs, each for its method only (so that they can be tuned as Vegas's γ and ratio are):
    # MagicDec-Stream's sink tokens (the rest of the budget is the recent window), Quest's page and retrieval's
    # chunk (tokens), and how many iterations retrieval keeps its chunks before ranking them afresh.
    stream_sinks: int = 16
    quest_page: int = 16
    retrieval_chunk: int = 32
    retrieval_every: int = 4
    max_model_len: int | None = None
    prefill_chunk: int = 2048
    # Where generation ends (vegas_jax.decode.stops): stop strings (the text ends before the first, or after it with
    # include_stop) and token ids that end a request as EOS does.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop: bool = False
    # History-dependent penalties (vegas_jax.decode.penalties: repetition as transformers', presence and frequency as
    # OpenAI's and vLLM's) and min-p (vegas_jax.decode.sampling).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    # Each generated token's log-probability and this many most likely alternatives (vegas_jax.decode.logprobs).
    logprobs: int | None = None
    draft_weights: str = "bf16"  # bf16 (the model's own weights), int8 or int4 (models.draft_weights)
    # What the drafts' quantized products multiply: bf16 (x as computed) or int8 (x rounded to int8 per group of
    # positions, multiplied in integers at one row where kernels run; vegas_jax.decode.draft_kernel).
    draft_activations: str = "bf16"
    gamma_max: int | None = None  # with gamma "auto": the most drafts of an iteration (default 8)
    # With gamma "auto": what an iteration of g = 1..γ_max drafts costs, in plain steps (>= 1 each); None: timed at
    # the start of a run (vegas_jax.decode.adaptive_gamma.Warmup; a run's metrics report them as `gamma_costs`).
    gamma_costs: tuple[float, ...] | None = None
    # A draft tree `DEPTHxBRANCHING` (vegas_jax.decode.tree_shapes; 6x1 is a chain) verified in one pass, and what
    # drafts it (vegas_jax.decode.drafters): self (the model's cheaper draft: a dense model's sparse draft, with a
    # selection method; an NSA model's sink-and-window draft, with method ar), ngram (prompt lookup, with method ar:
    # no draft pass, no selection) or head (a trained draft head, with method ar: docs/draft-head.md; the Engine's
    # draft_head); with an ssv_profile also auto (the planner chooses the drafter).
    draft_tree: str | None = None
    drafter: str = "self"
    # SSV on NSA models (vegas_jax.ssv.choice): the precision class (vegas_jax.ssv.precision: exact never changes the output;
    # approximate allows the approximate modes whose measured top-1 disagreement with the exact target is at most
    # precision_tolerance, default 0.05), an approximate mode pinned by its label (s<span>w<widen>r<refresh>; with
    # precision approximate), and a device profile from which the planner chooses the tree and the mode.
    precision: str = "exact"
    precision_tolerance: float | None = None
    approx_mode: str | None = None
    ssv_profile: str | None = None

    @classmethod
    def check(cls, options: Any) -> GenerationOptions:
        """`options` with plain Python values, every field checked for its type (`inputs.options_of`: a dict, a
        float count or a numeric string is refused) and then its range (`validate`); InputError names the field.
        Every Engine entry point checks its options so, before anything compiles."""
        options = inputs.options_of(options, cls)
        if not isinstance(options.gamma, str):
            options = dataclasses.replace(options, gamma=inputs.integer(options.gamma, "gamma"))
        options.validate()
        return options

    def validate(self) -> None:
        """InputError naming the first field out of range (of options whose types `check` has checked)."""
        checks = [
            (self.max_new_tokens >= 1, "{max_new_tokens} must be >= 1, got {}", self.max_new_tokens),
            # Below ~1e-37 logits / temperature overflows float32; anything that small is greedy in effect.
            (self.temperature == 0 or 1e-6 <= self.temperature < math.inf,
             "{temperature} must be 0 (greedy) or a finite number >= 1e-6, got {}", self.temperature),
            (0 <= self.top_k <= INT32_MAX, "{top_k} must be in [0, 2**31 - 1], got {}", self.top_k),
            (0 < self.top_p <= 1, "{top_p} must be in (0, 1], got {}", self.top_p),
            # Greedy decoding takes the argmax whatever the filters keep: a filter given with it would be ignored.
            (self.temperature > 0 or self.top_k == 0,
             "{top_k} {} has no effect with {temperature} 0 (greedy); give a temperature to sample", self.top_k),
            (self.temperature > 0 or self.top_p == 1,
             "{top_p} {} has no effect with {temperature} 0 (greedy); give a temperature to sample", self.top_p),
            (-INT32_MAX - 1 <= self.seed <= INT32_MAX, "{seed} must fit in 32 bits, got {}", self.seed),
            (self.method in METHODS, "{method} must be one of " + ", ".join(METHODS) + ", got {!r}", self.method),
            (self.gamma == adaptive_gamma.AUTO or (not isinstance(self.gamma, str) and 0 <= self.gamma <= MAX_GAMMA),
             "{gamma} must be auto or in [0, " + str(MAX_GAMMA) + "], got {!r}", self.gamma),
            (0 < self.sparse_ratio <= 1, "{sparse_ratio} must be in (0, 1], got {}", self.sparse_ratio),
            (self.min_sparse_tokens >= 1, "{min_sparse_tokens} must be >= 1, got {}", self.min_sparse_tokens),
            (self.score_mode in SCORE_MODES, "{score_mode} must be one of {}, got {!r}", SCORE_MODES, self.score_mode),
            (self.max_model_len is None or self.max_model_len >= 2, "{max_model_len} must be >= 2, got {}",
             self.max_model_len),
            (self.prefill_chunk >= 1, "{prefill_chunk} must be >= 1, got {}", self.prefill_chunk),
            (0 < self.repetition_penalty < math.inf,
             "{repetition_penalty} must be a finite number > 0 (1 is off; < 1 favours repetition), got {}",
             self.repetition_penalty),
            (-2 <= self.presence_penalty <= 2, "{presence_penalty} must be in [-2, 2], got {}", self.presence_penalty),
            (-2 <= self.frequency_penalty <= 2, "{frequency_penalty} must be in [-2, 2], got {}",
             self.frequency_penalty),
            (0 <= self.min_p <= 1, "{min_p} must be in [0, 1], got {}", self.min_p),
            (self.temperature > 0 or self.min_p == 0,
             "{min_p} {} has no effect with {temperature} 0 (greedy); give a temperature to sample", self.min_p),
            (self.logprobs is None or self.logprobs >= 0,
             "{logprobs} must be >= 0 (the number of alternatives shown), got {}", self.logprobs),
            (bool(self.stop) or not self.include_stop, "{include_stop} has no effect without {stop}"),
            (self.draft_weights in PRECISIONS, "{draft_weights} must be one of {}, got {!r}", ", ".join(PRECISIONS),
             self.draft_weights),
            (self.draft_activations in ACTIVATIONS, "{draft_activations} must be one of {}, got {!r}",
             ", ".join(ACTIVATIONS), self.draft_activations),
            (self.draft_activations == "bf16" or self.draft_weights != "bf16",
             "{draft_activations} {} multiplies quantized draft weights: give {draft_weights} int8 or int4",
             self.draft_activations),
            (self.draft_weights == "bf16" or (self.method != "ar" and self.gamma != 0),
             "{draft_weights} {} has no effect without drafts ({method} {}, {gamma} {})", self.draft_weights,
             self.method, self.gamma),
            (not self.auto_gamma or self.method != "ar",
             "{gamma} auto chooses how many drafts to make, but {method} ar makes none"),
            # Quest updates its page bounds incrementally at each verification, which adaptive γ's plain steps skip.
            (not self.auto_gamma or self.method != "quest", "{gamma} auto: not with {method} quest"),
            (self.gamma_max is None or self.auto_gamma, "{gamma_max} {}: only with {gamma} auto", self.gamma_max),
            (self.gamma_max is None or 1 <= self.gamma_max <= MAX_GAMMA,
             "{gamma_max} must be in [1, " + str(MAX_GAMMA) + "], got {}", self.gamma_max),
            (self.gamma_costs is None or self.auto_gamma, "{gamma_costs}: only with {gamma} auto"),
            # (With a draft tree the tree's checks say what is wrong: its depth is no γ_max.)
            (self.gamma_costs is None or not self.auto_gamma or self.draft_tree is not None
             or len(self.gamma_costs) == self.effective_gamma,
             "{gamma_costs} must give one cost for each g = 1..{gamma_max} ({}), got {}", self.effective_gamma,
             len(self.gamma_costs or ())),
            (self.gamma_costs is None or all(1 <= c < math.inf for c in self.gamma_costs),
             "{gamma_costs} must be finite numbers >= 1 (plain steps per iteration), got {}", self.gamma_costs),
            (self.stream_sinks >= 1, "{stream_sinks} must be >= 1, got {}", self.stream_sinks),
            # Pages and chunks tile the cache, whose capacity is a multiple of CAPACITY_ALIGN.
            (self.quest_page >= 1 and CAPACITY_ALIGN % self.quest_page == 0,
             "{quest_page} must divide " + str(CAPACITY_ALIGN) + ", got {}", self.quest_page),
            (self.retrieval_chunk >= 1 and CAPACITY_ALIGN % self.retrieval_chunk == 0,
             "{retrieval_chunk} must divide " + str(CAPACITY_ALIGN) + ", got {}", self.retrieval_chunk),
            (self.retrieval_every >= 1, "{retrieval_every} must be >= 1, got {}", self.retrieval_every),
        ] + [
            # A knob of another method would be ignored: refused, as top_k is when greedy.
            (self.method == method or getattr(self, knob) == getattr(GenerationOptions, knob),
             "{" + knob + "} {} applies to {method} " + method + " only, not {!r}", getattr(self, knob), self.method)
            for knob, method in METHOD_KNOBS.items()
        ]
        for ok, template, *values in checks + self._tree_checks():
            if not ok:
                raise InputError(template, *values)
        ssv.check(self)
        for i, text in enumerate(self.stop):
            if not text:
                raise InputError("{stop}: stop string {} is empty", i)
            if "\ufffd" in text:
                raise InputError("{stop}: stop string {} contains U+FFFD, which decoding writes for invalid bytes", i)
            inputs.utf8(text, "{stop}: stop string {}", i)
        stop_bytes = sum(len(s.encode("utf-8")) for s in self.stop)
        if stop_bytes > stops.MAX_STOP_BYTES:
            raise InputError("{stop}: {} bytes of stop strings in all, more than " + str(stops.MAX_STOP_BYTES),
                             stop_bytes)
        for token in self.stop_token_ids:
            if token < 0:
                raise InputError("{stop_token_ids}: {} is no token id", token)

    def _tree_checks(self) -> list[tuple]:
        """validate's checks of draft_tree and drafter (the tree's own syntax and size: parse_tree)."""
        if self.draft_tree is None:
            # With a profile the planner chooses the tree (or none) for the drafter given.
            return [(self.drafter != "auto" or self.ssv_profile is not None,
                     "{drafter} auto is the SSV planner's choice: only with {ssv_profile}"),
                    (self.drafter == "self" or self.ssv_profile is not None,
                     "{drafter} {} drafts a tree: give {draft_tree} too (6x1 is a chain)", self.drafter)]
        tree = parse_tree(self.draft_tree)
        penalised = self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        return [
            (self.drafter in DRAFTERS, "{drafter} must be one of " + ", ".join(DRAFTERS) + ", got {!r}", self.drafter),
            (self.drafter == "self" or self.method == "ar",
             "{drafter} {} reads no KV selection: {method} {} would be ignored (leave it ar)", self.drafter,
             self.method),
            (not self.auto_gamma, "{gamma} auto: not with {draft_tree} (a tree's depth is fixed)"),
            (self.gamma in (GenerationOptions.gamma, tree.depth),
             "{gamma} {} contradicts {draft_tree} {} (depth {}): leave {gamma} out or give the depth", self.gamma,
             self.draft_tree, tree.depth),
            # Only Quest's draft attention scores pages itself, step by step along a chain.
            (self.method != "quest", "{draft_tree}: not with {method} quest (it scores pages along a chain)"),
            (not penalised, "{draft_tree}: not with {repetition_penalty}, {presence_penalty} or {frequency_penalty} "
                            "(each tree node would need its own path as history)"),
        ]

    @property
    def tree(self) -> TreeShape | None:
        return None if self.draft_tree is None else parse_tree(self.draft_tree)

    @property
    def auto_gamma(self) -> bool:
        return self.gamma == adaptive_gamma.AUTO

    @property
    def effective_gamma(self) -> int:
        """The compiled γ: 0 for plain decoding; with auto, γ_max; with a draft tree, its depth."""
        if self.draft_tree is not None:
            return self.tree.depth
        if self.method == "ar":
            return 0
        if self.auto_gamma:
            return self.gamma_max or adaptive_gamma.DEFAULT_GAMMA_MAX
        return self.gamma

    def plain(self) -> "GenerationOptions":
        """The same request with plain decoding (what --compare-ar runs): no drafts, nothing about them, no
        planner (a pinned approximate mode stays: plain decoding of its target)."""
        return dataclasses.replace(self, method="ar", gamma=GenerationOptions.gamma, draft_weights="bf16",
                                   draft_activations="bf16", gamma_max=None, gamma_costs=None,
                                   draft_tree=None, drafter=GenerationOptions.drafter, ssv_profile=None)

    @property
    def sampling_values(self) -> tuple:
        """sampling.SamplingParams.create's values after the batch size."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
                self.frequency_penalty)

    @property
    def policy_knobs(self) -> dict[str, int]:
        """The method's own knobs, by the selection policy's field names (`selection.make_policy`)."""
        return {POLICY_FIELDS[knob]: getattr(self, knob) for knob, method in METHOD_KNOBS.items()
                if method == self.method}
