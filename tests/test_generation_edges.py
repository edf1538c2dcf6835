"""Where generation ends and what it returns, on the tiny random Qwen3: stop tokens (inside a run of accepted
drafts, as the very first token, several stop ids), `Engine.stream`'s chunks against the final result,
single-token prompts, and the cache length chosen when max_model_len is left unset. The reference is greedy
decoding by full recomputation (`dense_greedy`), cut by hand after the first stop token."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_lossless_tiny import GREEDY, dense_greedy, prompts, tiny_engine
from vegas_jax.runtime.engine import InputError

NEW = 64
# sparse_ratio 1: the drafts attend to everything, so the target accepts every draft (test_lossless_tiny's
# test_full_budget_accepts_every_draft) and iteration i emits tokens 5i - 4 .. 5i: four drafts, then the bonus.
ACCEPT_ALL = dataclasses.replace(GREEDY, method="vegas", sparse_ratio=1.0, gamma=4, max_new_tokens=NEW)
SPARSE = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=NEW)


def cut(tokens: list[int], stops) -> list[int]:
    """tokens up to and including the first stop token."""
    first = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
    return tokens[: first + 1]


@pytest.fixture(scope="module")
def setup():
    engine = tiny_engine()
    batch = prompts([45, 12, 80], engine.config.vocab_size)
    unstopped = dense_greedy(engine, batch, NEW)
    # Every test here uses two stop ids, the second one a token no request ever emits, so that the stop-id array
    # (part of the compiled state's shape) keeps one shape: one compilation per method for the whole module.
    never = next(t for t in range(engine.config.vocab_size) if all(t not in u for u in unstopped))
    return engine, batch, unstopped, never


def with_stops(engine, monkeypatch, *stops):
    monkeypatch.setattr(engine.tokenizer, "eos_ids", tuple(stops))


def test_a_stop_inside_an_accepted_run_cuts_the_output_there(setup, monkeypatch):
    engine, batch, unstopped, never = setup
    # A token first emitted as the second draft of an iteration (output index 5i - 3), in some request.
    request, position = next(
        (r, p) for r, out in enumerate(unstopped) for p in range(7, NEW, 5) if out[p] not in out[:p]
    )
    stop = unstopped[request][position]
    with_stops(engine, monkeypatch, stop, never)
    result = engine.generate(batch, ACCEPT_ALL)
    assert [r.tokens for r in result.requests] == [cut(u, (stop,)) for u in unstopped]
    stopped = result.requests[request]
    assert len(stopped.tokens) == position + 1 < NEW
    # The iteration that emitted the stop accepted all four drafts, two of them after the stop: they are dropped.
    assert stopped.metrics["iterations"] == (position - 1) // 5 + 1
    assert stopped.metrics["acceptance_by_position"] == [1.0] * 4


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_a_stop_as_the_first_token_ends_only_that_request(setup, method, monkeypatch):
    engine, batch, unstopped, never = setup
    stop = unstopped[1][0]  # what the bootstrap step emits for request 1
    with_stops(engine, monkeypatch, stop, never)
    result = engine.generate(batch, dataclasses.replace(ACCEPT_ALL, method=method))
    expected = [cut(u, (stop,)) for u in unstopped]
    assert [r.tokens for r in result.requests] == expected
    assert result.requests[1].tokens == [stop] and result.requests[1].metrics["iterations"] == 0
    assert max(map(len, expected)) > 1  # the others went on


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_several_stop_ids_each_end_a_request(setup, method, monkeypatch):
    engine, batch, unstopped, _ = setup
    # Two tokens, each first emitted by a different request mid-way, neither emitted earlier by the other.
    first, second = unstopped[0], unstopped[2]
    a = next(t for p, t in enumerate(first[10:], 10) if t not in first[:p] and t not in second[: p + 10])
    b = next(t for p, t in enumerate(second[10:], 10) if t not in second[:p] and t != a and t not in first[:p + 10])
    with_stops(engine, monkeypatch, a, b)
    result = engine.generate(batch, dataclasses.replace(SPARSE, method=method))
    expected = [cut(u, (a, b)) for u in unstopped]
    assert [r.tokens for r in result.requests] == expected
    assert {expected[0][-1], expected[2][-1]} == {a, b}  # each stop id ended one of them


@pytest.mark.parametrize("steps_per_call", [1, 3, None])
def test_stream_chunks_add_up_to_the_result(setup, steps_per_call, monkeypatch):
    engine, batch, unstopped, never = setup
    stop = unstopped[0][30]
    with_stops(engine, monkeypatch, stop, never)
    *chunks, result = engine.stream(batch, SPARSE, steps_per_call=steps_per_call)
    assert [len(c) for c in chunks[0]] == [1, 1, 1]  # the bootstrap step's token first
    streamed = [sum((chunk[i] for chunk in chunks), []) for i in range(len(batch))]
    assert streamed == [r.tokens for r in result.requests] == [cut(u, (stop,)) for u in unstopped]
    if steps_per_call == 1:  # one chunk per iteration: at most γ + 1 tokens each, and as many as the iterations
        assert all(len(c[i]) <= SPARSE.gamma + 1 for c in chunks[1:] for i in range(len(batch)))
        iterations = [sum(1 for c in chunks[1:] if c[i]) for i in range(len(batch))]
        assert iterations == [r.metrics["iterations"] for r in result.requests]


@pytest.mark.parametrize("method", ["ar", "vegas", "quest"])
def test_single_token_prompts(setup, method, monkeypatch):
    """Nothing to prefill: the bootstrap step verifies the only token, and selection starts from one position."""
    engine, batch, _, never = setup
    with_stops(engine, monkeypatch, never, never)
    single = [[5], [17], batch[2]]
    result = engine.generate(single, dataclasses.replace(SPARSE, method=method, max_new_tokens=24))
    assert [r.tokens for r in result.requests] == dense_greedy(engine, single, 24, engine.tokenizer.eos_ids)


@pytest.mark.parametrize(
    "prompt_length,capacity",
    [(30, 1152), (1010, 1664)],  # 30 + 20 -> 1024 (+ 1 row, to 128s); 1010 + 20 -> 2048, capped at the 1536 context
)
def test_max_model_len_follows_the_prompt_when_unset(prompt_length, capacity):
    """Left unset, max_model_len is prompt + max_new_tokens rounded up to 1024, at most the model's context."""
    engine = tiny_engine(context=1536)
    prompt = prompts([prompt_length], engine.config.vocab_size, seed=2)
    options = dataclasses.replace(GREEDY, method="ar", max_new_tokens=20, max_model_len=None, prefill_chunk=512)
    assert engine.start(prompt, options).state.cache.capacity == capacity
    assert [engine.generate(prompt, options).requests[0].tokens] == dense_greedy(engine, prompt, 20)


@pytest.mark.parametrize(
    "prompt_length,message",
    [(1530, "max_new_tokens 20: with a prompt of 1530 tokens it exceeds the context of 1536"),
     (1600, "prompts: prompt 0 has 1600 tokens, more than the model's context of 1536")],
    ids=["prompt-and-new-tokens-over-the-context", "prompt-over-the-context"],
)
def test_unset_max_model_len_refuses_what_the_context_cannot_hold(prompt_length, message):
    engine = tiny_engine(context=1536)
    options = dataclasses.replace(GREEDY, max_new_tokens=20, max_model_len=None)
    with pytest.raises(InputError, match=message):
        engine.check_input(prompts([prompt_length], engine.config.vocab_size), options)
