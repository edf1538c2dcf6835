"""Sampled speculative decoding has plain sampling's distribution, checked where it can go wrong: γ = 3 drafts per
iteration that the target rejects at every draft position, chains of accepted drafts, bonus tokens after two and
after three of them, over the first five emitted tokens of a tiny random model (vocabulary 4: the joint
distribution of five tokens has 1,024 cells). Each run samples its requests (seeds 0, 1, ...) in one batch, one
compiled loop, and compares the counts of the five-token outputs with the exact joint, computed in float64 from
full-attention logits of every continuation (`models.decoder.forward` with dense attention: no cache reuse, no
chunked prefill, no verification attention), by Pearson's chi-square test.

With penalties (repetition, presence, frequency) and min-p, each position's distribution depends on the tokens
before it, drafts included: the exact joint penalises every continuation's rows by its own history, and a loop that
penalises verification rows without the drafts before them fails the test.

Deliberately wrong acceptance rules and key use must fail the same test at the same sample size, which shows what
it can see. The Pallas kernels in interpret mode take about 0.2 s per request and iteration at these batch sizes on
a CPU, so the kernel path is tied to the tested jnp path instead: the same seeds draw the same tokens."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from models.config import ModelConfig
from models.decoder import forward, init_params
from models.kv_cache import KVCache
from tests.test_lossless_tiny import IdsTokenizer, prompts, scale_weight_matrices
from vegas_jax.decode import iteration as loop
from vegas_jax.decode import penalties
from vegas_jax.decode import sampling
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.runtime.engine import Engine, GenerationOptions
from vegas_jax.loading.bundle import LoadedModel

VOCAB, NEW, GAMMA = 4, 5, 3
PROMPT_LENGTH = 70
SEED, WEIGHT_SCALE = 4, 10.0
# Every setting filters with both top-k and top-p, so they share one compiled sampling mode; k = VOCAB keeps every
# token (top-p alone) and p = 0.995 cuts nothing here (top-k alone; both checked in `exact_joints`).
SETTINGS = {
    "t1.0-k3-p0.9": dict(temperature=1.0, top_k=3, top_p=0.9),
    "t0.7-k4-p0.8": dict(temperature=0.7, top_k=VOCAB, top_p=0.8),
    "t1.4-k2-p0.995": dict(temperature=1.4, top_k=2, top_p=0.995),
}
# History-dependent: strong penalties (on a vocabulary of 4, every token is in the prompt) and a min-p that cuts.
PENALISED = {"t1.0-k3-p0.9-penalties-minp0.2": dict(temperature=1.0, top_k=3, top_p=0.9, min_p=0.2,
                                                    repetition_penalty=1.3, presence_penalty=0.7,
                                                    frequency_penalty=0.9)}
# Per method, a budget that selects something real from the 70-token prompt: Vegas 2 tokens; streaming 16 sinks
# and an 8-token window; Quest one of four complete 16-token pages; retrieval one of two 32-token chunks.
BUDGET_FLOOR = {"ar": 1, "vegas": 2, "streaming": 24, "quest": 16, "retrieval": 32}
P_VALUE_OK, P_VALUE_CAUGHT = 1e-3, 1e-6


def options(method: str, setting: str) -> GenerationOptions:
    return GenerationOptions(
        method=method, max_new_tokens=NEW, gamma=GAMMA, sparse_ratio=0.02, min_sparse_tokens=BUDGET_FLOOR[method],
        prefill_chunk=80, max_model_len=PROMPT_LENGTH + NEW, **(SETTINGS | PENALISED)[setting],
    )


def penalised_rows(logits: np.ndarray, prompt: list[int], repetition_penalty: float, presence_penalty: float,
                   frequency_penalty: float) -> np.ndarray:
    """Row i of continuation c ([V^4, 5, V]) penalised by its own history, in float64: transformers' repetition
    penalty over the prompt and c[:i], then presence and frequency over c[:i] (vLLM's order)."""
    continuations = np.array(list(itertools.product(range(VOCAB), repeat=NEW - 1)))
    one_hot = np.eye(VOCAB)[continuations]  # [V^4, 4, V]
    counts = np.concatenate([np.zeros_like(one_hot[:, :1]), np.cumsum(one_hot, axis=1)], axis=1)  # before row i
    seen = np.isin(np.arange(VOCAB), prompt)[None, None, :] | (counts > 0)
    z = logits.astype(np.float64)
    z = np.where(seen, np.where(z < 0, z * repetition_penalty, z / repetition_penalty), z)
    return z - frequency_penalty * counts - presence_penalty * (counts > 0)


def processed_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float = 0.0) -> tuple[np.ndarray, float]:
    """Temperature, then top-k, then top-p (the smallest prefix of the sorted distribution whose mass reaches
    top_p), then min-p (at least min_p times the most likely token's probability), in float64, rows [..., V]. Also
    the smallest distance of any row from a filter's threshold: a reference whose kept set a float32 rounding could
    change would prove nothing."""
    z = logits.astype(np.float64) / temperature
    ordered = -np.sort(-z, axis=-1)
    kth = ordered[..., top_k - 1 : top_k]
    margin = np.inf if top_k == z.shape[-1] else float(np.min(kth - ordered[..., top_k : top_k + 1]))
    z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    mass_before = np.cumsum(sorted_p, -1) - sorted_p
    candidates = sorted_p > 0
    margin = min(margin, float(np.min(np.abs(mass_before - top_p)[candidates])))
    keep = np.zeros(p.shape, bool)
    np.put_along_axis(keep, order, mass_before < top_p, -1)
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
    if min_p > 0:
        with np.errstate(divide="ignore"):
            distance = np.abs(np.log(p) - np.log(min_p * p.max(-1, keepdims=True)))
        margin = min(margin, float(np.min(distance[p > 0])))
        p = np.where(p < min_p * p.max(-1, keepdims=True), 0.0, p)
    return p / p.sum(-1, keepdims=True), margin


def tiny_sampler() -> Engine:
    """One layer, one KV head: the cost of 20,000 requests is mostly reading their caches."""
    config = ModelConfig(
        architecture="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
        tie_word_embeddings=True, qk_norm=True,
    )
    # Large weights make attention peaky, so that a sparse draft often misses what the target attends to.
    params = scale_weight_matrices(init_params(config, jnp.float32, SEED), WEIGHT_SCALE)
    return Engine(LoadedModel(config, params, IdsTokenizer(), "random", "random"))


def continuation_logits(engine: Engine, prompt: list[int], new: int) -> np.ndarray:
    """[V^(new-1), new, V] logits of every continuation t1..t(new-1) of the prompt, in one dense pass: row i of
    continuation (t1..t(new-1)) is the distribution of token i + 1 after t1..ti (causality keeps later tokens out)."""
    continuations = list(itertools.product(range(VOCAB), repeat=new - 1))
    seqs = jnp.asarray([prompt + list(c) for c in continuations], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
    cache = KVCache.create(engine.config, len(continuations), seqs.shape[1], jnp.float32)
    logits, _, _ = jax.jit(forward, static_argnames="config")(
        engine.model.params, seqs, positions, cache, DenseAttention(), config=engine.config
    )
    return np.asarray(logits)[:, len(prompt) - 1 :]


@pytest.fixture(scope="module")
def model():
    engine = tiny_sampler()
    prompt = prompts([PROMPT_LENGTH], VOCAB, seed=5)[0]
    return engine, prompt, continuation_logits(engine, prompt, NEW)  # [V^4, 5, V]


@pytest.fixture(scope="module")
def exact(model):
    return exact_joints(model[2], model[1])


PENALTY_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def exact_joints(logits: np.ndarray, prompt: list[int]) -> dict[str, np.ndarray]:
    """Per setting, P(t1, ..., t5) as an array [V] * 5."""
    joints = {}
    for name, setting in (SETTINGS | PENALISED).items():
        rows = logits
        if name in PENALISED:
            rows = penalised_rows(logits, prompt, **{k: setting[k] for k in PENALTY_KEYS})
        probs, margin = processed_probs(rows, **{k: v for k, v in setting.items() if k not in PENALTY_KEYS})
        assert margin > 1e-4, f"{name}: a row lies {margin:.2e} from a top-k / top-p threshold"
        if setting["top_p"] > 0.99:
            assert np.all((probs > 0).sum(-1) == setting["top_k"]), "top-p was meant to cut nothing here"
        joint = np.ones((VOCAB,) * NEW)
        for i in range(NEW):
            # probs[c, i, t]: sequence c = (t1..t4) gives P(t_{i+1} = t | t1..ti); broadcast over the later tokens.
            p = probs[:, i].reshape((VOCAB,) * (NEW - 1) + (VOCAB,))
            p = p[(slice(None),) * i + (0,) * (NEW - 1 - i)]  # the rows do not depend on tokens after t_i
            joint *= p.reshape((VOCAB,) * (i + 1) + (1,) * (NEW - 1 - i))
        np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-9)
        joints[name] = joint
    return joints


def sample(engine: Engine, prompt: list[int], opts: GenerationOptions, num_seeds: int):
    """Counts of the five-token outputs of num_seeds requests; how their iterations ended, [drafts the iteration
    made, drafts it accepted], from `stream` in steps of one iteration (each chunk is one iteration's accepted
    drafts plus one token); and the GenerationResult."""
    *chunks, result = engine.stream([prompt] * num_seeds, opts, steps_per_call=1)
    outputs = np.array([r.tokens for r in result.requests])
    assert outputs.shape == (num_seeds, NEW)
    counts = np.zeros((VOCAB,) * NEW)
    np.add.at(counts, tuple(outputs.T), 1)
    outcomes = np.zeros((GAMMA + 1, GAMMA + 1), int)
    generated = np.array([len(c) for c in chunks[0]])
    for iteration in chunks[1:]:
        emitted = np.array([len(c) for c in iteration])
        live = emitted > 0
        drafts = np.minimum(GAMMA, NEW - generated - 1)  # the loop never drafts past the tokens it still owes
        np.add.at(outcomes, (drafts[live], emitted[live] - 1), 1)
        generated += emitted
    assert np.all(generated == NEW)
    return counts, outcomes, result


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; cells with fewer than 5 expected draws are pooled into one. A draw in a cell of probability
    exactly 0 (a token the filters remove) rejects outright."""
    counts, probs = counts.ravel(), probs.ravel()
    if counts[probs == 0].any():
        return 0.0
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    observed, expected = list(counts[big]), list(expected[big])
    if small.any():
        observed.append(counts[small].sum())
        expected.append(probs[small].sum() * counts.sum())
    observed, expected = np.array(observed), np.array(expected)
    return float(stats.chi2.sf(np.sum((observed - expected) ** 2 / expected), len(observed) - 1))


def assert_speculation_exercised(outcomes: np.ndarray) -> None:
    """The acceptance rule was really at work: rejections at each draft position, and bonus tokens after two and
    after three accepted drafts, each in at least 1 % of the requests."""
    floor = outcomes.sum(1)[GAMMA] // 100  # every request's first iteration makes γ drafts
    for position in range(GAMMA):
        rejected_here = outcomes[position + 1 :, position].sum()  # iterations that drafted past it, rejected it
        assert rejected_here >= floor, f"{rejected_here} rejections at draft position {position}: {outcomes}"
    for accepted in (2, 3):
        assert outcomes[accepted, accepted] >= floor, f"bonus after {accepted} accepted drafts: {outcomes}"


# (method, setting, seeds): Vegas and plain sampling with 20,000 seeds, the baselines with 10,000 (the wrong rules
# below are caught at 10,000). The acceptance rule is the same for every policy, so each filter setting meets
# speculation once.
CASES = [
    ("ar", "t1.0-k3-p0.9", 20_000),  # plain sampling on its own against the exact distribution
    ("vegas", "t1.0-k3-p0.9", 20_000),
    ("streaming", "t0.7-k4-p0.8", 10_000),
    ("quest", "t1.4-k2-p0.995", 10_000),
    ("retrieval", "t1.0-k3-p0.9", 10_000),
]


@pytest.fixture(scope="module")
def runs(model):
    """Sampled runs by (method, setting, seeds), kept for the module: the kernel test compares with one."""
    engine, prompt, _ = model
    done = {}

    def run(method, setting, seeds):
        if (method, setting, seeds) not in done:
            done[method, setting, seeds] = sample(engine, prompt, options(method, setting), seeds)
        return done[method, setting, seeds]

    return run


@pytest.mark.parametrize("method,setting,seeds", CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_sampled_joint_distribution_is_exact(runs, exact, method, setting, seeds):
    counts, outcomes, _ = runs(method, setting, seeds)
    if method != "ar":
        assert_speculation_exercised(outcomes)
    p_value = chi_square_p_value(counts, exact[setting])
    assert p_value > P_VALUE_OK, f"p = {p_value:.2e}"


# int4 drafts (groups, with offsets) multiplying int8-rounded activations, and adaptive γ with given costs (an
# iteration of g drafts 1 + 0.3 g plain steps), whose choices here mix γ_max (the prior's good drafts), fewer (the
# positions past g hold no drafts and count as rejected) and 0 (a plain step). γ_max 3: one verification pass, so
# g < 3 leaves placeholder positions in it.
def quantized_auto(gamma_max: int) -> dict:
    return dict(draft_weights="int4", draft_activations="int8", gamma="auto", gamma_max=gamma_max,
                gamma_costs=tuple(1 + 0.3 * g for g in range(1, gamma_max + 1)))


@pytest.mark.parametrize("gamma_max", [GAMMA, GAMMA + 1], ids=["one-pass", "passes-of-2-and-4"])
def test_int4_drafts_int8_activations_and_auto_gamma_keep_the_distribution(model, exact, gamma_max):
    """Also at γ_max 4, whose g 1 and 2 are verified in a pass of 2 drafts and g 3 in one of 4 (never 4 drafts
    here: no request owes more than 3 tokens after its drafts' bonus)."""
    engine, prompt, _ = model
    opts = dataclasses.replace(options("vegas", "t1.0-k3-p0.9"), **quantized_auto(gamma_max))
    counts, _, result = sample(engine, prompt, opts, 10_000)
    chosen = result.metrics["gamma_chosen_histogram"]
    assert chosen[0] and chosen[GAMMA] and sum(chosen[1:GAMMA]), chosen  # plain steps, fewer drafts, all of them
    by_position = result.metrics["acceptance_by_position"][:GAMMA]
    assert all(0.05 < a < 0.95 for a in by_position), by_position  # drafts accepted and rejected everywhere
    p_value = chi_square_p_value(counts, exact["t1.0-k3-p0.9"])
    assert p_value > P_VALUE_OK, f"p = {p_value:.2e}"


def test_kernel_path_draws_the_same_tokens(model, runs, monkeypatch):
    """Sampled Vegas through the Pallas kernels (interpret mode: sparse draft attention, verification with score
    collection, radix top-k) emits, seed for seed, what the jnp path's 20,000-seed run above emits for seeds
    0..199 (a request's draws depend on its seed, not its batch): the kernels change only float32 rounding, which
    moves no draw here. Same tokens and the same acceptances at every position, request for request."""
    engine, prompt, _ = model
    *_, reference = runs("vegas", "t1.0-k3-p0.9", 20_000)
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    kernel = engine.generate([prompt] * 200, options("vegas", "t1.0-k3-p0.9"))
    assert [r.tokens for r in kernel.requests] == [r.tokens for r in reference.requests[:200]]
    assert [r.metrics for r in kernel.requests] == [r.metrics for r in reference.requests[:200]]
    by_position = kernel.metrics["acceptance_by_position"]
    assert all(0.05 < a < 0.95 for a in by_position), by_position  # drafts accepted and rejected everywhere


def test_sampling_with_penalties_and_min_p_is_exact(runs, exact):
    """Vegas with every history-dependent penalty and min-p: each verification row and draft step penalised with
    the tokens before it, drafts included, and min-p cutting tokens, against the exact joint."""
    (setting,) = PENALISED
    counts, outcomes, _ = runs("vegas", setting, 10_000)
    assert_speculation_exercised(outcomes)
    assert (exact[setting] == 0).sum() > (exact["t1.0-k3-p0.9"] == 0).sum()  # min-p removed continuations
    p_value = chi_square_p_value(counts, exact[setting])
    assert p_value > P_VALUE_OK, f"p = {p_value:.2e}"


def test_penalties_that_ignore_the_drafts_are_caught(model, exact, monkeypatch):
    """Rows penalised with the emitted tokens' counts only (the drafts before each row left out, in the draft steps
    and in verification): the distribution after an accepted draft is wrong, and the test sees it."""
    engine, prompt, _ = model
    right = penalties.apply
    monkeypatch.setattr(penalties, "apply", lambda logits, history, params, drafts, preceding: right(
        logits, history, params, drafts[:, :0], preceding))
    (setting,) = PENALISED
    counts, outcomes, _ = sample(Engine(engine.model), prompt, options("vegas", setting), 5_000)
    assert_speculation_exercised(outcomes)
    p_value = chi_square_p_value(counts, exact[setting])
    assert p_value < P_VALUE_CAUGHT, f"p = {p_value:.2e}"


# ---- wrong rules must be caught -----------------------------------------------------------------------------------


def speculative_rule(*, q_row_limit: int | None = None, subtract_q: bool = True):
    """accept_speculative written out again with the same random draws, to be broken one way at a time:
    q_row_limit clamps the draft row the residual subtracts (None: the rejected position's own row, as it must);
    subtract_q=False draws the replacement from p instead of norm(max(0, p - q))."""

    def accept(keys, draft_tokens, draft_probs, target_probs, num_drafts):
        gamma = draft_tokens.shape[1]
        accept_keys, residual_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(accept_keys)
        p_draft = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
        q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        ok = (u * q_draft < p_draft) & (jnp.arange(gamma)[None] < num_drafts[:, None])
        accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
        row = lambda x, r: jnp.take_along_axis(x, r[:, None, None], axis=1)[:, 0]  # noqa: E731
        p_row = row(target_probs, accepted)
        q_row = row(draft_probs, jnp.minimum(accepted, gamma - 1 if q_row_limit is None else q_row_limit))
        residual = jnp.maximum(p_row - q_row, 0.0) if subtract_q else p_row
        rejected = (accepted < num_drafts)[:, None]
        return accepted, sampling.sample_rows(residual_keys, jnp.where(rejected, residual, p_row))

    return accept


def test_rewritten_rule_is_the_library_rule(rng):
    """The wrong rules below differ from the library's in one place each: unbroken, the rewrite draws the library's
    tokens from the same keys."""
    batch, vocab = 256, 5
    q = rng.dirichlet(np.ones(vocab), (batch, GAMMA))
    drafts = np.array([[rng.choice(vocab, p=q[b, j]) for j in range(GAMMA)] for b in range(batch)])
    args = (
        jax.vmap(jax.random.key)(jnp.asarray(rng.integers(0, 2**31, batch))),
        jnp.asarray(drafts, jnp.int32),
        jnp.asarray(q, jnp.float32),
        jnp.asarray(rng.dirichlet(np.ones(vocab), (batch, GAMMA + 1)), jnp.float32),
        jnp.asarray(rng.integers(0, GAMMA + 1, batch), jnp.int32),
    )
    want = jax.jit(sampling.accept_speculative)(*args)
    got = jax.jit(speculative_rule())(*args)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    accepted, num_drafts = np.asarray(want[0]), np.asarray(args[4])
    assert {0, 1, 2} <= set(accepted[accepted < num_drafts])  # rejections at every position were compared


STEP_KEYS = loop.step_keys


def one_key_per_iteration(keys, step, count):
    """Every draw of an iteration (each draft position's and the acceptance's) from one key."""
    fresh = STEP_KEYS(keys, step, count)
    return jnp.broadcast_to(fresh[:1], fresh.shape)


def drafts_past_g_count(state, most_drafts):
    """Adaptive γ's drafts beyond g (none made) counted as drafts, as if verification had no mask."""
    return jnp.clip(state.max_new - state.num_generated - 1, 0, GAMMA)


WRONG = {
    "residual-without-q": (sampling, "accept_speculative", speculative_rule(subtract_q=False)),
    "row-1-for-positions-2-on": (sampling, "accept_speculative", speculative_rule(q_row_limit=1)),
    "one-key-for-all-draws": (loop, "step_keys", one_key_per_iteration),
    "auto-gamma-unmasked": (loop, "counted_drafts", drafts_past_g_count),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_rule_is_caught(model, exact, wrong, monkeypatch):
    engine, prompt, _ = model
    monkeypatch.setattr(*WRONG[wrong])
    fresh = Engine(engine.model)  # the shared engine holds loops compiled with the right rule
    opts = options("vegas", "t1.0-k3-p0.9")
    if wrong.startswith("auto"):
        opts = dataclasses.replace(opts, **quantized_auto(GAMMA))
    counts, outcomes, _ = sample(fresh, prompt, opts, 10_000)
    if not wrong.startswith("auto"):  # adaptive γ's iterations do not all make γ drafts
        assert_speculation_exercised(outcomes)
    p_value = chi_square_p_value(counts, exact["t1.0-k3-p0.9"])
    assert p_value < P_VALUE_CAUGHT, f"p = {p_value:.2e}"
