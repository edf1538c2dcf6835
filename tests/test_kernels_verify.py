"""verify_attention in interpret mode against a float64 numpy computation.

Every run draws fresh inputs; a failing test prints its seed, and KERNEL_TEST_SEED=<seed> replays it.
Interpret mode fills outputs the kernel never writes with NaN, so finite outputs and scores mean every element
that must be written was. Cache rows at or past start[b] + S are NaN: reading any of them (the kernel must stay
within each sequence's own length) shows up as NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.verify_attention import verify_attention, verify_attention_reference

# Max |error| / max |expected|. Outputs: float32 is exact up to summation order; bf16 rounds the softmax weights
# before the V product and the output itself. Logit scores are float32 arithmetic on the (bf16-exact) inputs in
# both dtypes; weight scores go through float16 log-weights d below the row maximum (error <= |d| e^d 2^-11, 2e-4).
OUTPUT_TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SCORE_TOLERANCE = {"logit": 1e-5, "weight": 5e-4}


def make_case(rng, *, capacity, kv_heads, group, head_dim, queries, starts, dtype):
    batch = len(starts)
    # Larger queries make the softmax peaky, so a wrong causal mask changes the output visibly.
    q = rng.standard_normal((batch, queries, kv_heads * group, head_dim)) * 3
    k = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    v = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    for b, start in enumerate(starts):
        k[b, start + queries :] = np.nan
        v[b, start + queries :] = np.nan
    as_array = lambda x: jnp.asarray(x, dtype)
    return as_array(q), as_array(k), as_array(v), jnp.asarray(starts, jnp.int32)


def expected(q, k, v, start, score_mode, scored_row=None):
    """float64 causal attention and the Collect-2-Query scores of rows 0 and scored_row[b] (default the last;
    [B, T], -inf past start)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, queries, num_q_heads, head_dim = q.shape
    scored_row = np.full(batch, queries - 1) if scored_row is None else np.asarray(scored_row)
    capacity, kv_heads = k.shape[1:3]
    group = num_q_heads // kv_heads
    out = np.empty_like(q)
    scores = np.full((batch, capacity), -np.inf)
    for b in range(batch):
        seen = start[b] + 1  # keys that row 0 sees: the scored candidates
        score_sum = np.zeros(seen)
        for i in range(queries):
            visible = min(start[b] + i + 1, capacity)
            for h in range(num_q_heads):
                raw = k[b, :visible, h // group] @ q[b, i, h]
                weights = np.exp(raw / np.sqrt(head_dim) - (raw / np.sqrt(head_dim)).max())
                weights /= weights.sum()
                out[b, i, h] = weights @ v[b, :visible, h // group]
                # Rows 0 and scored_row each count once (the same row twice when it is 0).
                slots = int(i == 0) + int(i == scored_row[b])
                per_key = raw if score_mode == "logit" else weights
                score_sum += slots * per_key[:seen]
        scores[b, :seen] = score_sum / (2 * num_q_heads)
    return out, (scores if score_mode else None)


def relative_error(actual, wanted, what):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite values (unwritten, or read past a sequence's end)"
    return np.abs(actual - wanted).max() / np.abs(wanted).max()


def assert_matches(out, scores, case, score_mode, dtype, scored_row=None):
    want_out, want_scores = expected(*case, score_mode, scored_row)
    error = relative_error(out, want_out, "output")
    assert error <= OUTPUT_TOLERANCE[dtype], f"output relative error {error:.2e}"
    if score_mode is None:
        assert scores is None
        return
    scores = np.asarray(scores)
    assert scores.shape == want_scores.shape and scores.dtype == np.float32
    candidate = np.isfinite(want_scores)
    assert (scores[~candidate] == -np.inf).all(), "keys past start must score -inf"
    error = relative_error(scores[candidate], want_scores[candidate], "scores")
    assert error <= SCORE_TOLERANCE[score_mode], f"{score_mode} scores relative error {error:.2e}"


CASES = {
    # GQA 4, D 128, S 4; sequences of very different lengths, the shortest (start 0) sees one key from row 0, and
    # no length is a multiple of block_k.
    "gqa4_d128": dict(capacity=100, kv_heads=2, group=4, head_dim=128, queries=4, starts=[0, 61, 96],
                      block_k=16, num_splits=3),
    # GQA 3, D 64, S 7 (γ = 6), default block_k and num_splits.
    "gqa3_d64": dict(capacity=150, kv_heads=3, group=3, head_dim=64, queries=7, starts=[143, 40],
                     block_k=None, num_splits=None),
}


@pytest.mark.parametrize("score_mode", [None, "logit", "weight"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case_name", CASES)
def test_verify_matches_float64(rng, case_name, dtype, score_mode):
    shape = dict(CASES[case_name])
    launch = {name: shape.pop(name) for name in ("block_k", "num_splits")}
    launch = {name: value for name, value in launch.items() if value is not None}
    case = make_case(rng, dtype=dtype, **shape)
    out, scores = verify_attention(*case, score_mode=score_mode, interpret=True, **launch)
    assert out.shape == case[0].shape and out.dtype == dtype
    assert_matches(out, scores, case, score_mode, dtype)


@pytest.mark.parametrize("score_mode", [None, "logit", "weight"])
def test_stacked_cache_reads_only_the_given_layer(rng, score_mode):
    """Caches stacked [L, B, T, H_kv, D] with a (traced) layer, as the scanned decoder hands them: the kernel reads
    that layer in place. The other layers are NaN: reading any of their rows would poison the output."""
    shape = dict(CASES["gqa3_d64"])
    launch = {name: value for name in ("block_k", "num_splits") if (value := shape.pop(name)) is not None}
    q, k, v, starts = make_case(rng, dtype=jnp.float32, **shape)
    stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])  # noqa: E731
    run = jax.jit(lambda layer: verify_attention(q, stack(k), stack(v), starts, layer=layer, score_mode=score_mode,
                                                 interpret=True, **launch))
    out, scores = run(jnp.int32(1))
    assert_matches(out, scores, (q, k, v, starts), score_mode, jnp.float32)


# Prefill chunks: more query rows than one program holds, tiled in row blocks (a partial last block), each block
# reading keys up to its own last query; one sequence's chunk runs past the cache (its last queries see every key).
PREFILL_CASES = {
    "blocks_of_32": dict(capacity=120, kv_heads=2, group=3, head_dim=64, queries=50, starts=[0, 30, 85],
                         block_q=32, block_k=16, num_splits=2),
    "default_blocks": dict(capacity=200, kv_heads=1, group=4, head_dim=32, queries=45, starts=[100, 3],
                           block_q=None, block_k=None, num_splits=None),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case_name", PREFILL_CASES)
def test_prefill_row_blocks_match_float64(rng, case_name, dtype):
    shape = dict(PREFILL_CASES[case_name])
    launch = {name: shape.pop(name) for name in ("block_q", "block_k", "num_splits")}
    launch = {name: value for name, value in launch.items() if value is not None}
    case = make_case(rng, dtype=dtype, **shape)
    out, scores = verify_attention(*case, interpret=True, **launch)
    assert out.shape == case[0].shape and scores is None
    assert_matches(out, scores, case, None, dtype)


def test_row_block_reads_keys_only_up_to_its_last_query(rng):
    """50 queries of 3 heads in blocks of 32 rows: block 0 holds queries 0-10 (query 10's heads 0 and 1). Keys past
    start + 10 are NaN: block 0 must come out finite (its masked V rows would turn a read into NaN), later blocks see
    them."""
    q, k, v, start = make_case(rng, capacity=120, kv_heads=1, group=3, head_dim=16, queries=50, starts=[30],
                               dtype=jnp.float32)
    clean_out, _ = expected(q, k, v, start, None)
    k, v = (x.at[:, 41:].set(jnp.nan) for x in (k, v))
    out, _ = verify_attention(q, k, v, start, block_q=32, block_k=16, num_splits=2, interpret=True)
    first_block = np.asarray(out)[0, :11].reshape(-1, 16)[:32]  # rows 0-31 = query r // 3, head r % 3
    assert np.isfinite(first_block).all(), "block 0 read keys past its last query"
    error = np.abs(first_block - clean_out[0, :11].reshape(-1, 16)[:32]).max() / np.abs(clean_out).max()
    assert error <= OUTPUT_TOLERANCE[jnp.float32]
    assert np.isnan(np.asarray(out)[0, 12:]).all()


def test_scoring_needs_one_row_block(rng):
    many_rows = make_case(rng, capacity=64, kv_heads=1, group=3, head_dim=16, queries=50, starts=[2],
                          dtype=jnp.float32)
    with pytest.raises(ValueError, match="scoring needs S"):
        verify_attention(*many_rows, score_mode="logit", interpret=True)
    gamma_rows = make_case(rng, capacity=64, kv_heads=1, group=3, head_dim=16, queries=7, starts=[2], dtype=jnp.float32)
    with pytest.raises(ValueError, match="scoring needs all 21"):
        verify_attention(*gamma_rows, score_mode="logit", block_q=16, interpret=True)


@pytest.mark.parametrize("score_mode", ["logit", "weight"])
def test_single_query_scores_its_only_row(rng, score_mode):
    case = make_case(rng, capacity=40, kv_heads=1, group=4, head_dim=64, queries=1, starts=[39, 17],
                     dtype=jnp.float32)
    out, scores = verify_attention(*case, score_mode=score_mode, block_k=16, num_splits=2, interpret=True)
    assert_matches(out, scores, case, score_mode, jnp.float32)


@pytest.mark.parametrize("score_mode", ["logit", "weight"])
def test_scores_the_given_row_besides_row_0(rng, score_mode):
    """Adaptive γ drafts fewer tokens than the pass is wide: the second scored row is each sequence's last draft
    (here rows 2, 0 and 5 of 7), not the last row; the kernel and its reference both follow it."""
    shape = dict(CASES["gqa3_d64"], starts=[143, 40, 77])
    del shape["block_k"], shape["num_splits"]
    case = make_case(rng, dtype=jnp.float32, **shape)
    scored_row = jnp.asarray([2, 0, 5], jnp.int32)
    out, scores = verify_attention(*case, scored_row, score_mode=score_mode, interpret=True)
    assert_matches(out, scores, case, score_mode, jnp.float32, scored_row)
    finite = lambda x: jnp.nan_to_num(x, nan=7.0)
    q, k, v, start = case
    out, scores = verify_attention_reference(q, finite(k), finite(v), start, scored_row, score_mode=score_mode)
    assert_matches(out, scores, case, score_mode, jnp.float32, scored_row)
    _, last_row_scores = verify_attention(*case, score_mode=score_mode, interpret=True)
    assert not np.allclose(np.asarray(scores)[:, :40], np.asarray(last_row_scores)[:, :40])  # the row matters


@pytest.mark.parametrize("score_mode", [None, "logit", "weight"])
def test_reference_matches_float64(rng, score_mode):
    shape = dict(CASES["gqa3_d64"])
    del shape["block_k"], shape["num_splits"]
    q, k, v, start = make_case(rng, dtype=jnp.float32, **shape)
    # The dense reference weighs every row (NaN * 0 = NaN), so it gets the finite cache.
    finite = lambda x: jnp.nan_to_num(x, nan=7.0)
    out, scores = verify_attention_reference(q, finite(k), finite(v), start, score_mode=score_mode)
    assert_matches(out, scores, (q, k, v, start), score_mode, jnp.float32)


def test_rejects_unknown_score_mode(rng):
    case = make_case(rng, capacity=32, kv_heads=1, group=1, head_dim=16, queries=2, starts=[3], dtype=jnp.float32)
    with pytest.raises(ValueError, match="score_mode"):
        verify_attention(*case, score_mode="sum", interpret=True)
    with pytest.raises(ValueError, match="block_q must be at most 128"):
        verify_attention(*case, block_q=256, interpret=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("score_mode, queries", [(None, 7), ("logit", 7), ("weight", 7), (None, 512)],
                         ids=["plain", "logit", "weight", "prefill_chunk"])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(8, 4, 128), (3, 3, 64)], ids=["qwen3_8b", "smollm2"])
def test_lowers_to_triton_for_h200(kv_heads, group, head_dim, score_mode, queries):
    batch, capacity = 2, 32768
    spec = jax.ShapeDtypeStruct
    cache = spec((batch, capacity, kv_heads, head_dim), jnp.bfloat16)
    lowered = lower_for_h200(
        jax.jit(functools.partial(verify_attention, score_mode=score_mode)),
        spec((batch, queries, kv_heads * group, head_dim), jnp.bfloat16),
        cache,
        cache,
        spec((batch,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in lowered
