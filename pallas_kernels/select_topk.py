"""Exact per-row top-k with a per-row k, without sorting the rows.

`lax.top_k` with k >= 256 is a full sort on GPU (about 1 ms per 32 rows of 128K). Selection only needs the set.
Scores are compared as order-preserving 32-bit keys of their float bits (`monotone_key`); non-finite scores are
never selected.

Bracketing (the usual path: two reads of the scores). A sorted sample of each row (runs of 8 contiguous scores,
evenly spaced) gives 15 thresholds around where the k-th largest score should fall. One counting pass counts, per
chunk of the row, the scores at or above each threshold and the finite ones. The two adjacent thresholds whose
counts bracket k split the row: scores above the bracket are certainly selected, scores inside it are candidates.
One split pass writes every certain position straight to its slot (the per-chunk counts give each chunk its
offset) and the candidates' keys and positions to a small buffer, and sorting that buffer picks the rest.

Radix search (the fallback, taken for the whole call when some row's bracket holds more candidates than the
buffer: heavy ties, or a sample far off). It fixes `radix_bits` bits of the k-th largest key tau per pass, most
significant first: the counting kernel compares each score once against the 2**radix_bits candidate thresholds of
the pass and the next digit is the largest whose threshold still has at least k scores at or above it (8 passes
with 4 bits). The chunk counts of the last pass tell each chunk how many selected positions precede it, so a
compaction kernel (one more read) writes every position to its slot, in position order.

The fallback branch is a `lax.cond`, decided on the host: inside a compiled loop that costs a synchronisation per
call, which at small batch outweighs the passes bracketing saves (the decode loop uses radix search, see
vegas_jax/selection.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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


def split_kernel(
    scores_ref,  # [T] one row
    take_ref,  # [] signed key: scores at or above it are selected
    low_ref,  # [] signed key: scores in [low, take) are candidates
    taken_before_ref,  # [] positions taken in earlier chunks
    candidates_before_ref,  # [] candidates in earlier chunks
    taken_ref,  # [k_max] out: taken positions, from slot 0 on
    candidate_key_ref,  # [max_candidates] out
    candidate_position_ref,  # [max_candidates] out
    *,
    chunk_size: int,
    block_size: int,
):
    (length,) = scores_ref.shape
    take_key, low_key = take_ref[()], low_ref[()]
    chunk_start, chunk_end = _chunk_bounds(chunk_size, length)

    def scatter(ref, slot, value, mask):
        # Masked lanes aim one past the end: masked on GPU, and dropped by interpret mode (module compact_kernel).
        plt.store(ref.at[jnp.where(mask, slot, ref.shape[0])], value, mask=mask)

    def body(block, carry):
        taken, candidates = carry
        position, _, keys = _load_keys(scores_ref, chunk_start + block * block_size, block_size, chunk_end)
        take = keys >= take_key
        candidate = (keys >= low_key) & ~take
        scatter(taken_ref, taken + jnp.cumsum(take.astype(jnp.int32)) - 1, position, take)
        slot = candidates + jnp.cumsum(candidate.astype(jnp.int32)) - 1
        scatter(candidate_key_ref, slot, keys, candidate)
        scatter(candidate_position_ref, slot, position, candidate)
        return taken + take.astype(jnp.int32).sum(), candidates + candidate.astype(jnp.int32).sum()

    num_blocks = pl.cdiv(jnp.maximum(chunk_end - chunk_start, 0), block_size)
    lax.fori_loop(0, num_blocks, body, (taken_before_ref[()], candidates_before_ref[()]))


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


def split_unbatched(
    scores, take_key, low_key, taken_before, candidates_before, *, k_max, max_candidates, num_chunks, chunk_size,
    block_size, num_warps, interpret
):
    """(taken positions [k_max], candidate keys [max_candidates], candidate positions [max_candidates]); slots past
    the row's totals are unwritten."""
    (length,) = scores.shape
    kernel = functools.partial(split_kernel, chunk_size=chunk_size, block_size=block_size)
    row_scalar = pl.BlockSpec((), lambda c: ())
    chunk_scalar = pl.BlockSpec((None,), lambda c: (c,))
    row_block = lambda size: pl.BlockSpec((size,), lambda c: (0,))
    # All chunks write disjoint slots of the same row blocks.
    return _per_row_call(
        kernel,
        num_chunks,
        in_specs=[row_block(length), row_scalar, row_scalar, chunk_scalar, chunk_scalar],
        out_spec=[row_block(k_max), row_block(max_candidates), row_block(max_candidates)],
        out_shape=[jax.ShapeDtypeStruct((size,), jnp.int32) for size in (k_max, max_candidates, max_candidates)],
        num_warps=num_warps,
        interpret=interpret,
        name="split_selected",
    )(scores, take_key, low_key, taken_before, candidates_before)


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


# The 15 bracketing thresholds sit evenly spaced over +-5.6 standard deviations of the sample rank of the k-th
# largest score (a binomial count: about sqrt of the expected rank), decreasing, so the thresholds increase. Even
# spacing bounds every bracket's expected width, so a sample that is off by several deviations still lands in a
# bracket the buffer holds (finer brackets near the centre and wider outer ones overflowed in simulation).
_BRACKET_SPACING = 0.8
_BRACKET_OFFSETS = tuple(_BRACKET_SPACING * (7 - i) for i in range(15))
_SAMPLE_RUN = 8  # contiguous scores per sampled run: one 32-byte memory sector


def _sample_keys(scores, sample_size: int):
    """Sorted (ascending) keys of evenly spaced runs of each row, [R, n]; the whole row when it is that short."""
    length = scores.shape[1]
    if length <= sample_size:
        return jnp.sort(monotone_key(scores), axis=1)
    runs = sample_size // _SAMPLE_RUN
    positions = (jnp.arange(runs)[:, None] * (length // runs) + jnp.arange(_SAMPLE_RUN)[None, :]).reshape(-1)
    return jnp.sort(monotone_key(scores[:, positions]), axis=1)


def _bracket_thresholds(scores, k, *, k_max, sample_size):
    """[R, 16] increasing signed keys: the first counts the finite scores, the others bracket the k-th largest."""
    length = scores.shape[1]
    sample = _sample_keys(scores, sample_size)
    n = sample.shape[1]
    expected_rank = jnp.minimum(k, k_max).astype(jnp.float32) * (n / length)
    spread = jnp.sqrt(expected_rank) + 1.0
    rank = jnp.round(expected_rank[:, None] + jnp.asarray(_BRACKET_OFFSETS)[None, :] * spread[:, None])
    rank = jnp.clip(rank, 0, n - 1).astype(jnp.int32)  # 0: the largest sampled key
    first_finite = _signed(jnp.full((scores.shape[0], 1), _FIRST_FINITE_KEY, jnp.uint32))
    thresholds = jnp.maximum(jnp.take_along_axis(sample, n - 1 - rank, axis=1), first_finite)
    return jnp.concatenate([first_finite, thresholds], axis=1)


def default_max_candidates(k_max: int, length: int, sample_size: int) -> int:
    """Buffer for the candidates inside a bracket: three brackets' expected width in positions (the sample rank's
    spread times the positions per sampled score), at least 256."""
    sample_size = min(sample_size, length)
    spread = math.sqrt(min(k_max, length) * sample_size / length) + 1.0
    width = _BRACKET_SPACING * spread * length / sample_size
    return min(next_power_of_2(max(256, int(3 * width))), next_power_of_2(length))


class _Bracket(NamedTuple):
    """Per row, what the split pass does: take the keys >= take_key, buffer the keys in [low_key, take_key)."""

    wanted: jax.Array  # [R] positions to select
    take_key: jax.Array  # [R] signed key
    low_key: jax.Array  # [R] signed key
    taken: jax.Array  # [R, C] positions taken per chunk
    buffered: jax.Array  # [R, C] candidates buffered per chunk


def _bracket(k, thresholds, chunk_counts, k_max: int) -> _Bracket:
    """The bracket of each row from the counting pass at its thresholds ([R, 16], chunk counts [R, C, 16])."""
    totals = chunk_counts.sum(axis=1)
    wanted = _wanted(k, totals[:, 0], k_max)
    # The bracket is [low, low + 1): counts fall as the threshold grows, and a 17th threshold above every key
    # counts 0.
    low = jnp.sum(totals[:, 1:] >= wanted[:, None], axis=1)
    chunk_counts = jnp.pad(chunk_counts, ((0, 0), (0, 0), (0, 1)))
    thresholds = jnp.pad(thresholds, ((0, 0), (0, 1)), constant_values=_signed(jnp.uint32(_NO_THRESHOLD)))
    counts_at = lambda index: jnp.take_along_axis(chunk_counts, index[:, None, None], axis=2)[:, :, 0]
    key_at = lambda index: jnp.take_along_axis(thresholds, index[:, None], axis=1)[:, 0]
    at_low, above = counts_at(low), counts_at(low + 1)
    candidates = at_low.sum(axis=1) - above.sum(axis=1)
    needed = wanted - above.sum(axis=1)  # 1 <= needed <= candidates, unless wanted == 0
    # Nothing to choose when the bracket is taken whole or not at all.
    take_all = needed == candidates
    choose = (needed > 0) & ~take_all
    take_index = jnp.where(take_all, low, low + 1)
    take_key = key_at(take_index)
    return _Bracket(
        wanted=wanted,
        take_key=take_key,
        low_key=jnp.where(choose, key_at(low), take_key),
        taken=counts_at(take_index),
        buffered=jnp.where(choose[:, None], at_low - above, 0),
    )


def _bracket_select(scores, bracket: _Bracket, *, k_max, max_candidates, launch):
    """The split pass, then the buffered candidates sorted to fill the remaining slots."""
    split = jax.vmap(functools.partial(split_unbatched, k_max=k_max, max_candidates=max_candidates, **launch))
    taken_positions, candidate_keys, candidate_positions = split(
        scores, bracket.take_key, bracket.low_key, _exclusive_cumsum(bracket.taken, axis=1),
        _exclusive_cumsum(bracket.buffered, axis=1),
    )
    # Largest keys first (~key reverses the order), lower positions first among equal keys.
    stored = jnp.arange(max_candidates)[None, :] < bracket.buffered.sum(axis=1)[:, None]
    order = jnp.where(stored, ~candidate_keys, jnp.iinfo(jnp.int32).max)
    _, best = lax.sort((order, jnp.where(stored, candidate_positions, 0)), dimension=1, num_keys=2)
    num_taken = bracket.taken.sum(axis=1)[:, None]
    slot = jnp.arange(k_max)[None, :]
    from_buffer = jnp.take_along_axis(best, jnp.clip(slot - num_taken, 0, max_candidates - 1), axis=1)
    indices = jnp.where(
        slot < num_taken, taken_positions, jnp.where(slot < bracket.wanted[:, None], from_buffer, PAD_INDEX)
    )
    return indices, bracket.wanted


METHODS = ("bracket", "radix")


@functools.partial(
    jax.jit,
    static_argnames=("k_max", "method", "sample_size", "max_candidates", "radix_bits", "block_size", "num_chunks",
                     "num_warps", "interpret"),
)
def select_topk(
    scores: jax.Array,  # [R, T] float32
    k: jax.Array,  # [R] int32
    *,
    k_max: int,
    method: str = "bracket",
    sample_size: int | None = None,
    max_candidates: int | None = None,
    radix_bits: int = 4,
    block_size: int | None = None,
    num_chunks: int | None = None,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Per row r, the positions of its k[r] largest finite scores (non-finite scores are never selected).

    Returns (indices [R, k_max] int32, counts [R] int32) with counts[r] = min(k[r], k_max, finite scores in row r).
    indices[r, :counts[r]] are distinct positions, in no particular order; among scores equal to the k-th
    largest, the lowest positions are taken. The remaining slots hold PAD_INDEX (0).

    method: "bracket" (falls back to "radix" for the whole call when a bracket overflows its buffer) or "radix"
    (module docstring). sample_size: scores sampled per row for the bracket (a multiple of 8; None: T / 64
    within [512, 2048]). max_candidates: the bracket's candidate buffer per row (None: default_max_candidates).
    radix_bits: bits of the threshold fixed per radix pass. block_size: scores per inner step (power of two; None:
    2048 from T = 32K on, else 1024). num_chunks: programs per row (None: enough for about 512 programs).
    num_warps: Triton launch parameter. The defaults are the best of a sweep on the H200 at [256, 8K], [1920, 8K]
    and [256, 128K] (benchmarks/results/kernels-tune-2026-11-30-0804{46,514}.json).
    """
    if scores.ndim != 2 or k.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [R, T] and k [R]; got {scores.shape}, {k.shape}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 1 <= radix_bits <= 8:
        raise ValueError(f"radix_bits must be in [1, 8], got {radix_bits}")
    rows, length = scores.shape
    if sample_size is None:
        sample_size = min(max(next_power_of_2(length // 64), 512), 2048)
    if block_size is None:
        block_size = 2048 if length >= 32768 else 1024
    if sample_size < _SAMPLE_RUN or sample_size % _SAMPLE_RUN:
        raise ValueError(f"sample_size must be a positive multiple of {_SAMPLE_RUN}, got {sample_size}")
    check_power_of_2("block_size", block_size)
    scores = scores.astype(jnp.float32)
    k = k.astype(jnp.int32)
    if num_chunks is None:
        num_chunks = default_num_chunks(rows, length, block_size)
    chunk_size = pl.cdiv(pl.cdiv(length, num_chunks), block_size) * block_size
    launch = dict(num_chunks=num_chunks, chunk_size=chunk_size, block_size=block_size, num_warps=num_warps,
                  interpret=interpret)
    radix = functools.partial(_radix_select, k_max=k_max, radix_bits=radix_bits, launch=launch)
    if method == "radix":
        return radix(scores, k)

    if max_candidates is None:
        max_candidates = default_max_candidates(k_max, length, sample_size)
    thresholds = _bracket_thresholds(scores, k, k_max=k_max, sample_size=sample_size)
    chunk_counts = jax.vmap(functools.partial(count_at_least_unbatched, **launch))(scores, thresholds)
    bracket = _bracket(k, thresholds, chunk_counts, k_max)
    overflow = jnp.any(bracket.buffered.sum(axis=1) > max_candidates)
    bracket_select = functools.partial(_bracket_select, k_max=k_max, max_candidates=max_candidates, launch=launch)
    return lax.cond(overflow, lambda: radix(scores, k), lambda: bracket_select(scores, bracket))


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
