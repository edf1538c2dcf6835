"""The Mosaic GPU weight-only kernel (pallas_kernels/weight_only_mgpu.py) in GPU interpret mode against float64
numpy. Interpret mode multiplies from shared memory (the GPU multiplies the dequantized weight from registers),
so what this checks is everything around the tensor-core product: the pipeline's blocks, the groups' scales and
offsets, split-K and the padded rows. The kernel rounds each dequantized weight to bf16, so it is held to the
float64 product of the bf16-rounded weight tightly, and to the exact one within bf16's rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.weight_only_mgpu import weight_only_matmul_mgpu, weight_only_matmul_mgpu_reference


def _weight(rng, n, k, bits, group, with_offset):
    lo, hi = (-8, 8) if bits == 4 else (-127, 128)
    q = rng.integers(lo, hi, (n, k))
    scale = rng.uniform(0.005, 0.02, (k // group, n)).astype(np.float32)
    offset = (rng.normal(size=(k // group, n)) * 0.01).astype(np.float32) if with_offset else None
    return q, scale, offset


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("m, k, n, bits, group, blocks", [
    (1, 1024, 128, 4, 128, dict(block_n=128, block_k=256, splits=2, stages=2)),  # two groups a step
    (16, 512, 256, 4, 64, dict(block_n=128, block_k=64, splits=1, stages=3)),  # one group a step, 16 rows
    (5, 512, 128, 4, 256, dict(block_n=64, block_k=128, splits=2, stages=2)),  # a group over two steps
    (9, 512, 128, 8, 512, dict(block_n=64, block_k=128, splits=2, stages=2)),  # int8, one scale a column
])
@pytest.mark.parametrize("with_offset, zero_point", [(True, 8), (False, 0), (False, 8)])
def test_matches_float64(m, k, n, bits, group, blocks, with_offset, zero_point):
    rng = np.random.default_rng(m * 31 + bits)
    q, scale, offset = _weight(rng, n, k, bits, group, with_offset)
    x = _bf16(rng.normal(size=(m, k)))
    codes = jnp.asarray(q, jnp.int4 if bits == 4 else jnp.int8)
    got = weight_only_matmul_mgpu(jnp.asarray(x, jnp.bfloat16), codes, jnp.asarray(scale, jnp.bfloat16),
                                  None if offset is None else jnp.asarray(offset, jnp.bfloat16), group=group,
                                  zero_point=zero_point, out_dtype=jnp.float32, interpret=True, **blocks)
    s = np.repeat(_bf16(scale), group, axis=0).T  # [N, K]
    o = 0.0 if offset is None else np.repeat(_bf16(offset), group, axis=0).T
    shift = zero_point * s + o  # the kernel adds it rounded to bf16 once
    exact = x @ ((q + zero_point) * s + o).T
    rounded = x @ _bf16(_bf16(q * s) + _bf16(shift)).T  # the kernel's weight: each term and the sum in bf16
    got = np.asarray(got, np.float64)
    assert got.shape == (m, n)
    scale_of = np.max(np.abs(exact))
    assert np.max(np.abs(got - rounded)) / scale_of < 2e-3
    assert np.max(np.abs(got - exact)) / scale_of < 1e-2
    reference = weight_only_matmul_mgpu_reference(jnp.asarray(x, jnp.bfloat16), codes, jnp.asarray(scale),
                                                  None if offset is None else jnp.asarray(offset), group=group,
                                                  zero_point=zero_point)
    assert np.max(np.abs(np.asarray(reference, np.float64) - exact)) / scale_of < 1e-2


@pytest.mark.parametrize("shape, blocks, message", [
    ((1, 512, 100), dict(block_n=64, block_k=128), "do not tile"),
    ((1, 512, 128), dict(block_n=64, block_k=128, splits=8), "do not tile"),
    ((17, 512, 128), dict(block_n=64, block_k=128), "at most 16 rows"),
])
def test_untileable_shapes_are_refused(shape, blocks, message):
    m, k, n = shape
    with pytest.raises(ValueError, match=message):
        weight_only_matmul_mgpu(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((n, k), jnp.int4),
                                jnp.ones((k // 128, n), jnp.bfloat16), None, group=128, interpret=True, **blocks)


@pytest.mark.parametrize("bits, with_offset, scale_dtype", [(4, True, jnp.bfloat16), (8, False, jnp.bfloat16),
                                                           (4, True, jnp.float32)])
def test_stacked_weights_read_only_the_given_layer(bits, with_offset, scale_dtype):
    """Given every layer's weight stacked [L, ...] and a traced layer, the kernel multiplies that layer's weight
    alone, read in place (the other layers' scales and offsets NaN; float32 scales: the layer's converted to the
    kernel's bf16): the same products as the layer's own arrays give; the jnp twin reads the same layer."""
    m, k, n, group, layer = 3, 512, 128, 128, 1
    rng = np.random.default_rng(bits)
    q, scale, offset = _weight(rng, n, k, bits, group, with_offset)
    dtype = jnp.int4 if bits == 4 else jnp.int8
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    others = _weight(rng, n, k, bits, group, with_offset)[0]
    stack = lambda a, other: jnp.stack([jnp.asarray(a if i == layer else other) for i in range(3)])  # noqa: E731
    codes = stack(q, others).astype(dtype)
    scales = stack(scale, np.full_like(scale, np.nan)).astype(scale_dtype)
    offsets = None if offset is None else stack(offset, np.full_like(offset, np.nan)).astype(scale_dtype)
    blocks = dict(group=group, zero_point=8 if bits == 4 else 0, block_n=64, block_k=128, splits=2, stages=2,
                  out_dtype=jnp.float32, interpret=True)
    got = jax.jit(lambda i: weight_only_matmul_mgpu(x, codes, scales, offsets, i, **blocks))(jnp.int32(layer))
    assert np.all(np.isfinite(np.asarray(got)))
    alone = weight_only_matmul_mgpu(x, codes[layer], scales[layer], None if offsets is None else offsets[layer],
                                    **blocks)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
    reference = weight_only_matmul_mgpu_reference(x, codes, scales, offsets, layer, group=group,
                                                  zero_point=blocks["zero_point"])
    exact = weight_only_matmul_mgpu_reference(x, codes[layer], scales[layer],
                                              None if offsets is None else offsets[layer], group=group,
                                              zero_point=blocks["zero_point"])
    np.testing.assert_array_equal(np.asarray(reference), np.asarray(exact))
    assert np.max(np.abs(np.asarray(got) - np.asarray(reference, np.float32))) < 1e-2 * np.abs(exact).max()


def test_stacked_weights_lower_for_the_h200_at_llama_shapes():
    """At Llama-3.1-8B's fused gate/up (int4 in groups of 128, its 32 layers stacked, a traced layer) the kernel
    lowers for an H200 with the whole stack its operand: the layer is where its TMA copies start."""
    k, n, group, layers = 4096, 28672, 128, 32
    spec = jax.ShapeDtypeStruct
    scales = spec((layers, k // group, n), jnp.bfloat16)
    text = lower_for_h200(weight_only_matmul_mgpu, spec((8, k), jnp.bfloat16), spec((layers, n, k), jnp.int4),
                          scales, scales, spec((), jnp.int32), group=group, zero_point=8)
    calls = [line for line in text.splitlines() if "@mosaic_gpu" in line and " : (" in line]
    assert len(calls) == 1 and f"tensor<{layers}x{n}x{k}xi4>" in calls[0].rsplit(" : (", 1)[1]
