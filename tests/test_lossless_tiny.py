"""Losslessness on a tiny random Qwen3: plain greedy decoding through the engine equals greedy decoding by full
recomputation (`dense_greedy`, none of the engine's decode path), and greedy speculative output equals plain greedy
decoding token for token (every selection policy, both score modes). Sampled output is tested in
test_sampling_distribution.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.decoder import forward, init_params, per_layer
from models.kv_cache import KVCache
from models.quantized import QuantizedWeight
from vegas_jax.decode import adaptive_gamma
from vegas_jax.attention.dense import DenseAttention
from pallas_kernels.weight_only_matmul import weight_only_matmul
from vegas_jax.decode import draft_kernel
from vegas_jax.decode.draft_kernel import with_kernel
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.runtime.metrics import request_metrics
from vegas_jax.decode.selection import POLICIES
from vegas_jax.sharding import Placement


class IdsTokenizer:
    """Token ids as text: these tests look at ids, never at text."""

    def __init__(self, eos_ids=()):
        self.eos_ids = tuple(eos_ids)
        self.chat_template = None

    def decode(self, ids):
        return " ".join(map(str, ids))


def tiny_engine(vocab=96, layers=2, seed=0, weight_scale=6.0, eos_ids=(), context=512, tied=True) -> Engine:
    config = ModelConfig(
        architecture="qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=layers,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=context, tie_word_embeddings=tied, qk_norm=True,
    )
    # Larger weights than an initialiser's make attention peaky, so a sparse draft really differs from the target.
    params = scale_weight_matrices(init_params(config, jnp.float32, seed), weight_scale)
    return Engine(LoadedModel(config, params, IdsTokenizer(eos_ids), "random", "random"))


def scale_weight_matrices(params, scale: float):
    """params with every weight matrix (not the norm scales) times `scale`; a layer parameter's leading axis is
    the stacked layers'."""
    def scaled(path, x):
        matrix_ndim = x.ndim - (path[0].key == "layers")
        return x * scale if matrix_ndim > 1 else x

    return jax.tree_util.tree_map_with_path(scaled, params)


def prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


_dense_forward = jax.jit(forward, static_argnames="config")


def dense_greedy(engine: Engine, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> list[list[int]]:
    """Greedy decoding by full recomputation: every step runs each whole sequence through `forward` with dense
    attention over a fresh cache and takes the argmax of its last row. No cache carried between steps, no chunked
    prefill, no bootstrap step, no verification attention: none of the engine's decode path. A sequence ends
    after max_new_tokens tokens or after the first of `stop_ids`."""
    batch, length = len(prompts), max(map(len, prompts)) + max_new_tokens
    sequences, outputs = [list(p) for p in prompts], [[] for _ in prompts]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    for _ in range(max_new_tokens):
        tokens = np.zeros((batch, length), np.int32)  # padding after a sequence is invisible to its last row
        for i, seq in enumerate(sequences):
            tokens[i, : len(seq)] = seq
        cache = KVCache.create(engine.config, batch, length, engine.model.params["embed"].dtype)
        last = jnp.asarray([[len(seq) - 1] for seq in sequences], jnp.int32)
        logits, _, _ = _dense_forward(engine.model.params, jnp.asarray(tokens), positions, cache, DenseAttention(),
                                      config=engine.config, logit_rows=last)
        for i, token in enumerate(np.argmax(np.asarray(logits[:, 0]), axis=-1).tolist()):
            if len(outputs[i]) < max_new_tokens and not (outputs[i] and outputs[i][-1] in stop_ids):
                sequences[i].append(token)
                outputs[i].append(token)
    return outputs


GREEDY = GenerationOptions(
    max_new_tokens=128, gamma=5, sparse_ratio=0.1, min_sparse_tokens=6, prefill_chunk=32, max_model_len=256
)


@pytest.fixture(scope="module")
def greedy_setup():
    engine = tiny_engine()
    batch = prompts([45, 12, 80], engine.config.vocab_size)
    plain = engine.generate(batch, GREEDY)
    # A stop token that plain decoding emits mid-way in request 1 only (first occurrence after token 40).
    out1 = plain.requests[1].tokens
    others = set(plain.requests[0].tokens[:100]) | set(plain.requests[2].tokens[:100])
    stop = next(t for t in out1[40:] if t not in others and t not in out1[:40])
    engine.tokenizer.eos_ids = (stop,)
    plain = engine.generate(batch, GREEDY)
    assert len(plain.requests[1].tokens) < 128 and plain.requests[1].tokens[-1] == stop
    return engine, batch, plain


def test_plain_decoding_equals_dense_recomputation(greedy_setup):
    """The engine's plain decoding (chunked prefill, the bootstrap step, verification attention over the cache,
    one token per iteration, the stop) against full recomputation: every speculative test below compares with it."""
    engine, batch, plain = greedy_setup
    expected = dense_greedy(engine, batch, GREEDY.max_new_tokens, engine.tokenizer.eos_ids)
    assert [r.tokens for r in plain.requests] == expected


@pytest.mark.parametrize(
    "method,score_mode", [(m, "logit") for m in POLICIES] + [(m, "weight") for m in ("vegas", "vegas-all", "last")]
)
def test_greedy_speculative_equals_plain(greedy_setup, method, score_mode):
    engine, batch, plain = greedy_setup
    result = engine.generate(batch, dataclasses.replace(GREEDY, method=method, score_mode=score_mode))
    for spec, ref in zip(result.requests, plain.requests):
        assert spec.tokens == ref.tokens
    # Drafts that the target rejects, or the identity would not depend on the verification (a stop inside an
    # accepted run is tested in test_generation_edges.py).
    assert 0 < result.metrics["acceptance_rate"] < 1


@pytest.mark.parametrize("method,draft_weights,draft_activations", [
    ("vegas", "bf16", "bf16"), ("streaming", "int4", "bf16"), ("quest", "bf16", "bf16"),
    ("vegas", "int8", "int8"),  # int8 activations at three rows: the rounded rows through the float kernel
])
def test_kernel_path_equals_plain(greedy_setup, method, draft_weights, draft_activations, monkeypatch):
    """The Pallas kernels (interpret mode on CPU) in the loop: sparse draft attention, verification with score
    collection and radix top-k selection, and (quantized drafts) the weight-only matmul of the draft pass, with
    x rounded to int8 where asked, still token-for-token plain greedy decoding, with and without kernels."""
    engine, batch, plain = greedy_setup
    options = dataclasses.replace(GREEDY, method=method, draft_weights=draft_weights,
                                  draft_activations=draft_activations)
    reference = engine.generate(batch, options)
    assert [r.tokens for r in reference.requests] == [r.tokens for r in plain.requests]
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    if draft_weights != "bf16":  # every quantized weight of this model went through the kernel
        attached = with_kernel(engine.model.drafts[draft_weights], Placement(backend="interpret"),
                               draft_activations)
        weights = jax.tree.leaves(per_layer(attached), is_leaf=lambda x: isinstance(x, QuantizedWeight))
        assert len(weights) == 9 and all(w.kernel is not None for w in weights)  # 2 layers x 4, and the LM head
    # Same selections and drafts up to float rounding: a kernel attending the wrong keys (say, missing the new
    # token) would still be lossless, but would draft worse than the jnp path.
    assert result.metrics["tau"] == pytest.approx(reference.metrics["tau"], rel=0.02)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("draft_weights", ["int8", "int4"])
def test_int8_activations_take_the_integer_kernels_and_equal_plain(draft_weights, rows, monkeypatch):
    """Each draft product is `rows` rows (the batch), and the kernel path is the faster one measured on the H200
    (spied on at trace time): one row, every product in integers on codes held in words; three rows, int4 codes in
    groups of 64 in integers (the int8 tensor-core dot), int4 groups of 32 and int8 codes (the LM head's in both
    trees) in floats on the rounded rows, codes in bytes. Greedy output equals plain decoding's, token for token,
    and drafts are as good as with the activations unrounded (a product of the wrong rows would draft worse)."""
    engine = tiny_engine()
    batch = prompts([45, 30, 52][:rows], engine.config.vocab_size)
    plain = engine.generate(batch, GREEDY)
    calls = []

    def spy(x, q, *args, **kwargs):
        calls.append((x.shape[0], kwargs["bits"], kwargs["integer_dot"], q.dtype == jnp.int32))
        return weight_only_matmul(x, q, *args, **kwargs)

    monkeypatch.setattr(draft_kernel, "weight_only_matmul", spy)
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    options = dataclasses.replace(GREEDY, method="vegas", draft_weights=draft_weights, draft_activations="int8")
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    bits = int(draft_weights[3:])
    if rows == 1:
        assert set(calls) == {(1, bits, True, True), (1, 8, True, True)}
    else:
        # int4: groups of 64 in integers, groups of 32 (blocks below the int8 dot's K) in floats.
        integer = {True, False} if bits == 4 else {False}
        assert set(calls) == {(3, bits, i, False) for i in integer} | {(3, 8, False, False)}
    unrounded = engine.generate(batch, dataclasses.replace(options, draft_activations="bf16"))
    assert result.metrics["tau"] >= 0.9 * unrounded.metrics["tau"]


def test_kernel_prefill_fills_the_cache_as_the_jnp_path(monkeypatch):
    """Prefill through the verification kernel (interpret mode): chunks of 96 tokens are 192 query rows per KV
    head, two row blocks, in a cache of 256 rows (250 tokens + γ + 1) that the last chunk (positions 192-287) runs
    past. Same cache as the jnp path after prefill and the bootstrap step, and plain greedy decoding's tokens. (The
    rows past the cache write nothing and no logit of theirs is kept, so what they read is checked by the kernel's
    own tests.)"""
    engine = tiny_engine()
    batch = prompts([244, 20, 99], engine.config.vocab_size)
    options = dataclasses.replace(GREEDY, method="vegas", prefill_chunk=96, max_new_tokens=6, max_model_len=250)
    plain = engine.generate(batch, dataclasses.replace(options, method="ar"))
    reference = engine.start(batch, options).state
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    started = engine.start(batch, options)
    kernel = started.state
    assert kernel.cache.k[0].shape[1] == 256 and started.timings["prefill_chunk"] == 96
    for got, want in zip(jax.tree.leaves(kernel.cache), jax.tree.leaves(reference.cache)):
        got, want = np.asarray(got), np.asarray(want)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]


def test_full_budget_accepts_every_draft():
    engine = tiny_engine()
    opts = dataclasses.replace(GREEDY, method="vegas", sparse_ratio=1.0, max_new_tokens=64, gamma=4)
    result = engine.generate(prompts([30, 9, 50], engine.config.vocab_size), opts)
    # Sparse attention over everything is full attention: every draft matches, until the owed-token clamp.
    m = result.metrics
    assert m["acceptance_rate"] == 1.0
    # 1 bootstrap token, then 63 tokens in iterations of 5 (the last one clamped to 3): 13 iterations per request.
    assert m["iterations"] == 3 * 13
    assert all(len(r.tokens) == 64 for r in result.requests)


def test_tiny_budget_lowers_tau():
    engine = tiny_engine()
    batch = prompts([120, 100], engine.config.vocab_size)
    full = engine.generate(batch, dataclasses.replace(GREEDY, method="vegas", sparse_ratio=1.0, max_new_tokens=48))
    tiny = engine.generate(batch, dataclasses.replace(GREEDY, method="vegas", sparse_ratio=0.01, min_sparse_tokens=1,
                                                      max_new_tokens=48))
    assert tiny.metrics["tau"] < full.metrics["tau"]
    assert [r.tokens for r in tiny.requests] == [r.tokens for r in full.requests]


@pytest.mark.parametrize(
    "opts",
    [
        dataclasses.replace(GREEDY, method="vegas", gamma=0, max_new_tokens=20),  # γ = 0 is plain decoding
        dataclasses.replace(GREEDY, method="vegas", gamma=12, max_new_tokens=5),  # γ beyond the tokens owed
        dataclasses.replace(GREEDY, method="quest", gamma=3, max_new_tokens=1),  # only the prefill token
        dataclasses.replace(GREEDY, method="vegas", min_sparse_tokens=256, max_new_tokens=30),  # budget > prompt
    ],
    ids=["gamma0", "gamma-over-owed", "one-token", "prompt-below-budget"],
)
def test_edge_cases_equal_dense_recomputation(opts):
    """Against full recomputation, not the engine's plain decoding: with γ = 0 that is the very loop under test."""
    engine = tiny_engine()
    batch = prompts([7, 33, 2], engine.config.vocab_size)
    spec = engine.generate(batch, opts)
    assert [r.tokens for r in spec.requests] == dense_greedy(engine, batch, opts.max_new_tokens)


def test_nonfinite_logits_fail_the_request_without_a_token():
    """A NaN in the weights makes every logit NaN: every request must fail, never emit a token. (One failing
    request among healthy ones: tests/test_faults.py.)"""
    engine = tiny_engine()
    params = dict(engine.model.params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"].at[3].set(jnp.nan)}
    broken = Engine(dataclasses.replace(engine.model, params=params))
    result = broken.generate(prompts([10, 4], engine.config.vocab_size), dataclasses.replace(GREEDY, method="vegas"))
    assert [(r.status, r.tokens) for r in result.requests] == [("failed", [])] * 2
    assert all(r.reason.startswith("non-finite logits after 0 generated tokens") for r in result.requests)
    assert result.metrics["failed_requests"] == [0, 1]


def test_load_gives_an_engine_for_a_checkpoint():
    import vegas_jax
    from vegas_jax.loading import load_model

    from pathlib import Path

    fixture = str(Path(__file__).parent / "fixtures" / "tiny-llama")
    options = vegas_jax.GenerationOptions(method="vegas", max_new_tokens=12, min_sparse_tokens=4, max_model_len=64)
    via_load = vegas_jax.load(fixture, dtype="float32").generate(["hello"], options)
    direct = Engine(load_model(fixture, jnp.float32)).generate(["hello"], options)
    assert via_load.requests[0].tokens == direct.requests[0].tokens
    with pytest.raises(vegas_jax.InputError, match="dtype"):
        vegas_jax.load(fixture, dtype="int8")


def test_prefill_chunk_bounds_score_memory():
    """Bigger batches and longer caches prefill in smaller chunks, so the score arrays stay bounded."""
    from vegas_jax.runtime.prefill_chunks import PREFILL_SCORE_BYTES, prefill_chunk_for_memory

    for batch, heads, capacity in [(1, 9, 8448), (64, 9, 8448), (8, 32, 131200), (256, 64, 131200)]:
        chunk = prefill_chunk_for_memory(batch, heads, capacity)
        assert chunk % 16 == 0 and chunk >= 16
        assert chunk == 16 or 3 * 4 * batch * heads * chunk * capacity <= PREFILL_SCORE_BYTES
    assert prefill_chunk_for_memory(64, 9, 8448) < prefill_chunk_for_memory(1, 9, 8448)


def test_prefill_spans_cover_the_prompt_in_at_most_two_sizes():
    from vegas_jax.runtime.prefill_chunks import PREFILL_TAIL_CHUNK, prefill_spans

    assert prefill_spans(0, 2048) == []
    assert prefill_spans(4096, 2048) == [(0, 2048), (2048, 2048)]
    assert prefill_spans(2099, 2048) == [(0, 2048), (2048, PREFILL_TAIL_CHUNK)]  # 51 tokens: one small chunk
    assert prefill_spans(7935, 2048)[-1] == (6144, 2048)  # 1791 tokens: one more big chunk, not four small
    assert prefill_spans(44, 32) == [(0, 32), (32, 32)]  # chunks below twice the tail size stay one size
    for num_tokens in range(0, 5000, 37):
        for chunk in (16, 96, 1024, 1168, 2048):
            spans = prefill_spans(num_tokens, chunk)
            ends = [start + size for start, size in spans]
            assert [start for start, _ in spans] == ([0] + ends[:-1] if spans else [])  # contiguous from 0
            assert not spans or ends[-1] - chunk < num_tokens <= ends[-1]  # covers, less than a chunk of padding
            assert {size for _, size in spans} <= {chunk, PREFILL_TAIL_CHUNK}


def test_two_chunk_sizes_prefill_as_one(monkeypatch):
    """1,100-token prompts in a 1,024-token chunk and a 512-token tail leave the cache and the tokens that chunks of
    64 do."""
    engine = tiny_engine(context=2048)
    batch = prompts([1100, 700, 1050], engine.config.vocab_size)
    small = dataclasses.replace(GREEDY, method="vegas", prefill_chunk=64, max_new_tokens=8, max_model_len=1200)
    large = dataclasses.replace(small, prefill_chunk=1024)
    by_small = engine.start(batch, small).state
    started = engine.start(batch, large)
    assert started.timings["prefill_chunk"] == 1024
    for got, want in zip(jax.tree.leaves(started.state.cache), jax.tree.leaves(by_small.cache)):
        np.testing.assert_allclose(np.asarray(got)[:, :, :1099], np.asarray(want)[:, :, :1099], rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(want)).max())
    assert [r.tokens for r in engine.generate(batch, large).requests] == [
        r.tokens for r in engine.generate(batch, small).requests
    ]


def test_prefill_chunk_bounds_activation_memory():
    """The kernel path needs no score arrays, but a chunk of every sequence at once still holds the MLP's gate and
    up activations: SmolLM2 keeps 2048-token chunks at batch 64, Llama-3.1-8B's MLP halves them there."""
    from vegas_jax.runtime.prefill_chunks import PREFILL_ACTIVATION_BYTES, prefill_chunk_for_activations

    for batch, intermediate in [(1, 1536), (64, 1536), (64, 14336), (512, 14336), (4096, 28672)]:
        chunk = prefill_chunk_for_activations(batch, intermediate)
        assert chunk % 16 == 0 and chunk >= 16
        assert chunk == 16 or 2 * 4 * batch * intermediate * chunk <= PREFILL_ACTIVATION_BYTES
    assert prefill_chunk_for_activations(64, 1536) >= 2048 > prefill_chunk_for_activations(64, 14336) >= 1024


# ---- quantized drafts and adaptive γ: the drafts change, the output may not ------------------------------------


@pytest.mark.parametrize("draft_weights,gamma", [("int8", 5), ("int4", "auto")])
def test_quantized_drafts_equal_plain(greedy_setup, draft_weights, gamma):
    """Drafts from int8 weights (per channel) with γ 5, and from int4 weights (groups) with adaptive γ whose costs
    are timed at the start (the warm-up forces 5, 3, 2 and 0 for γ_max 5's passes of 2 and 5 drafts, then the loop
    chooses): token for token plain greedy decoding, ragged prompts and a stop included."""
    engine, batch, plain = greedy_setup
    options = dataclasses.replace(GREEDY, method="vegas", draft_weights=draft_weights, gamma=gamma,
                                  gamma_max=5 if gamma == "auto" else None)
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    assert 0 < result.metrics["acceptance_rate"] < 1 and result.metrics["draft_weights"] == draft_weights
    assert per_layer(engine.model.drafts[draft_weights])["layers"][0]["qkv_proj"].bits == int(draft_weights[3:])
    if gamma == "auto":
        chosen = result.metrics["gamma_chosen_histogram"]
        warm = 1 + adaptive_gamma.Warmup.SHORT + adaptive_gamma.Warmup.LONG  # iterations forced per timed g
        assert len(chosen) == 6 and all(chosen[g] >= warm for g in (0, 2, 3, 5)), chosen
        assert sum(chosen) == max(r.metrics["iterations"] for r in result.requests)  # one g per loop iteration
        costs = result.metrics["gamma_costs"]
        assert len(costs) == 5 and min(costs) >= 1


# Given costs of an iteration of g = 1..5 drafts: a fixed part of 1.1 and 0.3 a draft; 1.0 and 0.1.
COSTS_03_11 = tuple(1.1 + 0.3 * g for g in range(1, 6))
COSTS_01_10 = tuple(1.0 + 0.1 * g for g in range(1, 6))


def test_auto_gamma_falls_back_to_plain_steps_when_drafts_do_not_pay(greedy_setup):
    """This model's int4 drafts are mostly rejected (acceptance about 0.15 at the first position): with a draft
    step costing 0.3 plain steps and a speculative iteration's fixed part 1.1 (given, so the test does not depend on
    the CPU's timing; the loop is the one compiled above): speculation loses, and adaptive γ runs plain steps
    (g = 0) almost throughout, probing drafts now and then, the output still plain decoding's."""
    engine, batch, plain = greedy_setup
    options = dataclasses.replace(GREEDY, method="vegas", draft_weights="int4", gamma="auto", gamma_max=5,
                                  gamma_costs=COSTS_03_11)
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    chosen = result.metrics["gamma_chosen_histogram"]
    assert chosen[0] >= 0.8 * sum(chosen) and sum(chosen[1:]) > 0, chosen
    assert result.metrics["gamma_costs"] == pytest.approx(COSTS_03_11)


@pytest.mark.parametrize("forced,kernels", [(2, False), (3, False), (3, True)])
def test_auto_gamma_scores_its_last_draft_as_fixed_gamma_does(greedy_setup, forced, kernels, monkeypatch):
    """Adaptive γ verifies g < γ_max drafts in the narrowest compiled pass that holds them (γ_max 5: passes of 2
    and 5 drafts), so g 3 goes through a pass with placeholder rows after its drafts. Vegas selects from rows 0
    and g (the last draft), never from a placeholder: forced to g = 2 or 3 in a loop of γ_max 5, every request's
    drafts are accepted exactly as with a fixed γ of g (the same selections make the same drafts); also with the
    kernels (interpret mode), whose verification takes the scored row per sequence."""
    engine, batch, plain = greedy_setup
    if kernels:
        monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    fixed = engine.generate(batch, dataclasses.replace(GREEDY, method="vegas", gamma=forced))
    options = dataclasses.replace(GREEDY, method="vegas", gamma="auto", gamma_max=5,
                                  gamma_costs=COSTS_01_10)
    started = engine.start(batch, options)
    state = adaptive_gamma.with_control(started.state, started.config.placement, forced, COSTS_01_10)
    state = started.decode(engine.model.params, started.draft_params, state, jnp.int32(2**31 - 1),
                           jnp.int32(len(batch)))
    chosen = np.asarray(state.gamma_control.chosen).tolist()
    # g forced throughout, but at the very end: never more drafts than any request may still take.
    assert chosen[forced] >= int(state.step) - 1 and not any(chosen[forced + 1:]), chosen
    for i, request in enumerate(fixed.requests):
        generated = int(state.num_generated[i])
        assert np.asarray(state.output)[i, :generated].tolist() == request.tokens == plain.requests[i].tokens
        drafted, accepted = (np.asarray(c)[i, :forced] for c in (state.metrics.drafted, state.metrics.accepted))
        mine = request_metrics(generated, int(state.metrics.iterations[i]), drafted, accepted)
        assert mine == request.metrics
