"""Weight-only quantized matmul for decode shapes: x [M, K] (bf16, M a few rows) times an int8 or packed int4
weight, dequantised on the fly, so a step reads the packed bytes and not a bf16 copy.

The weight is w[k, n] = q[k, n] * scale[k // group, n] + offset[k // group, n] (offset absent: symmetric).
- int8: q [K, N] int8.
- int4: q [K / 2, N] uint8, split-half within each scale group: byte row g * group / 2 + j holds row
  g * group + j in its low nibble and row g * group + group / 2 + j in its high nibble (values 0..15, so
  symmetric int4 stores q + 8 with offset -8 * scale; group >= 32). Pairing rows half a group apart, rather than
  neighbours, lets a program split the nibbles into two [block_k, block_n] tiles and multiply each by a
  contiguous slice of x (Triton values cannot be interleaved or reshaped), both under the same scale; it is
  GGUF's own Q4_0 / Q4_1 layout for groups of 32, and it keeps whole groups on each device when K is split.

XLA keeps the int → bf16 convert out of its GEMMs at these shapes and reads no fewer bytes than a bf16 weight
(design notes, 2026-12-01), hence a kernel. Each program owns a block of output columns and a share of K
(split-K, so that narrow matrices still occupy every SM); a K block lies inside one scale group, so a block's
partial product is scaled once: x_blk @ (q_blk * s + o) = (x_blk @ q_blk) * s + rowsum(x_blk) * o. The
split partials are summed in float32 outside the kernel. Three kernels share that scheme (`_layout`): one row of x
without a dot, int4 at 2-16 rows as the transposed product w^T x^T, and a dot with the weight tile second. A fourth,
asked for by `integer_dot`, multiplies int8 or int4 codes by rows of x quantized to int8, in integers (one row: PTX
dp4a; 2-16 rows: an int8 tensor-core dot): an approximation of the product (x's quantization error, about 1 % of
the output), for drafts that ask for int8 activations. On a Hopper GPU the drafts' float products at up to 16 rows
go through pallas_kernels/weight_only_mgpu.py instead (vegas_jax.decode.draft_kernel.code_layout), whose layout avoids the
tile shuffles that keep these kernels issue-bound.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import ptx
from pallas_kernels._common import NUM_SMS, check_power_of_2, next_power_of_2, stacked_layer

_MIN_ROWS = 16  # Triton dots need every dimension >= 16
# Rows of x a program of the row-major dot multiplies: more rows take more programs along a third grid axis. One
# program once held them all, and its float32 accumulator [rows, block_n] passed Triton's limit of 2^20 elements a
# tensor at 16,384 rows (the sampled-distribution check's batch of seeds with int4 drafts, H100 2026-12-06);
# 64 x 128 is 64 registers a thread at 4 warps.
ROWS_BLOCK = 64
# An int8 dot's K on NVIDIA tensor cores (mma k32): Triton's front end refuses less, Pallas's lowering does not, and
# on an H100 blocks of 16 (int4 groups of 32) gave products wrong by about their own size.
INT8_DOT_MIN_K = 32


def _block_partial(x, q, scale, offset):
    """(x [M, bk] @ q [bk, bn]) * scale [bn] (+ rowsum(x) * offset [bn]), float32."""
    acc = plt.dot(x, q.astype(x.dtype), allow_tf32=False) * scale[None, :]
    if offset is not None:
        acc += jnp.sum(x.astype(jnp.float32), axis=1)[:, None] * offset[None, :]
    return acc


def _nibble_partial(x, nibbles, scale, offset):
    """_block_partial for 4-bit values [bk, bn] without an int -> float convert: nibbles are the bf16 128 + v
    of each value v (_nibble_tiles), so the dot gives x @ q + 128 rowsum(x), and the offset term takes the 128
    back. Other dtypes of x take the values (nibbles - 128) and convert."""
    if x.dtype != jnp.bfloat16:
        return _block_partial(x, nibbles.astype(jnp.float32) - 128.0, scale, offset)
    w = nibbles
    rowsum = jnp.sum(x.astype(jnp.float32), axis=1)[:, None]
    shift = -128.0 * scale if offset is None else offset - 128.0 * scale
    return plt.dot(x, w, allow_tf32=False) * scale[None, :] + rowsum * shift[None, :]


def _rows_of_x(bits: int, group: int, k0):
    """(the row of x block k0 of q starts at, int4: that of its high nibbles, and its scale group)."""
    if bits == 8:
        return k0, None, k0 // group
    half = group // 2
    g = k0 // half
    return k0 + g * half, k0 + (g + 1) * half, g


def _walk_blocks(load, step, blocks_per_split: int, init, prefetch: bool):
    """fori_loop over a program's K blocks: step(i, tile, carry) with tile = load(i). prefetch: the loop carries
    block i + 1's tile, loaded before block i is multiplied, so a program keeps a second tile's loads in flight
    while it computes (a one-row product has no dot for Triton's pipeliner to stage its loads through; the float
    kernel held a quarter of the SM's warps, limited by its registers, Nsight Compute 2026-12-02)."""
    if not prefetch:
        return lax.fori_loop(0, blocks_per_split, lambda i, carry: step(i, load(i), carry), init)

    def body(i, state):
        carry, tile = state
        upcoming = load(jnp.minimum(i + 1, blocks_per_split - 1))  # the last block loads itself again, unused
        return step(i, tile, carry), upcoming

    return lax.fori_loop(0, blocks_per_split, body, (init, load(0)))[0]


def weight_only_matmul_kernel(x_ref, q_ref, scale_ref, offset_ref, o_ref, *, bits: int, group: int, block_k: int,
                              blocks_per_split: int, unpack: str, interpret: bool):
    """One (column block, K split) program. x_ref [M, K]; q_ref [K or K/2, bn]; scale_ref, offset_ref
    [K / group, bn]; o_ref [M, bn] this split's partial output."""
    split = pl.program_id(1)
    m = x_ref.shape[0]

    def scale_row(ref, g):
        return None if ref is None else ref[g, :].astype(jnp.float32)

    def body(i, acc):
        k0 = (split * blocks_per_split + i) * block_k  # row of q this block starts at
        q = q_ref[pl.ds(k0, block_k), :]
        low_rows, high_rows, g = _rows_of_x(bits, group, k0)
        scale, offset = scale_row(scale_ref, g), scale_row(offset_ref, g)
        if bits == 8:
            return acc + _block_partial(x_ref[:, pl.ds(low_rows, block_k)], q, scale, offset)
        low, high = _nibble_tiles(q, unpack, interpret)
        acc += _nibble_partial(x_ref[:, pl.ds(low_rows, block_k)], low, scale, offset)
        return acc + _nibble_partial(x_ref[:, pl.ds(high_rows, block_k)], high, scale, offset)

    acc = lax.fori_loop(0, blocks_per_split, body, jnp.zeros((m, o_ref.shape[1]), jnp.float32))
    o_ref[...] = acc


def _exact_float(q):
    """float32(q) for int32 q in [-128, 255] without an int -> float convert (a quarter-rate instruction, the
    vector kernel's bottleneck): the float32 with bits 0x4B000000 | (q + 128) is exactly 2^23 + q + 128."""
    return lax.bitcast_convert_type((q + 128) | 0x4B000000, jnp.float32) - 8388736.0


def _unsigned_float(q):
    """_exact_float for q in [0, 255], one integer operation fewer (and with a mask before it, one LOP3)."""
    return lax.bitcast_convert_type(q | 0x4B000000, jnp.float32) - 8388608.0


def weight_only_vector_kernel(x_ref, q_ref, scale_ref, offset_ref, o_ref, *, bits: int, group: int, block_k: int,
                              blocks_per_split: int, prefetch: bool):
    """weight_only_matmul_kernel for one row of x: no dot (a dot pads the row to 16 and sends each weight tile
    through shared memory into the tensor cores' layout). The codes become exact floats in registers and are
    multiplied by x; since a K block lies in one scale group, a block's products are scaled once per element
    pair (int4: both nibbles of a byte share the scale) and its offset enters as rowsum(x_blk) * offset per
    column, into a [block_k, block_n] accumulator summed over K once at the end. A high nibble is used in place
    (16 times its code, one mask) and its row of x divided by 16 (exact). At Llama-3.1-8B's shapes this form
    read int4 codes 1.1-1.4x faster than dequantizing each weight first (H200,
    benchmarks/results/weight-only-2026-12-02-int4-variants.json)."""
    split = pl.program_id(1)

    def load(i):
        return q_ref[pl.ds((split * blocks_per_split + i) * block_k, block_k), :]

    def step(i, q, carry):
        acc, offsets = carry
        k0 = (split * blocks_per_split + i) * block_k
        q = q.astype(jnp.int32)
        low_rows, high_rows, g = _rows_of_x(bits, group, k0)
        x_low = x_ref[0, pl.ds(low_rows, block_k)].astype(jnp.float32)
        if bits == 8:
            products, x_sum = x_low[:, None] * _exact_float(q), jnp.sum(x_low)
        else:
            x_high = x_ref[0, pl.ds(high_rows, block_k)].astype(jnp.float32)
            products = (x_low[:, None] * _unsigned_float(q & 0xF)
                        + (x_high * 0.0625)[:, None] * _unsigned_float(q & 0xF0))
            x_sum = jnp.sum(x_low) + jnp.sum(x_high)
        acc += products * scale_ref[g, :].astype(jnp.float32)[None, :]
        if offset_ref is not None:
            offsets += x_sum * offset_ref[g, :].astype(jnp.float32)
        return acc, offsets

    block_n = o_ref.shape[1]
    carry = jnp.zeros((block_k, block_n), jnp.float32), jnp.zeros((block_n,), jnp.float32)
    acc, offsets = _walk_blocks(load, step, blocks_per_split, carry, prefetch)
    o_ref[...] = (jnp.sum(acc, axis=0) + offsets)[None, :]


def weight_only_integer_kernel(xw_ref, xs_ref, q_ref, scale_ref, offset_ref, o_ref, *, bits: int, group: int,
                               x_group: int, block_k: int, blocks_per_split: int, interpret: bool,
                               prefetch: bool):
    """Integer codes times one row of x in integers: x quantized to int8 per `x_group` positions along K (xw_ref
    [1, K / 4] int32, four consecutive codes a word, byte j holding position 4r + j; xs_ref [1, K / x_group] their
    scales), and each program's rows of codes gathered four at a time (rows k0 + j, k0 + 4 + j, ... by strided
    loads) into words of the same layout, so that PTX dp4a sums four byte products an instruction into an int32.
    int8: a word's four codes against four positions of x. int4: a word of four byte rows holds, in its low nibbles,
    four consecutive positions of the first half of a scale group and, in its high nibbles, the four half a group
    later (the split-half layout), so two masks make two words of values 0..15 and two dp4a take them against the
    two runs of x. A block lies in one weight group and one x group: its integer sums are scaled once per column,
    and an offset enters as (sum of the block's x codes) x offset, so the product is exactly that of the quantized
    row. The codes come as stored for the other kernels (words built from strided loads), or as int32 words already
    (pack_code_words: one load a word). Tried against the float vector kernel on the H200 with words stored ahead
    (2026-12-02, docs/experiments.md): int8 codes read 1.2-1.7x faster, int4 1.3-2.1x;
    benchmarks/bench_weight_only.py --integer-dot measures both forms here."""
    split = pl.program_id(1)
    dot4 = ptx.dp4a_emulated if interpret else ptx.dp4a
    words_per_block = block_k // 4

    def load(i):
        k0 = (split * blocks_per_split + i) * block_k
        if q_ref.dtype == jnp.int32:  # stored as words (pack_code_words)
            return q_ref[pl.ds(k0 // 4, words_per_block), :]
        return ptx.byte_words([q_ref[pl.ds(k0 + j, words_per_block, stride=4), :].astype(jnp.int32)
                               for j in range(4)])

    def step(i, words, acc):
        k0 = (split * blocks_per_split + i) * block_k
        low_rows, high_rows, g = _rows_of_x(bits, group, k0)
        x_runs = [xw_ref[0, pl.ds(low_rows // 4, words_per_block)]]
        if bits == 8:
            products = dot4(words, jnp.broadcast_to(x_runs[0][:, None], words.shape), jnp.zeros_like(words))
        else:
            x_runs.append(xw_ref[0, pl.ds(high_rows // 4, words_per_block)])
            low, high = words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F
            products = dot4(low, jnp.broadcast_to(x_runs[0][:, None], words.shape), jnp.zeros_like(words))
            products = dot4(high, jnp.broadcast_to(x_runs[1][:, None], words.shape), products)
        partial = jnp.sum(products, axis=0).astype(jnp.float32) * scale_ref[g, :].astype(jnp.float32)
        if offset_ref is not None:
            ones = jnp.full((words_per_block,), 0x01010101, jnp.int32)
            x_sum = sum(jnp.sum(dot4(run, ones, jnp.zeros_like(run))) for run in x_runs)
            partial += x_sum.astype(jnp.float32) * offset_ref[g, :].astype(jnp.float32)
        return acc + xs_ref[0, low_rows // x_group] * partial

    o_ref[...] = _walk_blocks(load, step, blocks_per_split, jnp.zeros((o_ref.shape[1],), jnp.float32),
                              prefetch)[None, :]


def weight_only_integer_rows_kernel(xq_ref, xs_ref, q_ref, scale_ref, offset_ref, o_ref, *, bits: int, group: int,
                                    x_group: int, block_k: int, blocks_per_split: int):
    """weight_only_integer_kernel for 2-16 rows, on the tensor cores: the rows' int8 codes (xq_ref [16, K], padded
    rows zero; xs_ref [16, K / x_group] their scales) times each block's codes as an int8 tile (int4: the two nibble
    tiles masked into bytes, no float conversion), a dot with an int32 accumulator, scaled once a block per row and
    column. dp4a per row would multiply the one-row kernel's instructions by the rows. Blocks of at least
    INT8_DOT_MIN_K code rows."""
    split = pl.program_id(1)

    def body(i, acc):
        k0 = (split * blocks_per_split + i) * block_k
        q = q_ref[pl.ds(k0, block_k), :]
        low_rows, high_rows, g = _rows_of_x(bits, group, k0)
        x_runs = [xq_ref[:, pl.ds(low_rows, block_k)]]
        if bits == 8:
            tiles = [q]
        else:
            x_runs.append(xq_ref[:, pl.ds(high_rows, block_k)])
            tiles = [(q & 0xF).astype(jnp.int8), (q >> 4).astype(jnp.int8)]
        sums = sum(jnp.dot(run, tile, preferred_element_type=jnp.int32) for run, tile in zip(x_runs, tiles))
        partial = sums.astype(jnp.float32) * scale_ref[g, :].astype(jnp.float32)[None, :]
        if offset_ref is not None:
            x_sum = sum(jnp.sum(run.astype(jnp.int32), axis=1) for run in x_runs)
            partial += x_sum.astype(jnp.float32)[:, None] * offset_ref[g, :].astype(jnp.float32)[None, :]
        x_scale = xs_ref[:, pl.ds(low_rows // x_group, 1)]  # [16, 1]: a block lies in one x group
        return acc + x_scale * partial

    o_ref[...] = lax.fori_loop(0, blocks_per_split, body, jnp.zeros(o_ref.shape, jnp.float32))


def pack_code_words(q):
    """Codes [R, N] as stored (int8, or uint8 bytes of two int4 nibbles) -> int32 [R / 4, N]: byte j of word (r, n)
    is q[4r + j, n] (the integer kernel's words)."""
    r, n = q.shape
    codes = q.astype(jnp.int32).reshape(r // 4, 4, n)
    return ptx.byte_words([codes[:, j] for j in range(4)])


def int8_rows(x, x_group: int):
    """x [M, K] -> (int32 [M, K] codes in -127..127, float32 [M, K / x_group] scales): symmetric, code = round(x /
    scale), scale = max |x| / 127 per group. The integer path's numerics: codes x scales is the row it multiplies."""
    m, k = x.shape
    grouped = x.astype(jnp.float32).reshape(m, k // x_group, x_group)
    absmax = jnp.max(jnp.abs(grouped), axis=-1)
    scales = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    codes = jnp.clip(jnp.round(grouped / scales[..., None]), -127, 127).astype(jnp.int32)
    return codes.reshape(m, k), scales


def quantize_rows_int8(x, x_group: int):
    """x [M, K] -> int8_rows's codes as int32 [M, K / 4], four consecutive positions a word (byte j holding position
    4r + j), and its scales."""
    codes, scales = int8_rows(x, x_group)
    codes = codes.reshape(x.shape[0], -1, 4)
    return ptx.byte_words([codes[..., j] for j in range(4)]), scales


def weight_only_swapped_kernel(xt_ref, q_ref, scale_ref, offset_ref, o_ref, *, group: int, block_k: int,
                               blocks_per_split: int, unpack: str, interpret: bool):
    """int4 at a few rows: the product transposed, out^T [block_n, R] = w^T [block_n, K] @ x^T [K, R], so that the
    weight tile just dequantised in registers is the dot's first operand and x (R = 16 padded rows) the small
    second one. At 8 rows it read int4 codes at up to 1.25x the rate of weight_only_matmul_kernel, whose weight
    tile is the dot's second operand (H200, weight-only-2026-12-02-int4-variants.json). xt_ref [K, R]; q_ref
    [K / 2, bn]; o_ref [bn, R] this split's partial output, transposed."""
    split = pl.program_id(1)

    def body(i, acc):
        k0 = (split * blocks_per_split + i) * block_k
        low, high = _nibble_tiles(q_ref[pl.ds(k0, block_k), :], unpack, interpret)
        low_rows, high_rows, g = _rows_of_x(4, group, k0)
        x_low, x_high = xt_ref[pl.ds(low_rows, block_k), :], xt_ref[pl.ds(high_rows, block_k), :]
        scale = scale_ref[g, :].astype(jnp.float32)
        products = plt.dot(low.T, x_low, allow_tf32=False) + plt.dot(high.T, x_high, allow_tf32=False)
        rowsum = jnp.sum(x_low.astype(jnp.float32), axis=0) + jnp.sum(x_high.astype(jnp.float32), axis=0)
        shift = -128.0 * scale if offset_ref is None else offset_ref[g, :].astype(jnp.float32) - 128.0 * scale
        return acc + products * scale[:, None] + rowsum[None, :] * shift[:, None]

    o_ref[...] = lax.fori_loop(0, blocks_per_split, body, jnp.zeros(o_ref.shape, jnp.float32))


def _nibble_bf16(nibbles):
    """bf16 128 + v for int32 v in 0..15: the bf16 with bits 0x4300 | v (its exponent puts the unit in the last
    mantissa bit)."""
    return lax.bitcast_convert_type((nibbles | 0x4300).astype(jnp.uint16), jnp.bfloat16)


UNPACKS = ("ops", "prmt")  # how a kernel turns int4 code bytes into bf16 tiles (_nibble_tiles)


def _nibble_tiles(q_bytes, unpack: str, interpret: bool = False):
    """(low, high): bf16 128 + the low and high nibble of each code byte of q_bytes [bk, bn] uint8, by integer
    operations a weight ("ops") or by PTX byte permutes four bytes at a time ("prmt": 4-6 instructions for 8
    weights against about 3 a weight; pallas_kernels.ptx)."""
    if unpack == "ops":
        q = q_bytes.astype(jnp.int32)
        return _nibble_bf16(q & 0xF), _nibble_bf16(q >> 4)
    return ptx.nibbles_to_bf16(q_bytes, high=False, interpret=interpret), ptx.nibbles_to_bf16(
        q_bytes, high=True, interpret=interpret)


def code_blocks(bits: int, k: int, group: int, block_k: int, x_group: int | None = None) -> tuple[int, int]:
    """(block_k as the kernels take it, the number of K blocks): block_k counts rows of the codes (positions for
    int8, bytes for int4) and is clamped to one scale group, the codes and (integer path) one x group."""
    block_rows = k if bits == 8 else k // 2
    block_k = min(block_k, group if bits == 8 else group // 2, block_rows, x_group or block_rows)
    return block_k, block_rows // block_k


PROGRAMS_PER_SM = 4


def default_splits(column_blocks: int, k_blocks: int) -> int:
    """Halve the K range of each program while the launch has fewer than PROGRAMS_PER_SM programs per SM, keeping
    at least two K blocks per program. Four, not two (until 2026-12-04): at Llama-3.1-8B's gate_up (4096 x 28672,
    int4) twice the splits of the two-per-SM rule took 40.9 us against 44.9 at one row (32 x 256 blocks) and 59.6
    against 66.9 at eight (64 x 128), and four times 41.6 and 61.6 (H200, bench_weight_only.py --split-factors,
    weight-only-2026-12-04-prmt-splits.json): more programs hide the loads' latency, until the partial sums cost."""
    splits = 1
    while (column_blocks * splits < PROGRAMS_PER_SM * NUM_SMS and k_blocks % (2 * splits) == 0
           and k_blocks // (2 * splits) >= 2):
        splits *= 2
    return splits


@functools.partial(jax.jit, static_argnames=("bits", "group", "block_k", "block_n", "num_splits", "num_warps",
                                             "num_stages", "interpret", "out_dtype", "integer_dot", "x_group",
                                             "nibble_unpack", "prefetch"))
def weight_only_matmul(x, q, scale, offset=None, layer=None, *, bits: int, group: int, block_k: int = 64,
                       block_n: int = 128, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
                       interpret: bool = False, out_dtype=None, integer_dot: bool = False, x_group: int = 128,
                       nibble_unpack: str = "ops", prefetch: bool | None = None):
    """x [M, K] @ dequantised w [K, N] -> [M, N] in out_dtype (default x's; float32 accumulation). See the module
    docstring for the layouts of q, scale [K / group, N] and offset (same shape, or None). layer (int32 []): q, scale
    and offset hold every layer's weight stacked [L, ...] and the product is layer `layer`'s, which the kernel reads
    in place (stacked_layer). integer_dot (1-16 rows): x quantized to int8 per x_group positions and multiplied in
    integers (one row: weight_only_integer_kernel; more: weight_only_integer_rows_kernel), the exact product of those
    quantized rows, an approximation of x @ w within x's quantization error. nibble_unpack (int4 at 2 rows or more,
    the dot kernels): how code bytes become bf16 tiles, "ops" (integer operations a weight) or "prmt" (PTX byte
    permutes, four bytes an instruction; _nibble_tiles), the same values either way. prefetch (one row): each program
    loads its next K block's codes before it multiplies the current one (_walk_blocks); by default with codes stored
    as words, the drafts' int8 activations at one row, where it took three of a layer's int4 products at
    Llama-3.1-8B's shapes from 55.1 to 50.5 us (q/k/v, gate/up and down in the drafts' 32 x 256 blocks; the float
    vector kernel lost 5-30 % with it: H200,
    `benchmarks/bench_weight_only.py --rows 1 --bits 4 --integer-dot --prefetch 0,1`,
    weight-only-2026-12-04-s35-prefetch.json)."""
    m, k = x.shape
    (q, scale, offset), layer = stacked_layer(layer, q, scale, offset)
    num_layers = q.shape[0]
    if nibble_unpack not in UNPACKS:
        raise ValueError(f"nibble_unpack must be one of {', '.join(UNPACKS)}, got {nibble_unpack!r}")
    if integer_dot and (m > _MIN_ROWS or k % x_group or (bits == 4 and x_group % group)):
        raise ValueError(f"integer_dot multiplies up to {_MIN_ROWS} rows quantized in x groups dividing K (int4: "
                         f"whole weight groups); got {m} rows, K = {k}, x_group {x_group}, {bits}-bit group {group}")
    stored_words = q.dtype == jnp.int32  # codes four rows a word (pack_code_words): the one-row integer path's own
    if stored_words and not (integer_dot and m == 1):
        raise ValueError("codes stored as words (int32) are multiplied by integer_dot at one row only")
    if prefetch and m > 1:
        raise ValueError(f"prefetch is the one-row kernels' (x has {m} rows)")
    prefetch = stored_words if prefetch is None else prefetch
    block_rows = k if bits == 8 else k // 2  # rows of the codes, what block_k counts: positions (int8), bytes (int4)
    rows_of_q = block_rows // 4 if stored_words else block_rows
    if bits not in (4, 8) or q.ndim != 3 or q.shape[1] != rows_of_q or (bits == 4 and k % 2):
        raise ValueError(f"q {q.shape[1:]} ({q.dtype}) is not a {bits}-bit weight for K = {k}")
    n = q.shape[2]
    if (scale.shape != (num_layers, k // group, n) or k % group
            or (offset is not None and offset.shape != scale.shape)):
        raise ValueError(f"scale {scale.shape[1:]} (offset {None if offset is None else offset.shape[1:]}) must be "
                         f"[K / group, N] = [{k // group}, {n}] (layers alike)")
    rows_per_group = group if bits == 8 else group // 2  # rows of q under one scale
    block_k, k_blocks = code_blocks(bits, k, group, block_k, x_group if integer_dot else None)
    check_power_of_2("block_k", block_k, 16)
    if integer_dot and x_group % block_k:
        raise ValueError(f"x_group {x_group} does not tile into blocks of {block_k}")
    if integer_dot and m > 1 and block_k < INT8_DOT_MIN_K:
        raise ValueError(f"integer_dot on {m} rows multiplies blocks of at least {INT8_DOT_MIN_K} code rows (the "
                         f"tensor cores' int8 dot); got {block_k} ({bits}-bit group {group}, x_group {x_group})")
    check_power_of_2("block_n", block_n, 16)
    if nibble_unpack == "prmt" and (block_k * block_n) % (4 * 32 * num_warps):
        raise ValueError(f"nibble_unpack 'prmt' takes four code bytes a thread at a time: a {block_k} x {block_n} "
                         f"block gives {num_warps * 32} threads {block_k * block_n / (num_warps * 32):g} each")
    if rows_per_group % block_k or block_rows % block_k or n % block_n:
        raise ValueError(f"K = {k}, N = {n}, group {group} do not tile into blocks of {block_k} x {block_n}")
    splits = num_splits or default_splits(n // block_n, k_blocks)
    if k_blocks % splits:
        raise ValueError(f"{k_blocks} K blocks do not split {splits} ways")
    layout = ("integer" if m == 1 else "integer_rows") if integer_dot else _layout(bits, x.dtype, m)
    blocks_per_split = k_blocks // splits
    column = lambda j, s, r: (0, 0, j)  # every layer's: the kernel indexes its layer (_LayerView)
    in_specs = [pl.BlockSpec((), lambda j, s, r: ()), pl.BlockSpec((num_layers, rows_of_q, block_n), column),
                pl.BlockSpec((num_layers, k // group, block_n), column)]
    args = [layer, q, scale]
    if offset is not None:
        in_specs.append(pl.BlockSpec((num_layers, k // group, block_n), column))
        args.append(offset)
    row_blocks = 1  # programs along the rows of x: the row-major dot's alone may take several
    if layout == "integer":
        xs = quantize_rows_int8(x, x_group)
        kernel = functools.partial(weight_only_integer_kernel, bits=bits, group=group, x_group=x_group,
                                   block_k=block_k, blocks_per_split=blocks_per_split, interpret=interpret,
                                   prefetch=prefetch)
        out_block, out_index, out_shape = (None, 1, block_n), lambda j, s, r: (s, 0, j), (splits, 1, n)
    elif layout == "integer_rows":
        codes, scales = int8_rows(x, x_group)
        xs = (jnp.zeros((_MIN_ROWS, k), jnp.int8).at[:m].set(codes.astype(jnp.int8)),
              jnp.ones((_MIN_ROWS, k // x_group), jnp.float32).at[:m].set(scales))
        kernel = functools.partial(weight_only_integer_rows_kernel, bits=bits, group=group, x_group=x_group,
                                   block_k=block_k, blocks_per_split=blocks_per_split)
        out_block, out_index = (None, _MIN_ROWS, block_n), lambda j, s, r: (s, 0, j)
        out_shape = (splits, _MIN_ROWS, n)
    elif layout == "swapped":
        xs = (jnp.zeros((k, _MIN_ROWS), x.dtype).at[:, :m].set(x.T),)
        kernel = functools.partial(weight_only_swapped_kernel, group=group, block_k=block_k,
                                   blocks_per_split=blocks_per_split, unpack=nibble_unpack, interpret=interpret)
        out_block, out_index = (None, block_n, _MIN_ROWS), lambda j, s, r: (s, j, 0)
        out_shape = (splits, n, _MIN_ROWS)
    else:
        rows = 1 if layout == "vector" else max(_MIN_ROWS, next_power_of_2(m))
        if rows > ROWS_BLOCK:  # blocks of ROWS_BLOCK rows, the last padded (not the whole to a power of 2)
            row_blocks, rows = -(-m // ROWS_BLOCK), ROWS_BLOCK
        xs = (x if layout == "vector" else jnp.zeros((row_blocks * rows, k), x.dtype).at[:m].set(x),)
        kernel = functools.partial(weight_only_vector_kernel if layout == "vector" else weight_only_matmul_kernel,
                                   bits=bits, group=group, block_k=block_k, blocks_per_split=blocks_per_split)
        kernel = functools.partial(kernel, **({"prefetch": prefetch} if layout == "vector"
                                              else {"unpack": nibble_unpack, "interpret": interpret}))
        out_block, out_index = (None, rows, block_n), lambda j, s, r: (s, r, j)
        out_shape = (splits, row_blocks * rows, n)
    x_block = (lambda a: (rows, k)) if row_blocks > 1 else (lambda a: a.shape)
    partial = pl.pallas_call(
        _reading_layer(kernel, len(xs), offset is not None),
        grid=(n // block_n, splits, row_blocks),
        in_specs=[pl.BlockSpec(x_block(a), lambda j, s, r: (r, 0)) for a in xs] + in_specs,
        out_specs=pl.BlockSpec(out_block, out_index),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"weight_only_matmul_{layout}",
    )(*xs, *args)
    total = partial.sum(axis=0)
    return (total[:, :m].T if layout == "swapped" else total[:m]).astype(out_dtype or x.dtype)


SWAPPED_MAX_ROWS = _MIN_ROWS  # the swapped kernel's x^T is one dot operand of 16 columns


def _layout(bits: int, dtype, rows: int) -> str:
    """Which kernel multiplies: one row the dot-free vector kernel; int4 with bf16 activations at up to 16 rows the
    swapped one; otherwise the row-major dot (int8, or more rows: the swapped form is measured at 8 rows alone)."""
    if rows == 1:
        return "vector"
    if bits == 4 and dtype == jnp.bfloat16 and rows <= SWAPPED_MAX_ROWS:
        return "swapped"
    return "rows"


@dataclasses.dataclass(frozen=True)
class _LayerView:
    """One layer of a stacked ref [L, ...], read as that layer's own ref would be. Each read is one indexer with
    the layer first: Triton's lowering takes one indexer a load, so `ref.at[layer]` and then a slice would not
    lower."""
    ref: Any
    layer: Any

    @property
    def dtype(self):
        return self.ref.dtype

    def __getitem__(self, index):
        return self.ref[(self.layer,) + (index if isinstance(index, tuple) else (index,))]


def _reading_layer(kernel, num_x: int, with_offset: bool):
    """The kernel on the pallas_call's refs (x refs, layer, q, scale[, offset], out), q, scale and offset every
    layer's, handed to it as views of the layer read (offset None where the weight has none)."""
    def call(*refs):
        x_refs, (layer_ref, *weight_refs, o_ref) = refs[:num_x], refs[num_x:]
        layer = layer_ref[()]
        views = [_LayerView(ref, layer) for ref in weight_refs]
        return kernel(*x_refs, *views, *([] if with_offset else [None]), o_ref)
    return call


def dequantize(q, scale, offset=None, *, bits: int, group: int):
    """The float32 weight [K, N] that q, scale and offset encode (module docstring)."""
    if bits == 4:
        q = q.astype(jnp.int32).reshape(-1, group // 2, q.shape[1])  # [groups, group / 2, N]
        q = jnp.concatenate([q & 0xF, q >> 4], axis=1).reshape(-1, q.shape[2])
    w = q.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), group, axis=0)
    if offset is not None:
        w += jnp.repeat(offset.astype(jnp.float32), group, axis=0)
    return w


def weight_only_matmul_reference(x, q, scale, offset=None, layer=None, *, bits: int, group: int):
    """x @ dequantize(...) in plain jnp, float32 accumulation, in x's dtype; with a layer, that layer's of stacked
    q, scale and offset."""
    if layer is not None:
        q, scale, offset = (None if a is None else a[layer] for a in (q, scale, offset))
    w = dequantize(q, scale, offset, bits=bits, group=group)
    return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST).astype(x.dtype)
