"""Task families of the benchmark suite: what users run beside summaries, each a generator of real-text prompts.

A summary draws on text near the end of its prompt, so a recency window sees what the drafts need; copying,
retrieval and multi-turn questions draw on text far from the end, and long generations grow the cache while they
decode. Which drafts win depends on the task, so the suite measures every method on each family:

- summarise: explain the code before the question (benchmarks.prompt_splits.split_prompts, unchanged: the records
  made before families existed are this family's);
- quote: reproduce, or change in a stated way (a rename), a function or class that lies wholly in the first half
  of the code;
- retrieval: several questions (a constant's value, a function's parameters, which module defines a name) whose
  answers sit at positions spread over the code, one in each quarter;
- multiturn: the code pasted in three user turns of a chat, each answered by a short real text (a docstring of
  that part), and a last question about a function of the first turn;
- longgen: a short prompt (LONG_PROMPT_TOKENS) asking for a long answer (LONG_NEW_TOKENS new tokens by default),
  the regime in which the cache grows while decoding.

Every family reads the same text as summarise, the Python standard library, and keeps its splits: tuning prompts
from the top-level modules, held-out ones from the packages (prompt_splits.HELDOUT_PACKAGES). The families but
summarise read each file behind a one-line header naming its module, tokenized between the lines where
definitions start and end, so that the token span of every function, class and constant (found by `ast`) is
known exactly. A prompt is a slice of that stream of tokens starting at a definition, wrapped in the chat template
with the family's question; prompts are consecutive slices (disjoint), every one exactly `prompt_tokens` long, and
the first n prompts of a larger count are the n prompts of that count. A prompt's question and where its answer
lies (token positions in the prompt) are in the PromptSet's provenance (`targets`), beside the files read and
their sha256, and the prompts' own sha256 (`prompts_sha256`), which names them in every record.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import hashlib
import io
import sys
import warnings
import weakref
from typing import Callable

import numpy as np

from benchmarks.prompt_splits import PromptSet, prompts_digest, split_files, split_prompts, stdlib_root

DEFAULT_FAMILY = "summarise"  # the family of a record that names none (made before families existed)
LONG_PROMPT_TOKENS = 512
LONG_NEW_TOKENS = 3584  # a long generation's context: 4,096 tokens
QUESTIONS_PER_PROMPT = 4  # retrieval
TURNS = 3  # multiturn: user turns holding code, before the last question
# Lengths of what quote reproduces (and multiturn's last turn asks for), in tokens: long enough that copying it is
# most of an answer, short enough that many functions qualify.
QUOTE_TOKENS = (48, 768)
# A question's tokens at most (quote, retrieval): a prompt's body is its length less the frame and the question,
# so positions are chosen within the body the longest question would leave.
QUESTION_TOKENS = 160
REPLY_CHARS = 240  # multiturn: an assistant's reply at most (its turns must leave room for the code)


@dataclasses.dataclass(frozen=True)
class Definition:
    kind: str  # function, class or constant
    name: str  # qualified within its module: Class.method, Class.CONSTANT
    module: str
    start: int  # its tokens' span in the split's stream, [start, end)
    end: int
    outer: int  # where the class it belongs to starts (its own start at module level)
    header: int  # where its module's header line starts
    params: tuple[str, ...] = ()  # a function's parameters, in order
    value: str = ""  # a constant's value, as written
    doc: str = ""  # the first paragraph of its docstring

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _lines(text: str) -> list[str]:
    # ast numbers lines split at \n, \r\n and \r only (str.splitlines would also split at \f and others).
    return io.StringIO(text, newline="").readlines()


def _parameters(node) -> tuple[str, ...]:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return tuple(names)


def _first_paragraph(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _found(tree: ast.Module) -> list[tuple[ast.AST, str, str, ast.AST | None]]:
    """(node, kind, qualified name, enclosing class node) of every function and class at any depth but inside a
    function, and every constant (a name bound to a literal) at module or class level."""
    out = []

    def visit(body, prefix: str, owner):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node, "function", prefix + node.name, owner))
            elif isinstance(node, ast.ClassDef):
                out.append((node, "class", prefix + node.name, owner))
                visit(node.body, f"{prefix}{node.name}.", node)
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and isinstance(node.value, ast.Constant) and node.lineno == node.end_lineno):
                out.append((node, "constant", prefix + node.targets[0].id, owner))

    visit(tree.body, "", None)
    return out


class SourceStream:
    """A split's files read in order into one stream of tokens, each behind a header line naming its module; files
    are read as prompts need them. `definitions` (sorted by start) holds every function, class and constant read."""

    def __init__(self, tokenizer, split: str):
        self.tokenizer = tokenizer
        self.paths = split_files(split)
        self.tokens: list[int] = []
        self.definitions: list[Definition] = []
        self.starts: list[int] = []  # of the definitions, for bisect
        self.files: list[dict] = []  # name, sha256, bytes, module, doc (its docstring's first paragraph), start, end
        self.boundaries: list[int] = []  # where a header or a definition starts: where prompts may start

    def read_to(self, length: int) -> bool:
        """Reads files until the stream holds `length` tokens; False if the split ends first."""
        root = stdlib_root()
        while len(self.tokens) < length:
            if len(self.files) == len(self.paths):
                return False
            path = self.paths[len(self.files)]
            data = path.read_bytes()
            name = str(path.relative_to(root))
            module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            start = len(self.tokens)
            doc = self._read(data.decode("utf-8", errors="replace"), name, module)
            self.files.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                               "module": module, "doc": doc, "start": start, "end": len(self.tokens)})
        return True

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _read(self, text: str, name: str, module: str) -> str:
        """Appends the file's tokens and definitions; returns the first paragraph of its docstring."""
        header = len(self.tokens)
        self.boundaries.append(header)
        self.tokens += self._encode(f"# ---- module {module} ({name}) ----\n")
        lines = _lines(text)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escape sequences and the like in old modules
                tree = ast.parse(text)
        except SyntaxError:
            tree = ast.Module([], [])
        found = _found(tree)
        spans = {}
        for node, kind, qualified, owner in found:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            spans[id(node)] = (first, node.end_lineno)
        # Each piece between two cuts is tokenized alone, so a definition's tokens are exactly its lines' tokens.
        cuts = sorted({0, len(lines)} | {line for span in spans.values() for line in span})
        offset = {}
        for a, b in zip(cuts, cuts[1:]):
            offset[a] = len(self.tokens)
            self.tokens += self._encode("".join(lines[a:b]))
        offset[len(lines)] = len(self.tokens)
        self.tokens += self._encode("\n\n")
        for node, kind, qualified, owner in found:
            first, last = spans[id(node)]
            extra = {}
            if kind == "function":
                extra = {"params": _parameters(node), "doc": _first_paragraph(ast.get_docstring(node))}
            elif kind == "class":
                extra = {"doc": _first_paragraph(ast.get_docstring(node))}
            else:
                extra = {"value": ast.get_source_segment(text, node.value) or ""}
            definition = Definition(kind, qualified, module, offset[first], offset[last],
                                    offset[spans[id(owner)][0]] if owner is not None else offset[first], header,
                                    **extra)
            self.definitions.append(definition)
            self.boundaries.append(definition.start)
        self.definitions.sort(key=lambda d: d.start)
        self.starts = [d.start for d in self.definitions]
        self.boundaries.sort()
        return _first_paragraph(ast.get_docstring(tree))

    def boundary_at_or_after(self, position: int) -> int | None:
        """The first place a prompt may start (a header or a definition) at or after `position`."""
        while True:
            i = bisect.bisect_left(self.boundaries, position)
            if i < len(self.boundaries):
                return self.boundaries[i]
            if not self.read_to(len(self.tokens) + 1):
                return None

    def within(self, start: int, end: int) -> list[Definition]:
        """The definitions wholly inside [start, end) (read that far)."""
        self.read_to(end)
        i = bisect.bisect_left(self.starts, start)
        return [d for d in self.definitions[i : bisect.bisect_left(self.starts, end)] if d.end <= end]

    def overlapping(self, start: int, end: int) -> list[Definition]:
        """The definitions with any token in [start, end), those begun before it too."""
        self.read_to(end)
        j = bisect.bisect_left(self.starts, end)
        return [d for d in self.definitions[:j] if d.end > start]

    def files_before(self, end: int) -> list[dict]:
        return [{k: f[k] for k in ("name", "sha256", "bytes")} for f in self.files if f["start"] < end]


_STREAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def source_stream(tokenizer, split: str) -> SourceStream:
    """One stream per tokenizer and split, kept while the tokenizer lives (several families read the same)."""
    streams = _STREAMS.setdefault(tokenizer, {})
    if split not in streams:
        streams[split] = SourceStream(tokenizer, split)
    return streams[split]


def _rng(family: str, split: str, prompt_tokens: int, index: int) -> np.random.Generator:
    # Seeded by what the prompt is, not by how many were asked for: the first n of a larger count are the same.
    seed = int.from_bytes(hashlib.sha256(f"{family}|{split}|{prompt_tokens}|{index}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


_SENTINEL = "\x00CODE{}\x00"


def _frame(tokenizer, messages: list[dict], slots: int) -> list[list[int]]:
    """The chat template's token ids around `slots` code bodies (_SENTINEL.format(i) in the messages' contents):
    slots + 1 pieces, the last ending with the assistant's turn opened."""
    rendered = tokenizer.render_chat(messages)
    pieces = []
    for i in range(slots):
        before, rendered = rendered.split(_SENTINEL.format(i))
        pieces.append(before)
    return [tokenizer.encode(p, add_special_tokens=False) for p in pieces + [rendered]]


def _unique(definitions: list[Definition], key: Callable[[Definition], str]) -> set[str]:
    seen: dict[str, int] = {}
    for d in definitions:
        seen[key(d)] = seen.get(key(d), 0) + 1
    return {name for name, n in seen.items() if n == 1}


def _label(d: Definition) -> str:
    """How a question names a definition: a method by its class too (whose `class` line the prompt then holds)."""
    if d.kind == "function":
        return f"the method `{d.name}`" if "." in d.name else f"the function `{d.name}`"
    return f"the class `{d.name}`" if d.kind == "class" else f"`{d.name}`"


def _copy_task(d: Definition, rng: np.random.Generator, where: str) -> tuple[str, dict]:
    """A request to reproduce `d` (a function or class) as written, or with a stated rename (its own name, or a
    function's parameter): the question and what it asks (edit: none, name or parameter, with the names)."""
    renamable = not (d.short.startswith("__") and d.short.endswith("__"))  # a special method keeps its name
    params = [p.lstrip("*") for p in d.params if p.lstrip("*") not in ("self", "cls")]
    edits = ["none"] + ["name"] * renamable + ["parameter"] * bool(params)
    edit = edits[rng.integers(len(edits))]
    if edit == "none":
        return (f"Reproduce {_label(d)} {where} exactly as it is written, from its first line to its last.",
                {"edit": "none"})
    if edit == "name":
        new = f"{d.short}_v2"
        return (f"Rewrite {_label(d)} {where} with its name changed to `{new}`, everything else exactly as written.",
                {"edit": "name", "new_name": new})
    old = params[rng.integers(len(params))]
    return (f"Rewrite {_label(d)} {where} with its parameter `{old}` renamed to `{old}_value` wherever it is used, "
            "everything else exactly as written.", {"edit": "parameter", "old_name": old, "new_name": f"{old}_value"})


def _copyable(d: Definition, start: int) -> bool:
    """Worth reproducing, and named unambiguously from within a prompt starting at `start`."""
    return (d.kind in ("function", "class") and QUOTE_TOKENS[0] <= d.end - d.start <= QUOTE_TOKENS[1]
            and d.outer >= start)


@dataclasses.dataclass
class _Prompt:
    tokens: list[int]
    target: dict
    consumed: int  # the stream position after the text it took


def _one_body(tokenizer, stream: SourceStream, start: int, prompt_tokens: int, question: str,
              target: dict) -> list[int]:
    """before + stream[start : start + n] + question + after, exactly prompt_tokens long."""
    before, after = _frame(tokenizer, [{"role": "user", "content": _SENTINEL.format(0) + "\n\n" + question}], 1)
    n = prompt_tokens - len(before) - len(after)
    if n < _body_room(tokenizer, prompt_tokens) - QUESTION_TOKENS:
        raise ValueError(f"a question of more than {QUESTION_TOKENS} tokens: {question!r}")
    target["body"] = [len(before), len(before) + n]
    return before + stream.tokens[start : start + n] + after


def _quote(tokenizer, stream: SourceStream, start: int, prompt_tokens: int, rng) -> _Prompt | None:
    room = _body_room(tokenizer, prompt_tokens)
    shortest = room - QUESTION_TOKENS
    inside = stream.within(start, start + shortest // 2)  # wholly in the first half of any body
    unique = _unique(stream.overlapping(start, start + room), lambda d: d.name)
    candidates = [d for d in inside if _copyable(d, start) and d.name in unique]
    if not candidates:
        return None
    d = candidates[rng.integers(len(candidates))]
    question, asked = _copy_task(d, rng, "defined above")
    target = {"name": d.name, "kind": d.kind, "module": d.module, **asked}
    tokens = _one_body(tokenizer, stream, start, prompt_tokens, question, target)
    offset = target["body"][0] - start
    target.update(start=d.start + offset, end=d.end + offset, question=question)
    return _Prompt(tokens, target, start + target["body"][1] - target["body"][0])


def _body_room(tokenizer, prompt_tokens: int) -> int:
    """A body's tokens with an empty question: what the frame leaves."""
    before, after = _frame(tokenizer, [{"role": "user", "content": _SENTINEL.format(0) + "\n\n"}], 1)
    return prompt_tokens - len(before) - len(after)


_RETRIEVAL = {
    "value": lambda d: f"What value is `{d.name}` set to?",
    "parameters": lambda d: f"What parameters does {_label(d)} take?",
    "module": lambda d: f"Which module defines `{d.short}`?",
}


def _answer(kind: str, d: Definition) -> str:
    return {"value": d.value, "parameters": ", ".join(d.params), "module": d.module}[kind]


def _retrieval(tokenizer, stream: SourceStream, start: int, prompt_tokens: int, rng) -> _Prompt | None:
    room = _body_room(tokenizer, prompt_tokens)
    shortest = room - QUESTION_TOKENS
    everything = stream.overlapping(start, start + room)
    unique_short, unique = _unique(everything, lambda d: d.short), _unique(everything, lambda d: d.name)
    asked, inside = [], stream.within(start, start + shortest)
    # One answer in each quarter of the code the longest question leaves (the body is at least that long).
    for q in range(QUESTIONS_PER_PROMPT):
        low, high = start + q * shortest // QUESTIONS_PER_PROMPT, start + (q + 1) * shortest // QUESTIONS_PER_PROMPT
        options = []
        for d in inside:
            if not low <= d.start < high or d.outer < start:
                continue
            if d.kind == "constant" and d.name in unique and len(d.value) <= 80:
                options.append(("value", d))
            if d.kind == "function" and d.name in unique and [p for p in d.params if p not in ("self", "cls")]:
                options.append(("parameters", d))
            if d.header >= start and d.short in unique_short and d.outer == d.start:  # module level
                options.append(("module", d))
        if not options:
            return None
        kinds = sorted({k for k, _ in options})
        kind = kinds[rng.integers(len(kinds))]
        chosen = [d for k, d in options if k == kind]
        asked.append((kind, chosen[rng.integers(len(chosen))]))
    order = rng.permutation(len(asked))
    lines = [f"{i + 1}. {_RETRIEVAL[asked[j][0]](asked[j][1])}" for i, j in enumerate(order)]
    question = "Answer each question about the code above in one line.\n" + "\n".join(lines)
    target = {"question": question}
    tokens = _one_body(tokenizer, stream, start, prompt_tokens, question, target)
    offset = target["body"][0] - start
    target["spread_over"] = [start + offset, start + shortest + offset]
    target["answers"] = [{"kind": kind, "name": d.name, "module": d.module, "answer": _answer(kind, d),
                          "start": d.start + offset, "end": d.end + offset} for kind, d in (asked[j] for j in order)]
    return _Prompt(tokens, target, start + target["body"][1] - target["body"][0])


_TURN_INTRO = ("I will paste some Python code in {n} parts. Part 1:\n\n", "Part {i}:\n\n")


def _reply(stream: SourceStream, start: int, end: int, part: int) -> str:
    """An assistant's short answer to a pasted part: the docstring of the first documented module or definition
    that begins in [start, end) (real text), else the names defined there."""
    documented = [(f["start"], f"Part {part} begins the module `{f['module']}`: {f['doc']}")
                  for f in stream.files if start <= f["start"] < end and f["doc"]]
    definitions = stream.within(start, end)
    documented += [(d.start, f"Part {part} begins with {_label(d)}: {d.doc}") for d in definitions if d.doc]
    if documented:
        return min(documented)[1][:REPLY_CHARS]
    names = ", ".join(f"`{d.name}`" for d in definitions[:4])
    return f"Part {part} defines {names}." if names else f"Part {part} holds no definitions, only statements."


def _multiturn(tokenizer, stream: SourceStream, start: int, prompt_tokens: int, rng) -> _Prompt | None:
    region = prompt_tokens // TURNS  # each part's text comes from its own region of the stream
    seen = region // 2  # what the replies and the question are chosen from: a part is at least this long
    starts = [start] + [stream.boundary_at_or_after(start + i * region) for i in range(1, TURNS)]
    if None in starts:
        return None
    stream.read_to(starts[-1] + region)
    unique = _unique(stream.overlapping(start, starts[-1] + region), lambda d: d.name)
    candidates = [d for d in stream.within(start, start + seen) if _copyable(d, start) and d.name in unique]
    if not candidates:
        return None
    d = candidates[rng.integers(len(candidates))]
    question, asked = _copy_task(d, rng, "from the code of my first message")
    question = "Going back to part 1: " + question[0].lower() + question[1:]
    messages = []
    for i, s in enumerate(starts):
        intro = _TURN_INTRO[0].format(n=TURNS) if i == 0 else _TURN_INTRO[1].format(i=i + 1)
        messages += [{"role": "user", "content": intro + _SENTINEL.format(i)},
                     {"role": "assistant", "content": _reply(stream, s, s + seen, i + 1)}]
    messages.append({"role": "user", "content": question})
    pieces = _frame(tokenizer, messages, TURNS)
    body = prompt_tokens - sum(map(len, pieces))
    sizes = [body // TURNS + (i < body % TURNS) for i in range(TURNS)]
    if min(sizes) < seen:
        raise ValueError(f"multiturn: {prompt_tokens} tokens leave parts of {min(sizes)} tokens, fewer than {seen}")
    if any(s + n > following for s, n, following in zip(starts, sizes, starts[1:])):
        return None  # a part would run into the next one's text (a long definition moved its start)
    tokens, where = [], []
    for piece, s, n in zip(pieces, starts, sizes):
        tokens += piece
        where.append([len(tokens), len(tokens) + n])
        tokens += stream.tokens[s : s + n]
    tokens += pieces[-1]
    offset = where[0][0] - start
    target = {"name": d.name, "kind": d.kind, "module": d.module, "turn": 1, **asked, "start": d.start + offset,
              "end": d.end + offset, "parts": where, "question": question}
    return _Prompt(tokens, target, starts[-1] + sizes[-1])


_LONG_ASKS = (
    "Write a complete unittest test module for the code above: a TestCase class for every function and class in "
    "it, several test methods each, every test with a comment saying what it checks.",
    "Write a long, detailed tutorial on the code above for a new Python programmer: explain every function and "
    "class in turn, with a worked example of each and the output it prints.",
    "Rewrite the code above as a new, fully documented module: type hints on every function, a docstring with "
    "examples for every function and class, and comments explaining each step.",
)


def _longgen(tokenizer, stream: SourceStream, start: int, prompt_tokens: int, rng) -> _Prompt | None:
    ask = _LONG_ASKS[rng.integers(len(_LONG_ASKS))]
    target = {"question": ask}
    tokens = _one_body(tokenizer, stream, start, prompt_tokens, ask, target)
    return _Prompt(tokens, target, start + target["body"][1] - target["body"][0])


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    what: str  # what its prompts ask, in a line (the report's)
    make: Callable | None  # (tokenizer, stream, start, prompt_tokens, rng) -> _Prompt | None (summarise: None)
    prompt_tokens: int | None = None  # its own prompt length (the suite's lengths when None)
    new_tokens: int | None = None  # its own new tokens (the suite's when None)


REGISTRY = {f.name: f for f in (
    Family("summarise", "explain the code before the question, function by function", None),
    Family("quote", "reproduce, or rename something in, a function or class from the first half of the code",
           _quote),
    Family("retrieval", f"{QUESTIONS_PER_PROMPT} questions (a constant's value, a function's parameters, a name's "
           "module) with answers in each quarter of the code", _retrieval),
    Family("multiturn", f"code pasted over {TURNS} chat turns, each answered; the last turn asks for a function "
           "of the first", _multiturn),
    Family("longgen", f"{LONG_PROMPT_TOKENS}-token prompts asking for a long answer (tests, a tutorial, a "
           "documented rewrite)", _longgen, prompt_tokens=LONG_PROMPT_TOKENS, new_tokens=LONG_NEW_TOKENS),
)}
FAMILIES = tuple(REGISTRY)


def family_prompts(family: str, tokenizer, split: str, count: int, prompt_tokens: int) -> PromptSet:
    """`count` prompts of the family from the split, each exactly `prompt_tokens` long (long generation's own
    length: `REGISTRY[family].prompt_tokens`), in a PromptSet whose provenance names the family, the files read and
    (but for summarise) each prompt's question and where its answer lies (`targets`)."""
    if family not in REGISTRY:
        raise ValueError(f"unknown task family {family!r}; choose from {', '.join(FAMILIES)}")
    spec = REGISTRY[family]
    if spec.make is None:
        made = split_prompts(tokenizer, split, count, prompt_tokens)
        return PromptSet(made.prompts, {**made.provenance, "family": family})
    stream = source_stream(tokenizer, split)
    prompts, targets, position = [], [], 0
    for i in range(count):
        rng = _rng(family, split, prompt_tokens, i)
        while True:
            start = stream.boundary_at_or_after(position)
            if start is None or not stream.read_to(start + prompt_tokens):
                raise ValueError(f"the {split} split holds {len(stream.tokens)} tokens of text, too few for {count} "
                                 f"{family} prompts of {prompt_tokens} tokens ({i} made)")
            made = spec.make(tokenizer, stream, start, prompt_tokens, rng)
            if made is not None:
                break
            position = start + 1  # nothing here to ask about: the next place a prompt may start
        assert len(made.tokens) == prompt_tokens, (family, len(made.tokens))
        prompts.append(made.tokens)
        targets.append(made.target)
        position = made.consumed
    provenance = {"family": family, "split": split, "prompt_tokens": prompt_tokens, "count": count,
                  "python": sys.version.split()[0], "files": stream.files_before(position), "targets": targets,
                  "prompts_sha256": prompts_digest(prompts)}
    return PromptSet(prompts, provenance)
