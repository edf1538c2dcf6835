"""pallas_kernels.nsa_tree_compressed (interpret mode) and its XLA twin against numpy float64: the compressed
branch of a tree's nodes over the prefix's visible compressed rows, with the rows the paths complete entering
only through their log-sum-exps; and its H200 lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.nsa_tree_compressed import (
    compressed_tree_branch,
    compressed_tree_branch_reference,
    default_splits,
)


def numpy_branch(q, k, v, visible, extra_lse):
    """float64: o [T, H_kv, G, D], probs [H_kv, T, C] (summed over the group), lse [H_kv, G, T]."""
    num_nodes, num_q_heads, head_dim = q.shape
    rows, num_kv_heads, _ = k.shape
    qg = q.reshape(num_nodes, num_kv_heads, num_q_heads // num_kv_heads, head_dim).astype(np.float64)
    logits = np.einsum("thgd,chd->hgtc", qg, k.astype(np.float64)) / np.sqrt(head_dim)
    logits[..., visible:] = -np.inf
    with np.errstate(divide="ignore"):
        lse = np.logaddexp(np.log(np.exp(logits).sum(axis=-1)), extra_lse.astype(np.float64))
    p = np.exp(logits - np.where(np.isfinite(lse), lse, 0.0)[..., None])
    return np.einsum("hgtc,chd->thgd", p, v.astype(np.float64)), p.sum(axis=1), lse


@pytest.mark.parametrize("nodes, q_heads, kv_heads, rows, visible, splits", [
    (5, 4, 2, 128, 70, None),   # a partly visible last block
    (64, 32, 2, 256, 200, 4),   # NSA-1B's group of 16: 8 nodes a program, 8 node blocks, 4 splits
    (11, 9, 3, 128, 128, 2),    # SmolLM2's group of 3: 42 nodes a program, every row visible
    (3, 4, 2, 64, 0, None),     # nothing visible: only the paths' rows count
])
def test_branch_equals_float64(rng, nodes, q_heads, kv_heads, rows, visible, splits):
    head_dim = 16
    q = rng.normal(size=(nodes, q_heads, head_dim)).astype(np.float32)
    k, v = (rng.normal(size=(rows, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    extra = rng.normal(size=(kv_heads, q_heads // kv_heads, nodes)).astype(np.float32)
    extra[:, :, ::2] = -np.inf  # nodes whose paths complete no compressed row
    if visible == 0:
        extra[:, :, 0] = -np.inf  # a node that sees no compressed row at all: zeros and lse -inf
    want = numpy_branch(q, k, v, visible, extra)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(visible), jnp.asarray(extra))
    kernel = compressed_tree_branch(*args, num_splits=splits, interpret=True)
    for got in (kernel, compressed_tree_branch_reference(*args)):
        for name, g, w in zip(("o", "probs", "lse"), got, want):
            g = np.asarray(g)
            assert np.array_equal(np.isfinite(g), np.isfinite(w)), name
            np.testing.assert_allclose(np.where(np.isfinite(w), g, 0), np.where(np.isfinite(w), w, 0), rtol=2e-5,
                                       atol=2e-6, err_msg=name)
    assert np.all(np.asarray(kernel[1])[:, :, visible:] == 0)  # rows past `visible` come back as zeros
    # The probabilities, which select blocks, to float32's accuracy: summed from three bf16 terms (dropping the
    # last one puts the error at 2-3x this bound).
    np.testing.assert_allclose(np.asarray(kernel[1], np.float64), want[1], rtol=2e-6, atol=2e-7)


def test_splits_hold_whole_blocks_and_aim_at_the_target_programs():
    assert default_splits(1, 2, 8, 2048, 64) == 32  # 2 heads x 8 node blocks x 32 splits = 512 programs
    assert default_splits(8, 2, 8, 2048, 64) == 4
    assert default_splits(64, 2, 8, 2048, 64) == 1
    assert default_splits(1, 2, 1, 192, 64) == 3  # 3 blocks: a split each


@pytest.mark.parametrize("rows, options, needle", [
    (100, {}, "compressed rows 100 must be a multiple of block_c 64"),
    (192, {"num_splits": 2}, "num_splits 2 must divide the 3 blocks"),
    (128, {"batch": 0}, "batch must be at least 1"),
])
def test_bad_arguments_are_one_clear_error(rows, options, needle):
    q, cache = jnp.zeros((2, 4, 16)), jnp.zeros((rows, 2, 16))
    with pytest.raises(ValueError, match=needle):
        compressed_tree_branch(q, cache, cache, jnp.int32(0), jnp.zeros((2, 2, 2)), interpret=True, **options)


def test_lowers_for_the_h200_at_nsa_1b_shapes():
    """64 nodes, 32 query / 2 KV heads, D 64, 32K context (2,048 compressed rows), bf16: both kernels lower."""
    shapes = (jax.ShapeDtypeStruct((64, 32, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 2, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2048, 2, 64), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32),
              jax.ShapeDtypeStruct((2, 16, 64), jnp.float32))
    lowered = lower_for_h200(jax.jit(functools.partial(compressed_tree_branch, batch=8)), *shapes)
    assert lowered.count("__gpu$xla.gpu.triton") == 2
