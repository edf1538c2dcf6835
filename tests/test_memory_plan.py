"""The plan made before anything is allocated: bytes per device against an independent count, a refusal that names
the flags to change when a run cannot fit, and `--dry-run`, which prints the plan without compiling."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine
from vegas_jax.engine import InputError
from vegas_jax.generate import main
from vegas_jax.memory import device_bytes


def test_plan_counts_parameters_and_cache():
    engine = tiny_engine()
    c = engine.config
    batch = prompts([45, 12, 80], c.vocab_size)
    plan = engine.plan(batch, dataclasses.replace(GREEDY, method="vegas"))
    parts = plan["bytes_per_device"]
    assert parts["params"] == sum(np.asarray(x).nbytes for x in __import__("jax").tree.leaves(engine.model.params))
    # K and V, every layer, every row of the cache, float32.
    assert plan["cache_capacity"] == 384 and plan["batch_rows"] == 3
    assert parts["kv_cache"] == 2 * c.num_layers * 3 * 384 * c.num_kv_heads * c.head_dim * 4
    assert parts["total"] >= parts["params"] + parts["kv_cache"]
    assert plan["mesh"] == {"data": 1, "model": 1} and not engine._compiled  # planning compiles nothing


def test_a_run_that_cannot_fit_is_refused_before_allocating():
    engine = tiny_engine()
    limit, _ = device_bytes(engine.placement)
    rows = 2 * limit // (2 * 2 * 384 * 2 * 16 * 4)  # twice as many sequences' caches as the device holds
    with pytest.raises(InputError, match=r"max_model_len / slots / mesh: this run needs .* GiB per device"):
        engine.generate([[1]] * rows, dataclasses.replace(GREEDY, max_new_tokens=8))
    assert not engine._compiled


def test_dry_run_prints_the_plan_and_compiles_nothing():
    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["--model", str(fixture), "--prompt", "hello world", "--prompt", "a b c", "--method", "vegas",
                     "--dry-run", "--quiet"])
    assert code == 0
    doc = json.loads(out.getvalue())
    plan = doc["plan"]
    assert plan["batch_rows"] == 2 and plan["gamma"] == 6 and plan["mesh"] == {"data": 1, "model": 1}
    assert plan["bytes_per_device"]["kv_cache"] > 0 and len(doc["prompt_tokens"]) == 2


def test_the_policy_knobs_reach_the_policy_and_its_memory():
    """Quest's page bounds take 2 x layers x rows x capacity / page x KV heads x head dim values: halving the page
    doubles them. The policy the loop compiles carries the knobs (`Engine._plan`)."""
    engine = tiny_engine()
    c = engine.config
    batch = prompts([45, 12, 80], c.vocab_size)
    state = {}
    for page in (16, 8):
        options = dataclasses.replace(GREEDY, method="quest", quest_page=page)
        state[page] = engine.plan(batch, options)["bytes_per_device"]["decode_state"]
        assert engine._plan(batch, options)[0].policy.page == page
    assert state[8] - state[16] == 2 * c.num_layers * 3 * (384 // 16) * c.num_kv_heads * c.head_dim * 4
    options = dataclasses.replace(GREEDY, method="retrieval", retrieval_chunk=16, retrieval_every=2)
    policy = engine._plan(batch, options)[0].policy
    assert (policy.chunk, policy.every) == (16, 2)
    assert engine._plan(batch, dataclasses.replace(GREEDY, method="streaming", stream_sinks=4))[0].policy.sinks == 4
