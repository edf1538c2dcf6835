"""Tree verification attention: the S new tokens of a draft tree attend to the committed prefix and to their
ancestors among the tree's rows, optionally scoring each prefix key.

The tree of sequence b occupies cache rows base[b] .. base[b] + R - 1 (row j holds tree node j's K/V, already
written); query s sees every key t < base[b] (the committed prefix, ragged over the batch) and the tree rows
base[b] + j where ancestors[s, j] (its root-to-node path, itself included). Cache rows at or past base[b] + R (scratch
rows not yet filled, or another round's leftovers) are never read.

Split-K as in pallas_kernels.verify_attention: one program per (row block, key split, KV head) holds up to 128 of
the S * G query rows of a KV head (GQA: row r is query r // G, head r % G, so one K/V block load serves every query
head of the group and every node), and the partial softmax results are merged by their log-sum-exps in plain JAX.
The prefix [0, base) is cut into `num_splits` splits, so batch 1 fills the GPU; one extra split holds the tree's
own rows as a single key block of R (padded to a power of two >= 16) under the ancestor mask, so the prefix loop
needs no per-row mask. Row blocks are the grid's first axis, which Pallas' Triton lowering makes the fastest
varying: the row blocks of a split run side by side and their repeated K/V reads of that split come from L2
(a tree of 65 rows at G = 16 is 9 row blocks; HBM reads the K/V about once).

Score collection ('logit', as the linear verifier's Collect-2-Query): for every key t <= base (the prefix and the
root's own row), the weighted sum over query nodes of the raw q.k (unscaled), averaged over the H_q heads, with
weights per node (vegas_jax.attention.tree: root 1/2 and the deepest nodes 1/2 between them; a chain's are the
linear verifier's rows 0 and S-1). Linear in the rows, so each program sums its rows' weighted logits while the
logit tile is in registers and writes one float per key and row block; XLA sums the row blocks and KV heads.
The 'weight' mode (softmax probabilities) needs every scored row's log-sum-exp, known only after the pass, and a
tree scores up to 33 rows per head: the linear kernel's stored float16 log-weights would cost more bytes than the
K/V, so weights are left to the jnp path.
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
    stacked_caches,
    combine_splits,
    heads_of_query_rows,
    next_power_of_2,
    online_softmax_start,
    query_rows_by_kv_head,
    split_partial_outputs,
    store_split_partials,
)
from pallas_kernels.verify_attention import default_num_splits, launch_blocks

MAX_TREE_ROWS = 128  # the tree's rows are one key block of the tree split


def tree_attention_kernel(
    q_ref,  # [block_q, D] row r = query r // G, head r % G of this KV head; zero rows past S * G
    k_ref,  # [L, T, D] one KV head's keys, every layer's
    v_ref,  # [L, T, D]
    layer_ref,  # [] the layer read
    base_ref,  # [] the root's row: the prefix is [0, base)
    tree_mask_ref,  # [block_q, tree_width] int32: row r sees tree row j (0 for padded rows and columns)
    *refs,  # (row weights [block_q],) o [block_q, D], l, m [block_q], (scores [T],)
    sm_scale: float,
    block_k: int,
    num_splits: int,
    tree_rows: int,
    num_rows: int,
    scoring: bool,
):
    if scoring:
        weight_ref, o_ref, l_ref, m_ref, score_ref = refs
    else:
        o_ref, l_ref, m_ref = refs
    block_q, head_dim = q_ref.shape
    tree_width = tree_mask_ref.shape[1]
    capacity = k_ref.shape[1]
    layer = layer_ref[()]
    split = pl.program_id(1)
    row = pl.program_id(0) * block_q + jnp.arange(block_q)
    base = base_ref[()]
    keys_per_split = pl.cdiv(pl.cdiv(base, num_splits), block_k) * block_k
    split_start = split * keys_per_split
    split_end = jnp.minimum(split_start + keys_per_split, base)  # the tree split's range is empty
    q = q_ref[...]
    weight = weight_ref[...] if scoring else None

    def attend(carry, raw, visible, v):
        o_prev, m_prev, l_prev = carry
        logits = jnp.where(visible, raw * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        return o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v), m_next, l_next

    def score(raw, start, size, written):
        if scoring:
            summed = jnp.sum(raw * weight[:, None], axis=0)
            plt.store(score_ref.at[pl.ds(start, size)], summed, mask=written)

    def prefix_block(block, carry):
        block_start = split_start + block * block_k
        key = block_start + jnp.arange(block_k)
        in_split = key < split_end
        k = plt.load(k_ref.at[layer, pl.ds(block_start, block_k), :], mask=in_split[:, None], other=0)
        raw = plt.dot(q, k, trans_b=True)  # [block_q, block_k] float32
        v = plt.load(v_ref.at[layer, pl.ds(block_start, block_k), :], mask=in_split[:, None], other=0)
        score(raw, block_start, block_k, in_split)
        # Every row sees every prefix key: a split with keys gives every row a real maximum, and an empty one is
        # weighted exp(finfo.min - max) = 0 in the combine.
        return attend(carry, raw, jnp.broadcast_to(in_split[None, :], raw.shape), v)

    def tree_block(_, carry):
        offset = jnp.arange(tree_width)
        filled = (offset < tree_rows) & (base + offset < capacity)
        k = plt.load(k_ref.at[layer, pl.ds(base, tree_width), :], mask=filled[:, None], other=0)
        raw = plt.dot(q, k, trans_b=True)  # [block_q, tree_width]
        v = plt.load(v_ref.at[layer, pl.ds(base, tree_width), :], mask=filled[:, None], other=0)
        score(raw, base, tree_width, offset == 0)  # the root's row, the last candidate
        # Every real row sees itself, so its maximum is real and its non-ancestors weigh exp(MASK_VALUE - max) = 0.
        return attend(carry, raw, (tree_mask_ref[...] != 0) & filled[None, :], v)

    carry = online_softmax_start(block_q, head_dim)
    carry = lax.fori_loop(0, pl.cdiv(jnp.maximum(split_end - split_start, 0), block_k), prefix_block, carry)
    o, m, l = lax.fori_loop(0, (split == num_splits).astype(jnp.int32), tree_block, carry)
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, row < num_rows)


def tree_attention_unbatched(
    q,  # [S, H_q, D]
    k_cache,  # [L, T, H_kv, D] every layer's
    v_cache,  # [L, T, H_kv, D]
    layer,  # [] int32
    base,  # []
    tree_mask,  # [row_blocks * block_q, tree_width] int32
    row_weights,  # [row_blocks * block_q] float32, or None
    *,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    block_q: int,
    tree_rows: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Returns out [S, H_q, D] and the score partials [row_blocks, H_kv, T] (None without row_weights); entries past
    base are unwritten."""
    num_queries, num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_rows = num_queries * group
    padded_rows, tree_width = tree_mask.shape
    row_blocks = padded_rows // block_q
    q_rows = query_rows_by_kv_head(q, num_kv_heads, padded_rows)
    scoring = row_weights is not None

    kernel = functools.partial(tree_attention_kernel, sm_scale=sm_scale, block_k=block_k, num_splits=num_splits,
                               tree_rows=tree_rows, num_rows=num_rows, scoring=scoring)
    head_rows = pl.BlockSpec((num_layers, capacity, None, head_dim), lambda r, s, h: (0, 0, h, 0))
    in_specs = [
        pl.BlockSpec((None, block_q, head_dim), lambda r, s, h: (h, r, 0)),
        head_rows,
        head_rows,
        pl.BlockSpec((), lambda r, s, h: ()),
        pl.BlockSpec((), lambda r, s, h: ()),
        pl.BlockSpec((block_q, tree_width), lambda r, s, h: (r, 0)),
    ]
    inputs = [q_rows, k_cache, v_cache, layer, base, tree_mask]
    # The (kv head, split, row block) layout of split_partial_outputs, on this kernel's (row block, split, kv head)
    # grid: row blocks first, so that the programs sharing a split's K/V run together.
    specs, out_shape = split_partial_outputs(num_splits + 1, num_kv_heads, block_q, head_dim, row_blocks)
    out_specs = [pl.BlockSpec(spec.block_shape, lambda r, s, h, index=spec.index_map: index(h, s, r))
                 for spec in specs]
    if scoring:
        in_specs.append(pl.BlockSpec((block_q,), lambda r, s, h: (r,)))
        inputs.append(row_weights)
        # Every split of a (row block, KV head) writes its own key range of the same score row.
        out_specs.append(pl.BlockSpec((None, None, capacity), lambda r, s, h: (r, h, 0)))
        out_shape.append(jax.ShapeDtypeStruct((row_blocks, num_kv_heads, capacity), jnp.float32))
    o, l, m, *score_partials = pl.pallas_call(
        kernel,
        grid=(row_blocks, num_splits + 1, num_kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"tree_attention_{'logit' if scoring else 'plain'}",
    )(*inputs)
    o, l, m = o[:, :, :num_rows], l[:, :, :num_rows], m[:, :, :num_rows]
    out = heads_of_query_rows(combine_splits(o, l, m), num_queries).astype(q.dtype)
    return out, (score_partials[0] if scoring else None)


def _row_layout(ancestors, score_weights, group: int, block_q: int, tree_width: int):
    """The per-row inputs of the S * G query rows padded to whole row blocks: the tree mask [rows, tree_width] int32
    and the score weights [rows] float32 (None without them); padded rows see nothing and weigh nothing."""
    num_queries, tree_rows = ancestors.shape
    padded_rows = pl.cdiv(num_queries * group, block_q) * block_q
    node = jnp.arange(padded_rows) // group
    real = node < num_queries
    mask = jnp.pad(ancestors, ((0, 0), (0, tree_width - tree_rows)))[jnp.minimum(node, num_queries - 1)]
    mask = (mask & real[:, None]).astype(jnp.int32)
    if score_weights is None:
        return mask, None
    weights = jnp.where(real, score_weights.astype(jnp.float32)[jnp.minimum(node, num_queries - 1)], 0.0)
    return mask, weights


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_k", "num_splits", "block_q", "num_warps", "num_stages", "interpret"),
)
def tree_attention(
    q: jax.Array,  # [B, S, H_q, D]
    k_cache: jax.Array,  # [B, T, H_kv, D], or [L, B, T, H_kv, D] with `layer`
    v_cache: jax.Array,  # like k_cache
    base: jax.Array,  # [B] int32
    ancestors: jax.Array,  # [S, R] bool
    *,
    layer: jax.Array | int | None = None,  # int32 []: the layer of stacked caches read (in place)
    score_weights: jax.Array | None = None,  # [S] float32
    sm_scale: float | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    block_q: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Tree-masked attention of S new tokens per sequence: query s sees the cached keys t < base[b] and the tree rows
    base[b] + j with ancestors[s, j] (R tree rows, R <= 128; the K/V of rows base[b] .. base[b] + R - 1 already
    written).

    Returns (out [B, S, H_q, D] in q's dtype, scores [B, T] float32 or None). With score_weights, scores are, for
    keys t <= base[b], sum_s score_weights[s] * (raw q_s.k_t averaged over the H_q heads), -inf beyond (module doc).

    block_k: prefix keys per inner step (power of two >= 16; None: 128 for head dim 64 with more than 16 query rows
    per program, else 64). num_splits: prefix splits per (sequence, KV head, row block), plus the tree's own split;
    None picks enough for about 512 programs. block_q: query rows per program (power of two >= 16, at most 128;
    None: all S * G rows up to 128). num_warps (None: 4 up to 32 query rows per program, else 8), num_stages:
    Triton launch parameters.
    """
    k_cache, v_cache, layer = stacked_caches(q, k_cache, v_cache, layer)
    batch, num_queries, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[2:4]
    group = num_q_heads // num_kv_heads
    if ancestors.ndim != 2 or ancestors.shape[0] != num_queries or not 1 <= ancestors.shape[1] <= MAX_TREE_ROWS:
        raise ValueError(f"ancestors must be [S, R] with S = {num_queries} and 1 <= R <= {MAX_TREE_ROWS}, "
                         f"got {ancestors.shape}")
    if base.shape != (batch,):
        raise ValueError(f"base must have shape ({batch},), got {base.shape}")
    if score_weights is not None and score_weights.shape != (num_queries,):
        raise ValueError(f"score_weights must have shape ({num_queries},), got {score_weights.shape}")
    query_rows = num_queries * group
    block_q, block_k, num_warps = launch_blocks(query_rows, head_dim, block_q, block_k, num_warps)
    row_blocks = pl.cdiv(query_rows, block_q)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, capacity, block_k, row_blocks)
    tree_rows = ancestors.shape[1]
    tree_mask, row_weights = _row_layout(ancestors.astype(bool), score_weights, group, block_q,
                                         max(16, next_power_of_2(tree_rows)))
    inner = functools.partial(
        tree_attention_unbatched,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        block_k=block_k,
        num_splits=num_splits,
        block_q=block_q,
        tree_rows=tree_rows,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    base = base.astype(jnp.int32)
    # The stacks are mapped over their batch axis where they lie (stacked_caches).
    out, partials = jax.vmap(inner, in_axes=(0, 1, 1, None, 0, None, None))(q, k_cache, v_cache, layer, base,
                                                                            tree_mask, row_weights)
    if score_weights is None:
        return out, None
    # Partials past base[b] were never written; the select keeps whatever is there out of the result.
    candidate = jnp.arange(capacity)[None, :] <= base[:, None]
    return out, jnp.where(candidate, partials.sum(axis=(1, 2)) / num_q_heads, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_reference(q, k_cache, v_cache, base, ancestors, *, score_weights=None, sm_scale=None):
    """XLA twin of tree_attention: dense masked attention over the whole cache capacity."""
    batch, num_queries, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[1:3]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    qg = q.reshape(batch, num_queries, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    raw = jnp.einsum("bshgd,bthd->bhgst", qg, k_cache, preferred_element_type=jnp.float32)
    t = jnp.arange(capacity)
    offset = t[None, :] - base[:, None]  # [B, T]: the tree row a cache row would be
    width = ancestors.shape[1]
    on_path = jnp.take(ancestors.astype(bool), jnp.clip(offset, 0, width - 1), axis=1)  # [S, B, T]
    in_tree = (offset >= 0) & (offset < width)
    visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & jnp.moveaxis(on_path, 0, 1))  # [B, S, T]
    logits = jnp.where(visible[:, None, None], raw * sm_scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgst,bthd->bshgd", probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    out = out.reshape(batch, num_queries, num_q_heads, head_dim).astype(q.dtype)
    if score_weights is None:
        return out, None
    scored = jnp.einsum("bhgst,s->bt", raw, score_weights.astype(jnp.float32)) / num_q_heads
    return out, jnp.where(t[None, :] <= base[:, None], scored, -jnp.inf)
