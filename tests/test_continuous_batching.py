"""Continuous batching (`Engine.serve`): requests admitted into a running decode loop as others finish give, request
for request, what one batch of all of them gives (`Engine.generate`), itself checked against plain decoding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine
from vegas_jax.runtime.engine import InputError
from vegas_jax.runtime.serving import SlotTable

LENGTHS = [45, 12, 80, 7, 33, 60, 21]


@pytest.fixture(scope="module")
def engine_and_prompts():
    engine = tiny_engine()
    batch = prompts(LENGTHS, engine.config.vocab_size, seed=3)
    # Uneven lengths so requests finish at different iterations: a stop token that one request emits mid-way.
    plain = engine.generate(batch, dataclasses.replace(GREEDY, max_new_tokens=40))
    tokens = plain.requests[2].tokens
    others = set().union(*(r.tokens[:30] for i, r in enumerate(plain.requests) if i != 2))
    engine.tokenizer.eos_ids = (next(t for t in tokens[10:] if t not in others and t not in tokens[:10]),)
    return engine, batch


def _request_metrics(result):
    return [(r.metrics["iterations"], r.metrics["tau"]) for r in result.requests]


@pytest.mark.parametrize(
    "method,temperature,slots,refill",
    [("ar", 0.0, 3, 1), ("vegas", 0.0, 3, 2), ("vegas", 0.0, 2, 1), ("vegas", 0.8, 3, 2), ("quest", 0.0, 4, 3),
     ("retrieval", 0.8, 3, 1)],
)
def test_serve_equals_one_batch(engine_and_prompts, method, temperature, slots, refill):
    engine, batch = engine_and_prompts
    options = dataclasses.replace(GREEDY, method=method, temperature=temperature, max_new_tokens=40)
    together = engine.generate(batch, options)
    served = engine.serve(batch, options, slots=slots, refill=refill)
    assert [r.tokens for r in served.requests] == [r.tokens for r in together.requests]
    # Same drafts and selections per request, not only the same output.
    assert _request_metrics(served) == _request_metrics(together)
    lengths = [len(r.tokens) for r in served.requests]
    assert min(lengths) < 40 == max(lengths)  # the stop token ended one request early
    m = served.metrics
    assert m["decode_tokens"] == sum(n - 1 for n in lengths)
    assert (m["slots"], m["refill"]) == (slots, refill)
    # The first call starts with every slot busy and queued requests left; the drain at the end is not steady.
    assert 0 < m["steady_decode_tokens"] < m["decode_tokens"]
    calls = m["decode_calls"]
    assert len(calls) > 1 and sum(c["tokens"] for c in calls) == m["decode_tokens"]
    assert m["loop_iterations"] == sum(c["iterations"] for c in calls) >= max(r.metrics["iterations"] for r in served.requests)


def test_serve_greedy_equals_plain_decoding(engine_and_prompts):
    engine, batch = engine_and_prompts
    options = dataclasses.replace(GREEDY, max_new_tokens=40)
    plain = engine.generate(batch, options)
    served = engine.serve(batch, dataclasses.replace(options, method="vegas"), slots=2, refill=2)
    assert [r.tokens for r in served.requests] == [r.tokens for r in plain.requests]


def test_more_slots_than_requests(engine_and_prompts):
    engine, batch = engine_and_prompts
    options = dataclasses.replace(GREEDY, method="vegas", max_new_tokens=12)
    served = engine.serve(batch[:2], options, slots=8)
    assert served.metrics["slots"] == 2
    assert [r.tokens for r in served.requests] == [r.tokens for r in engine.generate(batch[:2], options).requests]


@pytest.mark.parametrize("slots,refill,argument", [(0, None, "slots"), (4, 5, "refill"), (4, 0, "refill"),
                                                  (2.0, None, "slots"), (4, True, "refill")])
def test_bad_slots_or_refill(engine_and_prompts, slots, refill, argument):
    """Named as the Python caller wrote them (the CLI names its flags)."""
    engine, batch = engine_and_prompts
    with pytest.raises(InputError, match=f"^{argument} "):
        engine.serve(batch, GREEDY, slots=slots, refill=refill)


def test_per_request_seeds_do_not_depend_on_the_batch(engine_and_prompts):
    """Request i's sampled output is a function of seed + i, so the same prompt at the same index gives the same
    tokens in a batch of one and in a batch of many."""
    engine, batch = engine_and_prompts
    options = dataclasses.replace(GREEDY, method="vegas", temperature=0.8, max_new_tokens=20, seed=5)
    together = engine.generate(batch[:3], options)
    alone = engine.generate(batch[2:3], dataclasses.replace(options, seed=7))
    assert alone.requests[0].tokens == together.requests[2].tokens
    assert np.any([a.tokens != b.tokens for a, b in zip(together.requests[:2], together.requests[1:])])


def test_slot_table_admits_in_order_frees_finished_slots_and_reports_the_stopped():
    # 5 requests through 2 slots in groups of 1; host rows as the loop would return them, written by hand.
    table = SlotTable(slots=2, requests=5, refill=1)
    assert [g for g in table.groups()] == [([0], [0]), ([1], [1])] and table.request == [0, 1]
    assert table.finished_limit() == 1  # one slot free is enough for the next group of 1

    def rows(generated, done):
        return {"num_generated": np.asarray(generated), "done": np.asarray(done),
                "output": np.asarray([[g] * 3 for g in generated])}

    table.after_call(rows([4, 2], [False, True]), np.asarray([1, 1]), iterations=3, seconds=0.5)
    assert table.request == [0, None] and table.finished[1]["num_generated"] == 2
    assert table.calls[-1] == {"busy_slots": 2, "queued": 3, "iterations": 3, "tokens": 4, "seconds": 0.5}
    assert list(table.groups()) == [([2], [1])] and table.request == [0, 2]
    # Stopped here: request 0 and 2 still decoding, 3 and 4 never started.
    ordered = table.rows_in_order(rows([6, 3], [False, False]))
    assert ordered["num_generated"].tolist() == [6, 2, 3, 0, 0] and ordered["done"].tolist() == [0, 1, 0, 0, 0]
    assert table.metrics()["steady_decode_tokens_per_s"] == 8.0  # the one call: both slots busy, requests queued
    empty = SlotTable(slots=3, requests=1, refill=2)
    assert list(empty.groups()) == [([0], [0])] and empty.finished_limit() == 3  # nothing queued: wait for all
