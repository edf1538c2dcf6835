"""Every single-valued flag of the CLI has an environment variable, VEGAS_<FLAG> (--max-new-tokens:
VEGAS_MAX_NEW_TOKENS), as llama.cpp's flags have LLAMA_ARG_*: a cluster job or a container sets its defaults
once, and a flag on the command line wins. A switch (--quiet, --chat-template) takes 1, true, yes, on or 0, false,
no, off. Repeatable flags (--prompt, --stop, ...) have none: a list in one variable would need a separator of its
own. A variable with the prefix that names no flag is refused, as a misspelt flag is, rather than ignored."""

from __future__ import annotations

import argparse
from typing import Mapping

PREFIX = "VEGAS_"
# Read elsewhere: the attention backend and layer loop (vegas_jax.attention.backend), and the code a benchmark's records name.
OTHER_VARIABLES = frozenset({"VEGAS_KERNELS", "VEGAS_SCAN_LAYERS", "VEGAS_CODE"})
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction)
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


class VariableError(ValueError):
    """A VEGAS_* variable that is no flag's or whose value its flag refuses; the message starts with the name."""


def variable(action: argparse.Action) -> str:
    """The flag's own name (--stop-token-id: VEGAS_STOP_TOKEN_ID), not its destination's."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    return PREFIX + flag[2:].replace("-", "_").upper()


def apply(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, str]:
    """Sets the parser's defaults from the VEGAS_* variables of `environ`; returns {dest: variable} of those set.
    VariableError for a variable no flag has, or a value its flag's type or choices refuse."""
    flags = {variable(a): a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}
    taken = {}
    # An empty variable is an unset one (`VEGAS_MODEL= cmd` keeps the default model).
    for name in sorted(k for k in environ if k.startswith(PREFIX) and k not in OTHER_VARIABLES and environ[k]):
        action, text = flags.get(name), environ[name]
        if action is None:
            raise VariableError(f"{name}: no flag has this variable (VEGAS_<FLAG>, e.g. VEGAS_MAX_NEW_TOKENS)")
        if isinstance(action, _REPEATABLE):
            raise VariableError(f"{name}: {action.option_strings[0]} is repeatable and has no variable; "
                                    "give it on the command line")
        parser.set_defaults(**{action.dest: _value(name, action, text)})
        taken[action.dest] = name
    return taken


def given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags `argv` gives, however spelt (`--temp` for `--temperature`, `--flag=value`),
    from a parse with every default suppressed; `parser` is used up. --help and malformed flags exit as in any
    parse."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _value(name: str, action: argparse.Action, text: str):
    if isinstance(action, _SWITCHES):
        lowered = text.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise VariableError(f"{name}={text}: a switch is one of {', '.join(_TRUE + _FALSE)}")
        on = lowered in _TRUE
        return (not on) if isinstance(action, argparse._StoreFalseAction) else on
    try:
        value = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise VariableError(f"{name}={text}: {e or 'not a valid value'}") from None
    if action.choices is not None and value not in action.choices:
        raise VariableError(f"{name}={text}: one of {', '.join(map(str, action.choices))}")
    return value
