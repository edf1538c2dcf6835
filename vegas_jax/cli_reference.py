"""docs/cli.md, the CLI reference, generated from the argparse parsers of `vegas_jax.generate`, `vegas_jax.score`
and `vegas_jax.train_draft_head` so that it cannot drift from them (tests/test_docs.py compares the file with `render()`).

    python -m vegas_jax.cli_reference            # rewrites docs/cli.md
    python -m vegas_jax.cli_reference --check    # exit 1 if docs/cli.md differs from the parsers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vegas_jax import generate, score, train_draft_head
from vegas_jax.cli import flag_environment, option_flags

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
# What a flag's value looks like, by its argparse type.
VALUES = {option_flags.token_count: "N (K, M suffixes)", option_flags.gamma_value: "N \\| auto",
          option_flags.numbers: "C1,C2,...", int: "N", float: "X", Path: "PATH"}


def _cell(text: str) -> str:
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _prose(text: str) -> str:
    """text with < and > escaped outside `code spans`, so that Markdown shows them rather than reading HTML."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace(">", "&gt;") for i, part in enumerate(parts))


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return "\\|".join(str(c) for c in action.choices)
    return VALUES.get(action.type, "TEXT")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default is None or action.default is False or action.default == [] or action.nargs == 0:
        return "-"
    return f"`{action.default}`"


def _variable(action: argparse.Action) -> str:
    """The flag's VEGAS_<FLAG> variable (vegas_jax.cli.flag_environment); repeatable flags have none."""
    return "-" if isinstance(action, flag_environment._REPEATABLE) else f"`{flag_environment.variable(action)}`"


def flags_table(actions: list[argparse.Action], *, with_variables: bool) -> str:
    head = ["flag", "value", "default", "meaning"] + (["environment"] if with_variables else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for action in actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        repeat = " (repeatable)" if isinstance(action, flag_environment._REPEATABLE) else ""
        meaning = _cell(action.help or "")
        cells = [", ".join(f"`{o}`" for o in action.option_strings), _value(action) + repeat, _default(action), meaning]
        cells += [_variable(action)] if with_variables else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _section(module, *, with_variables: bool) -> list[str]:
    parser = module.build_parser()
    out = [f"## `{parser.prog}`", "", _prose(module.__doc__.strip())]
    # The help's headings (generate's options every user sets, and its research knobs), each with its table.
    groups = [g for g in parser._action_groups if any(a.option_strings for a in g._group_actions)]
    for group in groups:
        if len(groups) > 1:
            out += ["", f"### {group.title}"] + (["", _prose(group.description)] if group.description else [])
        out += ["", flags_table(group._group_actions, with_variables=with_variables)]
    if parser.epilog:
        out += ["", _prose(parser.epilog)]
    return out + [""]


def render() -> str:
    out = ["# CLI reference", "",
           "Generated from the argparse parsers by `python -m vegas_jax.cli_reference`; do not edit by hand "
           "(`tests/test_docs.py` checks that this file equals its output). What each flag does in depth: the "
           "other files of [docs/](.) and the [README](../README.md).", ""]
    out += _section(generate, with_variables=True)
    out += _section(score, with_variables=False)
    out += _section(train_draft_head, with_variables=False)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from the parsers")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m vegas_jax.cli_reference", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
