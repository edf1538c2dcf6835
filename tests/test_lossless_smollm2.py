"""Greedy decoding on the real SmolLM2-135M-Instruct (float32) through `Engine.generate`: plain decoding and Vegas
against Hugging Face transformers' greedy continuations (tests/fixtures/smollm2/greedy.json), and every selection
policy against plain greedy decoding token for token, for a batch of three prompts of different lengths, one of
which stops on EOS."""

from __future__ import annotations

import bisect
import dataclasses
import json
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import per_layer
from models.quantized import dequantize
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading import load_model
from vegas_jax.runtime.prefill_reuse import PrefillReuse

pytestmark = pytest.mark.slow
GREEDY_CASES = {c["kind"]: c for c in json.loads((Path(__file__).parent / "fixtures" / "smollm2" / "greedy.json").read_text())}

# A small budget floor, so that the drafts' attention really is sparse at these prompt lengths.
OPTIONS = GenerationOptions(max_new_tokens=64, gamma=6, sparse_ratio=0.07, min_sparse_tokens=24, max_model_len=1024,
                            prefill_chunk=128)


@pytest.fixture(scope="module")
def setup():
    engine = Engine(load_model(None, jnp.float32))
    tok = engine.tokenizer
    source = open(textwrap.__file__, encoding="utf-8").read()
    code = tok.encode(source)
    other = tok.encode(open(bisect.__file__, encoding="utf-8").read())
    question = tok.encode_chat([{"role": "user", "content": "In one short sentence: what does bisect.insort do?"}])
    batch = [code[:610], question, other[:230]]
    reuse = PrefillReuse()  # the speculative runs start from plain decoding's prefill (tests/test_prefill_reuse.py)
    plain = engine.generate(batch, OPTIONS, steps_per_call=None, reuse_prefill=reuse)
    lengths = [len(r.tokens) for r in plain.requests]
    assert lengths[1] < 64 and plain.requests[1].tokens[-1] in tok.eos_ids, "the chat request should stop on EOS"
    assert lengths[0] == lengths[2] == 64
    return engine, batch, plain, reuse


# One policy of each kind of selection on the real model (scored top-k, scored pages, retrieved chunks); the tiny
# model's tests run every policy (tests/test_lossless_tiny.py), and its CPU time is a tenth of these.
REAL_MODEL_POLICIES = ("vegas", "quest", "retrieval")


@pytest.mark.parametrize("method", REAL_MODEL_POLICIES)
def test_greedy_speculative_equals_plain_smollm2(setup, method):
    engine, batch, plain, reuse = setup
    # Prefill writes the same cache whatever the method (tested buffer for buffer in tests/test_prefill_reuse.py):
    # the run starts from plain decoding's, a prefill of the CPU's ten seconds saved, and decodes on its own.
    result = engine.generate(batch, dataclasses.replace(OPTIONS, method=method), steps_per_call=None,
                             reuse_prefill=reuse)
    assert result.metrics["prefill_reused"]
    for i, (spec, ref) in enumerate(zip(result.requests, plain.requests)):
        assert spec.tokens == ref.tokens, f"request {i} differs from plain decoding"
    # Real weights and real text: drafts are mostly right, so τ is well above 1 (1.9-2.7 across the policies).
    assert result.metrics["tau"] > 1.5


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_generate_equals_transformers_greedy(setup, method):
    """The fixtures' prompts, encoded by the engine (plain text; the chat template), and 32 greedy tokens from
    `generate`, against transformers' (its smallest top-1/top-2 logit margin on these paths: 0.0135). The third
    request, the module's first prompt, keeps the compiled shapes of the tests above (batch 3, 128-token chunks)."""
    engine, batch, plain, _ = setup
    text, chat = GREEDY_CASES["plain"], GREEDY_CASES["chat"]
    (message,) = chat["prompt"]
    assert message["role"] == "user"
    ids = [engine.encode_prompts([text["prompt"]], chat_template=False)[0],
           engine.encode_prompts([message["content"]], chat_template=True)[0]]
    assert ids == [text["prompt_ids"], chat["prompt_ids"]]
    new = len(text["new_ids"])
    assert new == len(chat["new_ids"]) == 32
    assert not set(engine.tokenizer.eos_ids) & set(text["new_ids"] + chat["new_ids"])  # the fixture ran on past EOS
    options = dataclasses.replace(OPTIONS, method=method, max_new_tokens=new)
    result = engine.generate(ids + batch[:1], options, steps_per_call=None)
    assert [r.tokens for r in result.requests] == [text["new_ids"], chat["new_ids"], plain.requests[0].tokens[:new]]


def test_int4_drafts_from_the_files_blocks_equal_plain_smollm2(setup):
    """Drafts from the GGUF's own blocks (every layer's Q4_1; the LM head, int8 in any draft, its Q8_0): the first
    request's first 24 tokens (alone: the CPU reads quantized weights several times slower than float32 ones, so
    this run is kept short) are plain decoding's. The blocks are exactly the weights the model dequantized, so the
    drafts differ from full-precision ones only in rounding: τ stays high."""
    engine, batch, plain, _ = setup
    options = dataclasses.replace(OPTIONS, method="vegas", draft_weights="int4", gamma=4, max_new_tokens=24)
    result = engine.generate(batch[:1], options, steps_per_call=None)
    assert result.requests[0].tokens == plain.requests[0].tokens[:24]
    assert engine.model.draft_sources["int4"] == "121 of 121 weights from the file's Q4_1/Q8_0 blocks"
    layer = per_layer(engine.model.drafts["int4"])["layers"][7]
    full = np.asarray(per_layer(engine.model.params)["layers"][7]["down_proj"])
    assert np.array_equal(np.asarray(dequantize(layer["down_proj"])), full)
    assert result.metrics["tau"] > 2.0


def test_the_shipped_dense_head_drafts_trees_that_equal_plain_smollm2(setup):
    """The head shipped for the embedded model (vegas_jax/loading/embedded_heads/dense, trained on the tuning
    split's generations) drafting 4x2 trees: the batch's tokens are plain decoding's, and the trained head's drafts
    are often accepted on this Python source, which it was not trained on (τ 1.77; an untrained head's is about
    1.0)."""
    from vegas_jax.loading.draft_head_checkpoint import embedded_head

    engine, batch, plain, _ = setup
    engine.use_draft_head(embedded_head("dense"))
    try:  # its own prefill: a head's rows are prefilled with the cache
        result = engine.generate(batch, dataclasses.replace(OPTIONS, draft_tree="4x2", drafter="head"),
                                 steps_per_call=None)
    finally:
        engine.draft_head = None
    for i, (spec, ref) in enumerate(zip(result.requests, plain.requests)):
        assert spec.tokens == ref.tokens, f"request {i} differs from plain decoding"
    assert result.metrics["tau"] > 1.5
