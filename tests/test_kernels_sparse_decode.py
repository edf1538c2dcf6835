"""sparse_decode_attention in interpret mode against a float64 numpy computation.

Every run draws fresh inputs; a failing test prints its seed, and KERNEL_TEST_SEED=<seed> replays it.
Interpret mode fills outputs the kernel never writes with NaN (test_interpret_mode_poisons_unwritten_outputs
checks that), so finite outputs mean every element was written. Cache rows outside a sequence's key set are NaN
too, so reading any of them shows up as NaN in the output.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from h200_lowering import lower_for_h200
from pallas_kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference

# Max |error| / max |expected| over the outputs: float32 is exact up to summation order; bf16 rounds the softmax
# weights before the V product and the output itself (2^-9 relative each).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rope_tables(positions, head_dim):
    """float64 tables of models.attention.rope_tables with frequencies 10000^(-2i/D)."""
    angles = np.asarray(positions, np.float64)[:, None] * 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    return np.concatenate([np.cos(angles)] * 2, -1), np.concatenate([-np.sin(angles), np.sin(angles)], -1)


def rotate(x, cos, sin):
    """Rotate-half RoPE in float64 of x [B, heads, D] at per-sequence tables [B, D]."""
    half = x.shape[-1] // 2
    swapped = np.concatenate([x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + swapped * sin[:, None]


def make_case(rng, *, batch, capacity, kv_heads, group, head_dim, k_max, counts, recent, dtype):
    """Random inputs; counts[b] listed rows, cached recent rows [start, position) and the new token at position
    for recent[b] = (start, position). Returns (args, key sets of cached rows)."""
    # Larger queries make the softmax peaky, so a wrong key set changes the output visibly.
    q = rng.standard_normal((batch, kv_heads * group, head_dim)) * 3
    k_new = rng.standard_normal((batch, kv_heads, head_dim))
    v_new = rng.standard_normal((batch, kv_heads, head_dim))
    k = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    v = rng.standard_normal((batch, capacity, kv_heads, head_dim))
    indices = rng.integers(-5, capacity + 5, (batch, k_max))  # junk past counts[b]: must never be read
    key_sets = []
    for b, (count, (start, position)) in enumerate(zip(counts, recent)):
        indices[b, :count] = rng.choice(start, count, replace=False)
        key_sets.append(np.concatenate([indices[b, :count], np.arange(start, position)]).astype(int))
        # The new token's own row is NaN too: it must be attended from k_new/v_new, never read back.
        outside = np.setdiff1d(np.arange(capacity), key_sets[-1])
        # Row 0 stays finite: lanes past a split's end read it (masked out of the softmax).
        outside = outside[outside != 0]
        k[b, outside] = np.nan
        v[b, outside] = np.nan
    as_array = lambda x: jnp.asarray(x, dtype)
    int32 = lambda x: jnp.asarray(x, jnp.int32)
    starts, positions = zip(*recent)
    cos, sin = (jnp.asarray(table, jnp.float32) for table in rope_tables(positions, head_dim))
    qkv = np.concatenate([q, k_new, v_new], axis=1)
    args = (as_array(qkv), cos, sin, as_array(k), as_array(v), int32(indices), int32(counts), int32(starts),
            int32(positions))
    return args, key_sets


def new_token(qkv, cos, sin, kv_heads):
    """float64 (q, k_new, v_new) of the kernel's qkv input, RoPE applied to q and k_new."""
    qkv, cos, sin = (np.asarray(x, np.float64) for x in (qkv, cos, sin))
    num_q = qkv.shape[1] - 2 * kv_heads
    q, k_new, v_new = qkv[:, :num_q], qkv[:, num_q : num_q + kv_heads], qkv[:, num_q + kv_heads :]
    return rotate(q, cos, sin), rotate(k_new, cos, sin), v_new


def expected_output(qkv, cos, sin, k, v, key_sets):
    """float64 softmax attention of the new token's rotated query heads over each sequence's cached key rows and
    its own rotated key."""
    k, v = (np.asarray(x, np.float64) for x in (k, v))
    q, k_new, v_new = new_token(qkv, cos, sin, k.shape[2])
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[2]
    out = np.empty_like(q)
    for b, rows in enumerate(key_sets):
        for h in range(num_q_heads):
            keys = np.concatenate([k[b, rows, h // group], k_new[b, None, h // group]])
            values = np.concatenate([v[b, rows, h // group], v_new[b, None, h // group]])
            logits = keys @ q[b, h] / np.sqrt(head_dim)
            weights = np.exp(logits - logits.max())
            out[b, h] = weights @ values / weights.sum()
    return out


def assert_written(cache_out, cache_in, new_rows, positions, dtype):
    """cache_out is cache_in with row positions[b] of sequence b replaced by new_rows[b] (none past the end):
    other rows bit for bit, the written rows up to the rounding of a RoPE computed in float32 and stored in
    dtype."""
    want = np.array(cache_in, np.float64)
    written = np.zeros(want.shape[:2], bool)
    for b, position in enumerate(np.asarray(positions)):
        if position < want.shape[1]:
            want[b, position] = new_rows[b]
            written[b, position] = True
    actual = np.asarray(cache_out, np.float64)
    np.testing.assert_array_equal(actual[~written], want[~written])
    bound = (1e-6 if dtype == jnp.float32 else 2**-8) * np.abs(want[written]).max()
    np.testing.assert_allclose(actual[written], want[written], rtol=0, atol=bound)


def assert_close(actual, expected, dtype, what):
    actual = np.asarray(actual, np.float64)
    assert np.isfinite(actual).all(), f"{what}: non-finite outputs (unwritten or reading rows outside the set)"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def test_interpret_mode_poisons_unwritten_outputs():
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)(
        jnp.zeros(8)
    )
    assert np.isnan(np.asarray(out)).all()


CASES = {
    # GQA 4, D 128, capacity not a multiple of block_k; sequences: empty list, full list with only the new token
    # as recent (written at the last row), and one much shorter than the others.
    "gqa4_d128": dict(
        batch=3, capacity=210, kv_heads=2, group=4, head_dim=128, k_max=40,
        counts=[0, 40, 9], recent=[(150, 157), (209, 209), (20, 23)], block_k=16, num_splits=3,
    ),
    # GQA 3, D 64, default block_k and num_splits (one split of up to 64 keys per block here); the second new
    # token lies past the cache (attended, not written).
    "gqa3_d64": dict(
        batch=2, capacity=150, kv_heads=3, group=3, head_dim=64, k_max=70,
        counts=[70, 33], recent=[(120, 131), (140, 150)], block_k=None, num_splits=None,
    ),
    # A long selection (k_max >= 4096), for which the default launch switches to 128-key blocks in long splits; a
    # full list, a partial one and an empty one.
    "long_selection": dict(
        batch=3, capacity=4500, kv_heads=1, group=2, head_dim=64, k_max=4200,
        counts=[4200, 2500, 0], recent=[(4300, 4310), (4200, 4203), (9, 40)], block_k=None, num_splits=None,
    ),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_sparse_decode_matches_float64(rng, case, dtype):
    shape = dict(CASES[case])
    launch = {name: shape.pop(name) for name in ("block_k", "num_splits")}
    launch = {name: value for name, value in launch.items() if value is not None}
    args, key_sets = make_case(rng, dtype=dtype, **shape)
    qkv, cos, sin, k, v, *_, positions = args
    out, k_out, v_out = sparse_decode_attention(*args, interpret=True, **launch)
    assert out.shape == (qkv.shape[0], shape["kv_heads"] * shape["group"], qkv.shape[2]) and out.dtype == dtype
    assert_close(out, expected_output(qkv, cos, sin, k, v, key_sets), dtype, "kernel")
    _, k_new, v_new = new_token(qkv, cos, sin, shape["kv_heads"])
    assert_written(k_out, k, k_new, positions, dtype)
    assert_written(v_out, v, v_new, positions, dtype)


def test_stacked_selections_read_only_the_given_layer(rng):
    shape = dict(CASES["gqa3_d64"])
    del shape["block_k"], shape["num_splits"]
    args, key_sets = make_case(rng, dtype=jnp.float32, **shape)
    qkv, cos, sin, k, v, indices, counts, starts, positions = args
    # Other layers list rows whose K/V are NaN in that sequence: reading any of them would poison the output.
    capacity = k.shape[1]
    outside = [np.setdiff1d(np.arange(1, capacity), rows) for rows in key_sets]
    junk = jnp.asarray(np.stack([rng.choice(rows, indices.shape[1]) for rows in outside]), jnp.int32)
    stacked = jnp.stack([junk, indices, junk])
    stacked_counts = jnp.stack([jnp.full_like(counts, indices.shape[1]), counts, jnp.full_like(counts, 1)])
    call = lambda layer: sparse_decode_attention(
        qkv, cos, sin, k, v, stacked, stacked_counts, starts, positions, layer=layer, interpret=True
    )
    out, _, _ = call(1)
    assert_close(out, expected_output(qkv, cos, sin, k, v, key_sets), jnp.float32, "layer 1 of 3")
    with pytest.raises(ValueError, match="layer 3 out of range"):
        call(3)


def test_stacked_cache_reads_and_writes_only_the_given_layer(rng):
    """Caches stacked [L, B, T, H_kv, D] with a traced layer, as the scanned decoder hands them: the kernel reads
    that layer's rows and writes the new row into that layer alone, in the stacks it aliases. The other layers are
    NaN: reading any of their rows would poison the output."""
    shape = dict(CASES["gqa3_d64"])
    del shape["block_k"], shape["num_splits"]
    args, key_sets = make_case(rng, dtype=jnp.float32, **shape)
    qkv, cos, sin, k, v, indices, counts, starts, positions = args
    stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])  # noqa: E731
    run = jax.jit(lambda layer, k_stack, v_stack: sparse_decode_attention(
        qkv, cos, sin, k_stack, v_stack, indices, counts, starts, positions, layer=layer, interpret=True))
    out, k_out, v_out = run(jnp.int32(1), stack(k), stack(v))
    assert_close(out, expected_output(qkv, cos, sin, k, v, key_sets), jnp.float32, "layer 1 of 3")
    _, k_new, v_new = new_token(qkv, cos, sin, shape["kv_heads"])
    assert_written(k_out[1], k, k_new, positions, jnp.float32)
    assert_written(v_out[1], v, v_new, positions, jnp.float32)
    for other in (0, 2):
        assert np.isnan(np.asarray(k_out[other])).all() and np.isnan(np.asarray(v_out[other])).all()


@pytest.mark.parametrize("max_recent", [None, 16])
def test_reference_matches_float64(rng, max_recent):
    shape = dict(CASES["gqa4_d128"])
    del shape["block_k"], shape["num_splits"]
    args, key_sets = make_case(rng, dtype=jnp.float32, **shape)
    qkv, cos, sin, k, v, *rest = args
    # The dense variant weighs every row (NaN * 0 = NaN), so it gets the finite cache here.
    finite = lambda x: jnp.nan_to_num(x, nan=7.0)
    out, k_out, _ = sparse_decode_attention_reference(
        qkv, cos, sin, finite(k), finite(v), *rest, max_recent=max_recent
    )
    assert_close(out, expected_output(qkv, cos, sin, k, v, key_sets), jnp.float32, "reference")
    assert_written(k_out, finite(k), new_token(qkv, cos, sin, shape["kv_heads"])[1], rest[-1], jnp.float32)


def test_rejects_non_power_of_two_head_dim(rng):
    args, _ = make_case(
        rng, batch=1, capacity=32, kv_heads=1, group=1, head_dim=48, k_max=4, counts=[4], recent=[(20, 22)],
        dtype=jnp.float32,
    )
    with pytest.raises(ValueError, match="head_dim"):
        sparse_decode_attention(*args, interpret=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("kv_heads, group, head_dim", [(8, 4, 128), (3, 3, 64)], ids=["qwen3_8b", "smollm2"])
def test_lowers_to_triton_for_h200(kv_heads, group, head_dim):
    """Three layers' calls, as the decoder makes them: one kernel program, traced and lowered once and called three
    times (a program per layer made the decode loop's compilation lower and compile a Triton kernel per layer)."""
    batch, capacity, k_max = 2, 32768, 2294
    spec = jax.ShapeDtypeStruct

    def three_layers(qkv, cos, sin, k, v, indices, counts, starts, positions):
        outs = []
        for layer in (0, 14, 29):
            out, k, v = sparse_decode_attention(qkv, cos, sin, k, v, indices, counts, starts, positions, layer=layer)
            outs.append(out)
        return outs, k, v

    lowered = lower_for_h200(
        jax.jit(three_layers),
        spec((batch, (group + 2) * kv_heads, head_dim), jnp.bfloat16),
        *[spec((batch, head_dim), jnp.float32)] * 2,
        *[spec((batch, capacity, kv_heads, head_dim), jnp.bfloat16)] * 2,
        spec((30, batch, k_max), jnp.int32),
        spec((30, batch), jnp.int32),
        *[spec((batch,), jnp.int32)] * 2,
    )
    assert lowered.count("__gpu$xla.gpu.triton") == 1
    assert len(re.findall(r"call @_sparse_decode_attention\b", lowered)) == 3
