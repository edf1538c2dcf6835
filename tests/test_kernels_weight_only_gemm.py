"""The weight-only GEMM kernel (interpret mode) and its jnp twin against float64 numpy, for int8 per channel,
int8 in GGUF's groups of 32, and packed int4 in groups with offsets; the split-half int4 packing round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.weight_only_gemm import (
    pack_int4,
    unpack_int4,
    weight_only_matmul,
    weight_only_matmul_reference,
)


def test_int4_packing_round_trip(rng):
    values = rng.integers(-8, 8, (128, 48)).astype(np.int8)
    packed = pack_int4(jnp.asarray(values), 64)
    assert packed.dtype == jnp.uint8 and packed.shape == (64, 48)
    # split-half: byte row j of group g holds rows g*64 + j (low nibble) and g*64 + 32 + j (high nibble)
    p = np.asarray(packed).astype(np.int16)
    np.testing.assert_array_equal((p[:32] & 15) - 8, values[:32])
    np.testing.assert_array_equal((p[32:] >> 4) - 8, values[96:])
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed, 64)), values)


@pytest.mark.parametrize("bits,group,offset,m,k,n,splits", [
    (8, None, False, 1, 192, 96, None),  # per channel, K in chunks of 64, N strips of 32
    (8, 32, False, 5, 256, 128, 2),  # GGUF Q8_0's groups, K split in two
    (4, 64, True, 3, 256, 64, None),  # asymmetric int4
    (4, 32, True, 17, 128, 256, 4),  # more rows than one 16-row dot, two N strips
])
def test_weight_only_matmul_against_float64(rng, bits, group, offset, m, k, n, splits):
    groups = 1 if group is None else k // group
    ints = rng.integers(-127, 128, (k, n)) if bits == 8 else rng.integers(-8, 8, (k, n))
    scale = rng.uniform(0.01, 0.1, (groups, n)).astype(np.float32)
    shift = rng.uniform(-0.5, 0.5, (groups, n)).astype(np.float32) if offset else None
    x = rng.standard_normal((m, k)).astype(np.float32)
    values = jnp.asarray(ints, jnp.int8) if bits == 8 else pack_int4(jnp.asarray(ints, jnp.int8), group)
    args = (jnp.asarray(x), values, jnp.asarray(scale), None if shift is None else jnp.asarray(shift))
    g = k if group is None else group
    w = ints.astype(np.float64).reshape(k // g, g, n) * scale[:, None]
    if shift is not None:
        w += shift[:, None]
    want = x.astype(np.float64) @ w.reshape(k, n)
    got = np.asarray(weight_only_matmul(*args, bits=bits, group=group, splits=splits, interpret=True))
    twin = np.asarray(weight_only_matmul_reference(*args, bits=bits, group=group))
    tolerance = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=tolerance)
    np.testing.assert_allclose(twin, want, rtol=1e-5, atol=tolerance)


def test_shapes_that_do_not_fit_are_refused():
    x = jnp.ones((2, 100))
    with pytest.raises(ValueError, match="multiple of the group"):
        weight_only_matmul(x, jnp.ones((100, 32), jnp.int8), jnp.ones((1, 32)), bits=8, interpret=True)
    with pytest.raises(ValueError, match="per-channel"):
        weight_only_matmul(jnp.ones((2, 128)), jnp.ones((64, 32), jnp.uint8), jnp.ones((1, 32)), bits=4,
                           interpret=True)


@pytest.mark.parametrize("bits,group,k,n,m", [
    (8, None, 4096, 14336 * 2, 1),  # Llama-3.1-8B's fused gate/up, per channel
    (4, 128, 14336, 4096, 16),  # its down projection, int4 groups with offsets
    (4, 32, 576, 1536, 8),  # SmolLM2's gate or up projection in GGUF's Q4_1 groups
])
def test_lowers_to_triton_for_h200(bits, group, k, n, m):
    """bf16 activations at draft shapes pass the Pallas Triton lowering's checks (power-of-two loads, dot shapes,
    primitives); Triton's own compilation runs only on a GPU."""
    spec = jax.ShapeDtypeStruct
    groups = 1 if group is None else k // group
    values = spec((k, n), jnp.int8) if bits == 8 else spec((k // 2, n), jnp.uint8)
    offset = None if bits == 8 else spec((groups, n), jnp.bfloat16)
    lowered = lower_for_h200(weight_only_matmul, spec((m, k), jnp.bfloat16), values, spec((groups, n), jnp.bfloat16),
                             offset, bits=bits, group=group)
    assert "__gpu$xla.gpu.triton" in lowered
