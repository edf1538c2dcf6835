"""select_topk in interpret mode against numpy's exact top-k, compared as sets of values.

Every run draws fresh inputs; a failing test prints its seed, and KERNEL_TEST_SEED=<seed> replays it.
Interpret mode fills outputs the kernel never writes with INT32_MIN, so every slot being a position or PAD_INDEX
means every slot was written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.select_topk import PAD_INDEX, monotone_key, select_topk, select_topk_reference


def make_scores(rng, rows, length):
    """Rows of different kinds, cycled: plain, heavy ties, -inf candidates masks, NaN/+inf, short candidate
    ranges, all -inf, all equal, negative only."""
    scores = rng.standard_normal((rows, length)).astype(np.float32)
    for r in range(rows):
        kind = r % 8
        if kind == 1:  # a few distinct values, ties spread over every chunk
            scores[r] = rng.integers(-3, 4, length)
        elif kind == 2:  # non-candidates scored -inf, as verification emits them
            scores[r, rng.random(length) < 0.5] = -np.inf
        elif kind == 3:  # non-finite junk is never selected
            scores[r, rng.random(length) < 0.1] = np.nan
            scores[r, rng.random(length) < 0.05] = np.inf
        elif kind == 4:  # a short sequence: candidates only at the start
            scores[r, rng.integers(1, length // 4) :] = -np.inf
        elif kind == 5:
            scores[r] = -np.inf
        elif kind == 6:
            scores[r] = 0.25
        elif kind == 7:  # tiny negative magnitudes, subnormals included
            scores[r] = -np.abs(scores[r]) * 1e-39
    return scores


def check_selection(scores, k, k_max, indices, counts, *, ties_lowest=True, positions_ordered=False):
    """Exact top-k as a multiset of values; ties_lowest: among scores equal to the k-th largest the lowest positions
    are taken; positions_ordered: positions increase."""
    indices, counts = np.asarray(indices), np.asarray(counts)
    assert indices.shape == (len(scores), k_max) and indices.dtype == np.int32
    for r, row in enumerate(scores):
        finite_values = np.sort(row[np.isfinite(row)])[::-1]
        want = min(max(k[r], 0), k_max, len(finite_values))
        assert counts[r] == want, f"row {r}: count {counts[r]}, want {want}"
        chosen = indices[r, : counts[r]]
        assert len(np.unique(chosen)) == want and ((0 <= chosen) & (chosen < len(row))).all(), f"row {r}"
        # Same multiset of values as the exact top-k: ties may pick any of the equal positions.
        np.testing.assert_array_equal(np.sort(row[chosen])[::-1], finite_values[:want], err_msg=f"row {r}")
        assert (indices[r, counts[r] :] == PAD_INDEX).all(), f"row {r}: slots past the count must hold the pad"
        if positions_ordered and want:
            assert (np.diff(chosen) > 0).all(), f"row {r}: positions must increase"
        if ties_lowest and want:
            tau = finite_values[want - 1]
            ties = np.flatnonzero(row == tau)
            taken = np.sort(np.intersect1d(chosen, ties))
            np.testing.assert_array_equal(taken, ties[: len(taken)], err_msg=f"row {r}")


def draw_k(rng, rows, length, k_max):
    """Per-row k: 0, exactly k_max, above k_max (clamped), negative (none) and random in between."""
    k = rng.integers(1, k_max, rows)
    k[:4] = [0, k_max, k_max + 17, -3][: min(rows, 4)]
    return jnp.asarray(k, jnp.int32)


@pytest.mark.parametrize(
    "rows, length, k_max, launch",
    [
        # The default 4-bit radix over a length that is not a multiple of the block, several chunks per row.
        (10, 1000, 120, dict(block_size=64, num_chunks=3)),
        # 5 bits: the last pass fixes only the remaining 2 bits; one chunk per row.
        (8, 517, 300, dict(radix_bits=5, block_size=128, num_chunks=1)),
        # 3 bits and the default launch parameters.
        (9, 2048, 64, dict(radix_bits=3)),
    ],
)
def test_radix_matches_exact_top_k(rng, rows, length, k_max, launch):
    scores = make_scores(rng, rows, length)
    k = draw_k(rng, rows, length, k_max)
    indices, counts = select_topk(jnp.asarray(scores), k, k_max=k_max, interpret=True, **launch)
    check_selection(scores, np.asarray(k), k_max, indices, counts, positions_ordered=True)


def test_rejects_bad_arguments():
    scores, k = jnp.zeros((2, 64)), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="radix_bits"):
        select_topk(scores, k, k_max=8, radix_bits=9, interpret=True)
    with pytest.raises(ValueError, match=r"\[R, T\]"):
        select_topk(scores, k[:1], k_max=8, interpret=True)


def test_reference_matches_exact_top_k(rng):
    scores = make_scores(rng, 16, 700)
    k = draw_k(rng, 16, 700, 200)
    indices, counts = select_topk_reference(jnp.asarray(scores), k, k_max=200)
    check_selection(scores, np.asarray(k), 200, indices, counts, ties_lowest=False)


def test_monotone_key_orders_like_floats(rng):
    values = np.concatenate([
        rng.standard_normal(1000) * 10.0 ** rng.integers(-40, 38, 1000),
        [0.0, -0.0, 1e-45, -1e-45, np.finfo(np.float32).max, -np.finfo(np.float32).max],
    ]).astype(np.float32)
    keys = np.asarray(monotone_key(jnp.asarray(values))).astype(np.int64)  # diffs overflow int32
    order = np.lexsort((keys, values))  # by value; -0.0 and +0.0 are equal floats, so then by key
    assert (np.diff(keys[order]) >= 0).all()
    # Equal keys only for equal floats (-0.0 and +0.0 compare equal as floats but get adjacent keys).
    same_key = np.diff(keys[order]) == 0
    assert (np.diff(values[order])[same_key] == 0).all()
    junk = np.asarray(monotone_key(jnp.asarray([np.nan, np.inf, -np.inf], jnp.float32)))
    assert (junk < keys.min()).all()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_lowers_to_triton_for_h200():
    rows, length = 8, 32768
    lowered = lower_for_h200(
        jax.jit(functools.partial(select_topk, k_max=2294)),
        jax.ShapeDtypeStruct((rows, length), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )
    # The counting passes (8 of 4 bits each) and the compaction.
    assert lowered.count("__gpu$xla.gpu.triton") >= 9
