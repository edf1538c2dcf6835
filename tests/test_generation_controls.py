"""The generation controls against independent references: the penalties and min-p against numpy transcriptions
of their definitions (transformers' RepetitionPenaltyLogitsProcessor, vLLM's presence / frequency penalties, HF's
min-p), with a verification slab's drafts in the history; stop strings against plain Python on the decoded text
(split across tokens, inside an accepted run of drafts); greedy decoding with penalties against full recomputation
in float64 numpy; greedy Vegas with penalties and stop strings against plain decoding token for token on a ragged
batch; logprobs against a plain forward pass; `Engine.score` against transformers' logits of the tiny HF fixtures;
conversations as prompts. The model: a tiny random Qwen3 with the tiny Llama fixture's byte-level tokenizer (288
tokens, few merges, so decoded text has characters split over tokens)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from models.kv_cache import KVCache
from tests.test_lossless_tiny import GREEDY, IdsTokenizer, _dense_forward, prompts, tiny_engine
from vegas_jax.decode import penalties
from vegas_jax.decode import sampling
from vegas_jax.runtime import scoring
from vegas_jax.decode import stops
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.runtime.engine import Engine, InputError
from vegas_jax.loading import load_model
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.decode.logprobs import Logprobs, host_list
from vegas_jax.loading.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB, NEW = 288, 48
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
PLAIN = dataclasses.replace(GREEDY, method="ar", max_new_tokens=NEW, **PENALTIES)
SPARSE = dataclasses.replace(PLAIN, method="vegas")
# sparse_ratio 1: drafts attend to everything and the target accepts all of them, so iteration i emits output
# positions 5i - 4 .. 5i (four drafts, then the bonus token; position 0 is the bootstrap step's).
# With one logprob a token, which `serve` must return as `generate` does.
ACCEPT_ALL = dataclasses.replace(PLAIN, method="vegas", sparse_ratio=1.0, gamma=4, logprobs=1)


# ---- the definitions, in numpy ------------------------------------------------------------------------------------


def hf_repetition(scores: np.ndarray, input_ids: list[int], penalty: float) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor.__call__ for one row: gather the scores of input_ids (prompt
    and output so far, repeats included), score < 0 ? score * penalty : score / penalty, scatter them back."""
    scores = scores.copy()
    ids = np.asarray(input_ids, np.int64)
    score = scores[ids]
    scores[ids] = np.where(score < 0, score * penalty, score / penalty)
    return scores


def vllm_presence_frequency(scores: np.ndarray, output_ids: list[int], presence: float, frequency: float):
    """vLLM's apply_penalties after the repetition step: counts of the output tokens only."""
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=scores.shape[-1])
    return scores - frequency * counts - presence * (counts > 0)


def penalised(scores, prompt, output, repetition, presence, frequency) -> np.ndarray:
    return vllm_presence_frequency(hf_repetition(scores, prompt + output, repetition), output, presence, frequency)


def test_penalties_give_each_row_its_own_prefix(rng):
    """penalties.apply on verification-shaped logits [B, γ+1, V] with drafts that repeat each other and earlier
    output: row r equals the definition applied with the prompt, the output so far and drafts 0..r-1; and a draft
    step (one row after j drafts) equals the same row."""
    batch, gamma, vocab = 3, 4, 12
    logits = rng.normal(0, 3, (batch, gamma + 1, vocab)).astype(np.float32)
    prompts_ = [rng.integers(0, vocab, 5).tolist() for _ in range(batch)]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (0, 3, 7)]
    drafts = np.array([[1, 1, 2, 1], [outputs[1][0], 4, outputs[1][0], 4], [9, 9, 9, 9]], np.int32)
    values = dict(repetition_penalty=[1.3, 0.7, 1.0], presence_penalty=[-0.5, 1.2, 0.0],
                  frequency_penalty=[0.8, -1.0, 0.3])
    params = sampling.SamplingParams.create(batch, 1.0, **{k: jnp.asarray(v) for k, v in values.items()})
    history = penalties.History.of_prompts(jnp.asarray(penalties.prompt_mask(prompts_, vocab)))
    history = history.add(jnp.asarray([o + [0] * (7 - len(o)) for o in outputs], jnp.int32),
                          jnp.asarray([[j < len(o) for j in range(7)] for o in outputs]))
    apply = jax.jit(penalties.apply)
    got = np.asarray(apply(jnp.asarray(logits), history, params, jnp.asarray(drafts), jnp.arange(gamma + 1)))
    for b in range(batch):
        for r in range(gamma + 1):
            want = penalised(logits[b, r].astype(np.float64), prompts_[b], outputs[b] + drafts[b, :r].tolist(),
                             values["repetition_penalty"][b], values["presence_penalty"][b],
                             values["frequency_penalty"][b])
            np.testing.assert_allclose(got[b, r], want, rtol=1e-6, atol=1e-6)
            step = apply(jnp.asarray(logits[:, r : r + 1]), history, params, jnp.asarray(drafts), jnp.asarray([r]))
            np.testing.assert_array_equal(np.asarray(step)[b, 0], got[b, r])


def test_repetition_penalty_counts_occurrence_not_repeats():
    """transformers' rule penalises a token once however often it occurs (a gather and a scatter, not a power)."""
    scores = np.array([2.0, -2.0, 1.0, 0.5])
    once, thrice = hf_repetition(scores, [0, 1], 2.0), hf_repetition(scores, [0, 0, 0, 1, 1], 2.0)
    np.testing.assert_array_equal(once, [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_array_equal(thrice, once)
    params = sampling.SamplingParams.create(1, 1.0, repetition_penalty=2.0)
    history = penalties.History.of_prompts(jnp.asarray(penalties.prompt_mask([[0, 0, 0, 1, 1]], 4)))
    got = penalties.apply(jnp.asarray(scores, jnp.float32)[None, None], history, params, jnp.zeros((1, 0), jnp.int32),
                          jnp.zeros((1,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(got)[0, 0], once)


def hf_filters(logits, temperature, top_k, top_p, min_p) -> tuple[np.ndarray, np.ndarray]:
    """transformers' warpers in its order (temperature, top-k, top-p, min-p) in float64, rows [..., V]; also each
    row's smallest distance from a threshold (top-k's in logits, top-p's in mass, min-p's in log-probability)."""
    z = logits.astype(np.float64) / temperature
    ordered = -np.sort(-z, axis=-1)
    kth = ordered[..., top_k - 1 : top_k]
    margin = np.full(z.shape[:-1], np.inf) if top_k == z.shape[-1] else kth[..., 0] - ordered[..., top_k]
    z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep = np.zeros(p.shape, bool)
    mass_before = np.cumsum(sorted_p, -1) - sorted_p
    np.put_along_axis(keep, order, mass_before < top_p, -1)
    if top_p < 1:
        margin = np.minimum(margin, np.min(np.where(sorted_p > 0, np.abs(mass_before - top_p), np.inf), axis=-1))
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
    # MinPLogitsWarper: probabilities after the warpers before it, threshold min_p times the largest.
    with np.errstate(divide="ignore", invalid="ignore"):
        distance = np.abs(np.log(p) - np.log(min_p * p.max(-1, keepdims=True)))
    p = np.where(p < min_p * p.max(-1, keepdims=True), 0.0, p)
    margin = np.minimum(margin, np.min(np.where(np.isfinite(distance), distance, np.inf), axis=-1))
    return p / p.sum(-1, keepdims=True), margin


@pytest.mark.parametrize("top_k,top_p", [(40, 1.0), (6, 0.9)])
def test_min_p_matches_transformers(rng, top_k, top_p):
    logits = rng.normal(0, 2.5, (64, 40)).astype(np.float32)
    min_p, temperature = 0.12, 0.8
    want, margin = hf_filters(logits, temperature, top_k, top_p, min_p)
    clear = margin > 1e-4  # rows where no float32 rounding can move a token across the threshold
    assert clear.sum() > 48
    params = sampling.SamplingParams.create(64, temperature, top_k, top_p, min_p)
    got = sampling.probabilities(jnp.asarray(logits), params, params.mode())
    np.testing.assert_allclose(np.asarray(got)[clear], want[clear], atol=1e-6)
    assert ((want > 0).sum(-1) < (hf_filters(logits, temperature, top_k, top_p, 0.0)[0] > 0).sum(-1))[clear].any()


# ---- stop strings, on the tokenizer alone --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer.from_hf_folder(FIXTURES / "tiny-llama")
    tok.eos_ids = ()  # the tests choose their stops
    return tok


def stop_reference(tokenizer, tokens: list[int], strings) -> int | None:
    """Plain Python on the decoded text: the first token after which the text contains a stop string."""
    return next((k for k in range(len(tokens)) if any(s in tokenizer.decode(tokens[: k + 1]) for s in strings)), None)


def text_reference(text: str, strings, include: bool) -> str:
    """Read the text one character at a time and stop as soon as it ends with a stop string (the longest, if
    several end there): the text before it, or through it."""
    for end in range(1, len(text) + 1):
        ending = [s for s in strings if text[:end].endswith(s)]
        if ending:
            return text[: end if include else end - max(map(len, ending))]
    return text


def walk(table: np.ndarray, tokens: list[int]) -> int | None:
    state = 0
    for k, token in enumerate(tokens):
        state, ended = divmod(int(table[state, token]), 2)
        if ended:
            return k
    return None


def test_the_stop_table_finds_what_the_decoded_text_contains(tokenizer):
    """The automaton's first stop over random token sequences (multi-byte characters split over tokens, invalid
    bytes, special tokens that decode to nothing) is the first token after which the decoded text contains a stop
    string; stop ids end at themselves; and the text is cut where a character-by-character reading stops."""
    rng = random.Random(7)
    # Half the tokens from a few pieces that spell the stop strings in several ways ("the" is t|he, t|h|e or part
    # of " the"; é is two byte tokens), the rest anything (special tokens and stray bytes included).
    pool = [tokenizer.backend.token_to_id(p) for p in ("t", "h", "e", "Ġ", "he", "Ġthe", "er", "Ã", "©", "r")]
    samples = [[rng.choice(pool) if rng.random() < 0.5 else rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
               for _ in range(300)]
    texts = [tokenizer.decode(s) for s in samples]
    strings = ("é", "the", "er t", "r\u00e9", "hh")
    table = stops.table(VOCAB, [7], strings, stops.token_bytes(tokenizer))
    assert table.shape[0] % stops.STATE_BUCKET == 0
    found = across = 0
    for tokens, text in zip(samples, texts):
        by_text = stop_reference(tokenizer, tokens, strings)
        by_id = next((k for k, t in enumerate(tokens) if t == 7), None)
        expected = min((k for k in (by_text, by_id) if k is not None), default=None)
        assert walk(table, tokens) == expected, (tokens, strings)
        if by_text is not None:
            found += 1
            across += not any(s in tokenizer.decode(tokens[by_text : by_text + 1]) for s in strings)
        for include in (False, True):
            assert stops.cut_text(text, strings, include) == text_reference(text, strings, include)
    assert found > 50 and across > 10  # many stops, many on strings that span tokens


def test_stop_strings_need_a_byte_level_tokenizer(tokenizer):
    with pytest.raises(InputError, match="^stop: stop strings need a byte-level BPE tokenizer"):
        stops.token_bytes(IdsTokenizer())  # token ids as text
    other = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer.backend.to_str()), bos_id=None, eos_ids=(), add_bos=False,
                      chat_template=None)
    other.backend.decoder = tokenizers.decoders.Metaspace()
    with pytest.raises(InputError, match="^stop: stop strings need a byte-level BPE tokenizer.*'Metaspace'"):
        stops.token_bytes(other)


# ---- decoding with penalties, stops and logprobs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tokenizer):
    """The tiny random model with the byte-level tokenizer, a ragged batch, and plain greedy decoding with penalties
    (run once: every test compares with it)."""
    random_model = tiny_engine(vocab=VOCAB, seed=3)
    engine = Engine(LoadedModel(random_model.config, random_model.model.params, tokenizer, "random", "random"))
    batch = prompts([45, 12, 80], VOCAB, seed=4)
    plain = engine.generate(batch, PLAIN)
    return engine, batch, [r.tokens for r in plain.requests]


def dense_penalised_greedy(engine, batch, new_tokens, options) -> list[list[int]]:
    """Greedy decoding by full recomputation (dense attention over a fresh cache every step, no drafts, no
    verification attention), the last row's logits penalised in float64 by the definitions above."""
    length = max(map(len, batch)) + new_tokens
    outputs, changed = [[] for _ in batch], 0
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (len(batch), length))
    for _ in range(new_tokens):
        tokens = np.zeros((len(batch), length), np.int32)
        for i, (prompt, out) in enumerate(zip(batch, outputs)):
            tokens[i, : len(prompt) + len(out)] = prompt + out
        last = jnp.asarray([[len(p) + len(o) - 1] for p, o in zip(batch, outputs)], jnp.int32)
        cache = KVCache.create(engine.config, len(batch), length, jnp.float32)
        logits, _, _ = _dense_forward(engine.model.params, jnp.asarray(tokens), positions, cache, DenseAttention(),
                                      config=engine.config, logit_rows=last)
        for i, row in enumerate(np.asarray(logits[:, 0], np.float64)):
            scores = penalised(row, batch[i], outputs[i], options.repetition_penalty, options.presence_penalty,
                               options.frequency_penalty)
            top2 = np.sort(scores)[-2:]
            assert top2[1] - top2[0] > 1e-4, "a near-tie: float32 could take either token"
            outputs[i].append(int(np.argmax(scores)))
            changed += outputs[i][-1] != np.argmax(row)
    assert changed > new_tokens // 4, "the penalties should change many of the tokens"
    return outputs


def test_plain_greedy_with_penalties_equals_full_recomputation(setup):
    engine, batch, plain = setup
    assert plain == dense_penalised_greedy(engine, batch, NEW, PLAIN)


def test_greedy_vegas_with_penalties_equals_plain_and_logprobs_a_forward_pass(setup):
    """Sparse drafts the target often rejects, penalties counting the drafts before each row: token for token plain
    decoding's output. Each token's log-probability (and its top 3) from the verification slab equals log_softmax of
    a plain forward pass over the final sequence, float32 within 1e-5."""
    engine, batch, plain = setup
    *chunks, result = engine.stream(batch, dataclasses.replace(SPARSE, logprobs=3), steps_per_call=3)
    assert [r.tokens for r in result.requests] == plain
    for i, request in enumerate(result.requests):  # the stream's chunks carry the same logprobs
        assert [e for chunk in chunks for e in chunk[i].logprobs] == request.logprobs
    assert 0 < result.metrics["acceptance_rate"] < 1
    length = max(len(p) + NEW for p in batch)
    tokens = np.zeros((len(batch), length), np.int32)
    for i, (prompt, out) in enumerate(zip(batch, plain)):
        tokens[i, : len(prompt) + len(out)] = prompt + out
    cache = KVCache.create(engine.config, len(batch), length, jnp.float32)
    logits, _, _ = _dense_forward(engine.model.params, jnp.asarray(tokens),
                                  jnp.broadcast_to(jnp.arange(length), tokens.shape), cache, DenseAttention(),
                                  config=engine.config)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    for i, (prompt, request) in enumerate(zip(batch, result.requests)):
        rows = logp[i, len(prompt) - 1 : len(prompt) - 1 + len(request.tokens)]
        got = request.logprobs
        assert [e.token for e in got] == request.tokens
        np.testing.assert_allclose([e.logprob for e in got], rows[np.arange(len(rows)), request.tokens], atol=1e-5)
        order = np.argsort(-rows, axis=-1)[:, :3]
        assert [[t for t, _ in e.top] for e in got] == order.tolist()
        np.testing.assert_allclose([[v for _, v in e.top] for e in got], np.take_along_axis(rows, order, -1),
                                   atol=1e-5)


def clean_ends(tokenizer, tokens) -> list[int | None]:
    """Per token k, the length of the text of tokens[:k + 1] when that text is a beginning of the whole text (no
    character left incomplete at k), else None."""
    text = tokenizer.decode(tokens)
    prefixes = [tokenizer.decode(tokens[: k + 1]) for k in range(len(tokens))]
    return [len(p) if text.startswith(p) else None for p in prefixes]


def stop_candidates(tokenizer, plain):
    """Stop strings from plain decoding's text, each where it first occurs: (4 characters across a token boundary
    of request 0, the boundary's token), and (the last 3 characters of the text through an iteration's second
    draft, output position 5i - 3, of request 2, that position)."""
    text0, ends0 = tokenizer.decode(plain[0]), clean_ends(tokenizer, plain[0])
    text2, ends2 = tokenizer.decode(plain[2]), clean_ends(tokenizer, plain[2])
    across = [(text0[c - 2 : c + 2], k) for k, c in enumerate(ends0[:-2]) if k >= 8 and c and c + 2 <= len(text0)
              and ends0[k + 1] is not None and ends0[k + 1] < c + 2 and text0.find(text0[c - 2 : c + 2]) == c - 2]
    in_run = [(text2[c - 3 : c], p) for p, c in enumerate(ends2) if p % 5 == 2 and p > 5 and c and ends2[p - 1]
              and ends2[p - 1] < c and text2.find(text2[c - 3 : c]) == c - 3]
    return [(a, b) for a in across for b in in_run if "\ufffd" not in a[0] + b[0]]


@pytest.fixture(scope="module")
def stopped(setup):
    """The first pair of candidate stop strings that stop request 0 after its boundary token (the string's last
    characters come from a later token) and request 2 at its draft position, with both strings active; and every
    request's expected tokens by `stop_reference`."""
    engine, batch, plain = setup
    for (across, boundary), (in_run, position) in stop_candidates(engine.tokenizer, plain):
        strings = (across, in_run)
        ends = [stop_reference(engine.tokenizer, tokens, strings) for tokens in plain]
        if ends[0] is not None and ends[0] > boundary and ends[2] == position:
            return strings, [tokens if k is None else tokens[: k + 1] for tokens, k in zip(plain, ends)]
    pytest.fail("no stop strings of the kinds wanted in this output")


@pytest.mark.parametrize("options", [PLAIN, ACCEPT_ALL], ids=["plain", "vegas-all-accepted"])
def test_stop_strings_end_requests_where_the_text_has_them(setup, stopped, options):
    """Against plain Python on the decoded text: tokens up to the one that completes a stop string, text cut before
    it (or through it with include_stop). With every draft accepted, request 2's string ends at an iteration's
    second draft: the two drafts after it and the bonus token are dropped."""
    engine, batch, plain = setup
    strings, expected = stopped
    result = engine.generate(batch, dataclasses.replace(options, stop=strings))
    assert [r.tokens for r in result.requests] == expected
    for request, tokens in zip(result.requests, expected):
        assert request.text == text_reference(engine.tokenizer.decode(tokens), strings, include=False)
    if options.method == "vegas":
        assert result.metrics["acceptance_rate"] == 1.0
        assert result.requests[2].metrics["iterations"] == (len(expected[2]) - 2) // 5 + 1
        assert (len(expected[2]) - 1) % 5 == 2  # the stop was the iteration's second token
    kept = engine.generate(batch, dataclasses.replace(options, stop=strings, include_stop=True))
    for request, tokens in zip(kept.requests, expected):
        assert request.text == text_reference(engine.tokenizer.decode(tokens), strings, include=True)


def test_serve_frees_a_stopped_request_slot_at_once(setup, stopped):
    """Under continuous batching the request that a stop string ends leaves its slot in the iteration it stops: the
    first decode call (three slots, refill 1) returns right then, and every request gets `generate`'s tokens and
    logprobs."""
    engine, batch, _ = setup
    strings, expected = stopped
    longest = max((0, 1), key=lambda i: len(expected[i]))
    assert len(expected[longest]) > len(expected[2])
    order = [2, longest, longest, 2]  # request 2 stops on a string first, in the first call
    options = dataclasses.replace(ACCEPT_ALL, stop=strings)
    served = engine.serve([batch[i] for i in order], options, slots=3, refill=1)
    assert [r.tokens for r in served.requests] == [expected[i] for i in order]
    together = engine.generate(batch, options)
    for r, i in zip(served.requests, order):
        # Float32 rounding differs a little with the batch a request is prefilled in (1e-6 here).
        np.testing.assert_allclose([e.logprob for e in r.logprobs], [e.logprob for e in together.requests[i].logprobs],
                                   atol=1e-5)
    first_call = served.metrics["decode_calls"][0]
    assert first_call["iterations"] == served.requests[0].metrics["iterations"] < NEW // 5


def test_logprobs_without_alternatives():
    buffers = Logprobs.create(1, 4, 0)
    logits = jnp.asarray([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]])
    written = buffers.write(logits, jnp.asarray([[2, 0]]), jnp.asarray([[1, 4]]), 0)  # slot 4: past the buffer
    want = np.asarray(jax.nn.log_softmax(logits[0, 0]))[2]
    np.testing.assert_allclose(np.asarray(written.chosen), [[0.0, want, 0.0, 0.0]], rtol=1e-6)
    assert host_list(written.chosen[0], written.top_ids[0], written.top_values[0], [5], 0)[0].top == []


# ---- scoring -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return Engine(load_model(str(FIXTURES / "tiny-llama"), jnp.float32))


def test_score_matches_transformers_logits(llama):
    """Each continuation token's log-probability against log_softmax (float64) of transformers' own logits for the
    tiny Llama fixture's sequences, split at several points; batches of two pairs, a chunk of 16 tokens (the
    sequences run over one); the greedy flag against the fixture's argmaxes."""
    reference = json.loads((FIXTURES / "tiny-llama" / "reference.json").read_text())["sequences"]
    engine = llama
    pairs = [(seq["input_ids"][:split], seq["input_ids"][split:]) for seq in reference for split in (1, 6)]
    # Strings split as lm-eval-harness splits them (prompt + continuation encoded whole), in the same batches.
    text = reference[0]["text"]
    scored = engine.score([p for p, _ in pairs] + [text[:10]], [c for _, c in pairs] + [text[10:]], batch_size=2,
                          prefill_chunk=16)
    whole = scored.pop()
    assert whole.tokens == reference[0]["input_ids"][len(engine.tokenizer.encode(text[:10])):]
    for (prompt, continuation), s, seq in zip(pairs, scored, [r for r in reference for _ in (1, 6)]):
        logits = np.array(seq["logits"], np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
            -1, keepdims=True)
        rows = np.arange(len(prompt) - 1, len(seq["input_ids"]) - 1)
        want = logp[rows, continuation]
        assert s.tokens == continuation and s.prompt_tokens == len(prompt)
        np.testing.assert_allclose(s.logprobs, want, atol=2e-4 * np.abs(logits).max())
        assert s.sum_logprob == pytest.approx(want.sum(), abs=1e-3 * len(want) * np.abs(logits).max())
        assert s.greedy == bool(np.all(np.argmax(logits[rows], -1) == continuation))
    assert scoring.perplexity(scored) == pytest.approx(
        np.exp(-sum(s.sum_logprob for s in scored) / sum(len(s.tokens) for s in scored)))


@pytest.mark.parametrize("prompts_,continuations,message", [
    (["a"], ["b", "c"], "prompts and continuations: 1 and 2 given"),
    ([[1, 2], [3]], [[4], []], "continuations: continuation 1 has no tokens"),
    ([[1]], [[400]], "continuations: continuation 0 has token ids outside the vocabulary"),
    ([[{"role": "user", "content": "x"}]], ["y"], "prompts: pair 0 is a conversation"),
])
def test_bad_score_input_names_the_argument(llama, prompts_, continuations, message):
    with pytest.raises(InputError, match="^" + message):
        llama.score(prompts_, continuations)


# ---- conversations as prompts ---------------------------------------------------------------------------------------


def test_conversations_are_prompts(llama):
    engine = llama
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert engine.encode_prompts([chat, "Hi"]) == [engine.tokenizer.encode_chat(chat),
                                                   engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])]
    for bad, message in [
        (chat, "prompts is a flat list of messages"),
        ([[{"role": "user"}]], "prompts: prompt 0: message 0 needs a string 'content'"),
        ([[{"role": "user", "content": "x"}, "y"]], "prompts: prompt 0: message 1 is a str"),
    ]:
        with pytest.raises(InputError, match="^" + message):
            engine.encode_prompts(bad)
    with pytest.raises(InputError, match="^prompts: prompt 0 is a conversation"):
        engine.encode_prompts([chat], chat_template=False)
