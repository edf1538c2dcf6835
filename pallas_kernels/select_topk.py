"""Exact per-row top-k with a per-row k, without sorting the rows.

`lax.top_k` with k >= 256 is a full sort on GPU (about 1 ms per 32 rows of 128K). Selection only needs the set.
Scores are compared as order-preserving 32-bit keys of their float bits (`monotone_key`); non-finite scores are
never selected.

Radix search fixes `radix_bits` bits of the k-th largest key tau per pass, most significant first: the counting
kernel compares each score once against the 2**radix_bits candidate thresholds of the pass and the next digit is
the largest whose threshold still has at least k scores at or above it (8 passes with 4 bits). The chunk counts of
the last pass tell each chunk how many selected positions precede it, so a compaction kernel (one more read)
writes every position to its slot, in position order.

A faster method for large calls, a sorted sample bracketing the k-th key and one split pass, was built and
measured (0.257 against 0.436 ms at [1920, 8K] on the H200), but it needs a fallback when a bracket overflows its
buffer, a `lax.cond` that inside the compiled decode loop cost more than the passes it saved; it was removed
(docs/experiments.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import TARGET_PROGRAMS, check_power_of_2, next_power_of_2

# Filler for index slots past a row's count: a valid position, so unmasked gathers stay in bounds.
PAD_INDEX = 0
_INT32_MIN = -(2**31)
_SIGN_BIT = 0x80000000
# Smallest unsigned key of a finite float (-max float); a threshold of 1 therefore counts the finite scores.
_FIRST_FINITE_KEY = 1
_NO_THRESHOLD = 0xFFFFFFFF  # above every finite key, so its count is 0


def monotone_key(x):
    """int32 key of float32 x ordered like x over finite values (-0.0 just below +0.0); non-finite -> INT32_MIN.

    Flipping the magnitude bits of negative floats makes their two's-complement order follow the float order.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return jnp.where(jnp.isfinite(x), key, _INT32_MIN)


def _signed(unsigned_key):
    """Unsigned search-space key (uint32) -> the signed kernel key with the same order."""
    return lax.bitcast_convert_type(unsigned_key ^ jnp.uint32(_SIGN_BIT), jnp.int32)


def _chunk_bounds(chunk_size: int, length: int):
    chunk_start = pl.program_id(0) * chunk_size
    return chunk_start, jnp.minimum(chunk_start + chunk_size, length)


def _load_keys(scores_ref, block_start, block_size: int, chunk_end):
    position = block_start + jnp.arange(block_size)
    in_chunk = position < chunk_end
    scores = plt.load(scores_ref.at[pl.ds(block_start, block_size)], mask=in_chunk, other=-jnp.inf)
    return position, in_chunk, monotone_key(scores)


def count_at_least_kernel(
    scores_ref,  # [T] one row
    thresholds_ref,  # [num_thresholds] signed keys
    counts_ref,  # [num_thresholds] out: scores of this chunk with key >= threshold
    *,
    chunk_size: int,
    block_size: int,
):
    (length,) = scores_ref.shape
    chunk_start, chunk_end = _chunk_bounds(chunk_size, length)
    thresholds = thresholds_ref[...]

    def body(block, counts):
        _, _, keys = _load_keys(scores_ref, chunk_start + block * block_size, block_size, chunk_end)
        at_least = keys[None, :] >= thresholds[:, None]
        return counts + at_least.astype(jnp.int32).sum(axis=1)

    num_blocks = pl.cdiv(jnp.maximum(chunk_end - chunk_start, 0), block_size)
    counts_ref[...] = lax.fori_loop(0, num_blocks, body, jnp.zeros(thresholds.shape, jnp.int32))


def compact_kernel(
    scores_ref,  # [T] one row
    tau_ref,  # [] signed key of the row's k-th largest score
    ties_needed_ref,  # [] how many scores equal to tau the row takes
    ties_before_ref,  # [] scores equal to tau in earlier chunks
    selected_before_ref,  # [] positions selected in earlier chunks
    count_ref,  # [] positions selected in the row
    indices_ref,  # [k_max] out
    *,
    chunk_size: int,
    block_size: int,
    pad_slots_per_chunk: int,
):
    (length,) = scores_ref.shape
    (k_max,) = indices_ref.shape
    chunk_start, chunk_end = _chunk_bounds(chunk_size, length)
    tau = tau_ref[()]
    ties_needed = ties_needed_ref[()]

    def body(block, carry):
        ties_seen, selected = carry
        position, _, keys = _load_keys(scores_ref, chunk_start + block * block_size, block_size, chunk_end)
        tie = (keys == tau).astype(jnp.int32)
        tie_rank = ties_seen + jnp.cumsum(tie) - 1
        take = (keys > tau) | ((tie == 1) & (tie_rank < ties_needed))
        slot = selected + jnp.cumsum(take.astype(jnp.int32)) - 1
        # Unselected lanes aim past the end: masked on GPU, and dropped (not written back) by interpret mode,
        # which would otherwise race them against the selected lane sharing their slot.
        plt.store(indices_ref.at[jnp.where(take, slot, k_max)], position, mask=take)
        return ties_seen + tie.sum(), selected + take.astype(jnp.int32).sum()

    num_blocks = pl.cdiv(jnp.maximum(chunk_end - chunk_start, 0), block_size)
    lax.fori_loop(0, num_blocks, body, (ties_before_ref[()], selected_before_ref[()]))

    # Each chunk also fills its share of the slots past the row's count.
    count = count_ref[()]
    pad_start = pl.program_id(0) * pad_slots_per_chunk
    pad_end = jnp.minimum(pad_start + pad_slots_per_chunk, k_max)

    def pad_body(block, carry):
        block_start = pad_start + block * block_size
        slot = block_start + jnp.arange(block_size)
        pad = jnp.full((block_size,), PAD_INDEX, jnp.int32)
        plt.store(indices_ref.at[pl.ds(block_start, block_size)], pad, mask=(slot >= count) & (slot < pad_end))
        return carry

    lax.fori_loop(0, pl.cdiv(pad_slots_per_chunk, block_size), pad_body, None)


def _per_row_call(kernel, num_chunks: int, in_specs, out_spec, out_shape, *, num_warps: int, interpret: bool, name):
    return pl.pallas_call(
        kernel,
        grid=(num_chunks,),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=name,
    )


def count_at_least_unbatched(scores, thresholds, *, num_chunks, chunk_size, block_size, num_warps, interpret):
    """scores [T], thresholds [N] signed keys -> counts [num_chunks, N] of keys >= each threshold per chunk."""
    (length,) = scores.shape
    (num_thresholds,) = thresholds.shape
    kernel = functools.partial(count_at_least_kernel, chunk_size=chunk_size, block_size=block_size)
    return _per_row_call(
        kernel,
        num_chunks,
        in_specs=[pl.BlockSpec((length,), lambda c: (0,)), pl.BlockSpec((num_thresholds,), lambda c: (0,))],
        out_spec=pl.BlockSpec((None, num_thresholds), lambda c: (c, 0)),
        out_shape=jax.ShapeDtypeStruct((num_chunks, num_thresholds), jnp.int32),
        num_warps=num_warps,
        interpret=interpret,
        name="count_at_least",
    )(scores, thresholds)


def compact_unbatched(
    scores, tau, ties_needed, ties_before, selected_before, count, *, k_max, num_chunks, chunk_size, block_size,
    num_warps, interpret
):
    """Positions of the row's selected scores, in position order, then PAD_INDEX: [k_max]."""
    (length,) = scores.shape
    kernel = functools.partial(
        compact_kernel, chunk_size=chunk_size, block_size=block_size,
        pad_slots_per_chunk=pl.cdiv(k_max, num_chunks),
    )
    row_scalar = pl.BlockSpec((), lambda c: ())
    chunk_scalar = pl.BlockSpec((None,), lambda c: (c,))
    # All chunks write disjoint slots of the same row block.
    return _per_row_call(
        kernel,
        num_chunks,
        in_specs=[pl.BlockSpec((length,), lambda c: (0,)), row_scalar, row_scalar, chunk_scalar, chunk_scalar,
                  row_scalar],
        out_spec=pl.BlockSpec((k_max,), lambda c: (0,)),
        out_shape=jax.ShapeDtypeStruct((k_max,), jnp.int32),
        num_warps=num_warps,
        interpret=interpret,
        name="compact_selected",
    )(scores, tau, ties_needed, ties_before, selected_before, count)


def default_num_chunks(rows: int, length: int, block_size: int) -> int:
    """Enough chunks for about TARGET_PROGRAMS programs, each chunk at least four blocks long."""
    wanted = next_power_of_2(pl.cdiv(TARGET_PROGRAMS, rows))
    return max(1, min(wanted, length // (4 * block_size)))


def _wanted(k, finite, k_max: int):
    """Positions a row selects: k, at most k_max and the row's finite scores, at least 0."""
    return jnp.clip(jnp.minimum(k, finite), 0, k_max)


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _radix_select(scores, k, *, k_max, radix_bits, launch):
    """Radix search for tau, then compaction (module docstring)."""
    rows = scores.shape[0]
    num_chunks = launch["num_chunks"]
    count_at_least = jax.vmap(functools.partial(count_at_least_unbatched, **launch))
    num_thresholds = 2**radix_bits
    digits = jnp.arange(num_thresholds, dtype=jnp.uint32)
    prefix = jnp.zeros((rows,), jnp.uint32)  # tau's bits fixed so far
    # Per chunk, the count of keys >= the end of tau's current candidate interval (so far: none above 2**32).
    above_interval = jnp.zeros((rows, num_chunks), jnp.int32)
    fixed_bits = 0
    while fixed_bits < 32:
        width = min(radix_bits, 32 - fixed_bits)
        shift = 32 - fixed_bits - width
        real_digit = digits < 2**width
        thresholds = jnp.where(real_digit, prefix[:, None] + (digits << shift), jnp.uint32(_NO_THRESHOLD))
        if fixed_bits == 0:
            # Digit 0 of the first pass (threshold 0) is known to hold every score; count the finite ones instead.
            thresholds = thresholds.at[:, 0].set(_FIRST_FINITE_KEY)
        chunk_counts = count_at_least(scores, _signed(thresholds))  # [R, C, N]
        totals = chunk_counts.sum(axis=1)  # [R, N]
        if fixed_bits == 0:
            wanted = _wanted(k, totals[:, 0], k_max)
        # Counts fall as the digit grows, so the digits 1.. whose threshold keeps `wanted` scores form a prefix.
        digit = jnp.sum(real_digit[None, 1:] & (totals[:, 1:] >= wanted[:, None]), axis=1).astype(jnp.uint32)
        prefix = prefix + (digit << shift)
        next_digit = jnp.minimum(digit + 1, num_thresholds - 1).astype(jnp.int32)
        next_counts = jnp.take_along_axis(chunk_counts, next_digit[:, None, None], axis=2)[:, :, 0]
        above_interval = jnp.where((digit + 1 < 2**width)[:, None], next_counts, above_interval)
        at_least_tau = jnp.take_along_axis(chunk_counts, digit.astype(jnp.int32)[:, None, None], axis=2)[:, :, 0]
        fixed_bits += width

    # tau = prefix now; at_least_tau and above_interval count keys >= tau and > tau per chunk.
    greater = above_interval
    equal = at_least_tau - greater
    ties_needed = wanted - greater.sum(axis=1)
    ties_before = _exclusive_cumsum(equal, axis=1)
    taken = greater + jnp.clip(ties_needed[:, None] - ties_before, 0, equal)
    compact = jax.vmap(functools.partial(compact_unbatched, k_max=k_max, **launch))
    indices = compact(scores, _signed(prefix), ties_needed, ties_before, _exclusive_cumsum(taken, axis=1), wanted)
    return indices, wanted


@functools.partial(
    jax.jit,
    static_argnames=("k_max", "radix_bits", "block_size", "num_chunks", "num_warps", "interpret"),
)
def select_topk(
    scores: jax.Array,  # [R, T] float32
    k: jax.Array,  # [R] int32
    *,
    k_max: int,
    radix_bits: int = 4,
    block_size: int | None = None,
    num_chunks: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per row r, the positions of its k[r] largest finite scores (non-finite scores are never selected).

    Returns (indices [R, k_max] int32, counts [R] int32) with counts[r] = min(k[r], k_max, finite scores in row r).
    indices[r, :counts[r]] are distinct positions, in increasing order; among scores equal to the k-th largest,
    the lowest positions are taken. The remaining slots hold PAD_INDEX (0).

    radix_bits: bits of the threshold fixed per pass (module docstring). block_size: scores per inner step (power
    of two; None: 2048 from T = 32K on, else 1024). num_chunks: programs per row (None: enough for about 512 programs).
    num_warps: Triton launch parameter. The default block size is the best of a sweep on the H200 at [256, 8K],
    [1920, 8K] and [256, 128K] (benchmarks/results/kernels-tune-2026-11-30-0804{46,514}.json).
    """
    if scores.ndim != 2 or k.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [R, T] and k [R]; got {scores.shape}, {k.shape}")
    if not 1 <= radix_bits <= 8:
        raise ValueError(f"radix_bits must be in [1, 8], got {radix_bits}")
    rows, length = scores.shape
    if block_size is None:
        block_size = 2048 if length >= 32768 else 1024
    check_power_of_2("block_size", block_size)
    scores = scores.astype(jnp.float32)
    k = k.astype(jnp.int32)
    if num_chunks is None:
        num_chunks = default_num_chunks(rows, length, block_size)
    chunk_size = pl.cdiv(pl.cdiv(length, num_chunks), block_size) * block_size
    launch = dict(num_chunks=num_chunks, chunk_size=chunk_size, block_size=block_size, num_warps=num_warps,
                  interpret=interpret)
    return _radix_select(scores, k, k_max=k_max, radix_bits=radix_bits, launch=launch)


@functools.partial(jax.jit, static_argnames=("k_max",))
def select_topk_reference(scores, k, *, k_max: int):
    """lax.top_k twin of select_topk: same contract, but positions in score order and ties broken arbitrarily.

    is_stable=False is XLA's fastest top_k (for k >= 256 on GPU it is a full sort either way); k_max <= T.
    """
    scores = scores.astype(jnp.float32)
    finite = jnp.isfinite(scores)
    _, indices = lax.top_k(jnp.where(finite, scores, -jnp.inf), k_max, is_stable=False)
    finite = finite.sum(axis=1)
    counts = jnp.clip(jnp.minimum(k.astype(jnp.int32), finite), 0, k_max)
    in_count = jnp.arange(k_max)[None, :] < counts[:, None]
    return jnp.where(in_count, indices, PAD_INDEX).astype(jnp.int32), counts
