"""What the library receives, normalised and checked in one place before anything compiles: prompts (a string, a
1-D sequence of integer token ids, or a conversation: a list of {"role", "content"} messages), batches of them, and
the typed fields of option dataclasses.

Errors name the argument at fault as the caller wrote it. `InputError` keeps its message as a template whose
named fields are argument names: `str(error)` names the Python arguments (`max_new_tokens`), and the CLI renders
the same error with its flags (`--max-new-tokens`). A field `{prompts[3]}` names an item of an argument (`prompts:
prompt 3`), which the CLI can name by where it came from (`--prompt-file long.txt`).

Text is anything a Python str holds that UTF-8 can encode: every str but one with a lone surrogate (U+D800 to
U+DFFF), which is what Python makes of bytes that are not UTF-8 (in argv, say) and what a JSON escape such as
"\\ud800" gives. Such text is refused where it enters, naming the argument, rather than fail in the tokenizer.
"""

from __future__ import annotations

import dataclasses
import string
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, TypeVar

import numpy as np

T = TypeVar("T")


class InputError(ValueError):
    """Bad user input; the message starts with the argument (or flag, or variable) at fault.

    `template` is a `str.format` string: its named fields are argument names, filled in by `render`'s naming
    function; its positional fields are `values`, filled in as they are (a value may hold braces)."""

    def __init__(self, template: str, *values: Any):
        self.template, self.values = template, values
        fields = (field for _, field, _, _ in string.Formatter().parse(template) if field)
        self.names = list(dict.fromkeys(field.partition("[")[0] for field in fields))
        super().__init__(self.render(lambda name: name))

    def render(self, name: Callable[[str], str], items: Mapping[str, Sequence[str]] | None = None) -> str:
        """The message with every argument named by `name(python_name)`, and item i of an argument by
        `items[python_name][i]` where `items` has it (else `name(python_name): prompt i` for `prompts`)."""
        items = items or {}
        return self.template.format(*self.values, **{n: _Argument(name(n), n, items.get(n)) for n in self.names})

    def __reduce__(self):
        # Pickled (across processes) as template and values: the rendered message is no template.
        return type(self), (self.template, *self.values)


class _Argument:
    """How a rendered message names an argument (`{prompts}`) and its items (`{prompts[3]}`)."""

    def __init__(self, shown: str, name: str, items: Sequence[str] | None):
        self.shown, self.name, self.items = shown, name, items

    def __format__(self, spec: str) -> str:
        return format(self.shown, spec)

    def __getitem__(self, index: int) -> str:
        if self.items is not None:
            return self.items[index]
        return f"{self.shown}: {self.name.removesuffix('s')} {index}"


def _named(name: str) -> str:
    """A template field naming the argument `name`."""
    return "{" + name + "}"


def item(name: str, index: int) -> str:
    """A template field naming item `index` of the argument `name` (`prompts: prompt 3` in the library)."""
    return "{" + f"{name}[{int(index)}]" + "}"


def _is_integer(value: Any) -> bool:
    # bool is an int subclass, but True is no count of tokens.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(value: Any, name: str) -> int:
    """`value` as a Python int: ints and numpy integers pass; bools, floats (even 4.0) and strings do not."""
    if not _is_integer(value):
        raise InputError(_named(name) + " must be an integer, got {!r} ({})", value, type(value).__name__)
    return int(value)


def real(value: Any, name: str) -> float:
    """`value` as a Python float: ints, floats and their numpy kinds pass; bools and strings do not."""
    if not (_is_integer(value) or isinstance(value, (float, np.floating))):
        raise InputError(_named(name) + " must be a number, got {!r} ({})", value, type(value).__name__)
    return float(value)


def text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InputError(_named(name) + " must be a string, got {!r} ({})", value, type(value).__name__)
    return value


def utf8(value: str, where: str, *where_values: Any) -> str:
    """`value` if UTF-8 can encode it; else InputError starting with `where` (a template, with `where_values`)
    saying which character cannot be."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        # Python decodes a byte that is not UTF-8 as U+DC80 + the byte (PEP 383's surrogateescape).
        what = (f"undecodable byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF
                else f"lone surrogate U+{code:04X}")
        raise InputError(where + " is not UTF-8 text: {} at character {}", *where_values, what, e.start) from None
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(_named(name) + " must be True or False, got {!r} ({})", value, type(value).__name__)
    return bool(value)


_CHECKS = {int: integer, float: real, str: text, bool: boolean}


def items(value: Any, name: str, check: Callable[[Any, str], T]) -> tuple[T, ...]:
    """A tuple of checked values from a list or tuple of them, or from one value alone (`stop="END"`)."""
    if isinstance(value, (list, tuple)):
        return tuple(check(v, name) for v in value)
    return (check(value, name),)


def _field_check(hint: Any) -> Callable[[Any, str], Any] | None:
    """The check for a field annotated int, float, str, bool or a tuple of one of them (`tuple[str, ...]`)."""
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in _CHECKS:
            return lambda value, name: items(value, name, _CHECKS[args[0]])
        return None
    return _CHECKS.get(hint)


def plain_fields(obj: Any, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every field of the dataclass `obj` annotated int, float, str, bool or a tuple of one of them (optionally
    `| None`) checked against its annotation and converted to a plain Python value; InputError names the field
    (by `names`' name for it where it has one). Fields of other types are left to their own checks."""
    hints = typing.get_type_hints(type(obj))
    values = {}
    for field in dataclasses.fields(obj):
        value, hint = getattr(obj, field.name), hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        check = _field_check(kinds[0]) if len(kinds) == 1 or kinds[1:] == (type(None),) else None
        if check is not None and not (value is None and type(None) in kinds):
            values[field.name] = check(value, (names or {}).get(field.name, field.name))
    return values


def options_of(options: Any, cls: type[T]) -> T:
    """`options` if it is a `cls`, with plain Python values of its fields' types (`plain_fields`). A dict is
    refused rather than read by key: `cls(**d)` says which key is unknown, a silent reading would not."""
    if isinstance(options, Mapping):
        raise InputError("{options} must be a {}, not a dict: pass {}(**options)", cls.__name__, cls.__name__)
    if not isinstance(options, cls):
        raise InputError("{options} must be a {}, got {}", cls.__name__, type(options).__name__)
    return dataclasses.replace(options, **plain_fields(options))


def _as_array(value: Any) -> np.ndarray | None:
    """numpy and JAX arrays (anything with __array__) as a numpy array; None for anything else."""
    return np.asarray(value) if hasattr(value, "__array__") else None


def _token_ids(prompt: Any, index: int, vocab_size: int, name: str) -> list[int]:
    array = _as_array(prompt)
    if array is not None:
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InputError(item(name, index) + " is an array of shape {} and dtype {}; a prompt of token ids "
                             "is 1-D and of integers", array.shape, array.dtype)
        ids = array.tolist()
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
        ids = list(prompt)
        for position, token in enumerate(ids):
            if not _is_integer(token):
                raise InputError(item(name, index) + " has a token id that is not an integer at position {}: "
                                 "{!r} ({})", position, token, type(token).__name__)
        ids = [int(t) for t in ids]
    elif isinstance(prompt, bytes):
        raise InputError(item(name, index) + " is bytes; decode it to a str")
    else:
        raise InputError(item(name, index) + " is a {}; a prompt is a string, a sequence of token ids or a list "
                         "of {{\"role\", \"content\"}} messages", type(prompt).__name__)
    if not ids:
        raise InputError(item(name, index) + " has no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InputError(item(name, index) + " has token ids outside the vocabulary [0, {}): {}", vocab_size,
                         bad[:5])
    return ids


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


# The roles chat templates render: OpenAI's (developer is its newer system), tool results, and Llama 3.1's
# ipython. A template renders an unknown role as it pleases (ChatML as a turn of that name, others not at all), so a
# misspelt one is refused rather than passed on.
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def _strings(value: Any) -> Iterator[str]:
    """Every string in `value`, a message's value: a string, or mappings and lists of them (a tool call)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _strings(key)
            yield from _strings(inner)
    elif isinstance(value, (list, tuple)):
        for inner in value:
            yield from _strings(inner)


def messages(value: Any, where: str, *where_values: Any) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of mappings, each with a "role" of ROLES and a string "content" (other
    keys, such as a tool call's, are passed to the chat template as they are), all of their text UTF-8 text.
    InputError starting with `where` (a template, with `where_values`) naming the message at fault."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InputError(where + ": a conversation is a non-empty list of {{\"role\", \"content\"}} messages, got "
                         "{}", *where_values, type(value).__name__ if value else "nothing")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise InputError(where + ": message {} is a {}, not a {{\"role\", \"content\"}} object", *where_values,
                             i, type(message).__name__)
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else type(message[key]).__name__
                raise InputError(where + ": message {} needs a string {!r} ({})", *where_values, i, key, got)
        for key, inner in message.items():
            for string in _strings(inner):
                utf8(string, where + ": message {} {!r}", *where_values, i, key)
        if message["role"] not in ROLES:
            raise InputError(where + ": message {} has role {!r}; a role is one of {}", *where_values, i,
                             message["role"], ", ".join(ROLES))
        out.append(dict(message))
    return out


def prompt_batch(prompts: Any, vocab_size: int, name: str = "prompts") -> list[str | list[int] | list[dict]]:
    """A batch of prompts (the argument `name`, which errors name) as a list of strings, lists of Python ints and
    conversations (lists of message dicts, `messages`). A batch is a list or tuple of prompts, or a 2-D integer array (one prompt a row); a bare string is
    one prompt, never a sequence of characters. A prompt is a string with more than whitespace, a 1-D sequence
    (list, tuple, numpy or JAX array) of integer token ids within the vocabulary (bools, floats and numeric strings
    are refused, not truncated), or a conversation. A flat list of integers is refused as ambiguous (one prompt, or
    many one-token ones): one prompt of ids is `[ids]`; likewise one conversation is `[messages]`."""
    if isinstance(prompts, str):
        prompts = [prompts]
    array = _as_array(prompts)
    if array is not None:
        if array.ndim != 2 or array.dtype.kind not in "iu":
            raise InputError(_named(name) + ": an array of prompts must be 2-D and of integer token ids (one prompt "
                             "a row), got shape {} and dtype {}", array.shape, array.dtype)
        prompts = array.tolist()
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise InputError(_named(name) + " must be a list of prompts (strings or sequences of token ids), got {}",
                         type(prompts).__name__)
    if not prompts:
        raise InputError(_named(name) + ": no prompt given")
    if all(_is_integer(p) for p in prompts):
        raise InputError(_named(name) + " is a flat sequence of integers; a batch is a list of prompts, so one "
                         "prompt of token ids is [ids]")
    if all(isinstance(p, Mapping) for p in prompts):
        raise InputError(_named(name) + " is a flat list of messages; a batch is a list of prompts, so one "
                         "conversation is [messages]")
    batch = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError(item(name, i) + " is empty (whitespace only)")
            batch.append(utf8(prompt, item(name, i)))
        elif _is_messages(prompt):
            batch.append(messages(prompt, item(name, i)))
        else:
            batch.append(_token_ids(prompt, i, vocab_size, name))
    return batch


def probe_writable(path) -> None:
    """Writes an empty file at `path` (a name of the caller's own, beside what it will write) and removes it;
    OSError when it cannot be written: an output folder is checked before the work that fills it."""
    try:
        path.write_bytes(b"")
    finally:
        path.unlink(missing_ok=True)
