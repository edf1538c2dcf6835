"""Top-n of each row for small n (NSA's block selection: n = 16 of a few thousand blocks), with lax.top_k's
contract: values in descending order, equal values in increasing position order, -inf entries returned after every
larger one.

On the H200 XLA runs `lax.top_k` with k = 16 as its TopK kernel, which took 44 us for the 2 rows of one
sequence's NSA decode step and 218 us for the 1,024 rows of a batch-8 verification of 64-node trees (kernel time,
`benchmarks/results/nsa-kernels-2026-12-03-183634.json`): most of both. Here a program holds a few rows whole in
registers and takes n rounds, each picking the largest entry ranked below the previous pick (a max, then the
lowest position holding it): two reductions a round, no sort and no memory traffic but one read of the row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import TARGET_PROGRAMS, check_power_of_2, next_power_of_2, previous_power_of_2

# Scores a program holds in registers (rows x padded length): 64 a thread at 4 warps; and at most MAX_ROWS rows,
# so that short rows do not pile up [rows, n] outputs past the registers.
MAX_TILE = 8192
MAX_ROWS = 64
MAX_N = 64
# The shortest chunk a row is cut into (each chunk leaves n candidates: shorter chunks would leave the second
# stage nearly the row's length), and the scores a thread holds before a program takes another warp.
MIN_CHUNK = 256
ENTRIES_PER_THREAD = 16
# Rows this long or shorter stay whole (one stage): on the H200 (2026-12-04, nsa-kernels-2026-12-04-114806.json
# and -115235-smollm2-view.json) rows of 512 and 2,048 scores took 6.8-10.6 us whole against 7.7-16.3 in chunks
# (a second launch's cost, never repaid at these lengths), while rows of 8,192 took 11.7-12.1 us in chunks against
# 33.1 whole (-122244.json).
WHOLE_ROW = 2048


def top_n_kernel(scores_ref, values_ref, indices_ref, *, n: int, length: int):
    scores = scores_ref[...]  # [rows, L] float32; columns past `length` are never picked
    position = lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    slot = lax.broadcasted_iota(jnp.int32, values_ref.shape, 1)
    in_row = position < length
    rows = scores.shape[0]

    def pick(r, carry):
        values, indices, last_value, last_index = carry
        # Ranked below the last pick: smaller, or equal and later (the first round: everything in the row).
        below = in_row & ((r == 0) | (scores < last_value[:, None])
                          | ((scores == last_value[:, None]) & (position > last_index[:, None])))
        best = jnp.max(jnp.where(below, scores, -jnp.inf), axis=1)
        index = jnp.min(jnp.where(below & (scores == best[:, None]), position, length), axis=1)
        values = jnp.where(slot == r, best[:, None], values)
        indices = jnp.where(slot == r, index[:, None], indices)
        return values, indices, best, index

    start = (jnp.zeros(values_ref.shape, jnp.float32), jnp.zeros(indices_ref.shape, jnp.int32),
             jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32))
    values, indices, _, _ = lax.fori_loop(0, n, pick, start)
    values_ref[...] = values
    indices_ref[...] = indices


@dataclasses.dataclass(frozen=True)
class TopNLaunch:
    """How top_n spreads its rows over programs: rows cut into chunks of `chunk` entries (a power of two; a row
    longer than one chunk goes in two stages), `block_rows` rows (chunks) a program, `num_warps` warps each."""

    chunk: int
    block_rows: int
    num_warps: int

    @classmethod
    def for_rows(cls, num_rows: int, length: int, min_chunk: int = MIN_CHUNK) -> "TopNLaunch":
        """A launch of about TARGET_PROGRAMS programs. A program's n rounds are serial, each two reductions across
        its threads, so the rounds of a few long rows run faster cut into chunks on more SMs (plus a second stage
        over the chunks' candidates) and few short rows faster one a program on a single warp (reductions in
        shuffles, no barrier) than packed into one program of 4 warps, as until 2026-12-04: 33 us a call for the
        24 rows of 512 blocks of a batch-8 SmolLM2 NSA-view decode step at 8K, 1.0 of its 2.4 ms. Rows of up to
        WHOLE_ROW scores stay whole whatever their number. min_chunk MAX_TILE: one stage wherever a row fits a
        program (the second stage's own launch)."""
        padded = next_power_of_2(length)
        per_program = next_power_of_2(pl.cdiv(padded * num_rows, TARGET_PROGRAMS))
        chunk = padded if padded <= WHOLE_ROW else min(padded, MAX_TILE, max(min_chunk, per_program))
        chunks = pl.cdiv(length, chunk)
        block_rows = min(MAX_ROWS, MAX_TILE // chunk, previous_power_of_2(max(1, num_rows * chunks // TARGET_PROGRAMS)))
        warps = min(4, previous_power_of_2(max(1, block_rows * chunk // ENTRIES_PER_THREAD // 32)))
        return cls(chunk=chunk, block_rows=block_rows, num_warps=warps)


@functools.partial(jax.jit, static_argnames=("n", "launch", "interpret"))
def top_n(scores: jax.Array, n: int, *, launch: TopNLaunch | None = None,
          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(values [..., n] float32, indices [..., n] int32) of the n largest entries of each row of scores [..., L]
    as `lax.top_k(scores, n)`: descending, ties to the lower position. Compared as float32 values, so -0.0 ties
    +0.0 (lax.top_k ranks +0.0 first) and NaN is outside the contract; NSA's scores are sums of probabilities.
    n <= min(L, MAX_N). launch: TopNLaunch.for_rows by default. Rows longer than launch.chunk go in two stages:
    each chunk's top n, then the top n of those candidates (in chunk order, so ties still go to the lower
    position; the -inf padding of the last chunk ranks after every real entry of the earlier, full chunks)."""
    *lead, length = scores.shape
    if not 1 <= n <= min(length, MAX_N):
        raise ValueError(f"n must be in [1, min(L, {MAX_N})], got n {n} for rows of {length}")
    rows = scores.reshape(-1, length).astype(jnp.float32)
    launch = launch or TopNLaunch.for_rows(rows.shape[0], length)
    check_power_of_2("launch.chunk", launch.chunk, next_power_of_2(n))
    check_power_of_2("launch.block_rows", launch.block_rows)
    if launch.chunk < length:
        chunks = pl.cdiv(length, launch.chunk)
        rows = jnp.pad(rows, ((0, 0), (0, chunks * launch.chunk - length)), constant_values=-jnp.inf)
        values, indices = _top_n_of_rows(rows.reshape(-1, launch.chunk), n, launch, interpret)
        indices = indices.reshape(-1, chunks, n) + launch.chunk * jnp.arange(chunks)[:, None]
        candidates = values.reshape(-1, chunks * n)
        values, picked = top_n(candidates, n, launch=TopNLaunch.for_rows(*candidates.shape, min_chunk=MAX_TILE),
                               interpret=interpret)
        indices = jnp.take_along_axis(indices.reshape(-1, chunks * n), picked, axis=1)
    else:
        values, indices = _top_n_of_rows(rows, n, launch, interpret)
    return values.reshape(*lead, n), indices.reshape(*lead, n)


def _top_n_of_rows(rows, n, launch, interpret):
    """One launch over rows [R, L] with L <= launch.chunk."""
    num_rows, length = rows.shape
    padded = next_power_of_2(length)
    # Rows and slots padded to powers of two (Triton's block shapes); padded columns are masked in the kernel.
    grid_rows = pl.cdiv(num_rows, launch.block_rows)
    slots = next_power_of_2(n)
    rows = jnp.pad(rows, ((0, grid_rows * launch.block_rows - num_rows), (0, padded - length)))
    kernel = functools.partial(top_n_kernel, n=n, length=length)
    out = lambda dtype: jax.ShapeDtypeStruct((grid_rows * launch.block_rows, slots), dtype)
    values, indices = pl.pallas_call(
        kernel, grid=(grid_rows,),
        in_specs=[pl.BlockSpec((launch.block_rows, padded), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((launch.block_rows, slots), lambda i: (i, 0))] * 2,
        out_shape=[out(jnp.float32), out(jnp.int32)],
        compiler_params=plt.CompilerParams(num_warps=launch.num_warps, num_stages=1), interpret=interpret,
        name="top_n",
    )(rows)
    return values[:num_rows, :n], indices[:num_rows, :n]


def top_n_reference(scores: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k twin of top_n."""
    return lax.top_k(scores.astype(jnp.float32), n)
