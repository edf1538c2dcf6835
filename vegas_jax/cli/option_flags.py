"""The CLI's flag for every generation option, made from one table: each option's flag name, default and type are
GenerationOptions' own (its flat name, `options.DEFAULTS`; vegas_jax.runtime.research_options for the nested
knobs), its range is checked where the options are (GenerationOptions.check), and this table adds only what a
command line needs besides: the help text and how the flag's text becomes a value. The options every user sets
go under one help heading, the research knobs under another. `build_options` turns the parsed flags back into
GenerationOptions, so no option is a flag of another name or default."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from vegas_jax.runtime.options import DEFAULTS, FLAT_RESEARCH, METHODS, GenerationOptions


def token_count(text: str) -> int:
    """An integer, optionally with a K (1024) or M (1024**2) suffix: `32K`, `128k`."""
    scale = {"k": 1024, "m": 1024**2}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        return int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number (a K or M suffix is allowed): {text!r}") from None


def gamma_value(text: str) -> int | str:
    """--gamma: a whole number of drafts, or `auto` (vegas_jax.decode.adaptive_gamma)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number or auto: {text!r}") from None


def numbers(text: str) -> tuple[float, ...]:
    """A comma-separated list of numbers (--gamma-costs)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


@dataclasses.dataclass(frozen=True)
class OptionFlag:
    """One option's flag: its flat name, help, and how its text becomes a value (`type`, or an argparse `action`
    for switches and repeatable flags); `flag` where it is not --<name with dashes>."""

    name: str
    help: str
    type: Callable[[str], object] | None = None
    action: str | None = None
    flag: str | None = None

    def add_to(self, group) -> None:
        default = [] if self.action == "append" else DEFAULTS[self.name]  # (argparse appends to a list)
        kwargs = {"type": self.type} if self.type is not None else {}
        if self.action is not None:
            kwargs["action"] = self.action
        group.add_argument(self.flag or "--" + self.name.replace("_", "-"), dest=self.name, default=default,
                           help=self.help, **kwargs)


USER_FLAGS = (
    OptionFlag("max_new_tokens", "tokens to generate per request, never exceeded (also when drafts run ahead)",
               token_count),
    OptionFlag("temperature", "0 means greedy", float),
    OptionFlag("top_k", "0 means off", int),
    OptionFlag("top_p", "1 means off", float),
    OptionFlag("min_p", "keep tokens at least this times as likely as the most likely one (0 means off)", float),
    OptionFlag("repetition_penalty",
               "transformers': logits of prompt and output tokens divided (if > 0) or multiplied by it; 1 off", float),
    OptionFlag("presence_penalty",
               "OpenAI's / vLLM's: subtracted from the logits of tokens in the output so far; in [-2, 2]", float),
    OptionFlag("frequency_penalty",
               "OpenAI's / vLLM's: times a token's count in the output so far, subtracted; in [-2, 2]", float),
    OptionFlag("stop", "stop string: the output ends before it (found across tokens); repeatable", action="append"),
    OptionFlag("stop_token_ids", "token id that ends a request as EOS does; repeatable", int, "append",
               "--stop-token-id"),
    OptionFlag("include_stop", "keep the stop string at the end of the text", action="store_true"),
    OptionFlag("logprobs", "report each generated token's log-probability and its K most likely alternatives", int),
    OptionFlag("seed", "request i uses seed + i", int),
    OptionFlag("max_model_len",
               "KV cache length (default: prompt + max-new-tokens rounded up to 1024, capped at the model's)",
               token_count),
    OptionFlag("prefill_chunk", "prompt tokens per prefill step (smaller bounds memory)", token_count),
    OptionFlag("method", f"one of: {', '.join(METHODS)}"),
    OptionFlag("gamma", "draft tokens per iteration, or auto: chosen each iteration from the measured costs and the "
                        "running acceptance (at most --gamma-max; 0 = a plain step)", gamma_value),
    OptionFlag("draft_weights", "what the drafts read: bf16 (the model's weights), int8 (per channel) or int4 "
                                "(groups); verification always reads the model's weights"),
    OptionFlag("draft_activations", "what the drafts' quantized products multiply (with --draft-weights int8 or "
                                    "int4): bf16, or int8 (x rounded to int8 per group; on the GPU one row "
                                    "multiplies in integers)"),
)

RESEARCH_FLAGS = (
    OptionFlag("sparse_ratio", "draft KV budget as a fraction of the current length", float),
    OptionFlag("min_sparse_tokens", "the draft KV budget's floor, in tokens", token_count),
    OptionFlag("score_mode", "logit | weight"),
    OptionFlag("stream_sinks", "--method streaming: sink tokens of the budget (the rest is the recent window)", int),
    OptionFlag("quest_page", "--method quest: tokens per page (divides 128)", int),
    OptionFlag("retrieval_chunk", "--method retrieval: tokens per chunk (divides 128)", int),
    OptionFlag("retrieval_every", "--method retrieval: iterations between rankings of the chunks", int),
    OptionFlag("gamma_max", "with --gamma auto: the most drafts of an iteration (8)", int),
    OptionFlag("gamma_costs", "with --gamma auto: what an iteration of 1, 2, .., --gamma-max drafts costs in plain "
                              "steps, comma-separated (default: timed at the start; a run's metrics report them)",
               numbers),
    OptionFlag("draft_tree", "verify a draft tree DEPTHxBRANCHING (e.g. 4x2; 6x1 is a chain; at most 64 nodes) "
                             "instead of a chain of --gamma drafts"),
    OptionFlag("drafter", "with --draft-tree: self (the model's cheaper draft: a dense model's sparse draft, with "
                          "--method; an NSA model's sink and window), ngram (prompt lookup) or head (a trained draft "
                          "head, --draft-head)"),
    OptionFlag("precision", "NSA models: exact (never changes the output) | approximate (allows approximate modes "
                            "whose measured top-1 disagreement is at most --precision-tolerance)"),
    OptionFlag("precision_tolerance",
               "with --precision approximate: the largest top-1 disagreement allowed, in [0, 0.5] (0.05)", float),
    OptionFlag("approx_mode", "with --precision approximate and no --ssv-profile: run this approximate mode's "
                              "modified target (s<span>w<widen>r<refresh>, e.g. s8w1r2)"),
    OptionFlag("ssv_profile", "NSA models: a device profile (benchmarks/profile_ssv.py); the planner chooses the "
                              "draft tree and the mode within --precision"),
)
USER_HEADING = "generation options"
RESEARCH_HEADING = "research options"
RESEARCH_DESCRIPTION = ("the knobs of each method and mechanism, nested in GenerationOptions by what they tune: the "
                        "draft KV budget and Vegas's scores, the baselines', adaptive gamma's, draft trees, SSV's")


def add_option_flags(parser: argparse.ArgumentParser):
    """The options' flags, under their two headings; (the user group, the research group), so that a caller may
    put flags of its own beside them."""
    user = parser.add_argument_group(USER_HEADING, "sampling, lengths, stops, penalties, log-probabilities, the "
                                                   "method, gamma and the drafts' precision")
    research = parser.add_argument_group(RESEARCH_HEADING, RESEARCH_DESCRIPTION)
    for flags, group in ((USER_FLAGS, user), (RESEARCH_FLAGS, research)):
        for option in flags:
            option.add_to(group)
    return user, research


def build_options(args: argparse.Namespace) -> GenerationOptions:
    """GenerationOptions from the parsed flags (research knobs by their flat names), not yet checked."""
    return GenerationOptions(**{option.name: getattr(args, option.name) for option in USER_FLAGS + RESEARCH_FLAGS})


def _every_option_has_one_flag() -> None:
    """The table covers GenerationOptions, each option once and in its group: a new option needs its flag."""
    user = {option.name for option in USER_FLAGS}
    research = {option.name for option in RESEARCH_FLAGS}
    options = set(DEFAULTS)
    if user & research or user | research != options or research != set(FLAT_RESEARCH):
        raise AssertionError(f"option flags out of step with GenerationOptions: {sorted(options ^ (user | research))}"
                             f", research {sorted(research ^ set(FLAT_RESEARCH))}")


_every_option_has_one_flag()
