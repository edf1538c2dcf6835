"""Each selection policy against a numpy reference written from its definition (docs/method.md,
`vegas_jax.decode.selection`), on fixed scores, caches and states: which positions it selects, its state after an update, the retrieval refresh
rhythm; and the verification pass's score collection (`VerifyAttention`, jnp path) against float64 numpy for
every score mode and row set."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import NewTokens, rope_tables
from models.config import ModelConfig
from models.kv_cache import KVCache
from vegas_jax.attention.verify import SCORE_MODES, SCORE_ROWS, ScoreRequest, VerifyAttention
from vegas_jax.decode.iteration import replace_rows
from vegas_jax.decode.selection import Budget, SelectContext, Selection, make_policy

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 2, 2, 2, 16
HEADS = KV_HEADS * GROUP
THETA = 10000.0
CAPACITY = 256
GAMMA = 3
CONFIG = ModelConfig(
    architecture="qwen3", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=LAYERS, num_heads=HEADS,
    num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=THETA, rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=True,
)


# ---- numpy references --------------------------------------------------------------------------------------------


def numpy_rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """HF rotate-half RoPE of x [B, S, H, D] at positions [B, S], float64."""
    inv_freq = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = positions[:, :, None, None] * inv_freq  # [B, S, 1, D/2]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles), x2 * np.cos(angles) + x1 * np.sin(angles)], -1)


def budget_tokens(budget: Budget, length: int, candidates: int) -> int:
    """The shared budget rule: ceil(ratio * length), at least min_tokens, at most k_max and the candidates."""
    return min(max(math.ceil(budget.ratio * length), budget.min_tokens), budget.k_max, candidates)


def top_positions(scores: np.ndarray, k: int) -> set[int]:
    order = np.argsort(-scores, kind="stable")
    if k < len(order):
        assert scores[order[k - 1]] - scores[order[k]] > 1e-4, "a near-tie at the budget boundary"
    return set(order[:k].tolist())


def selected(selection: Selection, layer: int, row: int) -> set[int]:
    count = int(selection.counts[layer, row])
    return set(np.asarray(selection.indices[layer, row, :count]).tolist())


def new_tokens(heads: np.ndarray, positions: np.ndarray) -> NewTokens:
    inv_freq = jnp.asarray(1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM), jnp.float32)
    cos, sin = rope_tables(jnp.asarray(positions, jnp.int32), inv_freq)
    return NewTokens(jnp.asarray(heads, jnp.float32), cos, sin, num_kv_heads=KV_HEADS)


def random_cache(rng, batch: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    shape = (batch, CAPACITY, KV_HEADS, HEAD_DIM)
    return [rng.standard_normal(shape) for _ in range(LAYERS)], [rng.standard_normal(shape) for _ in range(LAYERS)]


def as_cache(k: list[np.ndarray], v: list[np.ndarray]) -> KVCache:
    return KVCache(jnp.asarray(np.stack(k), jnp.float32), jnp.asarray(np.stack(v), jnp.float32))  # layers stacked


def context(scores, committed, candidates_end, accepted, cache, first=False) -> SelectContext:
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return SelectContext(scores=scores, committed=i32(committed), candidates_end=i32(candidates_end),
                         accepted=i32(accepted), cache=cache, first=first)


def attention_numpy(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Softmax attention of one token's query heads q [N, D] over key rows [T, K, D] where visible [T] (GQA:
    query head h reads KV head h // GROUP), float64."""
    kv = np.arange(HEADS) // GROUP
    logits = np.einsum("nd,tnd->nt", q, keys[:, kv]) / math.sqrt(HEAD_DIM)
    logits = np.where(visible[None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("nt,tnd->nd", weights, values[:, kv])


# ---- what each policy asks verification for ------------------------------------------------------------------


@pytest.mark.parametrize("mode", SCORE_MODES)
def test_each_policy_asks_for_its_scores(mode):
    """Vegas scores rows 0 and γ, vegas-all every row, last the last accepted token's row (kept apart until
    acceptance), retrieval the last layer's attention weights of that row whatever the mode; streaming and Quest
    need no scores."""
    budget = Budget.for_length(0.1, 8, 200)
    wanted = {
        "vegas": ScoreRequest(mode, "boundary"),
        "vegas-all": ScoreRequest(mode, "all"),
        "last": ScoreRequest(mode, "each"),
        "retrieval": ScoreRequest("weight", "each", last_layer_only=True),
        "streaming": None,
        "quest": None,
    }
    assert {name: make_policy(name, budget, GAMMA).score_request(mode) for name in wanted} == wanted


# ---- verification scores -------------------------------------------------------------------------------------


def verification_case(rng, starts):
    batch, rows = len(starts), GAMMA + 1
    positions = np.asarray(starts)[:, None] + np.arange(rows)[None, :]
    heads = rng.standard_normal((batch, rows, HEADS + 2 * KV_HEADS, HEAD_DIM))
    k_cache, v_cache = (x[0] for x in random_cache(rng, batch))
    return positions, heads, k_cache, v_cache


def verification_numpy(positions, heads, k_cache, v_cache, mode: str, rows: str):
    """Output [B, S, N, D], the caches with the new rows, and the scores: per query row, q.k (logit) or the softmax
    weight (weight) of each cached position, averaged over all query heads; then rows 0 and γ averaged (boundary),
    all rows averaged (all) or every row (each); -inf past row 0's position (drafts are never candidates)."""
    q = numpy_rope(heads[:, :, :HEADS], positions)
    k_new = numpy_rope(heads[:, :, HEADS : HEADS + KV_HEADS], positions)
    keys, values = k_cache.copy(), v_cache.copy()
    for b in range(len(positions)):
        keys[b, positions[b]] = k_new[b]
        values[b, positions[b]] = heads[b, :, HEADS + KV_HEADS :]
    kv = np.arange(HEADS) // GROUP
    raw = np.einsum("bsnd,btnd->bnst", q, keys[:, :, kv])
    visible = np.arange(CAPACITY)[None, None, :] <= positions[:, :, None]  # [B, S, T]
    scaled = np.where(visible[:, None], raw / math.sqrt(HEAD_DIM), -np.inf)
    weights = np.exp(scaled - scaled.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bnst,btnd->bsnd", weights, values[:, :, kv])
    per_row = (raw if mode == "logit" else weights).mean(axis=1)  # [B, S, T]
    scores = {"boundary": 0.5 * (per_row[:, 0] + per_row[:, -1]), "all": per_row.mean(1), "each": per_row}[rows]
    candidate = np.arange(CAPACITY)[None, :] <= positions[:, :1]
    if rows == "each":
        candidate = candidate[:, None]
    return out, keys, values, np.where(candidate, scores, -np.inf)


@pytest.mark.parametrize("rows", SCORE_ROWS)
@pytest.mark.parametrize("mode", SCORE_MODES)
def test_verification_scores_match_numpy(mode, rows):
    rng = np.random.default_rng(SCORE_MODES.index(mode) * 3 + SCORE_ROWS.index(rows))
    positions, heads, k_cache, v_cache = verification_case(rng, starts=[0, 37, 200])
    attention = VerifyAttention(ScoreRequest(mode, rows), num_layers=1)
    out, k_out, v_out, scores = attention(  # a one-layer stack (models.kv_cache.KVCache)
        0, new_tokens(heads, positions), jnp.asarray(positions, jnp.int32),
        jnp.asarray(k_cache[None], jnp.float32), jnp.asarray(v_cache[None], jnp.float32),
    )
    k_out, v_out = k_out[0], v_out[0]
    want_out, want_k, want_v, want_scores = verification_numpy(positions, heads, k_cache, v_cache, mode, rows)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(k_out), want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v_out), want_v, rtol=1e-6, atol=0)
    scores = np.asarray(scores)
    assert scores.shape == want_scores.shape
    np.testing.assert_array_equal(np.isinf(scores), np.isinf(want_scores))
    finite = np.isfinite(want_scores)
    np.testing.assert_allclose(scores[finite], want_scores[finite], rtol=1e-4, atol=1e-6)


def test_last_layer_only_scores_the_last_layer():
    rng = np.random.default_rng(7)
    positions, heads, k_cache, v_cache = verification_case(rng, starts=[5, 60])
    attention = VerifyAttention(ScoreRequest("weight", "each", last_layer_only=True), num_layers=LAYERS)
    stack = lambda cache: jnp.asarray(np.stack([cache] * LAYERS), jnp.float32)  # every layer's, alike
    args = (new_tokens(heads, positions), jnp.asarray(positions, jnp.int32), stack(k_cache), stack(v_cache))
    assert attention(0, *args)[3] is None
    *_, want = verification_numpy(positions, heads, k_cache, v_cache, "weight", "each")
    np.testing.assert_allclose(np.asarray(attention(LAYERS - 1, *args)[3]), want, rtol=1e-4, atol=1e-7)


# ---- Vegas, vegas-all, last: top positions by score ----------------------------------------------------------


@pytest.mark.parametrize("name", ["vegas", "vegas-all", "last"])
def test_scored_tokens_select_the_top_scores_of_each_layer(name):
    """Per layer and sequence, the `budget` best-scored candidates (all of them when fewer); 'last' reads the row
    of the last accepted token. Recent positions start at the end of the candidates."""
    rng = np.random.default_rng(11)
    committed = np.array([5, 40, 121, 200])
    accepted = np.array([0, 3, 1, 2])
    candidates_end = committed - accepted  # the last committed token before this iteration, included
    budget = Budget.for_length(0.1, 8, CAPACITY - GAMMA - 1)
    policy = make_policy(name, budget, GAMMA)
    shape = (len(committed), GAMMA + 1, CAPACITY) if name == "last" else (len(committed), CAPACITY)
    candidate = np.arange(CAPACITY) < candidates_end.reshape((-1,) + (1,) * (len(shape) - 1))
    scores = [np.where(candidate, rng.standard_normal(shape), -np.inf) for _ in range(LAYERS)]
    k, v = random_cache(rng, len(committed))
    ctx = context(tuple(jnp.asarray(s, jnp.float32) for s in scores), committed, candidates_end, accepted,
                  as_cache(k, v))
    state = policy.init_state(CONFIG, len(committed), CAPACITY, jnp.float32)
    selection, _ = policy.select(ctx, policy.empty_selection(LAYERS, len(committed)), state)
    for layer in range(LAYERS):
        for b in range(len(committed)):
            row = scores[layer][b, accepted[b]] if name == "last" else scores[layer][b]
            k_b = budget_tokens(budget, committed[b], candidates_end[b])
            assert selected(selection, layer, b) == top_positions(row[: candidates_end[b]], k_b)
    np.testing.assert_array_equal(selection.recent_start, candidates_end)


# ---- streaming ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [16, 4, 1000])
def test_streaming_keeps_its_sinks_and_the_most_recent_window(sinks):
    """Of a budget of k tokens, the first min(sinks, k) positions (16 by default) and the k - sinks newest ones;
    everything when the budget covers the sequence. Sinks are the index list, the window is the recent range."""
    committed = np.array([3, 16, 30, 41, 100, 230])
    budget = Budget.for_length(0.2, 24, CAPACITY - GAMMA - 1)
    policy = make_policy("streaming", budget, GAMMA, **({} if sinks == 16 else {"sinks": sinks}))
    k, v = random_cache(np.random.default_rng(0), len(committed))
    ctx = context((None,) * LAYERS, committed, committed, np.zeros_like(committed), as_cache(k, v))
    selection, _ = policy.select(ctx, policy.empty_selection(LAYERS, len(committed)), ())
    for b, length in enumerate(committed):
        k_b = budget_tokens(budget, length, length)
        kept = min(sinks, k_b)
        want = set(range(kept)) | set(range(length - (k_b - kept), length))
        recent = set(range(int(selection.recent_start[b]), length))
        for layer in range(LAYERS):
            assert selected(selection, layer, b) | recent == want, (length, k_b)
            assert max(selected(selection, layer, b), default=-1) < selection.recent_start[b]
    # The cases include budgets below the sinks and, but for sinks past any budget (all sinks), above them.
    assert budget_tokens(budget, 3, 3) < sinks and (sinks > budget.k_max or sinks < budget_tokens(budget, 230, 230))


# ---- Quest -------------------------------------------------------------------------------------------------------

QUEST_GAMMA, PAGE = 20, 16


def assert_quest_state(selection, state, keys: list[np.ndarray], committed: np.ndarray, page: int = PAGE):
    """The state holds, for every complete page (`page` rows entirely inside the verified KV), the element-wise min
    and max of its keys; the trailing partial page and everything newer are the recent range."""
    complete = committed // page
    np.testing.assert_array_equal(state.complete_pages, complete)
    np.testing.assert_array_equal(selection.recent_start, complete * page)
    for layer in range(LAYERS):
        for b, pages in enumerate(complete):
            rows = keys[layer][b, : pages * page].reshape(pages, page, KV_HEADS, HEAD_DIM).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(state.page_min[layer, b, :pages]), rows.min(1))
            np.testing.assert_array_equal(np.asarray(state.page_max[layer, b, :pages]), rows.max(1))


@pytest.mark.parametrize("page", [PAGE, 8])
def test_quest_page_bounds_after_prefill_and_each_iteration(page):
    """After the bootstrap selection and after iterations that commit 1 to γ + 1 tokens (completing up to two pages
    of 16 at once, three of 8, and near the end of the cache), with the verified rows rewritten as the loop rewrites
    them: rows past the committed length hold draft K/V when a page is first seen, so a page must be rebuilt once
    complete."""
    rng = np.random.default_rng(3)
    committed = np.array([15, 40, 200])
    knobs = {} if page == PAGE else {"page": page}
    policy = make_policy("quest", Budget.for_length(0.3, 32, CAPACITY - QUEST_GAMMA - 1), QUEST_GAMMA, **knobs)
    keys, values = random_cache(rng, len(committed))
    state = policy.init_state(CONFIG, len(committed), CAPACITY, jnp.float32)
    ctx = context((None,) * LAYERS, committed, committed, np.zeros_like(committed), as_cache(keys, values), first=True)
    selection, state = policy.select(ctx, policy.empty_selection(LAYERS, len(committed)), state)
    assert_quest_state(selection, state, keys, committed, page)
    for growth in ([21, 1, 2], [17, 21, 5], [1, 16, 21], [2, 2, 19]):
        for b, g in enumerate(growth):
            for layer in range(LAYERS):  # verification writes the accepted tokens' K/V over the drafts'
                keys[layer][b, committed[b] : committed[b] + g] = rng.standard_normal((g, KV_HEADS, HEAD_DIM))
        committed = committed + growth
        accepted = np.asarray(growth) - 1
        ctx = context((None,) * LAYERS, committed, committed - accepted, accepted, as_cache(keys, values))
        selection, state = policy.select(ctx, selection, state)
        assert_quest_state(selection, state, keys, committed, page)
    assert committed[2] // page >= CAPACITY // page - 2  # the last update reached the cache's last pages


def test_quest_draft_attends_the_top_pages_by_their_bound():
    """At a draft step, complete pages are ranked by Quest's bound sum_d max(q_d min_d, q_d max_d) averaged over
    query heads; the draft attends to the top budget // 16 pages, the trailing partial page, everything newer and
    itself (its K/V written at its position)."""
    rng = np.random.default_rng(5)
    committed = np.array([40, 100, 230])
    budget = Budget.for_length(0.3, 32, CAPACITY - QUEST_GAMMA - 1)
    policy = make_policy("quest", budget, QUEST_GAMMA)
    keys, values = random_cache(rng, len(committed))
    ctx = context((None,) * LAYERS, committed, committed, np.zeros_like(committed), as_cache(keys, values), first=True)
    state = policy.init_state(CONFIG, len(committed), CAPACITY, jnp.float32)
    selection, state = policy.select(ctx, policy.empty_selection(LAYERS, len(committed)), state)
    attention = policy.draft_attention(selection, state)
    positions = committed[:, None] + 2  # the third draft of the iteration
    heads = rng.standard_normal((len(committed), 1, HEADS + 2 * KV_HEADS, HEAD_DIM))
    q = numpy_rope(heads[:, :, :HEADS], positions)[:, 0]
    k_new = numpy_rope(heads[:, :, HEADS : HEADS + KV_HEADS], positions)[:, 0]
    pages_chosen = []
    for layer in range(LAYERS):
        # Every layer's stacks, of which the attention reads and writes `layer` alone.
        k_stack, v_stack = (np.stack(x).astype(np.float32) for x in (keys, values))
        out, k_out, _, _ = attention(layer, new_tokens(heads, positions), jnp.asarray(positions, jnp.int32),
                                     jnp.asarray(k_stack), jnp.asarray(v_stack))
        others = [other for other in range(LAYERS) if other != layer]
        np.testing.assert_array_equal(np.asarray(k_out)[others], k_stack[others])
        k_out = k_out[layer]
        for b in range(len(committed)):
            pages, position = committed[b] // PAGE, positions[b, 0]
            rows = keys[layer][b, : pages * PAGE].reshape(pages, PAGE, KV_HEADS, HEAD_DIM)
            lo, hi = rows.min(1), rows.max(1)  # [P, K, D]
            qg = q[b].reshape(KV_HEADS, GROUP, HEAD_DIM)
            bound = np.maximum(qg[None] * lo[:, :, None], qg[None] * hi[:, :, None]).sum(-1).mean((1, 2))
            top = top_positions(bound, budget_tokens(budget, position, pages * PAGE) // PAGE)
            pages_chosen.append(len(top))
            visible = np.zeros(CAPACITY, bool)
            for page in top:
                visible[page * PAGE : (page + 1) * PAGE] = True
            visible[pages * PAGE : position + 1] = True
            row_keys, row_values = keys[layer][b].copy(), values[layer][b].copy()
            row_keys[position], row_values[position] = k_new[b], heads[b, 0, HEADS + KV_HEADS :]
            want = attention_numpy(q[b], row_keys, row_values, visible)
            np.testing.assert_allclose(np.asarray(out)[b, 0], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.asarray(k_out)[b, position], k_new[b], rtol=1e-5, atol=1e-5)
    assert set(pages_chosen) == {2, 4}  # all of a short sequence's pages; a few of a long one's


# ---- retrieval -----------------------------------------------------------------------------------------------

CHUNK, EVERY = 32, 4


def retrieval_selection(budget, scores, accepted, committed, candidates_end):
    """The chunks retrieval picks afresh: 32-token chunks entirely inside the candidates, ranked by the mean
    attention weight of the last accepted token's row (non-finite weights count as 0); the budget in whole chunks.
    Returns ({row: token set}, recent_start)."""
    picks, recent = {}, []
    for b in range(len(committed)):
        row = scores[b, accepted[b]]
        complete = candidates_end[b] // CHUNK
        weights = np.where(np.isfinite(row), row, 0.0)[: complete * CHUNK].reshape(complete, CHUNK).mean(1)
        chunks = top_positions(weights, budget_tokens(budget, committed[b], complete * CHUNK) // CHUNK)
        picks[b] = {c * CHUNK + i for c in chunks for i in range(CHUNK)}
        recent.append(complete * CHUNK)
    return picks, np.array(recent)


def test_retrieval_refreshes_its_chunks_every_4_iterations_of_each_request():
    """Fresh chunks at the bootstrap selection and at every 4th iteration of a request, the previous ones in
    between; a request admitted into a running batch (`loop.replace_rows`, as `loop.admit` does) keeps its own
    rhythm."""
    rng = np.random.default_rng(9)
    budget = Budget.for_length(0.6, CHUNK, CAPACITY - GAMMA - 1)
    policy = make_policy("retrieval", budget, GAMMA)
    keys, values = random_cache(rng, 2)
    cache = as_cache(keys, values)

    def scores_for(candidates_end):
        shape = (len(candidates_end), GAMMA + 1, CAPACITY)
        weights = rng.random(shape)
        return np.where(np.arange(CAPACITY) < np.asarray(candidates_end)[:, None, None], weights, -np.inf)

    def select(selection, state, committed, accepted, first):
        candidates_end = committed - accepted
        scores = scores_for(candidates_end)
        ctx = context((None,) * (LAYERS - 1) + (jnp.asarray(scores, jnp.float32),), committed, candidates_end,
                      accepted, cache, first)
        return (*policy.select(ctx, selection, state), retrieval_selection(budget, scores, accepted, committed,
                                                                           candidates_end))

    committed = np.array([70, 150])
    state = policy.init_state(CONFIG, 2, CAPACITY, jnp.float32)
    selection, state, (want, want_recent) = select(policy.empty_selection(LAYERS, 2), state, committed,
                                                   np.zeros(2, int), first=True)
    current = {b: (want[b], want_recent[b]) for b in range(2)}
    since = [0, 0]  # iterations since each request's last refresh
    refreshed = []
    for iteration in range(1, 11):
        if iteration == 3:  # a new request takes row 1: its bootstrap selection and state replace the row's
            joining_state = policy.init_state(CONFIG, 1, CAPACITY, jnp.float32)
            joining, joining_state, (want_j, recent_j) = select(policy.empty_selection(LAYERS, 1), joining_state,
                                                                 np.array([90]), np.zeros(1, int), first=True)
            slot = jnp.asarray([1], jnp.int32)
            selection = replace_rows(selection, joining, slot)  # what loop.admit does to these parts of the state
            state = replace_rows(state, joining_state, slot)
            committed[1], since[1], current[1] = 90, 0, (want_j[0], recent_j[0])
        accepted = rng.integers(0, GAMMA + 1, 2)
        committed = committed + accepted + 1
        selection, state, (want, want_recent) = select(selection, state, committed, accepted, first=False)
        for b in range(2):
            since[b] += 1
            if since[b] == EVERY:
                since[b], current[b] = 0, (want[b], want_recent[b])
                refreshed.append((iteration, b))
            for layer in range(LAYERS):
                assert selected(selection, layer, b) == current[b][0], (iteration, b)
            assert selection.recent_start[b] == current[b][1], (iteration, b)
        np.testing.assert_array_equal(jax.tree.leaves(state)[0], since)
    assert refreshed == [(4, 0), (6, 1), (8, 0), (10, 1)]
