"""Real-text prompts in two disjoint splits, a tuning set and a held-out evaluation set, each recorded by the names
and sha256 hashes of the files its prompts were cut from.

Both splits are Python standard-library source (code, docstrings and, in `pydoc_data`, the language reference's
prose), which every machine that runs the benchmarks has, network or not:

- tuning: the top-level modules (`benchmarks.prompts.stdlib_files`), the text every benchmark before the suite
  used; tuning may see it.
- heldout: the modules of the standard-library packages in HELDOUT_PACKAGES, which no benchmark had used.

A split's files are read in a fixed order and tokenized one after another into one stream of tokens; prompt i is
the i-th slice of that stream, wrapped in the model's chat template with a question after it, every prompt exactly
`prompt_tokens` long (equal lengths: no padding anywhere, also for the transformers peer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np

from benchmarks.prompts import QUESTION, stdlib_files

SPLITS = ("tuning", "heldout")
# Packages of the standard library whose modules make the held-out split, in this order. Test folders are left
# out (they are mostly fixtures and generated data), as are encodings (codec tables) and site-packages.
HELDOUT_PACKAGES = (
    "pydoc_data", "email", "asyncio", "xml", "multiprocessing", "unittest", "importlib", "http", "logging",
    "urllib", "concurrent", "json", "tomllib", "html", "zipfile", "idlelib", "tkinter",
    # Appended (later packages only extend the stream, so earlier prompts keep their slices) for serving's 128
    # requests of 8K tokens, about 1.01M tokens of text, which the packages above (0.89M) could not fill.
    "xmlrpc", "re", "ctypes", "turtledemo", "wsgiref", "collections", "zoneinfo", "curses", "venv", "dbm", "sqlite3",
    "lib2to3",  # last: Python 3.13 removed it, and the packages before it hold enough without it
)
_LEFT_OUT_FOLDERS = {"test", "tests", "idle_test"}
MIN_FILE_BYTES = 2000  # shorter modules are mostly imports and license headers
_SENTINEL = "\x00PROMPT BODY\x00"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def heldout_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    files = []
    for package in HELDOUT_PACKAGES:
        found = sorted(p for p in (root / package).rglob("*.py")
                       if not _LEFT_OUT_FOLDERS & set(p.relative_to(root).parts) and p.stat().st_size >= MIN_FILE_BYTES)
        files += found
    return files


def split_files(split: str) -> list[Path]:
    """The files of a split, in the order their text is read."""
    if split == "tuning":
        return stdlib_files()
    if split == "heldout":
        return heldout_files()
    raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def prompts_digest(prompts: list[list[int]]) -> str:
    """sha256 of the prompts' token ids (equal lengths), as int32: what a record names the prompts it ran by."""
    return hashlib.sha256(np.asarray(prompts, np.int32).tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PromptSet:
    prompts: list[list[int]]
    # split, prompt_tokens, count, python (the standard library's version), files: [{name, sha256, bytes}] of the
    # files the prompts were cut from, and prompts_sha256 (`prompts_digest`); a task family's (task_families) also
    # family, and targets: per prompt, what its question asks and where the answer lies
    provenance: dict

    def head(self, count: int) -> "PromptSet":
        """The first `count` prompts: what split_prompts (or task_families.family_prompts) gives for that count
        (the same slices of the stream)."""
        if count == len(self.prompts):
            return self
        prompts = self.prompts[:count]
        cut = {"targets": self.provenance["targets"][:count]} if "targets" in self.provenance else {}
        return PromptSet(prompts, {**self.provenance, "count": count, "prompts_sha256": prompts_digest(prompts), **cut})


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids the chat template puts before a user message's text and after it (with QUESTION)."""
    rendered = tokenizer.render_chat([{"role": "user", "content": _SENTINEL + QUESTION}])
    before, after = rendered.split(_SENTINEL)
    return tokenizer.encode(before, add_special_tokens=False), tokenizer.encode(after, add_special_tokens=False)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_prompts(tokenizer, split: str, count: int, prompt_tokens: int) -> PromptSet:
    """`count` prompts of exactly `prompt_tokens` tokens from the split's text, each its own slice of it."""
    before, after = chat_frame(tokenizer)
    body = prompt_tokens - len(before) - len(after)
    if body < 1:
        raise ValueError(f"prompt_tokens {prompt_tokens} leaves no room for text in the chat template")
    root = stdlib_root()
    stream: list[int] = []
    used = []
    for path in split_files(split):
        if len(stream) >= count * body:
            break
        data = path.read_bytes()
        stream += tokenizer.encode(data.decode("utf-8", errors="replace") + "\n\n", add_special_tokens=False)
        used.append({"name": str(path.relative_to(root)), "sha256": _sha256(data), "bytes": len(data)})
    if len(stream) < count * body:
        raise ValueError(f"the {split} split has {len(stream)} tokens of text, fewer than {count} prompts of {body}")
    prompts = [before + stream[i * body : (i + 1) * body] + after for i in range(count)]
    provenance = {
        "split": split,
        "prompt_tokens": prompt_tokens,
        "count": count,
        "python": sys.version.split()[0],
        "files": used,
        "prompts_sha256": prompts_digest(prompts),
    }
    return PromptSet(prompts, provenance)
