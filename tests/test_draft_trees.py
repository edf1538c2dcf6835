"""Draft trees (vegas_jax.decode.tree_shapes, tree_decode, drafters) on a tiny random Qwen3 in float32, each against an
independent reference: every node's logits from one tree pass equal full recomputation of its root-to-node path,
and the committed path's K/V equal that recomputation's; greedy tree speculation with each drafter equals greedy
decoding by full recomputation (`dense_greedy`), ragged batches, with the caches after acceptance, the
log-probabilities and a stop id as plain decoding's; a sampled chain-shaped tree is the linear loop (tokens, τ). Sampled trees keep the
distribution: test_sampling_distribution's tiny model, the joint of four tokens (the last three from one tree
iteration) over 20,000 seeds (self drafts; n-gram drafts 10,000) against the exact float64 joint, and a rule without
the residual is caught."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import forward
from models.kv_cache import KVCache
from tests.test_lossless_tiny import dense_greedy, prompts, tiny_engine
from tests.test_sampling_distribution import (VOCAB, chi_square_p_value, continuation_logits, processed_probs,
                                              tiny_sampler)
from vegas_jax.decode import tree_iteration as tree_decode
from vegas_jax.attention.dense import DenseAttention
from vegas_jax.attention.family import DenseFamily
from vegas_jax.attention.tree import TreeAttention
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError
from vegas_jax.runtime.metrics import accepted_histogram
from vegas_jax.decode.tree_shapes import DEFAULT_RANK_RATES, TreeShape, parse_tree

_forward = jax.jit(forward, static_argnames="config")
# Depths 0 1 1 2 2 2 3 3: unequal branching, a leaf above the deepest level, two paths of depth 3.
IRREGULAR = TreeShape((-1, 0, 0, 1, 1, 2, 3, 5))
NEW = 14
LENGTHS = [21, 34, 9]  # ragged
STOP = 59  # greedy decoding emits it as the 8th token of the second sequence (and nowhere else)
CONTROLS = dict(logprobs=2, stop_token_ids=(STOP,))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def test_tree_shapes():
    tree = parse_tree("2x2")
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 2) and tree.depth == 2 and tree.num_parents == 3
    assert parse_tree("6x1") == TreeShape.chain(6) and TreeShape.chain(6).is_chain and not tree.is_chain
    assert IRREGULAR.children.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [7, -1], [-1, -1], [-1, -1]]
    assert IRREGULAR.path_nodes[7].tolist() == [0, 2, 5, 7] and IRREGULAR.path_nodes[4].tolist() == [0, 1, 4, 0]
    assert IRREGULAR.ancestors[7].tolist() == [True, False, True, False, False, True, False, True]
    for bad, needle in [("4by2", "DEPTHxBRANCHING"), ("0x3", ">= 1"), ("6x2", "126 drafted nodes, more than 64")]:
        with pytest.raises(InputError, match=needle):
            parse_tree(bad)
    with pytest.raises(ValueError, match="parent must come before"):
        TreeShape((-1, 2, 0))
    assert accepted_histogram(10, np.array([6, 2, 1])) == [4, 4, 1, 1]


def _best_by_enumeration(nodes: int, rates: tuple[float, ...], max_depth: int) -> float:
    """The largest expected τ over every tree of `nodes` drafted nodes no deeper than `max_depth` whose nodes have at
    most len(rates) children: each node in turn hangs under any earlier node with a rank free (its rank the number
    of children that node already has), the chance of its path the product of its ranks' rates."""
    best = 0.0

    def grow(chance, depth, kids):
        nonlocal best
        if len(chance) == nodes + 1:
            best = max(best, sum(chance))
            return
        for parent in range(len(chance)):
            if kids[parent] < len(rates) and depth[parent] < max_depth:
                kids[parent] += 1
                grow(chance + [chance[parent] * rates[kids[parent] - 1]], depth + [depth[parent] + 1],
                     kids + [0])
                kids[parent] -= 1

    grow([1.0], [0], [0])
    return best


def test_trees_shaped_by_rank_rates_are_the_best_of_their_size():
    """NODES[dDEPTH] trees against every tree of their size (and depth) by enumeration; a full tree's expected τ
    against its closed form, each level accepting with the sum of its ranks' rates; the grammar's refusals."""
    for rates in [(0.7, 0.12), (0.5, 0.3, 0.1), (0.9,)]:
        for nodes, depth in [(1, 6), (4, 6), (6, 6), (6, 2), (7, 3)]:
            if nodes > sum(len(rates)**d for d in range(1, depth + 1)):
                continue
            tree = TreeShape.for_rates(nodes, rates, depth)
            assert tree.num_nodes == nodes and tree.depth <= depth
            assert tree.expected_tokens(rates) == pytest.approx(_best_by_enumeration(nodes, rates, depth), abs=1e-12)
            levels = np.concatenate([[0], np.flatnonzero(np.diff(tree.depths)) + 1])
            assert list(tree.depths) == sorted(tree.depths) and len(levels) == tree.depth + 1  # level by level
    for depth, branching in [(4, 2), (3, 3), (6, 1)]:
        level = sum((0.6, 0.2, 0.1)[:branching])
        assert TreeShape.full(depth, branching).expected_tokens((0.6, 0.2, 0.1)) == pytest.approx(
            sum(level**d for d in range(depth + 1)))
    assert parse_tree("16") == TreeShape.for_rates(16, DEFAULT_RANK_RATES)
    assert parse_tree("9d3", rates=(0.6, 0.3)) == TreeShape.for_rates(9, (0.6, 0.3), 3)
    assert parse_tree("3", rates=(0.9,)) == TreeShape.chain(3) and parse_tree("4x2").describe() == "4x2"
    # The shipped head's rates: a tree of 12 nodes expects what 4x2's 30 do, one of 30 more.
    four_by_two = parse_tree("4x2").expected_tokens(DEFAULT_RANK_RATES)
    assert parse_tree("12").expected_tokens(DEFAULT_RANK_RATES) > four_by_two
    assert parse_tree("30").expected_tokens(DEFAULT_RANK_RATES) > four_by_two + 0.6
    for bad, rates, needle in [("16x", None, "NODES\\[dDEPTH\\]"), ("65", None, "1 to 64 nodes"),
                               ("8d0", None, "at least 1 deep"), ("8", (0.5, 0.6), "non-increasing"),
                               ("8", (0.7, 0.4), "summing to at most 1"), ("8", (1.0,), "in \\(0, 1\\)"),
                               ("7d2", None, "a tree 2 deep with 2 ranks of rates \\(tree_rates\\) holds fewer")]:
        with pytest.raises(InputError, match=needle):
            parse_tree(bad, rates=rates)


def test_rank_counts_follow_the_accepted_path():
    """The rank metrics of one iteration (tree_iteration._rank_counts) against a walk down each sequence's accepted
    path: every path node (the root included) offers the ranks of its counted children, every accepted draft counts
    its own rank."""
    tree, rng = IRREGULAR, np.random.default_rng(3)
    batch = 64
    last = rng.integers(0, tree.rows, batch)
    counted = rng.random((batch, tree.rows)) < 0.8  # children off the path may not be counted
    counted[np.arange(batch)[None, :], tree.path_nodes[last].T] = True  # an accepted path was
    offered, accepted = tree_decode._rank_counts(tree, jnp.asarray(tree.path_nodes[last]),
                                                jnp.asarray(tree.depths[last]), jnp.asarray(counted))
    want_offered = np.zeros((batch, tree.children.shape[1]), int)
    want_accepted = np.zeros_like(want_offered)
    for b, node in enumerate(last):
        path = []
        while node > 0:
            path.append(int(node))
            node = tree.parents[node]
        for parent in [0, *path]:
            for rank, child in enumerate(tree.children[parent]):
                want_offered[b, rank] += child >= 0 and counted[b, child]
        for node in path:
            want_accepted[b, list(tree.children[tree.parents[node]]).index(node)] += 1
    np.testing.assert_array_equal(np.asarray(offered), want_offered)
    np.testing.assert_array_equal(np.asarray(accepted), want_accepted)


def _path_tokens(tokens: np.ndarray, tree: TreeShape, node: int) -> list[int]:
    return [int(tokens[n]) for n in tree.path_nodes[node][1 : tree.depths[node] + 1]]


def test_every_node_attends_its_path_and_the_committed_path_is_plain_decoding(engine):
    """One tree pass over sequences of different lengths: node i's logits are those of the last row of a dense
    forward over prompt + path(i); committing a path leaves the K/V rows that forward writes."""
    config, params, tree = engine.config, engine.model.params, IRREGULAR
    seqs = prompts([9, 14], config.vocab_size, seed=3)
    batch, capacity = len(seqs), 32
    base = np.array([len(s) - 1 for s in seqs], np.int32)  # the last prompt token is the root, without K/V yet
    width = int(base.max())
    tokens = np.zeros((batch, width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s) - 1] = s[:-1]
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    _, cache, _ = _forward(params, jnp.asarray(tokens), positions, KVCache.create(config, batch, capacity, jnp.float32),
                           DenseAttention(), config=config)
    rng = np.random.default_rng(0)
    nodes = rng.integers(0, config.vocab_size, (batch, tree.rows)).astype(np.int32)
    nodes[:, 0] = [s[-1] for s in seqs]
    attention = TreeAttention(jnp.asarray(base[:, None] + np.arange(tree.rows)), jnp.asarray(base),
                              jnp.asarray(tree.ancestors))
    logits, cache, _ = _forward(params, jnp.asarray(nodes), jnp.asarray(base[:, None] + tree.depths), cache,
                                attention, config=config)

    paths = [(b, n) for b in range(batch) for n in range(tree.rows)]
    full = [seqs[b] + _path_tokens(nodes[b], tree, n) for b, n in paths]
    length = max(map(len, full))
    padded = np.zeros((len(full), length), np.int32)
    for i, s in enumerate(full):
        padded[i, : len(s)] = s
    ref_logits, ref_cache, _ = _forward(params, jnp.asarray(padded), jnp.broadcast_to(jnp.arange(length), padded.shape),
                                        KVCache.create(config, len(full), length, jnp.float32), DenseAttention(),
                                        config=config, logit_rows=jnp.asarray([[len(s) - 1] for s in full]))
    expected = np.asarray(ref_logits[:, 0]).reshape(batch, tree.rows, -1)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-4, rtol=1e-4)

    last = np.array([7, 4], np.int32)  # paths 0-2-5-7 and 0-1-4
    accepted = tree.depths[last]
    committed = DenseFamily().commit_path(config, cache, jnp.asarray(base), jnp.asarray(tree.path_nodes[last]),
                                          jnp.asarray(accepted), jnp.ones((batch,), bool))
    for b in range(batch):
        ref = paths.index((b, int(last[b])))
        rows = int(base[b] + accepted[b] + 1)  # the prompt and the path, the last accepted token included
        for got, want in ((committed.k, ref_cache.k), (committed.v, ref_cache.v)):
            for layer in range(config.num_layers):
                np.testing.assert_allclose(np.asarray(got[layer][b, :rows]), np.asarray(want[layer][ref, :rows]),
                                           atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("recent_span", [None, 3])
def test_a_draft_pass_attends_its_selection_recent_rows_and_path(recent_span):
    """A self drafter's pass over one level of IRREGULAR (its depth-2 nodes), against float64 attention over exactly
    the rows each node may see: the layer's selected rows, the recent rows [recent_start, base) and its path's tree
    rows. recent_span 3 gathers those rows (the policy bounds the recent range); None masks the whole cache."""
    from models.attention import NewTokens
    from vegas_jax.attention.tree import DraftPrefix

    rng = np.random.default_rng(7)
    layers, batch, capacity, kv_heads, group, dim, layer = 2, 2, 48, 2, 2, 16, 1
    k_cache = rng.standard_normal((layers, batch, capacity, kv_heads, dim)).astype(np.float32)
    v_cache = rng.standard_normal((layers, batch, capacity, kv_heads, dim)).astype(np.float32)
    base, recent_start = np.array([20, 31], np.int32), np.array([18, 28], np.int32)
    indices = np.zeros((layers, batch, 6), np.int32)
    counts = np.array([[4, 6], [5, 2]], np.int32)
    for b in range(batch):
        for n in range(layers):
            indices[n, b] = rng.choice(recent_start[b], 6, replace=False)
    nodes = np.flatnonzero(IRREGULAR.depths == 2)
    heads = rng.standard_normal((batch, len(nodes), kv_heads * (group + 2), dim)).astype(np.float32)
    ones, zeros = np.ones((batch, len(nodes), dim), np.float32), np.zeros((batch, len(nodes), dim), np.float32)
    new = NewTokens(jnp.asarray(heads), jnp.asarray(ones), jnp.asarray(zeros), kv_heads)  # no rotation
    rows = base[:, None] + nodes[None, :]
    prefix = DraftPrefix(jnp.asarray(indices), jnp.asarray(counts), jnp.asarray(recent_start), recent_span)
    attention = TreeAttention(jnp.asarray(rows), jnp.asarray(base), jnp.asarray(IRREGULAR.ancestors[nodes]), prefix)
    run = jax.jit(lambda attention, *args: attention(layer, *args))
    out, k_new, _, _ = run(attention, new, jnp.asarray(rows), jnp.asarray(k_cache), jnp.asarray(v_cache))

    q = heads[:, :, : kv_heads * group].astype(np.float64)
    for b in range(batch):  # the level's K/V land in its rows first, as the pass writes them
        k_cache[layer, b, rows[b]] = heads[b, :, kv_heads * group : kv_heads * (group + 1)]
        v_cache[layer, b, rows[b]] = heads[b, :, kv_heads * (group + 1) :]
    np.testing.assert_array_equal(np.asarray(k_new), k_cache)
    for b in range(batch):
        for s, node in enumerate(nodes):
            path = [base[b] + r for r in np.flatnonzero(IRREGULAR.ancestors[node])]
            seen = sorted(set(indices[layer, b, : counts[layer, b]]) | set(range(recent_start[b], base[b])) | set(path))
            for h in range(kv_heads * group):
                keys = k_cache[layer, b, seen, h // group].astype(np.float64)
                logits = keys @ q[b, s, h] / np.sqrt(dim)
                weights = np.exp(logits - logits.max())
                want = (weights / weights.sum()) @ v_cache[layer, b, seen, h // group].astype(np.float64)
                np.testing.assert_allclose(np.asarray(out[b, s, h]), want, atol=1e-5, rtol=1e-5)


def run_to_end(engine, ids, opts):
    """The final decode state of a whole run (engine.start, then the compiled loop to the end)."""
    started = engine.start(ids, opts)
    rows = started.state.committed.shape[0]
    return started.decode(engine.model.params, started.draft_params, started.state, np.int32(10_000),
                          np.int32(rows))


@pytest.fixture(scope="module")
def plain(engine):
    """(prompts, greedy tokens by full recomputation, plain decoding's final state, with logprobs and a stop id)."""
    ids = prompts(LENGTHS, engine.config.vocab_size, seed=1)
    # A repeated stretch gives the n-gram drafter matches beyond those of the output's own loops.
    ids[1] = ids[1][:17] + ids[1][:17]
    state = run_to_end(engine, ids, GenerationOptions(max_new_tokens=NEW, **CONTROLS))
    return ids, dense_greedy(engine, ids, NEW, stop_ids=(STOP,)), state


TREES = [
    ("vegas", "self", "2x3"),
    ("ar", "ngram", "3x2"),
    ("ar", "ngram", "9d3"),  # shaped by rank rates: irregular, first choices deepest
]


@pytest.mark.parametrize("method,drafter,tree", TREES, ids=[f"{m}-{d}-{t}" for m, d, t in TREES])
def test_greedy_tree_speculation_is_plain_greedy_decoding(engine, plain, method, drafter, tree):
    ids, expected, plain_state = plain
    opts = GenerationOptions(max_new_tokens=NEW, method=method, draft_tree=tree, drafter=drafter, sparse_ratio=0.1,
                             min_sparse_tokens=8, **CONTROLS)
    state = run_to_end(engine, ids, opts)
    output, count = np.asarray(state.output), np.asarray(state.num_generated)
    assert [output[i, : count[i]].tolist() for i in range(len(ids))] == expected
    assert count[1] == 8  # the stop id ended it
    for b, n in enumerate(count):  # each emitted token's log-probabilities come from its own path's row
        np.testing.assert_allclose(np.asarray(state.logprobs.chosen[b, :n]),
                                   np.asarray(plain_state.logprobs.chosen[b, :n]), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(state.logprobs.top_ids[b, :n]),
                                      np.asarray(plain_state.logprobs.top_ids[b, :n]))
    accepted = np.asarray(state.metrics.accepted).sum(0)
    assert accepted[1] > 0, accepted  # paths of depth 2 and more were accepted: the tree was at work
    assert np.asarray(state.metrics.rank_accepted).sum() == accepted.sum()  # each accepted draft has a rank
    committed = np.asarray(state.committed)
    np.testing.assert_array_equal(committed, np.asarray(plain_state.committed))
    for got, want in zip(state.cache.k + state.cache.v, plain_state.cache.k + plain_state.cache.v):
        for b, rows in enumerate(committed):
            np.testing.assert_allclose(np.asarray(got[b, :rows]), np.asarray(want[b, :rows]), atol=2e-5, rtol=1e-5)


def test_a_chain_shaped_tree_is_the_linear_loop(engine, plain):
    """Sampled, so that the drafts, the keys and the acceptance rule must all agree: tokens, τ and acceptance by
    position equal γ = 3's. (Greedy, both equal plain greedy decoding token for token.)"""
    ids = plain[0]
    common = dict(max_new_tokens=NEW, method="vegas", sparse_ratio=0.1, min_sparse_tokens=8, temperature=1.0)
    linear = engine.generate(ids, GenerationOptions(gamma=3, **common))
    chain = engine.generate(ids, GenerationOptions(draft_tree="3x1", **common))
    assert [r.tokens for r in chain.requests] == [r.tokens for r in linear.requests]
    for key in ("tau", "acceptance_by_position", "accepted_depth_histogram", "iterations"):
        assert chain.metrics[key] == linear.metrics[key], key
    (rate,) = chain.metrics["acceptance_by_rank"]  # a chain's one rank: accepted drafts over the nodes offering one
    assert 0 < rate < 1 and linear.metrics["acceptance_by_rank"] is None
    assert 1.2 < linear.metrics["tau"] < 3.8  # drafts accepted and rejected


# ---- sampling ------------------------------------------------------------------------------------------------
SAMPLED_NEW = 4  # the bootstrap token, then one 2x2 iteration: up to two drafts and a bonus
PROMPT_LENGTH = 32
SAMPLED = dict(temperature=1.0, top_k=3, top_p=0.9)


def tree_sampler():
    """The sampling test's tiny model, a 32-token prompt and the exact float64 joint of the first four tokens (also
    benchmarks/check_lossless_gpu.py's, on a GPU)."""
    engine = tiny_sampler()
    prompt = prompts([PROMPT_LENGTH], VOCAB, seed=5)[0]
    logits = continuation_logits(engine, prompt, SAMPLED_NEW)
    probs, margin = processed_probs(np.asarray(logits, np.float64), **SAMPLED)
    assert margin > 1e-4
    joint = np.ones((VOCAB,) * SAMPLED_NEW)
    for i in range(SAMPLED_NEW):
        p = probs[:, i].reshape((VOCAB,) * (SAMPLED_NEW - 1) + (VOCAB,))
        p = p[(slice(None),) * i + (0,) * (SAMPLED_NEW - 1 - i)]
        joint *= p.reshape((VOCAB,) * (i + 1) + (1,) * (SAMPLED_NEW - 1 - i))
    return engine, prompt, joint


@pytest.fixture(scope="module")
def sampler():
    return tree_sampler()


def sampled_counts(sampler, drafter: str, seeds: int = 20_000, tree: str = "2x2"):
    engine, prompt, _ = sampler
    method = "vegas" if drafter == "self" else "ar"
    opts = GenerationOptions(max_new_tokens=SAMPLED_NEW, method=method, draft_tree=tree, drafter=drafter,
                             sparse_ratio=0.02, min_sparse_tokens=2, prefill_chunk=80,
                             max_model_len=PROMPT_LENGTH + SAMPLED_NEW, **SAMPLED)
    result = engine.generate([prompt] * seeds, opts)
    outputs = np.array([r.tokens for r in result.requests])
    counts = np.zeros((VOCAB,) * SAMPLED_NEW)
    np.add.at(counts, tuple(outputs.T), 1)
    return counts, result.metrics["accepted_depth_histogram"]


# The self drafter's children are draws without replacement, the n-gram drafter's fixed choices. 3d2, shaped by
# rank rates, is irregular: the root's first child has one child of its own, its second none.
@pytest.mark.parametrize("drafter,seeds,tree", [("self", 20_000, "2x2"), ("ngram", 10_000, "2x2"),
                                                ("self", 20_000, "3d2")])
def test_sampled_trees_keep_the_distribution(sampler, drafter, seeds, tree):
    counts, histogram = sampled_counts(sampler, drafter, seeds, tree)
    # Rejections at the root, and paths of depth 1 and 2, each in at least 2 % of the tree iterations.
    assert min(histogram) > 0.02 * sum(histogram), histogram
    p_value = chi_square_p_value(counts, sampler[2])
    assert p_value > 1e-3, f"p = {p_value:.2e}"


def test_sampling_without_the_residual_is_caught(sampler, monkeypatch):
    """After a rejected sibling, drawing from the node's target as it was (not from the residual max(0, p - q))
    favours the drafted tokens: the same test rejects it, already at 4,000 seeds (p below 1e-100 at 5,000)."""
    monkeypatch.setattr(tree_decode, "residual", lambda p, q: p)
    engine, prompt, joint = sampler
    counts, _ = sampled_counts((Engine(engine.model), prompt, joint), "self", 4_000)  # a fresh engine compiles anew
    p_value = chi_square_p_value(counts, sampler[2])
    assert p_value < 1e-6, f"p = {p_value:.2e}"


def test_library_refusals_name_the_argument(engine):
    with pytest.raises(InputError, match="draft_tree 2x2: a dense model's self drafter drafts with a KV selection"):
        engine.check_input([[1, 2, 3]], GenerationOptions(draft_tree="2x2"))
    cases = [
        (dict(draft_tree="4x2", gamma=3, method="vegas"), "gamma 3 contradicts draft_tree 4x2"),
        (dict(drafter="ngram"), "drafter ngram drafts a tree: give draft_tree"),
        (dict(draft_tree="2x2", drafter="ngram", method="vegas"), "drafter ngram reads no KV selection"),
        (dict(draft_tree="2x2", method="quest"), "not with method quest"),
        (dict(draft_tree="2x2", method="vegas", temperature=1.0, presence_penalty=0.5), "presence_penalty"),
        (dict(draft_tree="2x2", method="vegas", gamma="auto"), "gamma auto: not with draft_tree"),
        (dict(draft_tree="2x2", drafter="eagle", method="vegas"), "drafter must be one of self, ngram"),
    ]
    for fields, message in cases:
        with pytest.raises(InputError, match=message):
            GenerationOptions.check(dataclasses.replace(GenerationOptions(), **fields))
