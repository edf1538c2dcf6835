"""The benchmark suite's task families (benchmarks/task_families.py) on SmolLM2's tokenizer: each family's prompts
are exact-length, deterministic, from their own split, named by distinct digests; and what each question refers
to is in the prompt where its target says, checked against the standard library's files parsed here afresh."""

from __future__ import annotations

import ast
import io

import pytest

from benchmarks.prompt_splits import split_files, split_prompts, stdlib_root
from benchmarks.task_families import (
    FAMILIES, LONG_PROMPT_TOKENS, QUESTION_TOKENS, QUESTIONS_PER_PROMPT, QUOTE_TOKENS, REGISTRY, TURNS, family_prompts,
)
from vegas_jax.loading.gguf import embedded_smollm2_path, open_gguf
from vegas_jax.loading.tokenizer import Tokenizer

LENGTH = 2048


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(embedded_smollm2_path()))


def length_of(family: str) -> int:
    return REGISTRY[family].prompt_tokens or LENGTH


def source_of(module: str, name: str) -> str:
    """The lines of `name` (Class.method) in the standard-library module, decorators included, found by ast."""
    path = stdlib_root() / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = stdlib_root() / module.replace(".", "/") / "__init__.py"
    text = path.read_bytes().decode("utf-8", errors="replace")
    body = ast.parse(text).body
    for part in name.split("."):
        node = next(n for n in body if getattr(n, "name", None) == part
                    or (isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == part))
        body = getattr(node, "body", [])
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "".join(io.StringIO(text, newline="").readlines()[first - 1 : node.end_lineno])


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_are_exact_deterministic_from_their_split_and_a_prefix_of_more(tok, family):
    length = length_of(family)
    digests = {}
    for split in ("tuning", "heldout"):
        three = family_prompts(family, tok, split, 3, length)
        assert [len(p) for p in three.prompts] == [length] * 3 and len({tuple(p) for p in three.prompts}) == 3
        assert three.provenance["family"] == family and three.provenance["split"] == split
        names = {str(p.relative_to(stdlib_root())) for p in split_files(split)}
        assert three.provenance["files"] and {f["name"] for f in three.provenance["files"]} <= names
        again, two = family_prompts(family, tok, split, 3, length), family_prompts(family, tok, split, 2, length)
        assert again.prompts == three.prompts
        assert three.head(2).prompts == two.prompts and three.head(2).provenance == {
            **two.provenance, "files": three.head(2).provenance["files"]}
        digests[split] = three.provenance["prompts_sha256"]
    assert digests["tuning"] != digests["heldout"]


def test_families_differ_and_summarise_is_the_split_prompts_of_before(tok):
    digests = {family: family_prompts(family, tok, "heldout", 2, length_of(family)).provenance["prompts_sha256"]
               for family in FAMILIES}
    assert len(set(digests.values())) == len(FAMILIES)
    # The records made before families existed are summarise's: the same prompts, the same digest.
    assert digests["summarise"] == split_prompts(tok, "heldout", 2, LENGTH).provenance["prompts_sha256"]
    with pytest.raises(ValueError, match="unknown task family 'copy'"):
        family_prompts("copy", tok, "heldout", 1, LENGTH)


def body_of(prompt: list[int], target: dict) -> tuple[int, int]:
    return tuple(target["body"]) if "body" in target else (target["parts"][0][0], target["parts"][-1][1])


@pytest.mark.parametrize("family", ["quote", "multiturn"])
def test_what_a_copy_question_asks_for_lies_early_in_the_prompt_as_written(tok, family):
    """quote: the function or class to reproduce lies wholly in the first half of the code, its tokens exactly its
    source's; multiturn: in the first of the parts pasted, the last turn naming it and the first part."""
    made = family_prompts(family, tok, "heldout", 6, LENGTH)
    edits = set()
    for prompt, target in zip(made.prompts, made.provenance["targets"]):
        start, end = target["start"], target["end"]
        source = source_of(target["module"], target["name"])
        assert tok.decode(prompt[start:end]) == source
        assert QUOTE_TOKENS[0] <= end - start <= QUOTE_TOKENS[1]
        first, last = body_of(prompt, target)
        if family == "quote":
            assert first <= start and end <= (first + last) // 2
        else:
            (part_start, part_end), *_ = target["parts"]
            assert part_start <= start and end <= part_end and len(target["parts"]) == TURNS
            text = tok.decode(prompt, skip_special_tokens=False)
            assert text.count("<|im_start|>user") == TURNS + 1 and text.count("<|im_start|>assistant") == TURNS + 1
            assert text.rsplit("<|im_start|>user", 1)[1].startswith("\nGoing back to part 1")
        # Named once in the code shown, so the question has one answer; the question says what to change.
        assert tok.decode(prompt[first:last]).count(source) == 1
        question = tok.decode(prompt[last:])
        assert f"`{target['name']}`" in question and target["question"] in question
        if target["edit"] != "none":
            assert f"`{target['new_name']}`" in question
        edits.add(target["edit"])
    assert len(edits) > 1  # reproductions and edits both


def test_retrieval_asks_several_questions_with_answers_spread_over_the_code(tok):
    made = family_prompts("retrieval", tok, "heldout", 16, LENGTH)
    kinds = set()
    for prompt, target in zip(made.prompts, made.provenance["targets"]):
        first, last = target["body"]
        answers = target["answers"]
        assert len(answers) == QUESTIONS_PER_PROMPT
        # One answer in each quarter of the code (but the last few tokens, which a longer question would take).
        low, high = target["spread_over"]
        assert low == first and last - QUESTION_TOKENS <= high <= last
        quarters = sorted((a["start"] - low) * QUESTIONS_PER_PROMPT // (high - low) for a in answers)
        assert quarters == list(range(QUESTIONS_PER_PROMPT)) and all(a["end"] <= last for a in answers)
        question = tok.decode(prompt[last:])
        for a in answers:
            shown = tok.decode(prompt[a["start"] : a["end"]])
            assert shown == source_of(a["module"], a["name"])
            if a["kind"] == "value":
                assert f"{a['name'].rsplit('.', 1)[-1]} = {a['answer']}" in shown
            elif a["kind"] == "parameters":
                assert all(p.lstrip("*") in shown for p in a["answer"].split(", "))
            else:  # the module's header line is in the prompt before the definition
                assert f"# ---- module {a['answer']} (" in tok.decode(prompt[first : a["start"]])
            assert f"`{a['name'].rsplit('.', 1)[-1] if a['kind'] == 'module' else a['name']}`" in question
            kinds.add(a["kind"])
    assert kinds == {"value", "parameters", "module"}


def test_long_generation_asks_for_a_long_answer_from_a_short_prompt(tok):
    spec = REGISTRY["longgen"]
    assert spec.prompt_tokens == LONG_PROMPT_TOKENS <= 512 and 2048 <= spec.new_tokens <= 4096
    assert spec.prompt_tokens + spec.new_tokens <= 8192  # SmolLM2's context
    made = family_prompts("longgen", tok, "tuning", 4, LONG_PROMPT_TOKENS)
    for prompt, target in zip(made.prompts, made.provenance["targets"]):
        assert target["question"] in tok.decode(prompt[target["body"][1]:])
        first, last = target["body"]
        assert last - first >= 0.75 * LONG_PROMPT_TOKENS  # mostly code: the answer is long, the prompt short
