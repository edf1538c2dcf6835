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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import next_power_of_2

# Scores a program holds in registers (rows x padded length): 64 a thread at 4 warps; and at most MAX_ROWS rows,
# so that short rows do not pile up [rows, n] outputs past the registers.
MAX_TILE = 8192
MAX_ROWS = 64
MAX_N = 64


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


@functools.partial(jax.jit, static_argnames=("n", "interpret"))
def top_n(scores: jax.Array, n: int, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(values [..., n] float32, indices [..., n] int32) of the n largest entries of each row of scores [..., L]
    as `lax.top_k(scores, n)`: descending, ties to the lower position. Compared as float32 values, so -0.0 ties
    +0.0 (lax.top_k ranks +0.0 first) and NaN is outside the contract; NSA's scores are sums of probabilities.
    n <= min(L, MAX_N). Rows longer than MAX_TILE (NSA's blocks of 16 past 128K positions) go in two stages: each
    MAX_TILE chunk's top n, then the top n of those candidates (in chunk order, so ties still go to the lower
    position; the -inf padding of the last chunk ranks after every real entry of the earlier, full chunks)."""
    *lead, length = scores.shape
    if not 1 <= n <= min(length, MAX_N):
        raise ValueError(f"n must be in [1, min(L, {MAX_N})], got n {n} for rows of {length}")
    padded = next_power_of_2(length)
    if padded > MAX_TILE:
        chunks = pl.cdiv(length, MAX_TILE)
        rows = jnp.pad(scores.reshape(-1, length).astype(jnp.float32), ((0, 0), (0, chunks * MAX_TILE - length)),
                       constant_values=-jnp.inf)
        values, indices = top_n(rows.reshape(-1, MAX_TILE), n, interpret=interpret)
        indices = indices.reshape(-1, chunks, n) + MAX_TILE * jnp.arange(chunks)[:, None]
        values, picked = top_n(values.reshape(-1, chunks * n), n, interpret=interpret)
        indices = jnp.take_along_axis(indices.reshape(-1, chunks * n), picked, axis=1)
        return values.reshape(*lead, n), indices.reshape(*lead, n)
    rows = scores.reshape(-1, length).astype(jnp.float32)
    num_rows = rows.shape[0]
    block_rows = max(1, min(MAX_ROWS, MAX_TILE // padded))
    # Rows and slots padded to powers of two (Triton's block shapes); padded columns are masked in the kernel.
    grid_rows = pl.cdiv(num_rows, block_rows)
    slots = next_power_of_2(n)
    rows = jnp.pad(rows, ((0, grid_rows * block_rows - num_rows), (0, padded - length)))
    kernel = functools.partial(top_n_kernel, n=n, length=length)
    out = lambda dtype: jax.ShapeDtypeStruct((grid_rows * block_rows, slots), dtype)
    values, indices = pl.pallas_call(
        kernel, grid=(grid_rows,),
        in_specs=[pl.BlockSpec((block_rows, padded), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((block_rows, slots), lambda i: (i, 0))] * 2,
        out_shape=[out(jnp.float32), out(jnp.int32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="top_n",
    )(rows)
    shape = (*lead, n)
    return values[:num_rows, :n].reshape(shape), indices[:num_rows, :n].reshape(shape)


def top_n_reference(scores: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k twin of top_n."""
    return lax.top_k(scores.astype(jnp.float32), n)
