"""Real long prompts for benchmarks: Python standard-library source (real text, never repeated filler), each
request a different slice, wrapped with a question in the model's chat template."""

from __future__ import annotations

import sysconfig
from pathlib import Path

QUESTION = "\n\nQuestion: explain what the code above does, function by function."


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules of more than 4000 bytes, by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)


def stdlib_corpus() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files())


def long_prompts(tokenizer, batch: int, prompt_tokens: int, corpus: str | None = None) -> list[list[int]]:
    """`batch` prompts of about `prompt_tokens` tokens (chat template included), from disjoint source slices."""
    ids = tokenizer.encode(corpus or stdlib_corpus())
    overhead = len(tokenizer.encode_chat([{"role": "user", "content": QUESTION}]))
    body = prompt_tokens - overhead - 8  # re-tokenizing decoded text can shift a few tokens
    if body * batch > len(ids):
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than {batch} prompts of {body}")
    prompts = []
    for i in range(batch):
        text = tokenizer.decode(ids[i * body : (i + 1) * body], skip_special_tokens=True)
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": text + QUESTION}])[:prompt_tokens])
    return prompts
