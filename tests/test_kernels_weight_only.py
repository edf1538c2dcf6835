"""The weight-only quantized matmul kernel (interpret mode) and its jnp twin against float64 numpy, int8 and
packed int4, with and without offsets, on fresh random inputs every run; a failing test prints its seed, and
KERNEL_TEST_SEED=<seed> replays it."""

from __future__ import annotations

import numpy as np
import jax
import jax.extend
import jax.numpy as jnp
import pytest

from h200_lowering import lower_for_h200
from pallas_kernels.ptx import dp4a_emulated, nibble_program
from pallas_kernels.weight_only_matmul import (
    INT8_DOT_MIN_K, ROWS_BLOCK, _layout, code_blocks, default_splits, dequantize, int8_rows, pack_code_words,
    quantize_rows_int8, weight_only_matmul, weight_only_matmul_reference,
)


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


def random_weight(rng, bits, group, with_offset, k, n, lowest_int8=-128):
    """(codes as the kernel stores them: int8 [K, N] or int4 bytes [K / 2, N]; scales; offsets or None)."""
    rows = k if bits == 8 else k // 2
    q = (rng.integers(lowest_int8, 128, (rows, n)).astype(np.int8) if bits == 8
         else rng.integers(0, 256, (rows, n)).astype(np.uint8))
    scale = rng.uniform(0.001, 0.02, (k // group, n)).astype(np.float32)
    offset = rng.uniform(-0.1, 0.1, (k // group, n)).astype(np.float32) if with_offset else None
    return q, scale, offset


@pytest.mark.parametrize("bits,group,with_offset,m,splits", [
    (8, 256, False, 3, None),  # per output channel
    (8, 256, True, 1, 2),  # one row: the kernel without a dot
    (8, 32, True, 17, 2),
    (4, 64, True, 1, None),  # one row
    (4, 32, False, 8, 4),
    (4, 64, True, 5, 2),  # the swapped kernel's ragged rows (bf16 activations), with offsets
    (8, 32, True, 150, 2),  # rows past ROWS_BLOCK: programs along the rows too, the last block ragged
    (4, 64, False, 130, None),
])
def test_weight_only_matmul_matches_float64(rng, bits, group, with_offset, m, splits):
    k, n = 256, 64
    q, scale, offset = random_weight(rng, bits, group, with_offset, k, n)
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


@pytest.mark.parametrize("m", [2, 8, 17])  # the swapped kernel (bf16, up to 16 rows), then the row-major dot
def test_prmt_unpacking_gives_the_same_products(rng, m):
    """nibble_unpack "prmt" (in interpret mode its PTX program run in integers) multiplies as "ops" does, to the
    bit, and both match float64 within bf16's rounding."""
    k, n, group = 256, 64, 64
    q, scale, offset = random_weight(rng, 4, group, True, k, n)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    run = lambda unpack: np.asarray(weight_only_matmul(  # noqa: E731
        x, jnp.asarray(q), scale, offset, bits=4, group=group, block_k=32, block_n=32, interpret=True,
        nibble_unpack=unpack), np.float64)
    expected = np.asarray(x, np.float64) @ numpy_weight(q, scale, offset, 4, group)
    np.testing.assert_array_equal(run("prmt"), run("ops"))
    np.testing.assert_allclose(run("prmt"), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def test_the_prmt_program_makes_bf16_128_plus_each_nibble():
    """nibble_program (byte permutes, shift, LOP3, emulated from PTX's definitions) on every byte value in every
    byte position of a word: output half j is the bf16 with bits 0x4300 | nibble of byte j, numpy's own value."""
    for position in range(4):
        for byte in range(256):
            word = byte << (8 * position) | (0xA5 << (8 * ((position + 1) % 4)))  # a neighbour that must not leak
            for high, nibble in ((False, byte & 0xF), (True, byte >> 4)):
                out = nibble_program(word, high)
                half = (out[position // 2] >> (16 * (position % 2))) & 0xFFFF
                value = np.array([half], np.uint16).view(jnp.bfloat16)[0]
                assert half == 0x4300 | nibble and float(value) == 128 + nibble, (position, byte, high)


def test_bad_layouts_are_refused():
    x = jnp.ones((2, 128), jnp.float32)
    with pytest.raises(ValueError, match="not a 4-bit weight"):
        weight_only_matmul(x, jnp.zeros((128, 32), jnp.uint8), jnp.ones((2, 32)), bits=4, group=64)
    with pytest.raises(ValueError, match="scale"):
        weight_only_matmul(x, jnp.zeros((128, 32), jnp.int8), jnp.ones((3, 32)), bits=8, group=64)
    with pytest.raises(ValueError, match="four code bytes a thread at a time: a 16 x 16 block gives 128 threads 2"):
        weight_only_matmul(jnp.ones((2, 64)), jnp.zeros((32, 16), jnp.uint8), jnp.ones((1, 16)), bits=4, group=64,
                           block_k=16, block_n=16, nibble_unpack="prmt")
    with pytest.raises(ValueError, match="nibble_unpack must be one of ops, prmt"):
        weight_only_matmul(x, jnp.zeros((64, 32), jnp.uint8), jnp.ones((2, 32)), bits=4, group=64,
                           nibble_unpack="lut")


LLAMA_LAYERS = 32


@pytest.mark.parametrize("rows,layout", [(1, "vector"), (8, "swapped"), (32, "rows")])
def test_each_layout_lowers_for_the_h200_at_llama_shapes(rows, layout):
    """The kernels pass the Pallas Triton lowering's checks at a real draft shape (Llama-3.1-8B's fused gate/up,
    int4 in groups of 128, its 32 layers stacked as the scanned layers hand them, and a traced layer), one per
    layout the entry picks."""
    k, n, group = 4096, 28672, 128
    assert _layout(4, jnp.bfloat16, rows) == layout
    spec = jax.ShapeDtypeStruct
    weight = (spec((LLAMA_LAYERS, k // 2, n), jnp.uint8), spec((LLAMA_LAYERS, k // group, n), jnp.bfloat16),
              spec((LLAMA_LAYERS, k // group, n), jnp.bfloat16), spec((), jnp.int32))
    text = lower_for_h200(weight_only_matmul, spec((rows, k), jnp.bfloat16), *weight, bits=4, group=group)
    assert f"weight_only_matmul_{layout}" in text
    if layout != "vector":  # the dot kernels' byte-permute unpacking: four code bytes an instance of the asm
        text = lower_for_h200(weight_only_matmul, spec((rows, k), jnp.bfloat16), *weight, bits=4, group=group,
                              nibble_unpack="prmt")
        assert "prmt.b32" in text


def _pallas_call(jaxpr):
    """The first pallas_call equation of a jaxpr, looked for in its sub-jaxprs too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if (found := _pallas_call(sub)) is not None:
                return found
    return None


def test_many_rows_take_programs_along_the_rows():
    """16,384 rows (a batch of sampled seeds) at Llama-3.1-8B's gate/up: every block the row-major dot's programs
    hold stays under Triton's 2^20 elements a tensor (one program holding every row passed it, and Triton refused
    the module on an H100), the rows split into ROWS_BLOCK-row programs, and it lowers for the H200."""
    k, n, group, rows = 4096, 28672, 128, 16384
    spec = jax.ShapeDtypeStruct
    weight = (spec((LLAMA_LAYERS, k // 2, n), jnp.uint8), spec((LLAMA_LAYERS, k // group, n), jnp.bfloat16),
              spec((LLAMA_LAYERS, k // group, n), jnp.bfloat16), spec((), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda *a: weight_only_matmul(*a, bits=4, group=group))(spec((rows, k), jnp.bfloat16),
                                                                                   *weight)
    grid = _pallas_call(jaxpr.jaxpr).params["grid_mapping"]
    assert grid.grid[2] == rows // ROWS_BLOCK
    x_block, *_, out_block = [[getattr(b, "block_size", 1) for b in m.block_shape] for m in grid.block_mappings]
    assert x_block == [ROWS_BLOCK, k] and out_block == [1, ROWS_BLOCK, 128]
    assert "weight_only_matmul_rows" in lower_for_h200(weight_only_matmul, spec((rows, k), jnp.bfloat16), *weight,
                                                       bits=4, group=group)


# ---- the integer dot (int8 or int4 codes, one row of x quantized to int8)-----------------------------------------


def numpy_int8_rows(x, x_group):
    """x's int8 codes and scales by the definition (symmetric, max |x| / 127 per group), float64. A quotient within
    float32's rounding of a tie (n + 1/2) rounds either way in float32 arithmetic (XLA on the CPU divides by the
    scale as a product with its reciprocal, one of them rounded: a code moved once in about a thousand seeds); there
    int8_rows's code is taken where it is one of the two neighbours, and any other stays a difference."""
    grouped = np.asarray(x, np.float64).reshape(x.shape[0], -1, x_group)
    scales = np.abs(grouped).max(-1) / 127
    scales = np.where(scales > 0, scales, 1.0)
    quotients = grouped / scales[..., None]
    codes = np.clip(np.round(quotients), -127, 127)
    implementation = np.asarray(int8_rows(jnp.asarray(x, jnp.float32), x_group)[0], np.float64).reshape(codes.shape)
    tie = np.abs(np.abs(quotients - np.trunc(quotients)) - 0.5) <= 2**-20 * np.maximum(1.0, np.abs(quotients))
    codes = np.where(tie & (np.abs(implementation - quotients) < 1), implementation, codes)
    return codes.reshape(x.shape), scales


def test_the_emulated_dp4a_sums_four_signed_byte_products(rng):
    a, b, c = (rng.integers(-2**31, 2**31, 4096).astype(np.int32) for _ in range(3))
    signed_bytes = lambda w: w.view(np.int8).reshape(-1, 4).astype(np.int64)  # little-endian: byte j of each word
    expected = (c.astype(np.int64) + (signed_bytes(a) * signed_bytes(b)).sum(-1) + 2**31) % 2**32 - 2**31
    np.testing.assert_array_equal(np.asarray(dp4a_emulated(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))),
                                  expected)


@pytest.mark.parametrize("m,stored_words", [(1, False), (1, True), (5, False)])  # words: one row only
@pytest.mark.parametrize("bits,group,x_group,with_offset,splits", [
    (8, 256, 128, False, None),  # per output channel
    (8, 256, 64, True, 2),
    (8, 32, 64, False, 4),
    (4, 32, 64, True, 2),  # GGUF's Q4_1 groups: two weight groups in an x group
    (4, 64, 64, False, None),
    (4, 128, 128, True, 4),
])
def test_integer_dot_matches_float64_of_the_quantized_row(rng, bits, group, x_group, with_offset, splits, m,
                                                          stored_words):
    """The kernel (interpret mode; one row: dp4a emulated, on codes as stored for the other kernels or packed in
    words; five rows: the int8 dot) against float64 numpy of the int8 rows it defines: exact integer sums, scaled
    once a block (the offset by the block's sum of x); and within x's quantization error of the exact product."""
    if m > 1 and bits == 4 and group // 2 < INT8_DOT_MIN_K:
        pytest.skip("several rows of int4 groups of 32 are refused (test_integer_dot_refuses_what_it_does_not_...)")
    k, n = 256, 64
    rows = k if bits == 8 else k // 2
    q, scale, offset = random_weight(rng, bits, group, with_offset, k, n, lowest_int8=-127)  # symmetric int8
    x = rng.normal(size=(m, k)).astype(np.float32)
    codes, scales = numpy_int8_rows(x, x_group)
    words, got_scales = quantize_rows_int8(jnp.asarray(x), x_group)
    np.testing.assert_allclose(np.asarray(got_scales), scales, rtol=1e-6)
    unpacked = np.asarray(words).view(np.int8).reshape(m, k)  # byte j of word r is position 4r + j
    np.testing.assert_array_equal(unpacked, codes)
    w = numpy_weight(q, scale, offset, bits, group)
    x_rows = codes * np.repeat(scales, x_group, axis=1)
    expected = x_rows @ w
    codes_in = jnp.asarray(q)
    if stored_words:
        codes_in = pack_code_words(codes_in)
        np.testing.assert_array_equal(np.asarray(codes_in).view(q.dtype).reshape(rows // 4, n, 4)
                                      .transpose(0, 2, 1).reshape(rows, n), q)  # byte j of word (r, n): q[4r + j, n]
    block_k = 16 if m == 1 else INT8_DOT_MIN_K  # several rows: the tensor cores' int8 dot
    got = np.asarray(weight_only_matmul(jnp.asarray(x), codes_in, scale, offset, bits=bits, group=group,
                                        block_k=block_k, block_n=32, num_splits=splits, interpret=True,
                                        integer_dot=True, x_group=x_group), np.float64)
    assert got.shape == (m, n)
    bound = 1e-5 * (np.abs(x_rows) @ np.abs(w))  # float32 scaling of exact integer sums
    assert np.all(np.abs(got - expected) <= bound)
    exact = np.asarray(x, np.float64) @ w
    assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("bits,integer_dot,stored_words", [(4, False, False), (4, True, False), (4, True, True),
                                                           (8, True, True)])
@pytest.mark.parametrize("splits", [1, 2, 16])  # 16: one block a program (int4: 256 byte rows, blocks of 16)
def test_prefetch_gives_the_same_one_row_products(rng, bits, integer_dot, stored_words, splits):
    """prefetch (the one-row kernels loading a block ahead) multiplies the same blocks in the same order: the same
    bits as without it, with one and with several K blocks a program (the last block loaded twice), and float64
    numpy within float32's rounding."""
    k, n, group = 512, 64, 64
    q, scale, offset = random_weight(rng, bits, group, bits == 4, k, n, lowest_int8=-127)
    x = rng.normal(size=(1, k)).astype(np.float32)
    codes_in = pack_code_words(jnp.asarray(q)) if stored_words else jnp.asarray(q)
    run = lambda prefetch: np.asarray(weight_only_matmul(  # noqa: E731
        jnp.asarray(x), codes_in, scale, offset, bits=bits, group=group, block_k=16, block_n=32, num_splits=splits,
        interpret=True, integer_dot=integer_dot, x_group=group, prefetch=prefetch), np.float64)
    got = run(True)
    np.testing.assert_array_equal(got, run(False))
    w = numpy_weight(q, scale, offset, bits, group)
    x_rows = x.astype(np.float64)  # what the kernel multiplies: x, or its int8 rows
    if integer_dot:
        codes, scales = numpy_int8_rows(x, group)
        x_rows = codes * np.repeat(scales, group, axis=1)
    assert np.all(np.abs(got - x_rows @ w) <= 1e-5 * (np.abs(x_rows) @ np.abs(w)))


def test_integer_dot_refuses_what_it_does_not_multiply():
    x, q8, ones = jnp.ones((1, 128), jnp.float32), jnp.zeros((128, 32), jnp.int8), jnp.ones((1, 32))
    for rows, integer_dot in ((1, False), (2, True)):
        with pytest.raises(ValueError, match="integer_dot at one row only"):
            weight_only_matmul(jnp.ones((rows, 128)), jnp.zeros((32, 32), jnp.int32), ones, bits=8, group=128,
                               interpret=True, integer_dot=integer_dot)
    for bad in [dict(x=jnp.ones((17, 128))), dict(x_group=96),  # int4: an x group of whole weight groups
                dict(bits=4, q=jnp.zeros((64, 32), jnp.uint8), group=64, scale=jnp.ones((2, 32)), x_group=32),
                # Several rows of int4 groups of 32: blocks of 16 code rows, below the int8 dot's K (wrong on a GPU).
                dict(x=jnp.ones((2, 128)), bits=4, q=jnp.zeros((64, 32), jnp.uint8), group=32,
                     scale=jnp.ones((4, 32)), x_group=64)]:
        args = dict(x=x, q=q8, scale=ones, offset=None, bits=8, group=128) | bad
        with pytest.raises(ValueError, match="integer_dot"):
            weight_only_matmul(args.pop("x"), args.pop("q"), args.pop("scale"), args.pop("offset"), **args,
                               integer_dot=True, interpret=True)


def test_integer_dot_lowers_for_the_h200_at_llama_shapes():
    """With the PTX dp4a and strided loads, at Llama-3.1-8B's fused gate/up (its 32 layers stacked, a traced layer),
    one row: int8 per output channel, and int4 in GGUF's Q4_1 groups of 32 with offsets; eight rows, int4 in groups
    of 128."""
    k, n, layers = 4096, 28672, LLAMA_LAYERS
    spec = jax.ShapeDtypeStruct
    layer = spec((), jnp.int32)
    for bits, rows, dtype, group in ((8, k, jnp.int8, k), (4, k // 2, jnp.uint8, 32)):
        scales = spec((layers, k // group, n), jnp.bfloat16)
        offset = scales if bits == 4 else None
        for codes in (spec((layers, rows, n), dtype), spec((layers, rows // 4, n), jnp.int32)):  # as stored, words
            text = lower_for_h200(weight_only_matmul, spec((1, k), jnp.bfloat16), codes, scales, offset, layer,
                                  bits=bits, group=group, block_k=16 if bits == 4 else 32, block_n=256,
                                  integer_dot=True)
            assert "weight_only_matmul_integer" in text and "dp4a.s32.s32" in text
        # Eight rows: the int8 dot (codes as stored), on blocks of at least its K (int4: groups of 128).
        group = max(group, 128)
        scales = spec((layers, k // group, n), jnp.bfloat16)
        text = lower_for_h200(weight_only_matmul, spec((8, k), jnp.bfloat16), spec((layers, rows, n), dtype), scales,
                              scales if bits == 4 else None, layer, bits=bits, group=group, block_k=64, block_n=128,
                              integer_dot=True)
        assert "weight_only_matmul_integer_rows" in text


@pytest.mark.parametrize("block_k, block_n, measured_best", [(32, 256, 8), (64, 128, 4)])
def test_default_splits_are_the_measured_best_at_8b_gate_up(block_k, block_n, measured_best):
    """Llama-3.1-8B's gate_up in int4 (4096 x 28672, groups of 64): the split counts the H200 timed fastest of the
    two-per-SM rule's and its double and quadruple (weight-only-2026-12-04-prmt-splits.json)."""
    _, k_blocks = code_blocks(4, 4096, 64, block_k)
    assert default_splits(28672 // block_n, k_blocks) == measured_best


def stacked_with_nan_neighbours(rng, weight, layers=3, layer=1):
    """(q, scale, offset) of `layers` layers stacked [L, ...], `weight` at `layer` and fresh codes with NaN scales
    and offsets at every other layer: a read of any other layer's weight shows in the product."""
    q, scale, offset = weight
    stack = lambda a, other: np.stack([a if i == layer else other for i in range(layers)])  # noqa: E731
    codes = rng.integers(0, 127, q.shape).astype(q.dtype)
    nan = np.full_like(scale, np.nan)
    return stack(q, codes), stack(scale, nan), None if offset is None else stack(offset, nan)


@pytest.mark.parametrize("bits,group,with_offset,m,integer_dot,stored_words", [
    (8, 32, True, 1, False, False),  # the vector kernel
    (4, 64, True, 5, False, False),  # swapped (bf16 rows)
    (8, 64, False, 3, False, False),  # the row-major dot
    (4, 64, True, 1, True, False),  # integer, one row, codes as stored (strided loads)
    (8, 64, True, 1, True, True),  # integer, one row, codes in words
    (4, 64, True, 5, True, False),  # integer rows (the int8 dot)
])
def test_stacked_weights_read_only_the_given_layer(rng, bits, group, with_offset, m, integer_dot, stored_words):
    """Every kernel given every layer's weight stacked [L, ...] and a traced layer multiplies that layer's weight
    alone, read in place (the other layers' scales are NaN): the same products as the layer's own arrays give, and
    float64 numpy's within float32's rounding; the jnp twin reads the same layer."""
    k, n, layer = 256, 64, 1
    weight = random_weight(rng, bits, group, with_offset, k, n, lowest_int8=-127)
    q, scale, offset = stacked_with_nan_neighbours(rng, weight, layer=layer)
    dtype = jnp.bfloat16 if bits == 4 and m > 1 and not integer_dot else jnp.float32
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    codes = lambda c: pack_code_words(jnp.asarray(c)) if stored_words else jnp.asarray(c)  # noqa: E731
    stacked_codes = jnp.stack([codes(c) for c in q])
    options = dict(bits=bits, group=group, block_k=32 if m > 1 and integer_dot else 16, block_n=32, num_splits=2,
                   interpret=True, integer_dot=integer_dot, x_group=group)
    q_scale, q_offset = jnp.asarray(scale), None if offset is None else jnp.asarray(offset)
    run = jax.jit(lambda layer: weight_only_matmul(x, stacked_codes, q_scale, q_offset, layer, **options))
    got = np.asarray(run(jnp.int32(layer)), np.float64)  # the layer traced, as in the scanned layer body
    assert np.all(np.isfinite(got))
    alone = weight_only_matmul(x, codes(weight[0]), *weight[1:], **options)
    np.testing.assert_array_equal(got, np.asarray(alone, np.float64))
    w = numpy_weight(*weight, bits, group)
    x_rows = np.asarray(x, np.float64)
    if integer_dot:
        row_codes, scales = numpy_int8_rows(np.asarray(x, np.float32), group)
        x_rows = row_codes * np.repeat(scales, group, axis=1)
    assert np.all(np.abs(got - x_rows @ w) <= 1e-5 * (np.abs(x_rows) @ np.abs(w)) + (
        1e-2 * np.abs(x_rows @ w).max() if dtype == jnp.bfloat16 else 0))
    reference = weight_only_matmul_reference(x.astype(jnp.float32), jnp.asarray(q), q_scale, q_offset, layer,
                                             bits=bits, group=group)
    x64 = np.asarray(x, np.float64)
    assert np.all(np.abs(np.asarray(reference, np.float64) - x64 @ w) <= 1e-5 * (np.abs(x64) @ np.abs(w)))
