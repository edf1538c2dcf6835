"""pallas_kernels.top_n (interpret mode) against numpy's stable argsort: descending values, ties to the lower
position, +inf first and -inf last, rows of any length and batch shape; its H200 lowering; and NSA's block
selection through it equals the lax.top_k path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from models.config import NSA_1B_LAYOUT
from models.nsa_selection import select_blocks
from pallas_kernels.top_n import MAX_TILE, TopNLaunch, top_n


def numpy_top_n(x: np.ndarray, n: int):
    order = np.argsort(-x, axis=-1, kind="stable")[..., :n]  # -(-inf) = +inf sorts last; ties keep position order
    return np.take_along_axis(x, order, -1), order


@pytest.mark.parametrize("shape, n", [((3, 5), 5), ((7, 100), 16), ((2, 3, 2048), 16), ((5, 3000), 16),
                                      ((1, 40), 1), ((4, 64), 64)])
def test_top_n_equals_a_stable_descending_sort(rng, shape, n):
    """Coarse values (many ties), +inf and -inf entries, rows mostly -inf: the kernel's values and positions are
    the first n of a stable descending sort."""
    x = np.round(rng.normal(size=shape), 1).astype(np.float32)
    x[rng.random(shape) < 0.1] = np.inf
    x[rng.random(shape) < 0.3] = -np.inf
    x.reshape(-1, shape[-1])[0, 1:] = -np.inf  # a row with one finite entry: the rest come back as -inf, in order
    values, indices = top_n(jnp.asarray(x), n, interpret=True)
    want_values, want_indices = numpy_top_n(x, n)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(values), want_values)


@pytest.mark.parametrize("launch", [TopNLaunch(chunk=16, block_rows=4, num_warps=1),
                                    TopNLaunch(chunk=32, block_rows=1, num_warps=2),
                                    TopNLaunch(chunk=256, block_rows=2, num_warps=4)])
def test_every_launch_returns_the_same_top_n(rng, launch):
    """Chunks shorter than a row (two stages, ties across chunks, a padded last chunk), several rows a program,
    rows fewer than a program holds: each launch still returns a stable descending sort's first n."""
    x = np.round(rng.normal(size=(5, 200)), 1).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1, 3:] = -np.inf
    values, indices = top_n(jnp.asarray(x), 16, launch=launch, interpret=True)
    want_values, want_indices = numpy_top_n(x, 16)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(values), want_values)


@pytest.mark.parametrize("rows, length, want", [
    (24, 512, TopNLaunch(chunk=512, block_rows=1, num_warps=1)),  # a batch-8 SmolLM2 view step at 8K: rows whole
    (744, 128, TopNLaunch(chunk=128, block_rows=1, num_warps=1)),  # short rows: a program a row, one warp
    (2, 2048, TopNLaunch(chunk=2048, block_rows=1, num_warps=4)),  # NSA-1B at 32K, batch 1: rows whole, 4 warps
    (1024, 2048, TopNLaunch(chunk=2048, block_rows=2, num_warps=4)),  # 64-node trees at batch 8: rows whole
    (2, 8192, TopNLaunch(chunk=256, block_rows=1, num_warps=1)),  # NSA-1B at 128K, batch 1: 32 chunks a row
])
def test_the_default_launch_spreads_rows_over_programs(rows, length, want):
    assert TopNLaunch.for_rows(rows, length) == want


def test_top_n_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="n must be in"):
        top_n(jnp.zeros((2, 8)), 9)
    with pytest.raises(ValueError, match="launch.chunk must be a power of two >= 16"):
        top_n(jnp.zeros((2, 64)), 9, launch=TopNLaunch(chunk=8, block_rows=1, num_warps=1))


@pytest.mark.parametrize("length", [MAX_TILE + 1, 3 * MAX_TILE - 5])
def test_rows_longer_than_a_tile_go_in_two_stages(rng, length):
    """Ties across chunks (coarse values), -inf everywhere but a few entries in the last, padded chunk, and a row
    whose only finite entries are in its first chunk: still a stable descending sort's first n."""
    x = np.round(rng.normal(size=(3, length)), 1).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = -np.inf
    x[1, :-3] = -np.inf
    x[2, 5:] = -np.inf
    values, indices = top_n(jnp.asarray(x), 16, interpret=True)
    want_values, want_indices = numpy_top_n(x, 16)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(values), want_values)


def test_nsa_selection_through_the_kernel_equals_lax_top_k(rng):
    """select_blocks with top_n: forced blocks (+inf), blocks past the query's own (-inf), ties among scores."""
    scores = np.round(rng.random((2, 3, 6, 40)), 2).astype(np.float32)
    positions = rng.integers(0, 40 * NSA_1B_LAYOUT.select_block, (2, 3, 6))
    kernel = select_blocks(jnp.asarray(scores), jnp.asarray(positions), NSA_1B_LAYOUT,
                           functools.partial(top_n, interpret=True))
    plain = select_blocks(jnp.asarray(scores), jnp.asarray(positions), NSA_1B_LAYOUT)
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(plain))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("rows, length", [(2, 2048), (1024, 2048), (16, 8192), (3, 37), (2, 20000)])
def test_top_n_lowers_to_triton_for_h200(rows, length):
    lowered = lower_for_h200(jax.jit(functools.partial(top_n, n=16)),
                             jax.ShapeDtypeStruct((rows, length), jnp.float32))
    two_stages = TopNLaunch.for_rows(rows, length).chunk < length  # few or long rows: chunks, then their candidates
    assert lowered.count("__gpu$xla.gpu.triton") == 1 + two_stages
