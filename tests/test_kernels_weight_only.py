"""The weight-only quantized matmul kernel (interpret mode) and its jnp twin against float64 numpy, int8 and
packed int4, with and without offsets, on fresh random inputs every run; a failing test prints its seed, and KERNEL_TEST_SEED=<seed> replays it."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.weight_only_matmul import _layout, dequantize, weight_only_matmul, weight_only_matmul_reference


def numpy_weight(q, scale, offset, bits, group):
    """The weight by its definition, float64, one element at a time along K."""
    q = np.asarray(q).astype(np.int64)
    if bits == 4:  # byte row g * group / 2 + j: rows g * group + j (low nibble) and + group / 2 (high)
        n = q.shape[1]
        halves = q.reshape(-1, group // 2, n)
        q = np.concatenate([halves % 16, halves // 16], axis=1).reshape(-1, n)
    k = q.shape[0]
    groups = np.arange(k) // group
    w = q * np.asarray(scale, np.float64)[groups]
    if offset is not None:
        w += np.asarray(offset, np.float64)[groups]
    return w


@pytest.mark.parametrize("bits,group,with_offset,m,splits", [
    (8, 256, False, 3, None),  # per output channel
    (8, 256, True, 1, 2),  # one row: the kernel without a dot
    (8, 32, True, 17, 2),
    (4, 64, True, 1, None),  # one row
    (4, 32, False, 8, 4),
    (4, 64, True, 5, 2),  # the swapped kernel's ragged rows (bf16 activations), with offsets
])
def test_weight_only_matmul_matches_float64(rng, bits, group, with_offset, m, splits):
    k, n = 256, 64
    rows = k if bits == 8 else k // 2
    q = (rng.integers(-128, 128, (rows, n)).astype(np.int8) if bits == 8
         else rng.integers(0, 256, (rows, n)).astype(np.uint8))
    scale = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    offset = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32) if with_offset else None
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = numpy_weight(q, scale, offset, bits, group)
    expected = np.asarray(x, np.float64) @ w
    # float32 accumulation's error grows with the sum of |x| |w| over K, not with the (possibly cancelling) result.
    bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(w))

    np.testing.assert_allclose(np.asarray(dequantize(jnp.asarray(q), scale, offset, bits=bits, group=group)),
                               numpy_weight(q, scale, offset, bits, group), rtol=1e-6, atol=1e-7)
    xf = x.astype(jnp.float32)
    reference = weight_only_matmul_reference(xf, jnp.asarray(q), scale, offset, bits=bits, group=group)
    assert np.all(np.abs(np.asarray(reference) - expected) <= bound)
    got = weight_only_matmul(xf, jnp.asarray(q), scale, offset, bits=bits, group=group, block_k=32, block_n=32,
                             num_splits=splits, interpret=True)
    assert got.shape == (m, n)
    assert np.all(np.abs(np.asarray(got) - expected) <= bound)
    # bf16 activations (the GPU's int4 path builds its bf16 weights from bits): the output, rounded to bf16.
    got = weight_only_matmul(x, jnp.asarray(q), scale, offset, bits=bits, group=group, block_k=32, block_n=32,
                             num_splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_bad_layouts_are_refused():
    x = jnp.ones((2, 128), jnp.float32)
    with pytest.raises(ValueError, match="not a 4-bit weight"):
        weight_only_matmul(x, jnp.zeros((128, 32), jnp.uint8), jnp.ones((2, 32)), bits=4, group=64)
    with pytest.raises(ValueError, match="scale"):
        weight_only_matmul(x, jnp.zeros((128, 32), jnp.int8), jnp.ones((3, 32)), bits=8, group=64)


@pytest.mark.parametrize("rows,layout", [(1, "vector"), (8, "swapped"), (32, "rows")])
def test_each_layout_lowers_for_the_h200_at_llama_shapes(rows, layout):
    """The kernels pass the Pallas Triton lowering's checks at a real draft shape (Llama-3.1-8B's fused gate/up,
    int4 in groups of 128), one per layout the entry picks."""
    k, n, group = 4096, 28672, 128
    assert _layout(4, jnp.bfloat16, rows) == layout
    spec = jax.ShapeDtypeStruct
    text = lower_for_h200(weight_only_matmul, spec((rows, k), jnp.bfloat16), spec((k // 2, n), jnp.uint8),
                          spec((k // group, n), jnp.bfloat16), spec((k // group, n), jnp.bfloat16), bits=4,
                          group=group)
    assert f"weight_only_matmul_{layout}" in text
