"""The trained draft head (models.draft_head, vegas_jax.decode.drafters.HeadDrafter, vegas_jax.train_draft_head) on tiny
random models in float32, each against an independent reference: training lowers the loss on held-back sequences
and a resumed run ends where an uninterrupted one does; the head drafter's chain equals the head run from scratch
over the whole verified history (target hidden states by a dense forward of the emitted sequence); greedy decoding
with the head as drafter equals greedy decoding by full recomputation (chains and trees on a dense model) and plain
NSA decoding (an NSA model), with drafts accepted; sampled trees keep the distribution (the exact float64 joint of
test_draft_trees); serving admits requests with their head memory as generate runs them; bad input is one named
error."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import draft_head
from models.decoder import forward
from models.kv_cache import KVCache
from tests.test_draft_trees import run_to_end, sampled_counts, tree_sampler
from tests.test_lossless_tiny import dense_greedy, prompts, tiny_engine
from tests.test_nsa_trees import emitted, plain_run
from tests.test_planner import profile_doc
from tests.test_sampling_distribution import chi_square_p_value
from vegas_jax import train_draft_head
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.decode.drafters import HeadDrafter
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError
from vegas_jax.runtime.prefill_reuse import PrefillReuse
from vegas_jax.decode.iteration import request_step, step_keys

SETTINGS = train_draft_head.Settings(prompts=16, prompt_tokens=12, new_tokens=24, steps=60, batch=4,
                                     learning_rate=3e-3, unroll=2, generate_batch=16, validation=4)
NEW = 20


def trained(engine, folder, settings=SETTINGS, seed=2):
    """(data, the checkpoint's record) of a head trained on the engine's greedy outputs of random prompts."""
    data = train_draft_head.make_data(engine, prompts([settings.prompt_tokens] * settings.prompts,
                                                      engine.config.vocab_size, seed), settings)
    return data, train_draft_head.train(engine, data, folder, settings, checkpoint_every=20, progress=False)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(engine with a trained head, its folder, the training data)."""
    engine, folder = tiny_engine(), tmp_path_factory.mktemp("head")
    data, _ = trained(engine, folder)
    engine.use_draft_head(folder)
    return engine, folder, data


def test_training_lowers_the_loss_and_resumes_where_it_stopped(dense, tmp_path):
    engine, folder, data = dense
    model = engine.config
    held_back = prompts([SETTINGS.prompt_tokens] * 4, model.vocab_size, seed=9)  # prompts it never saw
    check = train_draft_head.make_data(engine, held_back, SETTINGS)
    loss = lambda head: loss_of(engine, head, check["tokens"], check["generated"])  # noqa: E731
    before, before_metrics = loss(draft_head.init_params(model, jnp.float32, SETTINGS.seed))
    head = jax.tree.map(np.asarray, engine.draft_head)
    after, after_metrics = loss(head)
    assert after < 0.9 * before, (before, after)
    assert after_metrics["agreement"][0] > before_metrics["agreement"][0] + 0.2

    # Two runs cut off by their time limit after one step each, then one to the end: the params of one run.
    for _ in range(2):
        train_draft_head.train(engine, data, tmp_path, SETTINGS, time_limit=0.0, progress=False)
    record = train_draft_head.train(engine, data, tmp_path, SETTINGS, progress=False)
    assert [h["step"] for h in record["history"]] == list(range(1, SETTINGS.steps + 1))
    resumed = jax.tree.map(np.asarray, draft_head_params(tmp_path, engine))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), resumed, head)

    # The data's last `validation` sequences are never in a batch, and the head's loss and agreement on them are
    # recorded at each checkpoint (here at the end: the two cut-off runs' first steps, and every 200th).
    trained_on = SETTINGS.prompts - SETTINGS.validation
    assert all(train_draft_head.batch_rows(SETTINGS, step, SETTINGS.prompts).max() < trained_on
               for step in range(SETTINGS.steps))
    assert [h["step"] for h in record["history"] if "validation" in h] == [1, 2, SETTINGS.steps]
    held = slice(trained_on, SETTINGS.prompts)
    want_loss, want = loss_of(engine, resumed, data["tokens"][held], data["generated"][held])
    got = record["history"][-1]["validation"]
    assert got["loss"] == pytest.approx(float(want_loss), rel=1e-4)
    np.testing.assert_allclose(got["agreement"], np.asarray(want["agreement"]), atol=1e-4)
    with pytest.raises(InputError, match="unroll 1: the checkpoint was trained with 2"):
        train_draft_head.train(engine, data, tmp_path, train_draft_head.Settings(**{**SETTINGS.__dict__,
                                                                                 "unroll": 1}), progress=False)


def loss_of(engine, head, tokens, generated):
    """train_draft_head.loss_and_metrics of a head over these sequences (jitted)."""
    loss = jax.jit(functools.partial(
        train_draft_head.loss_and_metrics, model=engine.config, prompt_tokens=SETTINGS.prompt_tokens,
        unroll=SETTINGS.unroll, context_tokens=SETTINGS.context_tokens, placement=engine.placement))
    return loss(head, engine.model.params, jnp.asarray(tokens), jnp.asarray(generated))


def draft_head_params(folder, engine):
    from vegas_jax.loading.draft_head_checkpoint import load_head

    return load_head(folder, engine.config)


_forward = jax.jit(forward, static_argnames=("config", "with_hidden"))
_features = jax.jit(draft_head.features, static_argnums=2)
WIDTH = 64  # every reference pass's rows, padding after the real ones (causal: they change none of them)


def attends(window: int) -> jax.Array:
    """[1, WIDTH, WIDTH]: row p sees rows p - window + 1 .. p (window 0: every row up to p)."""
    rows = np.arange(WIDTH)
    seen = rows[None, :] <= rows[:, None]
    if window:
        seen &= rows[None, :] > rows[:, None] - window
    return jnp.asarray(seen)[None]


def reference_chain(engine, head, sequence: list[int], depth: int, window: int = 0) -> list[int]:
    """The head's greedy chain after `sequence`, recomputed from scratch: the target's hidden states by a dense
    forward of the whole sequence, the head over all its rows 0 .. len - 2, prompt and generated alike (row p:
    hidden state p, token p + 1) with causal attention (over the last `window` rows; 0: all), then each draft's
    row appended and the whole head pass run again."""
    model, target = engine.config, engine.model.params
    tokens = jnp.asarray([sequence + [0] * (WIDTH - len(sequence))])
    positions = jnp.arange(WIDTH)[None]
    _, _, _, hidden = _forward(target, tokens, positions, KVCache.create(model, 1, WIDTH, jnp.float32),
                               DenseAttention(), config=model, with_hidden=True)
    features = np.zeros((1, WIDTH, model.hidden_size), np.float32)
    following = np.zeros((1, WIDTH), np.int32)
    rows = len(sequence) - 1
    features[0, :rows], following[0, :rows] = hidden[0, :rows], sequence[1:]
    causal = attends(window)
    drafts = []
    for _ in range(depth):
        k, v = draft_head.empty_cache(model, 1, WIDTH, jnp.float32)
        out, _, _ = _features(head, target, model, jnp.asarray(features), jnp.asarray(following),
                              positions, k, v, positions, causal)
        token = int(jnp.argmax(draft_head.logits(target, model, out[:, rows - 1 : rows])[0, 0]))
        drafts.append(token)
        features[0, rows], following[0, rows] = out[0, rows - 1], token
        rows += 1
    return drafts


def test_a_checkpoints_window_is_the_span_it_trained_over(dense):
    """Rows of 11 prompt positions (prompt_tokens - 1) and 24 generated ones: a head row saw at most 35 in
    training, the window decoding keeps unless told otherwise (0: every position; a negative one is refused)."""
    engine, folder, _ = dense
    assert engine.draft_head_window == min(SETTINGS.context_tokens, SETTINGS.prompt_tokens - 1) + SETTINGS.new_tokens
    other = tiny_engine()
    other.use_draft_head(folder, window=0)
    assert other.draft_head_window == 0
    with pytest.raises(InputError, match=r"^window must be >= 0 \(0: every position\), got -1$"):
        other.use_draft_head(folder, window=-1)
    assert other.draft_head_window == 0


@pytest.mark.parametrize("window", [None, 0, 7])
def test_the_head_drafters_chain_is_the_head_over_the_whole_history(dense, window):
    """After a few iterations (prompt rows written by chunked prefill, generated rows by earlier proposals, ragged
    batch), a proposal's chain equals reference_chain, which carries no head cache between drafts: with the
    checkpoint's window (35, which the longest sequence outgrows), every position (0) and a window shorter than
    every sequence (7, which changes the chains)."""
    engine, folder, _ = dense
    if window is not None:
        engine = tiny_engine()
        engine.use_draft_head(folder, window)
    ids = prompts([12, 37, 9], engine.config.vocab_size, seed=4)
    # Chunks of 16: the longest prompt's 36 prefilled rows take three chunks, a ragged tail.
    opts = GenerationOptions(max_new_tokens=NEW, draft_tree="4x1", drafter="head", prefill_chunk=16)
    started = engine.start(ids, opts)
    state = started.decode(engine.model.params, started.draft_params, started.state, np.int32(3), np.int32(3))
    config = started.config
    assert config.head_window == engine.draft_head_window
    keys = step_keys(state.keys, request_step(state), config.tree.depth + 2)
    drafts = jax.jit(lambda s: HeadDrafter().propose(engine.model.params, engine.draft_head, s, keys, config,
                                                     jnp.full((3,), 4)).tokens)(state)
    output, count = np.asarray(state.output), np.asarray(state.num_generated)
    for b, prompt in enumerate(ids):
        sequence = prompt + output[b, : count[b]].tolist()
        want = reference_chain(engine, engine.draft_head, sequence, 4, engine.draft_head_window)
        assert np.asarray(drafts[b, 1:]).tolist() == want, b


def reference_prompt_rows(engine, head, prompt: list[int], window: int):
    """(K, V) [len - 1, K, H] each: the head's rows of the prompt's positions 0 .. len - 2 from scratch (the
    target's hidden states by a dense forward of the prompt, the head over them with causal attention over the
    last `window` rows, 0: all)."""
    model, target = engine.config, engine.model.params
    rows = len(prompt) - 1
    tokens = jnp.asarray([prompt + [0] * (WIDTH - len(prompt))])
    positions = jnp.arange(WIDTH)[None]
    _, _, _, hidden = _forward(target, tokens, positions, KVCache.create(model, 1, WIDTH, jnp.float32),
                               DenseAttention(), config=model, with_hidden=True)
    following = jnp.asarray([prompt[1:] + [0] * (WIDTH - rows)])
    k, v = draft_head.empty_cache(model, 1, WIDTH, jnp.float32)
    _, k, v = _features(head, target, model, hidden, following, positions, k, v, positions, attends(window))
    return np.asarray(k[0, :rows]), np.asarray(v[0, :rows])


def test_prefill_writes_the_heads_rows_of_every_prompt_position(dense):
    """In chunks of 16 (three for the longest prompt, a ragged batch) as in one chunk: the head's K/V of every
    prefilled position equals the head run from scratch over the prompt."""
    engine, _, _ = dense
    ids = prompts([12, 37, 9], engine.config.vocab_size, seed=5)
    want = [reference_prompt_rows(engine, engine.draft_head, p, engine.draft_head_window) for p in ids]
    for chunk in (16, 2048):
        options = GenerationOptions(max_new_tokens=NEW, draft_tree="4x1", drafter="head", prefill_chunk=chunk)
        memory = engine.start(ids, options).state.drafter_state
        for b, prompt in enumerate(ids):
            rows = len(prompt) - 1
            np.testing.assert_allclose(np.asarray(memory.k[b, :rows]), want[b][0], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(np.asarray(memory.v[b, :rows]), want[b][1], atol=1e-5, rtol=1e-5)


def test_a_kept_prefill_keeps_the_heads_rows_with_the_cache(dense):
    """A head run started from a kept prefill (vegas_jax.runtime.prefill_reuse) starts from the state of its own
    prefill, the head's rows included; a prefill kept without the head is not reused for one with it."""
    from tests.test_prefill_reuse import host

    engine, _, _ = dense
    ids = prompts([12, 37, 9], engine.config.vocab_size, seed=6)
    head = GenerationOptions(max_new_tokens=NEW, draft_tree="3x2", drafter="head", prefill_chunk=16)
    reuse = PrefillReuse()
    engine.start(ids, dataclasses.replace(head, draft_tree="2x1", drafter="ngram"), reuse_prefill=reuse)
    assert not engine.start(ids, head, reuse_prefill=reuse).timings["prefill_reused"]  # keeps the head's now
    reused = engine.start(ids, head, reuse_prefill=reuse)
    assert reused.timings["prefill_reused"]
    for a, b in zip(host(engine.start(ids, head).state), host(reused.state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tree", ["4x1", "2x3", "7d4"])  # 7d4: shaped by rank rates, irregular
def test_greedy_decoding_with_the_head_is_plain_greedy_decoding(dense, tree):
    engine, _, _ = dense
    ids = prompts([12, 21, 9], engine.config.vocab_size, seed=2)  # the first is a training prompt
    state = run_to_end(engine, ids, GenerationOptions(max_new_tokens=NEW, draft_tree=tree, drafter="head"))
    output, count = np.asarray(state.output), np.asarray(state.num_generated)
    assert [output[i, : count[i]].tolist() for i in range(len(ids))] == dense_greedy(engine, ids, NEW)
    assert np.asarray(state.metrics.accepted).sum(0)[1] > 0  # paths of depth 2 and more were accepted


def test_a_draft_vocabulary_drafts_its_most_frequent_tokens_only_and_decodes_as_plain_greedy(dense):
    """Training counts the tokens of the sequences it trains on (validation left out); a draft vocabulary of K
    is the K most frequent (ties by id), read out through the LM head's rows of them. The head then drafts those
    tokens only, and greedy decoding stays plain greedy decoding, drafts accepted."""
    from vegas_jax.loading.draft_head_checkpoint import token_counts

    engine, folder, data = dense
    model = engine.config
    want = np.zeros(model.vocab_size, np.int64)
    for row, generated in zip(data["tokens"][: SETTINGS.prompts - SETTINGS.validation], data["generated"]):
        for token in row[: SETTINGS.prompt_tokens + generated]:
            want[token] += 1
    np.testing.assert_array_equal(token_counts(folder), want)

    size = 24  # of 96
    other = tiny_engine()
    other.use_draft_head(folder, vocabulary=size)
    readout = other.draft_head[draft_head.READOUT]
    ranked = sorted(range(model.vocab_size), key=lambda t: (-want[t], t))[:size]
    assert np.asarray(readout["tokens"]).tolist() == ranked
    hidden = jax.random.normal(jax.random.key(0), (2, 3, model.hidden_size))
    full = draft_head.logits(engine.model.params, model, hidden)
    np.testing.assert_allclose(np.asarray(draft_head.logits(engine.model.params, model, hidden, readout)),
                               np.asarray(full)[..., ranked], atol=1e-5, rtol=1e-5)

    ids = prompts([12, 21, 9], model.vocab_size, seed=2)
    opts = GenerationOptions(max_new_tokens=NEW, draft_tree="2x3", drafter="head", prefill_chunk=16)
    started = other.start(ids, opts)
    state = started.decode(other.model.params, started.draft_params, started.state, np.int32(2), np.int32(2))
    keys = step_keys(state.keys, request_step(state), started.config.tree.depth + 2)
    drafts = jax.jit(lambda s: HeadDrafter().propose(other.model.params, other.draft_head, s, keys, started.config,
                                                     jnp.full((3,), 3)).tokens)(state)
    assert set(np.asarray(drafts)[:, 1:].ravel().tolist()) <= set(ranked)
    state = run_to_end(other, ids, opts)
    output, count = np.asarray(state.output), np.asarray(state.num_generated)
    assert [output[i, : count[i]].tolist() for i in range(len(ids))] == dense_greedy(engine, ids, NEW)
    assert set(sum((output[i, : count[i]].tolist() for i in range(len(ids))), [])) - set(ranked)  # not all in it
    assert np.asarray(state.metrics.accepted).sum(0)[1] > 0


def test_greedy_decoding_with_the_head_is_plain_nsa_decoding(tmp_path):
    """Also where the SSV planner chooses the drafter (drafter auto): among those its profile times that the
    engine can run, the head only where the engine has one."""
    engine, ids, plain = plain_run("nsa-1b")
    settings = train_draft_head.Settings(**{**SETTINGS.__dict__, "steps": 40})
    trained(engine, tmp_path / "head", settings)
    doc = profile_doc()
    doc["drafts"] = [dict(d, drafter="head") for d in doc["drafts"]]  # the n-gram drafter's times, as the head's
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    auto = GenerationOptions(max_new_tokens=16, drafter="auto", ssv_profile=str(profile))
    with pytest.raises(InputError, match="drafter auto: the profile .* times none of the drafters this engine can"):
        Engine(engine.model).generate(ids, auto)

    engine.use_draft_head(tmp_path / "head")
    state = run_to_end(engine, ids, GenerationOptions(max_new_tokens=16, draft_tree="3x2", drafter="head"))
    assert emitted(state) == emitted(plain)
    np.testing.assert_array_equal(np.asarray(state.committed), np.asarray(plain.committed))
    assert np.asarray(state.metrics.accepted).sum(0)[0] > 0
    planned = engine.generate(ids, auto)
    assert planned.metrics["ssv_plan"]["drafter"] == "head" and planned.metrics["drafter"] == "head"
    assert [r.tokens for r in planned.requests] == emitted(plain)


def test_on_a_dense_model_the_planner_chooses_between_the_head_and_plain_decoding(dense, tmp_path):
    """drafter auto with a dense model's profile: the planner costs the trees of the drafters the profile times
    and the engine runs, here the head's (cheaper than n-gram lookup's in this profile) and decodes as plain
    greedy decoding; with head drafts costing 1000 plain steps it decodes plainly. An NSA model's profile, and a
    method that reads a KV selection, are refused naming the option."""
    engine, _, _ = dense
    ids = prompts([12, 21, 9], engine.config.vocab_size, seed=2)
    doc = profile_doc()
    doc["config"] = {"attention": "dense"}
    doc["passes"] = [p for p in doc["passes"] if p["mode"] == "exact"]
    doc["distances"] = {}
    doc["drafts"] += [dict(d, drafter="head", ms=d["ms"] / 2) for d in doc["drafts"]]
    profile = tmp_path / "dense.json"
    profile.write_text(json.dumps(doc))
    result = engine.generate(ids, GenerationOptions(max_new_tokens=NEW, drafter="auto", ssv_profile=str(profile)))
    plan = result.metrics["ssv_plan"]
    assert plan["drafter"] == "head" and plan["tree"] is not None and result.metrics["drafter"] == "head"
    assert [r.tokens for r in result.requests] == dense_greedy(engine, ids, NEW)
    assert result.metrics["tau"] > 1.0

    slow = dict(doc, drafts=[dict(d, ms=1000 * d["ms"]) for d in doc["drafts"]])
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    planned = engine.plan(ids, GenerationOptions(max_new_tokens=NEW, drafter="auto",
                                                 ssv_profile=str(tmp_path / "slow.json")))
    assert planned["ssv_plan"]["tree"] is None and planned["draft_tree"] is None

    (tmp_path / "nsa.json").write_text(json.dumps(profile_doc()))
    with pytest.raises(InputError, match="ssv_profile .*nsa.json: profiles an NSA model, and this one is dense"):
        engine.plan(ids, GenerationOptions(drafter="auto", ssv_profile=str(tmp_path / "nsa.json")))
    with pytest.raises(InputError, match="ssv_profile: on a dense model .* leave method ar, got 'vegas'"):
        engine.plan(ids, GenerationOptions(drafter="auto", method="vegas", ssv_profile=str(profile)))


def test_sampled_trees_with_the_head_keep_the_distribution(tmp_path):
    """The head's children are draws without replacement from its distributions, as the self drafter's are."""
    sampler = tree_sampler()
    engine = sampler[0]
    engine.use_draft_head(draft_head.init_params(engine.config, jnp.float32, 3))
    counts, histogram = sampled_counts(sampler, "head", 10_000)
    assert min(histogram) > 0.02 * sum(histogram), histogram
    p_value = chi_square_p_value(counts, sampler[2])
    assert p_value > 1e-3, f"p = {p_value:.2e}"


def test_sampled_trees_with_a_draft_vocabulary_keep_the_distribution():
    """The head drafts from 3 of the 4 tokens, the one left out the likeliest second token: its probability
    reaches the output through the residual alone."""
    sampler = tree_sampler()
    engine, _, joint = sampler
    likeliest = int(np.argmax(joint.sum(axis=(0, 2, 3))))
    vocabulary = [t for t in (3, 1, 2, 0) if t != likeliest]
    engine.use_draft_head(draft_head.init_params(engine.config, jnp.float32, 3), vocabulary=vocabulary)
    assert np.asarray(engine.draft_head[draft_head.READOUT]["tokens"]).tolist() == vocabulary
    counts, histogram = sampled_counts(sampler, "head", 10_000)
    assert min(histogram) > 0.02 * sum(histogram), histogram
    p_value = chi_square_p_value(counts, joint)
    assert p_value > 1e-3, f"p = {p_value:.2e}"


def test_serving_with_the_head_equals_generate(dense):
    """Continuous batching admits requests with their head memory (sampled, so the keys must agree too)."""
    engine, _, _ = dense
    ids = prompts([12, 30, 9, 21, 16], engine.config.vocab_size, seed=2)
    options = GenerationOptions(max_new_tokens=NEW, draft_tree="3x2", drafter="head", temperature=0.8)
    together, served = engine.generate(ids, options), engine.serve(ids, options, slots=2, refill=1)
    assert [r.tokens for r in served.requests] == [r.tokens for r in together.requests]
    assert together.metrics["tau"] > 1.2


def test_refusals_name_the_argument(dense, tmp_path):
    from vegas_jax.loading import draft_head_checkpoint

    engine, folder, _ = dense
    with pytest.raises(InputError, match="drafter head: this engine has no draft head"):
        tiny_engine().generate([[1, 2, 3]], GenerationOptions(draft_tree="2x2", drafter="head"))
    with pytest.raises(InputError, match="drafter head reads no KV selection"):
        GenerationOptions.check(GenerationOptions(draft_tree="2x2", drafter="head", method="vegas"))
    with pytest.raises(InputError, match="draft_head .*: trained for a target with"):
        tiny_engine(vocab=64).use_draft_head(folder)
    with pytest.raises(InputError, match="draft_head .*: holds no draft head checkpoint"):
        engine.use_draft_head(tmp_path)
    fresh = draft_head.init_params(engine.config, jnp.float32, 0)
    for vocabulary, needle in [(97, r"draft_vocab must be in \[0, 96\] \(0: the whole vocabulary\), got 97"),
                               (-1, r"draft_vocab must be in \[0, 96\]"),
                               ([3, 3], r"draft_vocab: token ids must be distinct integers in \[0, 96\)"),
                               ([], r"draft_vocab: token ids must be distinct"),
                               ([5, 96], r"draft_vocab: token ids must be distinct"),
                               (8, "draft_vocab 8: a head given as params has no token counts")]:
        with pytest.raises(InputError, match=needle):
            tiny_engine().use_draft_head(fresh, vocabulary=vocabulary)
    with pytest.raises(InputError, match="draft_vocab: a draft vocabulary is the draft head's; give draft_head too"):
        Engine(engine.model, draft_vocab=8)
    counted = tmp_path / "uncounted"
    draft_head_checkpoint.export(folder, counted)
    (counted / draft_head_checkpoint.TOKEN_COUNTS).write_bytes(b"garbage\n")
    with pytest.raises(InputError, match=r"^draft_vocab: cannot read .*uncounted/token_counts.npz: \w+Error: .*$"):
        tiny_engine().use_draft_head(counted, vocabulary=8)
    (counted / draft_head_checkpoint.TOKEN_COUNTS).unlink()
    with pytest.raises(InputError, match="draft_vocab 8: .*uncounted \\(no token_counts.npz\\) has no token counts"):
        tiny_engine().use_draft_head(counted, vocabulary=8)
    narrow = tiny_engine()
    narrow.use_draft_head(folder, vocabulary=2)
    with pytest.raises(InputError, match="draft_vocab: 2 tokens, fewer than the 3 children a node of the draft tree"):
        narrow.plan([[1, 2, 3]], GenerationOptions(draft_tree="2x3", drafter="head"))


def test_an_exported_head_drafts_as_its_training_folder_and_does_not_resume(dense, tmp_path):
    """export: the newest params rounded to bfloat16 with the record (the window kept), no optimizer state
    (smaller), loaded by use_draft_head as the training folder is; training into it and exporting over it are
    refused, naming the flag."""
    from vegas_jax.loading import draft_head_checkpoint

    engine, folder, data = dense
    exported = draft_head_checkpoint.export(folder, tmp_path / "ship")
    other = tiny_engine()
    other.use_draft_head(exported)
    assert other.draft_head_window == engine.draft_head_window
    want = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), engine.draft_head)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), other.draft_head, want)
    size = lambda path: sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())  # noqa: E731
    newest = Path(folder) / str(draft_head_checkpoint.manager(folder).latest_step())
    assert size(exported) < size(newest) / 3
    np.testing.assert_array_equal(draft_head_checkpoint.token_counts(exported),
                                  draft_head_checkpoint.token_counts(folder))
    with pytest.raises(InputError, match="holds an exported head"):
        train_draft_head.train(engine, data, exported, SETTINGS, progress=False)
    with pytest.raises(InputError, match="already holds a head checkpoint"):
        draft_head_checkpoint.export(folder, exported)


@pytest.mark.parametrize("damage", ["params data", "record", "params item"])
def test_a_corrupt_head_checkpoint_is_one_line_and_leaves_no_read_behind(dense, tmp_path, damage):
    """A head folder damaged after training (a data file overwritten, the record cut, an item gone) is refused
    naming draft_head (out, when training would resume from it) and the step, with Orbax's other reads finished."""
    import shutil

    from tests.test_faults import _pending_orbax_tasks

    _, folder, data = dense
    copy = tmp_path / "head"
    shutil.copytree(folder, copy)
    step = copy / str(max(int(d.name) for d in copy.iterdir() if d.name.isdigit()))
    if damage == "params data":
        for f in (step / "params" / "ocdbt.process_0" / "d").iterdir():
            f.write_bytes(b"garbage\n")
    elif damage == "record":
        (step / "record" / "metadata").write_text("{not json")
    else:
        shutil.rmtree(step / "params")
    with pytest.raises(InputError) as caught:
        tiny_engine().use_draft_head(str(copy))
    message = str(caught.value)
    del caught
    assert message.startswith(f"draft_head {copy}: cannot read the head checkpoint's step {step.name}: ")
    assert "\n" not in message and not _pending_orbax_tasks()
    engine = tiny_engine()
    with pytest.raises(InputError, match=f"^out {copy}: cannot read the head checkpoint's step {step.name}: "):
        train_draft_head.train(engine, data, copy, SETTINGS, progress=False)


def test_the_command_line_refuses_bad_flags_in_one_line(tmp_path, capsys):
    for argv, needle in [(["--steps", "0"], "error: --steps must be >= 1, got 0"),
                         (["--prompts", "4", "--batch", "5"], "error: --batch must be in [1, --prompts], got 5"),
                         (["--prompts", "70"], "error: --validation must be in [0, --prompts - --batch] "
                                                "(sequences left to train on), got 64"),
                         (["--time-limit", "-1"], "error: --time-limit must be >= 0"),
                         (["--context-tokens", "-1"], "error: --context-tokens must be >= 0, got -1"),
                         (["--steps", "x"], "error: argument --steps: invalid int value: 'x'"),
                         (["--export", __file__], f"error: --export {__file__}: must be a new or empty folder")]:
        assert train_draft_head.main(["--out", str(tmp_path / "x"), *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [needle] or (len(lines) == 1 and lines[0].startswith(needle)), lines


def test_a_training_step_past_the_device_is_refused_before_the_data_is_made(tmp_path, capsys, monkeypatch):
    """The memory plan against the device (its limit replaced by 1 GiB, as a small GPU's): --dry-run says whether a
    step fits; a run whose step does not is one error line naming the flags that shrink it, with nothing written."""
    monkeypatch.setattr(train_draft_head, "device_bytes", lambda placement: (2**30, "a 1 GiB device"))
    out = tmp_path / "head"
    small = ["--prompts", "65", "--batch", "1", "--new-tokens", "8", "--context-tokens", "0"]
    for argv, verdict in [([], "does not fit"), (small, "fits")]:
        assert train_draft_head.main(["--out", str(out), "--dry-run", *argv]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[-1].split() == ["1.00", "GiB", "on", "this", "device", "(a", "1", "GiB", "device):",
                                       *verdict.split()], printed
        step_gib = next(line.split()[0] for line in printed if line.endswith("per training step on the device, "
                                                                              "all together"))
        assert (float(step_gib) <= 1.0) == (verdict == "fits")
    assert train_draft_head.main(["--out", str(out), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --batch / --new-tokens / --context-tokens: a training step "
                                                   "needs "), lines
    assert "but it has 1.00 GiB (a 1 GiB device)" in lines[0] and not out.exists()
