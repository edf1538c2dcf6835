"""Helpers shared by the kernels of this package."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# Finite stand-in for -inf on masked logits: exp(masked - max) underflows to 0 instead of (-inf) - (-inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Programs per launch that the default split counts aim for: H100/H200 have NUM_SMS SMs, and about four resident
# programs per SM hide the latency of the row gathers and of the split-K tails.
NUM_SMS = 132
TARGET_PROGRAMS = 512


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def previous_power_of_2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def whole_block_splits(programs: int, blocks: int, max_splits: int | None = None) -> int:
    """Splits of a stream of `blocks` key blocks for about TARGET_PROGRAMS programs when `programs` already run
    per split (batch x heads x ...): a power of two at most max_splits, or the block count itself when smaller,
    dividing the blocks so that every split holds whole blocks."""
    splits = max(1, min(next_power_of_2(pl.cdiv(TARGET_PROGRAMS, programs)), max_splits or blocks, blocks))
    while blocks % splits:
        splits //= 2
    return splits


def check_power_of_2(name: str, value: int, minimum: int = 1):
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


def stacked_caches(q, k_cache, v_cache, layer, num_query_dims: int = 4):
    """(k, v, layer) for a kernel that reads one layer of stacked caches [L, B, T, H_kv, D] in place: the stacks
    and layer as given (`layer` an int or traced int32), or per-layer caches [B, T, H_kv, D] (layer None) as a
    stack of one. The kernel takes the whole stack and the layer as operands and indexes with it, so a scanned
    layer body never slices a layer out (a copy of its cache per pass, issue 52). Callers vmap the stacks over
    their batch axis 1, where Pallas's batching indexes the block without moving the axis (a transpose)."""
    if layer is not None and k_cache.ndim != 5:
        raise ValueError(f"with a layer the caches must be stacked [L, B, T, H_kv, D], got {k_cache.shape}")
    (k_cache, v_cache), layer = stacked_layer(layer, k_cache, v_cache)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must both be [L, B, T, H_kv, D]; got {k_cache.shape}, {v_cache.shape}")
    one_layer = jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)
    check_cache_shapes(q, one_layer, one_layer, num_query_dims)
    return k_cache, v_cache, layer


def check_cache_shapes(q, k_cache, v_cache, num_query_dims: int):
    """q [B, (S,) H_q, D] against caches [B, T, H_kv, D]."""
    if q.ndim != num_query_dims:
        raise ValueError(f"q must have {num_query_dims} dims, got shape {q.shape}")
    *_, num_q_heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4 or k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"caches must both be [B, T, H_kv, D]; got {k_cache.shape}, {v_cache.shape}, q {q.shape}")
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit a cache of {num_kv_heads} KV heads of dim {cache_head_dim}")
    # Every Triton load must have a power-of-two number of elements, and dots need dims >= 16.
    check_power_of_2("head_dim", head_dim, 16)


def combine_splits(o, l, m):
    """Merges split-K partials o [splits, ..., D], l and m [splits, ...] into the normalised output."""
    m_max = m.max(axis=0)
    correction = jnp.exp(m - m_max[None])
    l_total = (l * correction).sum(axis=0)
    o_total = (o * correction[..., None]).sum(axis=0)
    return o_total / l_total[..., None]


def normalised_with_lse(o, l, m):
    """Partials o [splits, ..., D], l, m [splits, ...] -> (normalised o, lse; -inf where no row was seen)."""
    m_max = m.max(axis=0)
    correction = jnp.exp(m - m_max[None])
    total = (l * correction).sum(axis=0)
    out = (o * correction[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.where(total > 0, m_max + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def query_rows_by_kv_head(q, num_kv_heads: int, padded_rows: int):
    """q [S, H_q, D] as each KV head's query rows [H_kv, padded_rows, D]: row r is query r // G, head r % G of the
    head's group (GQA: one K/V block load serves every query head of the group and every query); zero past S * G."""
    num_queries, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = q.reshape(num_queries, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    rows = rows.reshape(num_kv_heads, num_queries * group, head_dim)
    return jnp.pad(rows, ((0, 0), (0, padded_rows - num_queries * group), (0, 0)))


def heads_of_query_rows(rows, num_queries: int):
    """query_rows_by_kv_head's inverse for rows [H_kv, S * G, D] (padding dropped): [S, H_q, D]."""
    num_kv_heads, num_rows, head_dim = rows.shape
    group = num_rows // num_queries
    rows = rows.reshape(num_kv_heads, num_queries, group, head_dim).transpose(1, 0, 2, 3)
    return rows.reshape(num_queries, num_kv_heads * group, head_dim)


def online_softmax_start(rows: int, head_dim: int):
    """(o, m, l) before any key block: zero output and sum, the lowest finite maximum."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax_step(carry, q, k, v, valid, sm_scale):
    """One key block of an online softmax inside a kernel: carry (o, m, l) over q [R, D] rows, k, v [N, D], valid
    [N]. Returns the new carry and the block's scaled logits (masked entries MASK_VALUE)."""
    o_prev, m_prev, l_prev = carry
    logits = plt.dot(q, k, trans_b=True) * sm_scale
    logits = jnp.where(valid[None, :], logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(logits - m_next[:, None])
    l_next = l_prev * correction + p.sum(axis=1)
    o_next = o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v)
    return (o_next, m_next, l_next), logits


def store_split_partials(o_ref, l_ref, m_ref, o, l, m, real_rows):
    """Stores one split's unnormalised output and softmax statistics; padded rows are never read back, and not
    storing them saves write bandwidth."""
    plt.store(o_ref, o, mask=real_rows[:, None])
    plt.store(l_ref, l, mask=real_rows)
    plt.store(m_ref, m, mask=real_rows)


def split_partial_outputs(num_splits: int, num_kv_heads: int, rows: int, head_dim: int, row_blocks: int = 1):
    """(out_specs, out_shape) of split-K partials o [splits, H_kv, row_blocks * rows, D], l and m [splits, H_kv,
    row_blocks * rows] on a (kv head, split) grid, or a (kv head, split, row block) grid with row blocks of `rows`."""
    specs = [
        pl.BlockSpec((None, None, rows, head_dim), lambda h, s, r=0: (s, h, r, 0)),
        pl.BlockSpec((None, None, rows), lambda h, s, r=0: (s, h, r)),
        pl.BlockSpec((None, None, rows), lambda h, s, r=0: (s, h, r)),
    ]
    shapes = [
        jax.ShapeDtypeStruct((num_splits, num_kv_heads, row_blocks * rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_kv_heads, row_blocks * rows), jnp.float32),
        jax.ShapeDtypeStruct((num_splits, num_kv_heads, row_blocks * rows), jnp.float32),
    ]
    return specs, shapes


def stacked_layer(layer, *arrays):
    """(arrays, layer int32 []) for a kernel that reads one layer of stacked arrays [L, ...] in place (caches,
    quantized weights): the stacks and the layer (an int or traced int32) as given, or one layer's arrays (layer
    None) as stacks of one (a reshape, no copy) and layer 0; a None array stays None. The kernel takes the whole
    stacks and the layer as operands and indexes with it: a layer's slice as a kernel's operand would be a buffer
    of its own, a copy per layer and pass of a scanned layer body (issue 52). Callers vmap stacked caches over
    their batch axis 1."""
    if layer is None:
        return tuple(None if a is None else a[None] for a in arrays), jnp.int32(0)
    return arrays, jnp.asarray(layer, jnp.int32)
