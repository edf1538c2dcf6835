"""Verification attention: S new tokens per sequence attend causally to the cache, optionally scoring each key.

Query i of sequence b sits at position start[b] + i and sees keys t <= start[b] + i; the K/V of the S new tokens
are already in the cache `[B, T, H_kv, D]` (those of queries past T are not: they see keys up to T - 1), or in
layer `layer` of a stacked cache `[L, B, T, H_kv, D]`, which the kernel reads in place: the whole stack is its
operand and the layer an int32 scalar it indexes with, so a scanned layer body never slices a layer out (a copy of
the layer's cache per pass, issue 52) and one compiled kernel serves every layer. Only keys
below min(start[b] + S, T) are read (ragged lengths: no streaming of the whole capacity T). Split-K flash decoding:
one program per (sequence, KV head, key split, row block) holds up to 128 of the S * G query rows of that KV head
(G = H_q / H_kv; row r is query r // G, head r % G; padded to a power of two >= 16 for the Triton dots), and
per-split partial softmax results are combined in plain JAX. Verification's S * G rows fit one block; prefill
chunks (S in the hundreds) are tiled in row blocks, a third grid axis, and each block reads keys only up to its
own last query.

Score collection (Vegas' Collect-2-Query) for every key t <= start[b]: the mean over all H_q heads and over the
query rows 0 and scored_row[b] (default S-1: the last draft, whose output predicts the bonus token; adaptive γ
drafts g < S-1 tokens into a pass of fixed width, and its last draft is row g) of
  - "logit": the raw q.k (unscaled). Linear in the rows, so each program sums its 2G scored rows' logits while the
    logit tile is in registers and writes one float per key; a tiny XLA reduction sums the KV heads.
  - "weight": the softmax probability exp(sm_scale * q.k - lse_row). A second dot multiplies the key block by the
    2G scored query rows laid out as columns ([block_k, D] x [D, 16]), so the scored logits come out one key per
    row and are stored from a thread's registers. lse_row is only known after the whole pass, so each program
    writes, per key and scored row, d = sm_scale * q.k - m as float16 (m = the row's running maximum after the
    key's block, written once per block in float32), and an XLA pass adds m - lse_row and exponentiates. d <= 0
    (up to rounding) and float16 keeps 11 significant bits, so a weight's relative error is at most |d| * 2^-11:
    tiny for the keys that matter (d near 0). That is 4 G bytes written and read back per key and KV head (3% of
    the K/V bytes for Qwen3-8B, 5% for SmolLM2), where re-reading K for the lse would cost 50%.
Measured at B 8 x T 128K on the H200 (kernels-2026-11-30-{071109,080033,080407}.json), collection costs, SmolLM2 /
Qwen3-8B shapes: logit +16% / +9% (+13.9% / +7.5% in kernels-2026-11-30-103114.json); logit through the second
dot +41% / +8%, through float32 products of the summed query vector with the key rows +58% / +93%; weight by
picking each scored row out of the logit tile (a cross-warp reduction per row and block) +125% / +71%, through the
second dot +62% / +25%.
Keys t > start[b] get -inf.
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
    stacked_caches,
    check_power_of_2,
    combine_splits,
    heads_of_query_rows,
    next_power_of_2,
    online_softmax_start,
    query_rows_by_kv_head,
    split_partial_outputs,
    store_split_partials,
)

SCORE_MODES = (None, "logit", "weight")
_MAX_SPLITS = 64
# Query rows per program; beyond this the accumulator tile no longer fits in registers.
MAX_QUERY_ROWS = 128


def verify_attention_kernel(
    q_ref,  # [block_q, D] row r = query r // G, head r % G of this KV head; zero rows past S * G
    k_ref,  # [L, T, D] one KV head's keys, every layer's
    v_ref,  # [L, T, D]
    layer_ref,  # [] the layer read
    start_ref,  # [] position of query 0
    scored_row_ref,  # [] the query scored besides query 0
    o_ref,  # [block_q, D] this split's unnormalised output
    l_ref,  # [block_q]
    m_ref,  # [block_q]
    *score_refs,  # "logit": [T] summed raw logits; "weight": [T * 2G] d and [T / block_k * 2G] m (module doc)
    sm_scale: float,
    block_s: int,
    block_k: int,
    num_splits: int,
    group: int,
    num_queries: int,
    score_mode: str | None,
):
    block_q, head_dim = q_ref.shape
    split = pl.program_id(1)
    row_block = pl.program_id(2)
    layer = layer_ref[()]
    start = start_ref[()]
    scored_row = scored_row_ref[()]
    row = row_block * block_q + jnp.arange(block_q)
    last_query = jnp.minimum(((row_block + 1) * block_q - 1) // group, num_queries - 1)
    # Never past the cache: a prefill chunk's padding may run beyond it.
    num_keys = jnp.minimum(start + last_query + 1, k_ref.shape[1])
    keys_per_split = pl.cdiv(pl.cdiv(num_keys, num_splits), block_k) * block_k
    split_start = split * keys_per_split
    split_end = jnp.minimum(split_start + keys_per_split, num_keys)
    last_visible_key = start + row // group
    q = q_ref[...]
    # Scored rows: the G heads of query 0, then those of query scored_row (the same rows twice when it is 0,
    # matching a mean over the two row slots).
    slots = (row < group).astype(jnp.float32) + (row // group == scored_row).astype(jnp.float32)
    if score_mode == "weight":
        # As the columns of a second dot: scored column c is query row source_row[c]; padded columns are zero.
        column = jnp.arange(block_s)
        real_column = column < 2 * group
        source_row = jnp.where(column < group, 0, scored_row) * group + column % group
        source_row = jnp.where(real_column, source_row, 0)
        q_scored = jnp.where(real_column[:, None], q_ref[source_row, :], 0).astype(q.dtype)

    def body(block, carry):
        o_prev, m_prev, l_prev = carry
        block_start = split_start + block * block_k
        key = block_start + jnp.arange(block_k)
        in_split = key < split_end
        k = plt.load(k_ref.at[layer, pl.ds(block_start, block_k), :], mask=in_split[:, None], other=0)
        raw = plt.dot(q, k, trans_b=True)  # [block_q, block_k] float32
        visible = in_split[None, :] & (key[None, :] <= last_visible_key[:, None])
        logits = jnp.where(visible, raw * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        v = plt.load(v_ref.at[layer, pl.ds(block_start, block_k), :], mask=in_split[:, None], other=0)
        o_next = o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v)

        candidate = in_split & (key <= start)  # visible to both scored queries (query 0 sees the fewest)
        if score_mode == "logit":
            (score_ref,) = score_refs
            summed = jnp.sum(raw * slots[:, None], axis=0)
            plt.store(score_ref.at[pl.ds(block_start, block_k)], summed, mask=candidate)
        elif score_mode == "weight":
            below_max_ref, block_max_ref = score_refs
            scored = plt.dot(k, q_scored, trans_b=True)  # [block_k, block_s]: key against scored column
            column_max = jnp.sum(jnp.where(row[:, None] == source_row[None, :], m_next[:, None], 0.0), axis=0)
            below_max = (scored * sm_scale - column_max[None, :]).astype(jnp.float16)
            # Flat [key, scored row] slots; masked lanes aim one past the end, where interpret mode drops
            # them instead of racing them against the real lanes that share their slot.
            written = candidate[:, None] & real_column[None, :]
            slot = jnp.where(written, key[:, None] * (2 * group) + column[None, :], below_max_ref.shape[0])
            plt.store(below_max_ref.at[slot], below_max, mask=written)
            block_slot = (block_start // block_k) * (2 * group) + column
            block_slot = jnp.where(real_column, block_slot, block_max_ref.shape[0])
            plt.store(block_max_ref.at[block_slot], column_max, mask=real_column)
        return o_next, m_next, l_next

    num_blocks = pl.cdiv(jnp.maximum(split_end - split_start, 0), block_k)
    # A row's masked keys all come after its visible ones, and key 0 is visible to every row, so the finite
    # MASK_VALUE never contributes: within a split a fully masked block follows a real maximum, and a split
    # whose keys are all masked for a row is weighted by exp(MASK_VALUE - real max) = 0 in the combine.
    o, m, l = lax.fori_loop(0, num_blocks, body, online_softmax_start(block_q, head_dim))
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, row < num_queries * group)


def verify_attention_unbatched(
    q,  # [S, H_q, D]
    k_cache,  # [L, T, H_kv, D] every layer's
    v_cache,  # [L, T, H_kv, D]
    layer,  # [] int32
    start,  # []
    scored_row,  # []
    *,
    score_mode: str | None,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    block_q: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Returns out [S, H_q, D] and the per-KV-head score partials: "logit" [H_kv, T] summed raw logits, "weight"
    ([H_kv, T, 2G] d, [H_kv, cdiv(T, block_k), 2G] m, [H_kv, 2G] lse of the scored rows; see the module doc),
    None otherwise; entries past start are unwritten."""
    num_queries, num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    query_rows = num_queries * group
    row_blocks = pl.cdiv(query_rows, block_q)
    q_rows = query_rows_by_kv_head(q, num_kv_heads, row_blocks * block_q)

    kernel = functools.partial(
        verify_attention_kernel,
        sm_scale=sm_scale,
        block_k=block_k,
        num_splits=num_splits,
        group=group,
        num_queries=num_queries,
        score_mode=score_mode,
        block_s=max(16, next_power_of_2(2 * group)),
    )
    head_rows = pl.BlockSpec((num_layers, capacity, None, head_dim), lambda h, s, r: (0, 0, h, 0))
    out_specs, out_shape = split_partial_outputs(num_splits, num_kv_heads, block_q, head_dim, row_blocks)
    # Every split of a KV head writes its own key range of the same score block (one row block when scoring).
    if score_mode == "logit":
        out_specs.append(pl.BlockSpec((None, capacity), lambda h, s, r: (h, 0)))
        out_shape.append(jax.ShapeDtypeStruct((num_kv_heads, capacity), jnp.float32))
    elif score_mode == "weight":
        for slots, dtype in ((capacity, jnp.float16), (pl.cdiv(capacity, block_k), jnp.float32)):
            out_specs.append(pl.BlockSpec((None, slots * 2 * group), lambda h, s, r: (h, 0)))
            out_shape.append(jax.ShapeDtypeStruct((num_kv_heads, slots * 2 * group), dtype))
    o, l, m, *score_partials = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_splits, row_blocks),
        in_specs=[
            pl.BlockSpec((None, block_q, head_dim), lambda h, s, r: (h, r, 0)),
            head_rows,
            head_rows,
            pl.BlockSpec((), lambda h, s, r: ()),
            pl.BlockSpec((), lambda h, s, r: ()),
            pl.BlockSpec((), lambda h, s, r: ()),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"verify_attention_{score_mode or 'plain'}",
    )(q_rows, k_cache, v_cache, layer, start, scored_row)
    o, l, m = o[:, :, :query_rows], l[:, :, :query_rows], m[:, :, :query_rows]
    out = heads_of_query_rows(combine_splits(o, l, m), num_queries).astype(q.dtype)
    if score_mode != "weight":
        return out, (score_partials[0] if score_partials else None)
    m_max = m.max(axis=0)
    lse = m_max + jnp.log((l * jnp.exp(m - m_max[None])).sum(axis=0))  # [H_kv, S * G]
    last_scored = lax.dynamic_slice_in_dim(lse, scored_row * group, group, axis=1)
    scored_lse = jnp.concatenate([lse[:, :group], last_scored], axis=1)  # [H_kv, 2G]
    below_max, block_max = (x.reshape(num_kv_heads, -1, 2 * group) for x in score_partials)
    return out, (below_max, block_max, scored_lse)


def launch_blocks(query_rows: int, head_dim: int, block_q: int | None, block_k: int | None,
                  num_warps: int | None) -> tuple[int, int, int]:
    """(block_q, block_k, num_warps) for `query_rows` query rows per KV head: the given ones checked, None ones
    chosen. block_q: all rows in one block up to MAX_QUERY_ROWS (at least 16, Triton's smallest dot), never more
    than the rows need. block_k: 128 keys a step for head dim 64 with more than 16 rows a program, else 64 --
    measured on the H200 (SmolLM2 shapes, S = 7, B = 64, T = 8K): 0.139 ms against 0.167 ms for 64
    (benchmarks/results/kernels-tune-2026-11-30-051414.json); head dim 128 keeps the 64 that measured 102 % of
    copy bandwidth for Qwen3-8B shapes. num_warps: 4 up to 32 rows a program, else 8."""
    if block_q is None:
        block_q = max(16, next_power_of_2(min(query_rows, MAX_QUERY_ROWS)))
    check_power_of_2("block_q", block_q, 16)
    if block_q > MAX_QUERY_ROWS:
        raise ValueError(f"block_q must be at most {MAX_QUERY_ROWS}, got {block_q}")
    block_q = min(block_q, max(16, next_power_of_2(query_rows)))
    if block_k is None:
        block_k = 128 if block_q > 16 and head_dim <= 64 else 64
    check_power_of_2("block_k", block_k, 16)
    if num_warps is None:
        num_warps = 4 if block_q <= 32 else 8
    return block_q, block_k, num_warps


def default_num_splits(batch: int, num_kv_heads: int, capacity: int, block_k: int, row_blocks: int = 1) -> int:
    wanted = next_power_of_2(pl.cdiv(TARGET_PROGRAMS, batch * num_kv_heads * row_blocks))
    return max(1, min(wanted, _MAX_SPLITS, pl.cdiv(capacity, block_k)))


@functools.partial(
    jax.jit,
    static_argnames=("score_mode", "sm_scale", "block_k", "num_splits", "block_q", "num_warps", "num_stages",
                     "interpret"),
)
def verify_attention(
    q: jax.Array,  # [B, S, H_q, D]
    k_cache: jax.Array,  # [B, T, H_kv, D], or [L, B, T, H_kv, D] with `layer`
    v_cache: jax.Array,  # like k_cache
    start: jax.Array,  # [B] int32
    scored_row: jax.Array | None = None,  # [B] int32 in [0, S); None: S - 1
    *,
    layer: jax.Array | int | None = None,  # int32 []: the layer of stacked caches read (in place)
    score_mode: str | None = None,
    sm_scale: float | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    block_q: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention of S new tokens per sequence: query i at position start[b] + i sees the cached keys up to
    that position (up to T - 1 for queries past the cache, such as a prefill chunk's padding).

    Returns (out [B, S, H_q, D] in q's dtype, scores [B, T] float32 or None). scores (score_mode "logit" or
    "weight", see the module docstring: of query rows 0 and scored_row[b]) cover keys t <= start[b] and are -inf
    beyond.

    block_k: keys per inner step (power of two >= 16; None: 128 for head dim 64 with more than 16 query rows per
    program, else 64).
    num_splits: split-K parallelism per (sequence, KV head, row block);
    None picks enough for about 512 programs. block_q: query rows per program (power of two >= 16; None: all S * G
    rows in one block up to 128, else blocks of 128). Scoring needs S * G <= 128 (one block). num_warps (None: 4 up
    to 32 query rows per program, else 8), num_stages: Triton launch parameters.
    """
    if score_mode not in SCORE_MODES:
        raise ValueError(f"score_mode must be one of {SCORE_MODES}, got {score_mode!r}")
    k_cache, v_cache, layer = stacked_caches(q, k_cache, v_cache, layer)
    batch, num_queries, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[2:4]
    query_rows = num_queries * (num_q_heads // num_kv_heads)
    if score_mode is not None and query_rows > MAX_QUERY_ROWS:
        raise ValueError(f"scoring needs S * G <= {MAX_QUERY_ROWS} query rows per KV head, got {query_rows}")
    block_q, block_k, num_warps = launch_blocks(query_rows, head_dim, block_q, block_k, num_warps)
    if score_mode is not None and block_q < query_rows:
        raise ValueError(f"scoring needs all {query_rows} query rows in one block, got block_q {block_q}")
    row_blocks = pl.cdiv(query_rows, block_q)
    if start.shape != (batch,):
        raise ValueError(f"start must have shape ({batch},), got {start.shape}")
    scored_row = default_scored_row(scored_row, batch, num_queries)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, capacity, block_k, row_blocks)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    inner = functools.partial(
        verify_attention_unbatched,
        score_mode=score_mode,
        sm_scale=sm_scale,
        block_k=block_k,
        num_splits=num_splits,
        block_q=block_q,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    start = start.astype(jnp.int32)
    # The stacks are mapped over their batch axis where they lie (stacked_caches).
    out, partials = jax.vmap(inner, in_axes=(0, 1, 1, None, 0, 0))(q, k_cache, v_cache, layer, start, scored_row)
    if score_mode is None:
        return out, None
    if score_mode == "logit":
        summed = partials.sum(axis=1)  # [B, T]
    else:
        below_max, block_max, scored_lse = partials  # [B, H_kv, T, 2G], [B, H_kv, T / block_k, 2G], [B, H_kv, 2G]
        row_max = jnp.repeat(block_max, block_k, axis=2)[:, :, :capacity]
        log_weight = below_max.astype(jnp.float32) + (row_max - scored_lse[:, :, None, :])
        summed = jnp.exp(log_weight).sum(axis=(1, 3))
    # Partials past start[b] were never written; the select keeps whatever is there out of the result.
    candidate = jnp.arange(capacity)[None, :] <= start[:, None]
    return out, jnp.where(candidate, summed / (2 * num_q_heads), -jnp.inf)


def default_scored_row(scored_row: jax.Array | None, batch: int, num_queries: int) -> jax.Array:
    """[B] int32: the given rows (checked for shape), or the last query's."""
    if scored_row is None:
        return jnp.full((batch,), num_queries - 1, jnp.int32)
    if scored_row.shape != (batch,):
        raise ValueError(f"scored_row must have shape ({batch},), got {scored_row.shape}")
    return scored_row.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("score_mode", "sm_scale"))
def verify_attention_reference(q, k_cache, v_cache, start, scored_row=None, *, score_mode=None, sm_scale=None):
    """XLA twin of verify_attention: dense masked attention over the whole cache capacity."""
    batch, num_queries, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[1:3]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    qg = q.reshape(batch, num_queries, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    raw = jnp.einsum("bshgd,bthd->bhgst", qg, k_cache, preferred_element_type=jnp.float32)
    t = jnp.arange(capacity)
    positions = start[:, None] + jnp.arange(num_queries)[None, :]  # [B, S]
    visible = t[None, None, :] <= positions[:, :, None]  # [B, S, T]
    logits = jnp.where(visible[:, None, None], raw * sm_scale, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - lse)
    out = jnp.einsum("bhgst,bthd->bshgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    out = out.reshape(batch, num_queries, num_q_heads, head_dim).astype(q.dtype)
    if score_mode is None:
        return out, None
    per_head = raw if score_mode == "logit" else probs  # [B, H_kv, G, S, T]
    scored_row = default_scored_row(scored_row, batch, num_queries)
    second = jnp.take_along_axis(per_head, scored_row[:, None, None, None, None], axis=3)[:, :, :, 0]
    scored = per_head[:, :, :, 0].mean(axis=(1, 2)) + second.mean(axis=(1, 2))
    candidate = t[None, :] <= start[:, None]
    return out, jnp.where(candidate, scored / 2, -jnp.inf)
