"""The plan made before anything is allocated: bytes per device against an independent count, a refusal that names
the flags to change when a run cannot fit, and `--dry-run`, which prints the plan without compiling."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.test_lossless_tiny import GREEDY, prompts, tiny_engine
from vegas_jax.runtime.engine import InputError
from vegas_jax.generate import main
from vegas_jax.runtime.memory import device_bytes, estimate
from vegas_jax.sharding import Placement


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
    assert plan["mesh"] == {"data": 1, "model": 1} and not engine.programs  # planning compiles nothing


def test_plan_counts_the_generation_controls():
    """Penalties keep each request's token counts (int32) and prompt tokens (bool) per vocabulary entry, logprobs a
    value and K alternatives (id and value) per output slot; their step buffers are a penalised and a log-softmax
    copy of the verification logits."""
    engine = tiny_engine()
    c = engine.config
    batch = prompts([45, 12, 80], c.vocab_size)
    plain = engine.plan(batch, dataclasses.replace(GREEDY, method="vegas"))["bytes_per_device"]
    controls = dataclasses.replace(GREEDY, method="vegas", repetition_penalty=1.2, logprobs=5)
    more = engine.plan(batch, controls)["bytes_per_device"]
    width = 256  # max_new_tokens 128 rounded up to the output bucket
    assert more["decode_state"] - plain["decode_state"] == 3 * (c.vocab_size * (4 + 1) + width * 4 * (1 + 2 * 5))
    # With kernels (no prefill score arrays) and one-token prefill chunks the verification step is the largest.
    step = {flag: estimate(c, engine.model.params, Placement("interpret"), batch=3, capacity=384, gamma=5, k_max=8,
                           policy="vegas", output_width=width, sampling=False, prefill_chunk=1, refill=None,
                           penalties=flag, logprobs=5 if flag else None)["largest_step_buffers"]
            for flag in (False, True)}
    assert step[True] - step[False] == 2 * 3 * 6 * c.vocab_size * 4


def test_plan_counts_the_draft_heads_cache_over_the_whole_context_and_its_params():
    """The head drafter keeps K and V of one layer for every position of the cache and its tree's scratch rows
    (float32 here), besides the model's cache; its params, with a draft vocabulary's rows of the LM head, count as
    draft weights."""
    import jax.numpy as jnp

    from models import draft_head

    engine = tiny_engine()
    c = engine.config
    params = draft_head.init_params(c, jnp.float32, 0)
    head_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    batch = prompts([45, 12, 80], c.vocab_size)
    for vocabulary, readout_bytes in [(0, 0), ([5, 9, 2], 3 * 4 + 3 * c.hidden_size * 4)]:
        engine.use_draft_head(params, vocabulary=vocabulary)
        plans = {drafter: engine.plan(batch, dataclasses.replace(GREEDY, gamma=4, draft_tree="4x2", drafter=drafter))
                 for drafter in ("ngram", "head")}
        rows = 1 + 2 + 4 + 8 + 16  # a 4x2 tree's nodes: depth 4, two children each
        extra = plans["head"]["bytes_per_device"]["kv_cache"] - plans["ngram"]["bytes_per_device"]["kv_cache"]
        assert extra == 2 * 3 * (plans["head"]["cache_capacity"] + rows) * c.num_kv_heads * c.head_dim * 4
        assert plans["ngram"]["bytes_per_device"]["draft_weights"] == 0
        assert plans["head"]["bytes_per_device"]["draft_weights"] == head_bytes + readout_bytes


def test_a_run_that_cannot_fit_is_refused_before_allocating():
    engine = tiny_engine()
    limit, _ = device_bytes(engine.placement)
    rows = 2 * limit // (2 * 2 * 384 * 2 * 16 * 4)  # twice as many sequences' caches as the device holds
    with pytest.raises(InputError, match=r"max_model_len / slots / mesh: this run needs .* GiB per device"):
        engine.generate([[1]] * rows, dataclasses.replace(GREEDY, max_new_tokens=8))
    assert not engine.programs


def test_dry_run_prints_the_plan_and_compiles_nothing(tmp_path, monkeypatch):
    """--output-json, if given, gets the plan printed; the plan names the layer loop the run compiles (scanned on
    the CPU, VEGAS_SCAN_LAYERS=0 unrolled)."""
    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["--model", str(fixture), "--prompt", "hello world", "--prompt", "a b c", "--method", "vegas",
                     "--dry-run", "--quiet", "--output-json", str(tmp_path / "plan.json")])
    assert code == 0
    doc = json.loads(out.getvalue())
    assert json.loads((tmp_path / "plan.json").read_text()) == doc
    plan = doc["plan"]
    assert plan["batch_rows"] == 2 and plan["gamma"] == 6 and plan["mesh"] == {"data": 1, "model": 1}
    assert plan["bytes_per_device"]["kv_cache"] > 0 and len(doc["prompt_tokens"]) == 2
    assert plan["layer_loop"] == "scanned"
    monkeypatch.setenv("VEGAS_SCAN_LAYERS", "0")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--model", str(fixture), "--prompt", "hello world", "--dry-run", "--quiet"]) == 0
    assert json.loads(out.getvalue())["plan"]["layer_loop"] == "unrolled"


def test_dry_run_plan_counts_quantized_draft_weights():
    """With --draft-weights the plan names the drafts' precision and source and counts their bytes in the total:
    int4 values of the four projections and the LM head, two a byte, with their scales and offsets."""
    fixture = Path(__file__).parent / "fixtures" / "tiny-llama"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["--model", str(fixture), "--prompt", "hello world", "--method", "vegas", "--draft-weights", "int4",
                     "--dtype", "float32", "--dry-run", "--quiet"])
    assert code == 0
    plan = json.loads(out.getvalue())["plan"]
    parts = plan["bytes_per_device"]
    assert plan["draft_weights"] == "int4" and plan["draft_weights_source"] == "quantized from the float32 weights"
    linear = parts["params"] // 4 - sum(np.prod(s) for s in _unquantized_shapes(fixture))  # values quantized
    assert linear / 2 < parts["draft_weights"] < linear  # half a byte a value, plus scales and offsets
    assert parts["total"] == (parts["params"] + parts["draft_weights"] + parts["decode_state"]
                              + parts["largest_step_buffers"] + parts["joining_group"] + parts["kept_prefill"])


def _unquantized_shapes(fixture: Path):
    """Shapes of the tiny Llama's parameters that the draft reads as they are: the norm scales, and the embedding
    of an untied model (its LM head is quantized, the embedding only looked up)."""
    config = json.loads((fixture / "config.json").read_text())
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    embed = (config["vocab_size"], d)
    return [(d,)] * (2 * layers + 1) + ([embed] if not config.get("tie_word_embeddings") else [])


def test_the_policy_knobs_reach_the_policy_and_its_memory():
    """Quest's page bounds take 2 x layers x rows x capacity / page x KV heads x head dim values: halving the page
    doubles them. The policy the loop compiles carries the knobs (`run_plan.resolve`)."""
    engine = tiny_engine()
    c = engine.config
    batch = prompts([45, 12, 80], c.vocab_size)
    state = {}
    for page in (16, 8):
        options = dataclasses.replace(GREEDY, method="quest", quest_page=page)
        state[page] = engine.plan(batch, options)["bytes_per_device"]["decode_state"]
        assert engine._fitted_plan(batch, options).config.policy.page == page
    assert state[8] - state[16] == 2 * c.num_layers * 3 * (384 // 16) * c.num_kv_heads * c.head_dim * 4
    options = dataclasses.replace(GREEDY, method="retrieval", retrieval_chunk=16, retrieval_every=2)
    policy = engine._fitted_plan(batch, options).config.policy
    assert (policy.chunk, policy.every) == (16, 2)
    streaming = dataclasses.replace(GREEDY, method="streaming", stream_sinks=4)
    assert engine._fitted_plan(batch, streaming).config.policy.sinks == 4
