"""Sparse draft attention: one query token per sequence over selected cache rows plus a recent range.

For sequence b the key set is the union of the cache rows `indices[b, :counts[b]]` (all below recent_start[b],
distinct) and the contiguous rows `[recent_start[b], recent_end[b])`. The kernel reads those K/V rows straight
from the cache `[B, T, H_kv, D]` (no gathered copy in HBM) and runs split-K flash decoding: both parts are laid
end to end as one list of "virtual keys", each split takes an equal share of that list, and the per-split
partial softmax results are combined in plain JAX afterwards. One program handles all query heads of a KV head,
padded to 16 rows because Triton dots need every dimension >= 16.

Triton backend: the row gathers are pointer loads `k_ref.at[rows]`, which Mosaic GPU cannot do on Hopper.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import (
    MASK_VALUE,
    TARGET_PROGRAMS,
    check_cache_shapes,
    check_power_of_2,
    combine_splits,
    next_power_of_2,
    online_softmax_start,
    split_partial_outputs,
    store_split_partials,
)

_MAX_SPLITS = 32


def sparse_decode_kernel(
    q_ref,  # [block_h, D] the query heads of one KV head, zero-padded
    k_ref,  # [T, D] one KV head's keys
    v_ref,  # [T, D]
    indices_ref,  # [K_max] selected rows
    count_ref,  # [] valid entries of indices
    recent_start_ref,  # []
    recent_end_ref,  # []
    o_ref,  # [block_h, D] this split's unnormalised output
    l_ref,  # [block_h] this split's softmax denominator
    m_ref,  # [block_h] this split's logit maximum
    *,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    num_heads: int,
):
    block_h, head_dim = q_ref.shape
    split = pl.program_id(1)
    count = count_ref[()]
    recent_start = recent_start_ref[()]
    num_keys = count + recent_end_ref[()] - recent_start
    # Whole blocks per split so that only a split's last block is partial.
    keys_per_split = pl.cdiv(pl.cdiv(num_keys, num_splits), block_k) * block_k
    split_start = split * keys_per_split
    split_end = jnp.minimum(split_start + keys_per_split, num_keys)
    q = q_ref[...]

    def body(block, carry):
        o_prev, m_prev, l_prev = carry
        block_start = split_start + block * block_k
        key = block_start + jnp.arange(block_k)
        listed = key < count
        in_split = key < split_end
        listed_rows = plt.load(indices_ref.at[pl.ds(block_start, block_k)], mask=listed, other=0)
        rows = jnp.where(listed, listed_rows, recent_start + key - count)
        # Lanes past the split read row 0 instead of being masked (interpret mode cannot discharge a masked
        # row gather); they all hit the same cached line and are masked out of the softmax below.
        rows = jnp.where(in_split, rows, 0)
        k = k_ref[rows, :]
        logits = plt.dot(q, k, trans_b=True) * sm_scale  # [block_h, block_k] float32
        logits = jnp.where(in_split[None, :], logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        v = v_ref[rows, :]
        o_next = o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v)
        return o_next, m_next, l_next

    num_blocks = pl.cdiv(jnp.maximum(split_end - split_start, 0), block_k)
    o, m, l = lax.fori_loop(0, num_blocks, body, online_softmax_start(block_h, head_dim))
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, jnp.arange(block_h) < num_heads)


def sparse_decode_unbatched(
    q,  # [H_q, D]
    k_cache,  # [T, H_kv, D]
    v_cache,  # [T, H_kv, D]
    indices,  # [K_max]
    count,  # []
    recent_start,  # []
    recent_end,  # []
    *,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    num_q_heads, head_dim = q.shape
    capacity, num_kv_heads, _ = k_cache.shape
    (k_max,) = indices.shape
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    q_grouped = q.reshape(num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, block_h - group), (0, 0)))

    kernel = functools.partial(
        sparse_decode_kernel, sm_scale=sm_scale, block_k=block_k, num_splits=num_splits, num_heads=group
    )
    scalar = pl.BlockSpec((), lambda h, s: ())
    head_rows = pl.BlockSpec((capacity, None, head_dim), lambda h, s: (0, h, 0))
    out_specs, out_shape = split_partial_outputs(num_splits, num_kv_heads, block_h, head_dim)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, block_h, head_dim), lambda h, s: (h, 0, 0)),
            head_rows,
            head_rows,
            pl.BlockSpec((k_max,), lambda h, s: (0,)),
            scalar,
            scalar,
            scalar,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_decode_attention",
    )(q_grouped, k_cache, v_cache, indices, count, recent_start, recent_end)
    out = combine_splits(o[:, :, :group], l[:, :, :group], m[:, :, :group])
    return out.reshape(num_q_heads, head_dim).astype(q.dtype)


def default_num_splits(batch: int, num_kv_heads: int, k_max: int, block_k: int) -> int:
    """Enough splits for about TARGET_PROGRAMS programs, but no more splits than blocks of selected keys."""
    wanted = next_power_of_2(pl.cdiv(TARGET_PROGRAMS, batch * num_kv_heads))
    return max(1, min(wanted, _MAX_SPLITS, pl.cdiv(k_max, block_k)))


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps", "num_stages", "interpret")
)
def sparse_decode_attention(
    q: jax.Array,  # [B, H_q, D]
    k_cache: jax.Array,  # [B, T, H_kv, D]
    v_cache: jax.Array,  # [B, T, H_kv, D]
    indices: jax.Array,  # [B, K_max] int32
    counts: jax.Array,  # [B] int32
    recent_start: jax.Array,  # [B] int32
    recent_end: jax.Array,  # [B] int32
    *,
    sm_scale: float | None = None,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention of one query token per sequence over selected cache rows plus a recent range.

    Sequence b attends to rows `indices[b, :counts[b]]` (distinct, all < recent_start[b]; entries past counts[b]
    are never read) and rows `[recent_start[b], recent_end[b])`; at least one of the two must be non-empty.
    Returns [B, H_q, D] in q's dtype; accumulation is float32.

    block_k: keys per inner step (power of two >= 16). num_splits: split-K parallelism per (sequence, KV head);
    None picks enough for about 512 programs. num_warps, num_stages: Triton launch parameters.
    """
    check_cache_shapes(q, k_cache, v_cache, num_query_dims=3)
    batch, _, head_dim = q.shape
    check_power_of_2("block_k", block_k, 16)
    for name, value in (("counts", counts), ("recent_start", recent_start), ("recent_end", recent_end)):
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {value.shape}")
    if indices.ndim != 2 or indices.shape[0] != batch:
        raise ValueError(f"indices must be [B, K_max], got {indices.shape}")
    if num_splits is None:
        num_splits = default_num_splits(batch, k_cache.shape[2], indices.shape[1], block_k)
    inner = functools.partial(
        sparse_decode_unbatched,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        block_k=block_k,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    as_int32 = lambda x: x.astype(jnp.int32)
    return jax.vmap(inner)(
        q, k_cache, v_cache, as_int32(indices), as_int32(counts), as_int32(recent_start), as_int32(recent_end)
    )


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_recent"))
def sparse_decode_attention_reference(
    q, k_cache, v_cache, indices, counts, recent_start, recent_end, *, sm_scale=None, max_recent=None
):
    """XLA twin of sparse_decode_attention: gathers the selected rows with take_along_axis.

    The recent range is gathered too when its length is known to be at most the static max_recent (the decode loop
    knows it: accepted drafts plus this iteration's drafts); with max_recent=None it is read as a mask over the
    whole cache, which is exact for any length but streams every row.
    """
    batch, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[1:3]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    listed_valid = jnp.arange(indices.shape[1])[None, :] < counts[:, None]
    if max_recent is None:
        k, v = k_cache, v_cache
        t = jnp.arange(capacity)[None, :]
        batch_rows = jnp.arange(batch)[:, None]
        listed = jnp.zeros((batch, capacity), bool).at[batch_rows, indices].max(listed_valid, mode="drop")
        valid = listed | ((t >= recent_start[:, None]) & (t < recent_end[:, None]))
    else:
        recent_rows = recent_start[:, None] + jnp.arange(max_recent)[None, :]
        recent_valid = recent_rows < recent_end[:, None]
        valid = jnp.concatenate([listed_valid, recent_valid], axis=1)  # [B, K_max + max_recent]
        rows = jnp.where(valid, jnp.concatenate([indices, recent_rows], axis=1), 0)
        k = jnp.take_along_axis(k_cache, rows[:, :, None, None], axis=1)  # [B, N, H_kv, D]
        v = jnp.take_along_axis(v_cache, rows[:, :, None, None], axis=1)
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bhgd,bnhd->bhgn", qg, k, preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgn,bnhd->bhgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
