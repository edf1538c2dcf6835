"""Losslessness on a tiny random Qwen3: greedy speculative output equals plain greedy decoding token for token
(every selection policy), and sampled output has plain sampling's distribution."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.decoder import init_params
from vegas_jax import sampling
from vegas_jax.engine import Engine, GenerationOptions
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.selection import POLICIES


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
    params = jax.tree.map(lambda x: x * weight_scale if x.ndim > 1 else x, init_params(config, jnp.float32, seed))
    return Engine(LoadedModel(config, params, IdsTokenizer(eos_ids), "random", "random"))


def prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


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


@pytest.mark.parametrize("method", POLICIES)
def test_greedy_speculative_equals_plain(greedy_setup, method):
    engine, batch, plain = greedy_setup
    result = engine.generate(batch, dataclasses.replace(GREEDY, method=method))
    for spec, ref in zip(result.requests, plain.requests):
        assert spec.tokens == ref.tokens
    m = result.metrics
    assert m["iterations"] > 0 and 1.0 <= m["tau"] <= GREEDY.gamma + 1
    # The stop landed inside an iteration for at least one policy run is not guaranteed; that it was honoured is.
    assert len(result.requests[1].tokens) == len(plain.requests[1].tokens)


@pytest.mark.parametrize("method", ["vegas", "streaming", "quest"])
def test_kernel_path_equals_plain(greedy_setup, method, monkeypatch):
    """The Pallas kernels (interpret mode on CPU) in the loop: sparse draft attention, verification with score
    collection and radix top-k selection, still token-for-token plain greedy decoding."""
    engine, batch, plain = greedy_setup
    options = dataclasses.replace(GREEDY, method=method)
    reference = engine.generate(batch, options)
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    result = engine.generate(batch, options)
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    # Same selections and drafts up to float rounding: a kernel attending the wrong keys (say, missing the new
    # token) would still be lossless, but would draft worse than the jnp path.
    assert result.metrics["tau"] == pytest.approx(reference.metrics["tau"], rel=0.02)


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
def test_edge_cases_match_plain(opts):
    engine = tiny_engine()
    batch = prompts([7, 33, 2], engine.config.vocab_size)
    plain = engine.generate(batch, dataclasses.replace(opts, method="ar"))
    spec = engine.generate(batch, opts)
    assert [r.tokens for r in spec.requests] == [r.tokens for r in plain.requests]
    assert all(len(r.tokens) == opts.max_new_tokens for r in spec.requests)


# ---- sampling: the joint distribution of the first three tokens --------------------------------------------------

VOCAB = 8
SAMPLED = GenerationOptions(max_new_tokens=3, temperature=0.9, top_k=6, top_p=0.95, gamma=2, sparse_ratio=0.1,
                            min_sparse_tokens=2, prefill_chunk=16, max_model_len=32)
NUM_SEEDS = 20_000


def _processed_probs_numpy(logits: np.ndarray, opts: GenerationOptions) -> np.ndarray:
    """Temperature, then top-k, then top-p (HF order), in float64."""
    z = logits.astype(np.float64) / opts.temperature
    kth = np.sort(z)[::-1][opts.top_k - 1]
    z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[mass_before < opts.top_p]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _exact_joint(engine: Engine, prompt: list[int], opts: GenerationOptions) -> np.ndarray:
    """P(t1, t2, t3) from full-attention logits of every continuation, [V, V, V]."""
    from models.decoder import forward
    from models.kv_cache import KVCache
    from vegas_jax.attention.dense import DenseAttention

    pairs = list(itertools.product(range(VOCAB), repeat=2))
    seqs = np.array([prompt + [a, b] for a, b in pairs], np.int32)
    n, length = seqs.shape
    cache = KVCache.create(engine.config, n, 64, jnp.float32)
    positions = np.broadcast_to(np.arange(length), (n, length))
    logits, _, _ = forward(engine.model.params, jnp.asarray(seqs), jnp.asarray(positions), cache, DenseAttention(),
                           config=engine.config)
    logits = np.asarray(logits)
    p1 = _processed_probs_numpy(logits[0, length - 3], opts)
    joint = np.zeros((VOCAB,) * 3)
    for row, (a, b) in enumerate(pairs):
        p2 = _processed_probs_numpy(logits[row, length - 2], opts)[b]
        p3 = _processed_probs_numpy(logits[row, length - 1], opts)
        joint[a, b] = p1[a] * p2 * p3
    return joint


def _empirical(engine: Engine, prompt: list[int], opts: GenerationOptions) -> np.ndarray:
    result = engine.generate([prompt] * NUM_SEEDS, opts, steps_per_call=None)
    counts = np.zeros((VOCAB,) * 3)
    for r in result.requests:
        counts[tuple(r.tokens)] += 1
    return counts, result


def _chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's test, pooling cells with fewer than 5 expected draws into one."""
    counts, expected = counts.ravel(), expected_probs.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    stat = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
    dof = len(obs) - 1
    return _chi2_sf(stat, dof)


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma, series form)."""
    from math import exp, lgamma, log

    a, x2 = k / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-15 * total:
        term *= x2 / (a + n)
        total += term
        n += 1
    lower = exp(-x2 + a * log(x2) - lgamma(a)) * total if x2 > 0 else 0.0
    return max(0.0, 1.0 - lower)


@pytest.fixture(scope="module")
def sampling_setup():
    engine = tiny_engine(vocab=VOCAB, layers=1, seed=3, weight_scale=10.0)
    prompt = prompts([14], VOCAB, seed=5)[0]
    return engine, prompt, _exact_joint(engine, prompt, SAMPLED)


@pytest.mark.parametrize("method", ["ar", "vegas"])
def test_sampled_joint_distribution_matches_exact(sampling_setup, method):
    engine, prompt, exact = sampling_setup
    counts, result = _empirical(engine, prompt, dataclasses.replace(SAMPLED, method=method))
    if method == "vegas":
        # Drafts must sometimes be rejected, or the acceptance rule would go untested.
        assert result.metrics["acceptance_rate"] < 0.95
    assert _chi_square_p_value(counts, exact) > 1e-4


def test_wrong_acceptance_rule_is_caught(sampling_setup, monkeypatch):
    """Drawing the replacement from p instead of norm(max(0, p - q)) biases the output; the test must see it."""
    engine, prompt, exact = sampling_setup
    monkeypatch.setattr(sampling, "accept_speculative", _wrong_rule)
    fresh = Engine(engine.model)  # the shared engine holds loops compiled with the right rule
    counts, _ = _empirical(fresh, prompt, dataclasses.replace(SAMPLED, method="vegas"))
    assert _chi_square_p_value(counts, exact) < 1e-6


def _wrong_rule(keys, draft_tokens, draft_probs, target_probs, num_drafts):
    """Standard ratio test, but on rejection resample from p itself (a classic bug)."""
    gamma = draft_tokens.shape[1]
    accept_keys, residual_keys = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k))(keys), 1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(accept_keys)
    p_draft = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    ok = (u * q_draft < p_draft) & (jnp.arange(gamma)[None] < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    p_row = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    return accepted, sampling.sample_rows(residual_keys, p_row)


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
    from vegas_jax.engine import PREFILL_SCORE_BYTES, prefill_chunk_for_memory

    for batch, heads, capacity in [(1, 9, 8448), (64, 9, 8448), (8, 32, 131200), (256, 64, 131200)]:
        chunk = prefill_chunk_for_memory(batch, heads, capacity)
        assert chunk % 16 == 0 and chunk >= 16
        assert chunk == 16 or 3 * 4 * batch * heads * chunk * capacity <= PREFILL_SCORE_BYTES
    assert prefill_chunk_for_memory(64, 9, 8448) < prefill_chunk_for_memory(1, 9, 8448)


def test_prefill_spans_cover_the_prompt_in_at_most_two_sizes():
    from vegas_jax.engine import PREFILL_TAIL_CHUNK, prefill_spans

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
        np.testing.assert_allclose(np.asarray(got)[:, :1099], np.asarray(want)[:, :1099], rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(want)).max())
    assert [r.tokens for r in engine.generate(batch, large).requests] == [
        r.tokens for r in engine.generate(batch, small).requests
    ]


def test_prefill_chunk_bounds_activation_memory():
    """The kernel path needs no score arrays, but a chunk of every sequence at once still holds the MLP's gate and
    up activations: SmolLM2 keeps 2048-token chunks at batch 64, Llama-3.1-8B's MLP halves them there."""
    from vegas_jax.engine import PREFILL_ACTIVATION_BYTES, prefill_chunk_for_activations

    for batch, intermediate in [(1, 1536), (64, 1536), (64, 14336), (512, 14336), (4096, 28672)]:
        chunk = prefill_chunk_for_activations(batch, intermediate)
        assert chunk % 16 == 0 and chunk >= 16
        assert chunk == 16 or 2 * 4 * batch * intermediate * chunk <= PREFILL_ACTIVATION_BYTES
    assert prefill_chunk_for_activations(64, 1536) >= 2048 > prefill_chunk_for_activations(64, 14336) >= 1024
