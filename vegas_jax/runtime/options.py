"""What a generation request asks for: `GenerationOptions`, one frozen value per request in two layers (the options
every user sets, flat; the research knobs, nested per method: vegas_jax.runtime.research_options), its fields
checked for type and range before anything compiles (InputError names the option by its flat name, its CLI flag's),
and what follows from them (the compiled γ, the draft tree, the selection policy's knobs). A run resolves them once
into its plan (vegas_jax.runtime.run_plan.resolve), which the engine (vegas_jax.runtime.engine) runs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.quantized import PRECISIONS
from vegas_jax.decode import adaptive_gamma
from vegas_jax import inputs
from vegas_jax.decode import stops
from vegas_jax.decode.draft_kernel import ACTIVATIONS
from vegas_jax.decode.drafters import DRAFTERS
from vegas_jax.inputs import InputError
from vegas_jax.decode.selection import POLICIES
from vegas_jax.decode.tree_shapes import TreeShape
from vegas_jax.runtime.research_options import (MAX_GAMMA, AdaptiveGammaConfig, QuestConfig, RetrievalConfig,
                                                SelectionConfig, SsvConfig, StreamingConfig, TreeConfig, option)

METHODS = ("ar",) + POLICIES
INT32_MAX = 2**31 - 1
# GenerationOptions' nested research values: its field and the value's type.
RESEARCH = {"selection": SelectionConfig, "streaming": StreamingConfig, "quest": QuestConfig,
            "retrieval": RetrievalConfig, "adaptive_gamma": AdaptiveGammaConfig, "drafting": TreeConfig,
            "ssv": SsvConfig}
# Every research knob by its flat name (the CLI flag's, GenerationOptions' keyword): (nested field, its field).
FLAT_RESEARCH = {cls.flat_name(f.name): (nested, f.name) for nested, cls in RESEARCH.items()
                 for f in dataclasses.fields(cls)}
# The baselines' own knobs (a nested value each, of the same name as its method), by flat name: their method.
BASELINES = ("streaming", "quest", "retrieval")
METHOD_KNOBS = {flat: nested for flat, (nested, _) in FLAT_RESEARCH.items() if nested in BASELINES}


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True, init=False)
class GenerationOptions:
    """The options every user sets, flat and named as Hugging Face's `generate` and vLLM's are, then the research
    knobs nested by the method or mechanism they tune (vegas_jax.runtime.research_options). A research knob is also
    taken as a flat keyword (`GenerationOptions(method="quest", quest_page=32)`, `dataclasses.replace(options,
    sparse_ratio=0.1)`, its CLI flag's name) and lands in its nested value, and is read so too
    (`options.quest_page`); `flat()` gives every option by its flat name. Every field carries its help, from which
    its CLI flag is made (vegas_jax.cli.option_flags)."""

    max_new_tokens: int = option(256, "tokens to generate per request, never exceeded (also when drafts run ahead)")
    temperature: float = option(0.0, "0 means greedy")
    top_k: int = option(0, "0 means off")
    top_p: float = option(1.0, "1 means off")
    min_p: float = option(0.0, "keep tokens at least this times as likely as the most likely one (0 means off)")
    # History-dependent penalties (vegas_jax.decode.penalties: repetition as transformers', presence and frequency as
    # OpenAI's and vLLM's); min-p above (vegas_jax.decode.sampling).
    repetition_penalty: float = option(1.0, "transformers': logits of prompt and output tokens divided (if > 0) or "
                                            "multiplied by it; 1 off")
    presence_penalty: float = option(0.0, "OpenAI's / vLLM's: subtracted from the logits of tokens in the output so "
                                          "far; in [-2, 2]")
    frequency_penalty: float = option(0.0, "OpenAI's / vLLM's: times a token's count in the output so far, "
                                           "subtracted; in [-2, 2]")
    # Where generation ends (vegas_jax.decode.stops): stop strings (the text ends before the first, or after it with
    # include_stop) and token ids that end a request as EOS does.
    stop: tuple[str, ...] = option((), "stop string: the output ends before it (found across tokens); repeatable")
    stop_token_ids: tuple[int, ...] = option((), "token id that ends a request as EOS does; repeatable")
    include_stop: bool = option(False, "keep the stop string at the end of the text")
    # Each generated token's log-probability and this many most likely alternatives (vegas_jax.decode.logprobs).
    logprobs: int | None = option(None, "report each generated token's log-probability and its K most likely "
                                        "alternatives")
    seed: int = option(0, "request i uses seed + i")
    max_model_len: int | None = option(None, "KV cache length (default: prompt + max-new-tokens rounded up to 1024, "
                                             "capped at the model's)")
    prefill_chunk: int = option(2048, "prompt tokens per prefill step (smaller bounds memory)")
    method: str = option("ar", "one of: " + ", ".join(METHODS))
    # A count, or "auto" (vegas_jax.decode.adaptive_gamma; its knobs: the nested adaptive_gamma).
    gamma: int | str = option(6, "draft tokens per iteration, or auto: chosen each iteration from the measured costs "
                                 "and the running acceptance (at most --gamma-max; 0 = a plain step)")
    # bf16 (the model's own weights), int8 or int4 (models.draft_weights), and what their quantized products multiply:
    # bf16 (x as computed) or int8 (x rounded to int8 per group of positions, multiplied in integers at one row where
    # kernels run; vegas_jax.decode.draft_kernel).
    draft_weights: str = option("bf16", "what the drafts read: bf16 (the model's weights), int8 (per channel) or int4 "
                                        "(groups); verification always reads the model's weights")
    draft_activations: str = option("bf16", "what the drafts' quantized products multiply (with --draft-weights int8 "
                                            "or int4): bf16, or int8 (x rounded to int8 per group; on the GPU one "
                                            "row multiplies in integers)")
    # The research knobs, one value per method or mechanism (RESEARCH).
    selection: SelectionConfig = SelectionConfig()
    streaming: StreamingConfig = StreamingConfig()
    quest: QuestConfig = QuestConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    adaptive_gamma: AdaptiveGammaConfig = AdaptiveGammaConfig()
    drafting: TreeConfig = TreeConfig()
    ssv: SsvConfig = SsvConfig()

    def __init__(self, **options):
        """Keyword options only: fields by name, research knobs also by flat name (a flat knob given beside its
        nested value replaces that field of it, as `dataclasses.replace` does)."""
        knobs: dict[str, dict] = {}
        for name, value in options.items():
            if name in FLAT_RESEARCH:
                nested, field = FLAT_RESEARCH[name]
                knobs.setdefault(nested, {})[field] = value
            elif name not in OPTION_FIELDS:
                raise TypeError(f"GenerationOptions.__init__() got an unexpected keyword argument {name!r}")
        for name in OPTION_FIELDS:
            object.__setattr__(self, name, options.get(name, getattr(GenerationOptions, name)))
        for nested, changes in knobs.items():
            object.__setattr__(self, nested, dataclasses.replace(self._research(nested), **changes))

    def __getattr__(self, name: str):
        """A research knob read by its flat name (`options.quest_page`), as it is given."""
        if name in FLAT_RESEARCH:
            nested, field = FLAT_RESEARCH[name]
            return getattr(getattr(self, nested), field)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _research(self, nested: str):
        """The nested value of that name; InputError naming it when it is not one of its type."""
        value, cls = getattr(self, nested), RESEARCH[nested]
        if not isinstance(value, cls):
            raise InputError("{" + nested + "} must be a {}, got {}", cls.__name__, type(value).__name__)
        return value

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name (what the CLI's config reports)."""
        doc = {name: getattr(self, name) for name in OPTION_FIELDS if name not in RESEARCH}
        return doc | {flat: getattr(getattr(self, nested), field) for flat, (nested, field) in FLAT_RESEARCH.items()}

    @classmethod
    def check(cls, options: Any) -> GenerationOptions:
        """`options` with plain Python values, every field checked for its type (`inputs.options_of`: a dict, a
        float count or a numeric string is refused), each nested research value by its own check, and then every
        option against the others (`validate`); InputError names the option by its flat name. A run checks its
        options so once, before anything compiles (vegas_jax.runtime.run_plan.resolve)."""
        options = inputs.options_of(options, cls)
        if not isinstance(options.gamma, str):
            options = dataclasses.replace(options, gamma=inputs.integer(options.gamma, "gamma"))
        options = dataclasses.replace(options, **{nested: options._research(nested).checked() for nested in RESEARCH})
        options.validate()
        return options

    def validate(self) -> None:
        """InputError naming the first option out of range, or at odds with another (of options whose types and
        nested values `check` has checked)."""
        gammas, flat = self.adaptive_gamma, self.flat()
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
            (gammas.gamma_max is None or self.auto_gamma, "{gamma_max} {}: only with {gamma} auto", gammas.gamma_max),
            (gammas.costs is None or self.auto_gamma, "{gamma_costs}: only with {gamma} auto"),
            # (With a draft tree the tree's checks say what is wrong: its depth is no γ_max.)
            (gammas.costs is None or not self.auto_gamma or self.drafting.draft_tree is not None
             or len(gammas.costs) == self.effective_gamma,
             "{gamma_costs} must give one cost for each g = 1..{gamma_max} ({}), got {}", self.effective_gamma,
             len(gammas.costs or ())),
        ] + [
            # A knob of another method would be ignored: refused, as top_k is when greedy.
            (self.method == method or flat[knob] == DEFAULTS[knob],
             "{" + knob + "} {} applies to {method} " + method + " only, not {!r}", flat[knob], self.method)
            for knob, method in METHOD_KNOBS.items()
        ]
        for ok, template, *values in checks + self._tree_checks():
            if not ok:
                raise InputError(template, *values)
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
        """validate's checks of draft_tree and drafter against the other options (the tree's own syntax and size:
        TreeConfig's check)."""
        draft_tree, drafter, profile = self.drafting.draft_tree, self.drafting.drafter, self.ssv.profile
        if draft_tree is None:
            # With a profile the planner chooses the tree (or none) for the drafter given.
            return [(drafter != "auto" or profile is not None,
                     "{drafter} auto is the SSV planner's choice: only with {ssv_profile}"),
                    (drafter == "self" or profile is not None,
                     "{drafter} {} drafts a tree: give {draft_tree} too (6x1 is a chain)", drafter)]
        tree = self.drafting.shape()
        penalised = self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        return [
            (drafter in DRAFTERS, "{drafter} must be one of " + ", ".join(DRAFTERS) + ", got {!r}", drafter),
            (drafter == "self" or self.method == "ar",
             "{drafter} {} reads no KV selection: {method} {} would be ignored (leave it ar)", drafter,
             self.method),
            (not self.auto_gamma, "{gamma} auto: not with {draft_tree} (a tree's depth is fixed)"),
            (self.gamma in (GenerationOptions.gamma, tree.depth),
             "{gamma} {} contradicts {draft_tree} {} (depth {}): leave {gamma} out or give the depth", self.gamma,
             draft_tree, tree.depth),
            # Only Quest's draft attention scores pages itself, step by step along a chain.
            (self.method != "quest", "{draft_tree}: not with {method} quest (it scores pages along a chain)"),
            (not penalised, "{draft_tree}: not with {repetition_penalty}, {presence_penalty} or {frequency_penalty} "
                            "(each tree node would need its own path as history)"),
        ]

    @property
    def tree(self) -> TreeShape | None:
        return self.drafting.shape()

    @property
    def auto_gamma(self) -> bool:
        return self.gamma == adaptive_gamma.AUTO

    @property
    def effective_gamma(self) -> int:
        """The compiled γ: 0 for plain decoding; with auto, γ_max; with a draft tree, its depth."""
        if self.drafting.draft_tree is not None:
            return self.tree.depth
        if self.method == "ar":
            return 0
        if self.auto_gamma:
            return self.adaptive_gamma.gamma_max or adaptive_gamma.DEFAULT_GAMMA_MAX
        return self.gamma

    def plain(self) -> "GenerationOptions":
        """The same request with plain decoding (what --compare-ar runs): no drafts, nothing about them (a
        baseline's knobs would be refused with method ar), no planner (a pinned approximate mode stays: plain
        decoding of its target)."""
        return dataclasses.replace(self, method="ar", gamma=GenerationOptions.gamma, draft_weights="bf16",
                                   draft_activations="bf16", adaptive_gamma=AdaptiveGammaConfig(),
                                   drafting=TreeConfig(), ssv=dataclasses.replace(self.ssv, profile=None),
                                   **{method: RESEARCH[method]() for method in BASELINES})

    @property
    def sampling_values(self) -> tuple:
        """sampling.SamplingParams.create's values after the batch size."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
                self.frequency_penalty)

    @property
    def policy_knobs(self) -> dict[str, int]:
        """The method's own knobs, by the selection policy's field names (`selection.make_policy`)."""
        return dataclasses.asdict(getattr(self, self.method)) if self.method in BASELINES else {}


OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(GenerationOptions))
DEFAULTS = GenerationOptions().flat()  # every option's default, by its flat name
