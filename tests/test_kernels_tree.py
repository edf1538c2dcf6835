"""tree_attention in interpret mode against a float64 numpy brute force (each node's visible keys: the prefix, then
its ancestors found by walking the parents array), on chains, full trees and a 64-node tree, ragged batches; a chain
equals the linear verification kernel; TreeAttention's kernel path equals its jnp path, and greedy tree speculation
through the kernel is plain greedy decoding.

Every run draws fresh inputs; a failing test prints its seed, and KERNEL_TEST_SEED=<seed> replays it. Cache rows at
or past base[b] + R (scratch rows this round has not filled) are NaN, so reading any of them shows up as NaN, as
does an output the kernel never writes (interpret mode fills those with NaN).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from models.attention import NewTokens, rope_tables
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.verify_attention import verify_attention, verify_attention_reference
from tests.test_kernels_verify import OUTPUT_TOLERANCE
from tests.test_kernels_verify import make_case as make_verify_case
from tests.test_lossless_tiny import prompts, tiny_engine
from vegas_jax.attention.tree import TreeAttention
from vegas_jax.attention.verify import ScoreRequest
from vegas_jax.runtime.engine import GenerationOptions
from vegas_jax.sharding import Placement
from vegas_jax.decode.tree_shapes import TreeShape

SCORE_TOLERANCE = 1e-5  # logit scores are float32 sums of bf16-exact products in both dtypes


def random_tree(nodes: int, reach: int, seed: int) -> TreeShape:
    """Node i hangs off one of the `reach` nodes before it."""
    rng = np.random.default_rng(seed)
    return TreeShape(tuple([-1] + [int(rng.integers(max(0, i - reach), i)) for i in range(1, nodes + 1)]))


RANDOM_64 = random_tree(64, 12, seed=64)  # 64 drafted nodes, depth 14, up to 4 children, 2 deepest nodes


def make_case(rng, tree: TreeShape, *, capacity, kv_heads, group, head_dim, bases, dtype):
    """test_kernels_verify's case with the tree's rows as the new tokens at bases: rows past base + R are NaN."""
    return make_verify_case(rng, capacity=capacity, kv_heads=kv_heads, group=group, head_dim=head_dim,
                            queries=tree.rows, starts=bases, dtype=dtype)


def boundary_weights(tree: TreeShape) -> np.ndarray:
    """The Vegas rows of a tree: the root 1/2, the deepest nodes 1/2 between them."""
    weights = np.zeros(tree.rows, np.float32)
    weights[list(tree.levels[-1])] = 0.5 / len(tree.levels[-1])
    weights[0] += 0.5
    return weights


def path_of(parents, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path


def expected(q, k, v, base, parents, weights):
    """float64 tree attention and weighted logit scores ([B, T], -inf past base)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, rows, num_q_heads, head_dim = q.shape
    capacity, kv_heads = k.shape[1:3]
    group = num_q_heads // kv_heads
    out = np.empty_like(q)
    scores = np.full((batch, capacity), -np.inf)
    for b in range(batch):
        scores[b, : base[b] + 1] = 0.0
        for node in range(rows):
            visible = list(range(base[b])) + sorted(base[b] + j for j in path_of(parents, node))
            for h in range(num_q_heads):
                raw = k[b, visible, h // group] @ q[b, node, h]
                weight = np.exp(raw / np.sqrt(head_dim) - (raw / np.sqrt(head_dim)).max())
                out[b, node, h] = (weight / weight.sum()) @ v[b, visible, h // group]
                scores[b, : base[b] + 1] += weights[node] * raw[: base[b] + 1] / num_q_heads
    return out, scores


def relative_error(actual, wanted, what):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values (unwritten, or read past the tree's rows)"
    return np.abs(actual - wanted).max() / np.abs(wanted).max()


def assert_matches(out, scores, want_out, want_scores, dtype):
    error = relative_error(out, want_out, "output")
    assert error <= OUTPUT_TOLERANCE[dtype], f"output relative error {error:.2e}"
    if scores is None:
        return
    scores = np.asarray(scores)
    assert scores.dtype == np.float32
    candidate = np.isfinite(want_scores)
    assert (scores[~candidate] == -np.inf).all(), "keys past the root's row must score -inf"
    error = relative_error(scores[candidate], want_scores[candidate], "scores")
    assert error <= SCORE_TOLERANCE, f"scores relative error {error:.2e}"


CASES = {
    # GQA 3, D 16, ragged: a tree at the cache's start (no prefix), one mid-cache, one whose padded tree block runs
    # past the cache's end; two prefix splits of blocks of 16; scored.
    "6x1": dict(tree=TreeShape.chain(6), capacity=64, kv_heads=2, group=3, head_dim=16, bases=[0, 25, 56],
                dtype=jnp.float32, scored=True, launch=dict(block_k=16, num_splits=2)),
    "4x2": dict(tree=TreeShape.full(4, 2), capacity=96, kv_heads=1, group=4, head_dim=32, bases=[3, 50],
                dtype=jnp.float32, scored=False, launch=dict(block_k=16, num_splits=3)),
    # 40 rows of 3 heads: 120 query rows in 8 row blocks of 16, default splits; bf16.
    "3x3": dict(tree=TreeShape.full(3, 3), capacity=128, kv_heads=2, group=3, head_dim=16, bases=[70, 9],
                dtype=jnp.bfloat16, scored=False, launch=dict(block_q=16)),
    # 65 rows of NSA-1B's group of 16: 1040 query rows, 9 row blocks of 128, each scoring its own rows.
    # One draft of 2 heads: 4 query rows, fewer than Triton's smallest dot, padded to one block of 16.
    "1x1": dict(tree=TreeShape.chain(1), capacity=48, kv_heads=2, group=2, head_dim=16, bases=[5, 30],
                dtype=jnp.float32, scored=True, launch=dict(block_k=16)),
    "64": dict(tree=RANDOM_64, capacity=160, kv_heads=1, group=16, head_dim=16, bases=[40, 90],
               dtype=jnp.float32, scored=True, launch=dict(block_k=32, num_splits=2)),
}


@pytest.mark.parametrize("case_name", CASES)
def test_tree_attention_matches_float64(rng, case_name):
    shape = dict(CASES[case_name])
    tree, dtype, scored, launch = shape.pop("tree"), shape["dtype"], shape.pop("scored"), shape.pop("launch")
    case = make_case(rng, tree, **shape)
    weights = boundary_weights(tree)
    out, scores = tree_attention(*case, jnp.asarray(tree.ancestors),
                                 score_weights=jnp.asarray(weights) if scored else None, interpret=True, **launch)
    assert out.shape == case[0].shape and out.dtype == dtype and (scores is None) == (not scored)
    want_out, want_scores = expected(*case, tree.parents, weights)
    assert_matches(out, scores, want_out, want_scores, dtype)
    if not tree.is_chain:
        # The check catches a wrong mask: causal attention over the tree's rows is far from the tree's output.
        finite = [jnp.nan_to_num(x, nan=7.0) for x in case[1:3]]
        causal, _ = verify_attention_reference(case[0], *finite, case[3])
        assert relative_error(causal, want_out, "causal") > 0.1


def test_chain_equals_the_linear_verification_kernel(rng):
    """A chain of 7 (γ = 6) is linear verification: the same outputs and the same Collect-2-Query logit scores."""
    tree = TreeShape.chain(6)
    case = make_case(rng, tree, capacity=80, kv_heads=3, group=3, head_dim=32, bases=[60, 11, 0], dtype=jnp.float32)
    out, scores = tree_attention(*case, jnp.asarray(tree.ancestors), score_weights=jnp.asarray(boundary_weights(tree)),
                                 block_k=16, num_splits=2, interpret=True)
    linear_out, linear_scores = verify_attention(*case, score_mode="logit", block_k=16, num_splits=2, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(linear_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(linear_scores), atol=1e-5, rtol=1e-5)


def test_reference_matches_float64(rng):
    tree = TreeShape.full(3, 2)
    case = make_case(rng, tree, capacity=48, kv_heads=2, group=2, head_dim=16, bases=[30, 4], dtype=jnp.float32)
    weights = boundary_weights(tree)
    # The dense reference weighs every row (NaN * 0 = NaN), so it gets the finite cache.
    finite = [jnp.nan_to_num(x, nan=7.0) for x in case[1:3]]
    out, scores = tree_attention_reference(case[0], *finite, case[3], jnp.asarray(tree.ancestors),
                                           score_weights=jnp.asarray(weights))
    assert_matches(out, scores, *expected(*case, tree.parents, weights), jnp.float32)


def test_rejects_bad_arguments(rng):
    tree = TreeShape.full(2, 2)
    case = make_case(rng, tree, capacity=32, kv_heads=1, group=1, head_dim=16, bases=[3], dtype=jnp.float32)
    with pytest.raises(ValueError, match="ancestors must be"):
        tree_attention(*case, jnp.ones((tree.rows - 1, tree.rows), bool), interpret=True)
    with pytest.raises(ValueError, match="score_weights must have shape"):
        tree_attention(*case, jnp.asarray(tree.ancestors), score_weights=jnp.ones(3), interpret=True)


def _tree_layer_inputs(rng, tree, bases, capacity, kv_heads, group, head_dim):
    batch = len(bases)
    rows = jnp.asarray(np.array(bases)[:, None] + np.arange(tree.rows)[None, :], jnp.int32)
    positions = jnp.asarray(np.array(bases)[:, None] + tree.depths[None, :], jnp.int32)
    heads = rng.standard_normal((batch, tree.rows, kv_heads * (group + 2), head_dim)) * 2
    cos, sin = rope_tables(positions, 10000.0 ** -(jnp.arange(0, head_dim, 2) / head_dim))
    new = NewTokens(jnp.asarray(heads, jnp.float32), cos, sin, num_kv_heads=kv_heads)
    # Three layers' stacks, as the decoder hands every layer's attention (models.kv_cache.KVCache).
    caches = [jnp.asarray(rng.standard_normal((3, batch, capacity, kv_heads, head_dim)), jnp.float32)
              for _ in range(2)]
    return rows, positions, new, caches


@pytest.mark.parametrize("rows", ["boundary", "all"])
def test_tree_verification_runs_the_kernel_where_it_serves(rng, rows):
    """TreeAttention on the interpret placement equals its jnp path (outputs, written rows, logit scores of the
    boundary or all rows); weight scores and draft passes stay jnp."""
    tree = TreeShape.full(2, 3)
    bases = [17, 40]
    rows_, positions, new, caches = _tree_layer_inputs(rng, tree, bases, 64, 2, 2, 16)
    reference = TreeAttention(rows_, jnp.asarray(bases, jnp.int32), jnp.asarray(tree.ancestors), None,
                              ScoreRequest("logit", rows), 1, tuple(tree.levels[-1]))
    kernel = TreeAttention(**{**reference.__dict__, "placement": Placement("interpret")})
    assert kernel._kernel_serves(0) and not reference._kernel_serves(0)
    assert not TreeAttention(**{**kernel.__dict__, "request": ScoreRequest("weight")})._kernel_serves(0)
    assert not TreeAttention(**{**kernel.__dict__, "request": ScoreRequest("logit", "each")})._kernel_serves(0)
    # A middle layer of the stacks: the kernel reads and the jnp path writes that layer alone.
    want = reference(1, new, positions, *caches)
    got = kernel(1, new, positions, *caches)
    np.testing.assert_array_equal(np.asarray(got[1][0]), np.asarray(caches[0][0]))  # other layers untouched
    for name, a, b in zip(("out", "k", "v", "scores"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("scored", [False, True], ids=["plain", "logit"])
@pytest.mark.parametrize("kv_heads, group, tree", [(3, 3, TreeShape.full(4, 2)), (2, 16, RANDOM_64)],
                         ids=["smollm2_4x2", "nsa1b_64"])
def test_lowers_to_triton_for_h200(kv_heads, group, tree, scored):
    batch, capacity, head_dim = 2, 32768, 64
    spec = jax.ShapeDtypeStruct
    cache = spec((batch, capacity, kv_heads, head_dim), jnp.bfloat16)
    weights = spec((tree.rows,), jnp.float32) if scored else None
    lowered = lower_for_h200(
        tree_attention,
        spec((batch, tree.rows, kv_heads * group, head_dim), jnp.bfloat16),
        cache,
        cache,
        spec((batch,), jnp.int32),
        spec((tree.rows, tree.rows), jnp.bool_),
        score_weights=weights,
    )
    assert "__gpu$xla.gpu.triton" in lowered


def test_greedy_tree_speculation_through_the_kernel_is_plain_greedy(monkeypatch):
    """The loop's tree verification on the interpret placement (the tree kernel with Vegas' logit scores guiding the
    self drafts): token for token plain greedy decoding, on a ragged batch, with the trees at work."""
    engine = tiny_engine()
    ids = prompts([21, 34, 9], engine.config.vocab_size, seed=1)
    common = dict(max_new_tokens=10, sparse_ratio=0.1, min_sparse_tokens=8)
    plain = engine.generate(ids, GenerationOptions(**common))
    monkeypatch.setenv("VEGAS_KERNELS", "interpret")
    tree = engine.generate(ids, GenerationOptions(method="vegas", draft_tree="2x3", drafter="self", **common))
    assert [r.tokens for r in tree.requests] == [r.tokens for r in plain.requests]
    assert tree.metrics["tau"] > 1.0  # drafts were accepted: the verification's logits decided them
