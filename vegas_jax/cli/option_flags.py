"""The CLI's flag for every generation option, made from the option's own field (GenerationOptions', or a nested
research value's: vegas_jax.runtime.research_options): its flat name gives the flag (vegas_jax.cli.arguments.flag)
and its VEGAS_<FLAG> variable (vegas_jax.cli.flag_environment), its default and help are the field's, and its type
says how the flag's text becomes a value (PARSERS where the type alone does not: counts with K and M suffixes,
`--gamma auto`, lists of numbers); its range is checked where the options are (GenerationOptions.check). The
options every user sets go under one help heading, the research knobs under another. `build_options` turns the
parsed flags back into GenerationOptions."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from vegas_jax.cli.arguments import flag
from vegas_jax.runtime.options import RESEARCH, GenerationOptions


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
    """A comma-separated list of numbers (--gamma-costs, --tree-rates)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None


# How a flag's text becomes its option's value where the option's type does not say.
PARSERS = {"max_new_tokens": token_count, "max_model_len": token_count, "prefill_chunk": token_count,
           "min_sparse_tokens": token_count, "gamma": gamma_value, "gamma_costs": numbers, "tree_rates": numbers}
USER_HEADING = "generation options"
USER_DESCRIPTION = "sampling, lengths, stops, penalties, log-probabilities, the method, gamma and the drafts' precision"
RESEARCH_HEADING = "research options"
RESEARCH_DESCRIPTION = ("the knobs of each method and mechanism, nested in GenerationOptions by what they tune: the "
                        "draft KV budget and Vegas's scores, the baselines', adaptive gamma's, draft trees, SSV's")


def option_fields() -> tuple[list[tuple[str, dataclasses.Field, typing.Any]], list]:
    """(the options every user sets, the research knobs): each (flat name, field, type)."""
    hints = typing.get_type_hints(GenerationOptions)
    user = [(f.name, f, hints[f.name]) for f in dataclasses.fields(GenerationOptions) if f.name not in RESEARCH]
    research = []
    for cls in RESEARCH.values():
        hints = typing.get_type_hints(cls)
        research += [(cls.flat_name(f.name), f, hints[f.name]) for f in dataclasses.fields(cls)]
    return user, research


def _add_flag(group, name: str, field: dataclasses.Field, hint) -> None:
    """The option's flag: a switch for a bool, repeatable for a tuple, else one value of its type."""
    kinds = [k for k in (typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,))
             if k is not type(None)]
    kwargs = {"default": field.default}
    if name in PARSERS:
        kwargs["type"] = PARSERS[name]
    elif kinds[0] is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(kinds[0]) is tuple:
        item = typing.get_args(kinds[0])[0]
        kwargs |= {"action": "append", "default": []} | ({} if item is str else {"type": item})
    elif kinds[0] in (int, float):
        kwargs["type"] = kinds[0]
    group.add_argument(flag(name), dest=name, help=field.metadata["help"], **kwargs)


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """The options' flags, under their two headings."""
    user, research = option_fields()
    for heading, description, fields in ((USER_HEADING, USER_DESCRIPTION, user),
                                         (RESEARCH_HEADING, RESEARCH_DESCRIPTION, research)):
        group = parser.add_argument_group(heading, description)
        for name, field, hint in fields:
            _add_flag(group, name, field, hint)


def build_options(args: argparse.Namespace) -> GenerationOptions:
    """GenerationOptions from the parsed flags (research knobs by their flat names), not yet checked."""
    user, research = option_fields()
    return GenerationOptions(**{name: getattr(args, name) for name, _, _ in user + research})
