"""Plain NSA decoding: one new query per sequence, the 1x baseline that sparse verification is measured against.

Two kernels per layer, each split so that one sequence with 2 KV heads still launches hundreds of programs:
- `compressed_decode`: the compressed branch. Grid (KV head, split of the compressed rows); each program holds
  all G query heads of its KV head (padded to 16 rows for the Triton dots), streams its share of the compressed
  keys and values once, and writes its partial softmax (o, l, m) and its raw scaled logits. The logits become
  selection scores in XLA (probabilities through the combined log-sum-exp, summed over the group, spread onto
  selection blocks, top-n through pallas_kernels.top_n: vegas_jax.attention.nsa's rules, on [H_kv, C] floats).
- `sparse_window_decode`: the selected and window branches. Grid (KV head, split): the first splits take the
  selected blocks (one block per inner step, a contiguous [l', D] load at the block's row), the rest the window
  rows (16 per step, gathered). Each program's partials belong to one branch, so the gated model combines
  selected and window splits apart, and the view (one softmax over both) combines them together, its window
  splits masking the rows of selected blocks so no row counts twice.
The gate sum g_cmp o_cmp + g_slc o_slc + g_win o_win happens in XLA on [H_q, D] values.

`nsa_decode_reference` is the XLA twin: the same branches over gathered rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from models.config import NSALayout
from models.nsa_selection import compressed_visible, num_select_blocks, select_blocks, selection_scores
from pallas_kernels._common import (
    check_power_of_2,
    combine_splits,
    next_power_of_2,
    normalised_with_lse,
    online_softmax_start,
    online_softmax_step,
    split_partial_outputs,
    stacked_layer,
    store_split_partials,
    whole_block_splits,
)
from pallas_kernels.top_n import top_n

WINDOW_STEP = 16  # window rows per inner step of sparse_window_decode
_MAX_SPLITS = 64


def _group_rows(q_ref, kv_head, group: int, block_h: int):
    """The query heads of one KV head as [block_h, D] rows; rows past the group repeat its last head."""
    lane = jnp.arange(block_h)
    return q_ref[kv_head * group + jnp.minimum(lane, group - 1), :], lane < group


def compressed_kernel(q_ref, k_ref, v_ref, layer_ref, position_ref, o_ref, l_ref, m_ref, logits_ref, *, sm_scale,
                      block_c, chunk, group, block_h, stride, compress_block):
    kv_head, split = pl.program_id(0), pl.program_id(1)
    position, layer = position_ref[()], layer_ref[()]  # k_ref, v_ref [L, C, D]: every layer's rows of one head
    q, real = _group_rows(q_ref, kv_head, group, block_h)
    complete = jnp.where(position >= compress_block - 1, (position - compress_block + 1) // stride + 1, 0)
    first = split * chunk
    steps = jnp.clip(pl.cdiv(complete - first, block_c), 0, chunk // block_c)

    def body(step, carry):
        start = first + step * block_c
        k = k_ref[layer, pl.ds(start, block_c), :]
        v = v_ref[layer, pl.ds(start, block_c), :]
        valid = start + jnp.arange(block_c) < complete
        carry, logits = online_softmax_step(carry, q, k, v, valid, sm_scale)
        logits_ref[:, pl.ds(step * block_c, block_c)] = logits
        return carry

    o, m, l = lax.fori_loop(0, steps, body, online_softmax_start(block_h, q.shape[1]))
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, real)


def sparse_window_kernel(q_ref, k_ref, v_ref, layer_ref, blocks_ref, position_ref, o_ref, l_ref, m_ref, *, sm_scale,
                         group, block_h, select_block, top_n, blocks_per_split, select_splits, window, window_per_split,
                         joint):
    kv_head, split = pl.program_id(0), pl.program_id(1)
    position, layer = position_ref[()], layer_ref[()]  # k_ref, v_ref [L, T, D]: every layer's rows of one head
    q, real = _group_rows(q_ref, kv_head, group, block_h)
    start = online_softmax_start(block_h, q.shape[1])

    def selected():
        first = split * blocks_per_split

        def body(step, carry):
            block = blocks_ref[first + step]
            base = jnp.maximum(block, 0) * select_block
            rows = base + jnp.arange(select_block)
            valid = (block >= 0) & (rows <= position)
            k = k_ref[layer, pl.ds(base, select_block), :]
            v = v_ref[layer, pl.ds(base, select_block), :]
            return online_softmax_step(carry, q, k, v, valid, sm_scale)[0]

        steps = jnp.clip(top_n - first, 0, blocks_per_split)
        return lax.fori_loop(0, steps, body, start)

    def window_rows():
        first = position - window + 1 + (split - select_splits) * window_per_split
        listed = blocks_ref[...]

        def body(step, carry):
            rows = first + step * WINDOW_STEP + jnp.arange(WINDOW_STEP)
            valid = (rows >= 0) & (rows <= position)
            if joint:  # rows of a selected block are attended by the selected splits already
                hit = jnp.where((rows // select_block)[:, None] == listed[None, :], 1, 0)
                valid = valid & (jnp.max(hit, axis=1) == 0)
            safe = jnp.clip(rows, 0, k_ref.shape[1] - 1)
            return online_softmax_step(carry, q, k_ref[layer, safe, :], v_ref[layer, safe, :], valid, sm_scale)[0]

        return lax.fori_loop(0, window_per_split // WINDOW_STEP, body, start)

    o, m, l = lax.cond(split < select_splits, selected, window_rows)
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, real)


def _compressed_unbatched(q, k_cmp, v_cmp, layer, position, *, layout, sm_scale, block_c, num_splits, interpret):
    num_q_heads, head_dim = q.shape
    num_layers, rows, num_kv_heads, _ = k_cmp.shape
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    chunk = rows // num_splits
    kernel = functools.partial(
        compressed_kernel, sm_scale=sm_scale, block_c=block_c, chunk=chunk, group=group, block_h=block_h,
        stride=layout.compress_stride, compress_block=layout.compress_block)
    head_rows = pl.BlockSpec((num_layers, rows, None, head_dim), lambda h, s: (0, 0, h, 0))
    out_specs, out_shape = split_partial_outputs(num_splits, num_kv_heads, block_h, head_dim)
    out_specs.append(pl.BlockSpec((None, None, block_h, chunk), lambda h, s: (s, h, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((num_splits, num_kv_heads, block_h, chunk), jnp.float32))
    o, l, m, logits = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_splits),
        in_specs=[pl.BlockSpec((num_q_heads, head_dim), lambda h, s: (0, 0)), head_rows, head_rows,
                  pl.BlockSpec((), lambda h, s: ()), pl.BlockSpec((), lambda h, s: ())],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_compressed_decode",
    )(q, k_cmp, v_cmp, layer, position)
    out, lse = normalised_with_lse(o[:, :, :group], l[:, :, :group], m[:, :, :group])
    logits = jnp.moveaxis(logits[:, :, :group], 0, 2).reshape(num_kv_heads, group, rows)
    return out, logits, lse  # [H_kv, G, D], [H_kv, G, C], [H_kv, G]


def _sparse_window_unbatched(q, k_cache, v_cache, layer, blocks, position, *, layout, joint, sm_scale, select_splits,
                             window_splits, interpret):
    num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    top_n = blocks.shape[1]
    listed = next_power_of_2(top_n)  # Triton loads a power-of-two number of elements
    blocks = jnp.pad(blocks, ((0, 0), (0, listed - top_n)), constant_values=-1)
    num_splits = select_splits + window_splits
    kernel = functools.partial(
        sparse_window_kernel, sm_scale=sm_scale, group=group, block_h=block_h, select_block=layout.select_block,
        top_n=top_n, blocks_per_split=pl.cdiv(top_n, select_splits), select_splits=select_splits,
        window=layout.window, window_per_split=layout.window // max(window_splits, 1), joint=joint)
    head_rows = pl.BlockSpec((num_layers, capacity, None, head_dim), lambda h, s: (0, 0, h, 0))
    out_specs, out_shape = split_partial_outputs(num_splits, num_kv_heads, block_h, head_dim)
    o, l, m = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_splits),
        in_specs=[pl.BlockSpec((num_q_heads, head_dim), lambda h, s: (0, 0)), head_rows, head_rows,
                  pl.BlockSpec((), lambda h, s: ()), pl.BlockSpec((None, listed), lambda h, s: (h, 0)),
                  pl.BlockSpec((), lambda h, s: ())],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_sparse_window_decode",
    )(q, k_cache, v_cache, layer, blocks, position)
    o, l, m = o[:, :, :group], l[:, :, :group], m[:, :, :group]
    if joint:
        return combine_splits(o, l, m), None
    o_slc = combine_splits(o[:select_splits], l[:select_splits], m[:select_splits])
    if window_splits == 0:
        return o_slc, jnp.zeros_like(o_slc)
    return o_slc, combine_splits(o[select_splits:], l[select_splits:], m[select_splits:])


def default_splits(batch: int, num_kv_heads: int, layout: NSALayout, compressed_rows: int, block_c: int):
    """(compressed splits, selected splits, window splits): about TARGET_PROGRAMS programs for the compressed
    stream (whole blocks per split), one selected block per program, window steps of 16 rows spread over up to
    as many programs as the selected blocks take."""
    compressed = whole_block_splits(batch * num_kv_heads, compressed_rows // block_c, _MAX_SPLITS)
    window_steps = layout.window // WINDOW_STEP
    window = 0 if window_steps == 0 else math.gcd(window_steps, next_power_of_2(layout.top_n))
    return compressed, layout.top_n, window


def check_layout(layout: NSALayout, capacity: int, compressed_rows: int, block_c: int):
    check_power_of_2("select_block", layout.select_block, 16)
    if capacity % layout.select_block:
        raise ValueError(f"cache capacity {capacity} must be a multiple of select_block {layout.select_block}")
    if layout.window % WINDOW_STEP:
        raise ValueError(f"window {layout.window} must be a multiple of {WINDOW_STEP}")
    if compressed_rows % block_c:
        raise ValueError(f"compressed rows {compressed_rows} must be a multiple of block_c {block_c}")


@functools.partial(jax.jit, static_argnames=("layout", "kind", "block_c", "interpret"))
def nsa_decode(q, k_cache, v_cache, k_cmp, v_cmp, position, gates=None, *, layer=None, layout: NSALayout,
               kind: str = "nsa", block_c: int = 64, interpret: bool = False):
    """NSA attention of one rotated query per sequence q [B, H_q, D] at position [B] over its layer cache (raw
    k, v [B, T, H_kv, D] holding the query's own row; compressed k_cmp, v_cmp [B, C, H_kv, D]), with gates
    [B, H_q, 3] for kind "nsa" (vegas_jax.attention.nsa for the rules). With `layer` (an int or traced int32) the
    four caches are every layer's, stacked [L, ...] (models.nsa_cache.NSACache), and the kernels read that layer
    in place: the stacks and the layer are their operands, never a layer's slice (a copy, issue 52). Returns
    out [B, H_q, D] in q's dtype."""
    (k_cache, v_cache, k_cmp, v_cmp), layer = stacked_layer(layer, k_cache, v_cache, k_cmp, v_cmp)
    batch, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[2:4]
    if k_cache.shape != v_cache.shape or k_cmp.shape != v_cmp.shape or k_cache.shape[1] != batch:
        raise ValueError(f"caches must be [B, T, H_kv, D] and [B, C, H_kv, D]; got {k_cache.shape}, {v_cache.shape}, "
                         f"{k_cmp.shape}, {v_cmp.shape} for q {q.shape}")
    if (kind == "nsa") != (gates is not None):
        raise ValueError(f"gates are needed exactly for kind 'nsa', got kind {kind!r} with gates {gates is not None}")
    check_power_of_2("head_dim", head_dim, 16)
    check_layout(layout, capacity, k_cmp.shape[2], block_c)
    sm_scale = 1.0 / math.sqrt(head_dim)
    cmp_splits, select_splits, window_splits = default_splits(batch, num_kv_heads, layout, k_cmp.shape[2], block_c)
    position = position.astype(jnp.int32)
    compressed = functools.partial(_compressed_unbatched, layout=layout, sm_scale=sm_scale, block_c=block_c,
                                   num_splits=cmp_splits, interpret=interpret)
    # The stacks are mapped over their batch axis where they lie (stacked_layer).
    o_cmp, logits, lse = jax.vmap(compressed, in_axes=(0, 1, 1, None, 0))(q, k_cmp, v_cmp, layer, position)
    blocks = blocks_from_logits(logits, lse, position, layout, capacity,
                                top_k=functools.partial(top_n, interpret=interpret))
    sparse = functools.partial(_sparse_window_unbatched, layout=layout, joint=kind == "nsa-view", sm_scale=sm_scale,
                               select_splits=select_splits, window_splits=window_splits, interpret=interpret)
    o_slc, o_win = jax.vmap(sparse, in_axes=(0, 1, 1, None, 0, 0))(q, k_cache, v_cache, layer, blocks, position)
    if kind == "nsa-view":
        out = o_slc
    else:
        g = gates.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, 3, 1).astype(jnp.float32)
        out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def blocks_from_logits(logits, lse, position, layout: NSALayout, capacity: int, top_k=jax.lax.top_k):
    """Selected blocks [B, H_kv, top_n] from compressed logits [B, H_kv, G, C] (scaled; invisible entries
    arbitrary) and each head's log-sum-exp [B, H_kv, G]; top_k as models.nsa_selection.select_blocks."""
    visible = compressed_visible(position, logits.shape[-1], layout)[:, None, None, :]
    probs = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
    scores = selection_scores(probs.sum(axis=2), num_select_blocks(layout, capacity), layout)
    return select_blocks(scores, position[:, None], layout, top_k)


@functools.partial(jax.jit, static_argnames=("layout", "kind"))
def nsa_decode_reference(q, k_cache, v_cache, k_cmp, v_cmp, position, gates=None, *, layer=None,
                         layout: NSALayout, kind: str = "nsa"):
    """XLA twin of nsa_decode (`layer` as there): compressed attention over the visible compressed rows, then
    the selected blocks' rows and the window's rows gathered (window rows inside a selected block dropped for the
    view's joint softmax), each branch a masked softmax."""
    (k_cache, v_cache, k_cmp, v_cmp), layer = stacked_layer(layer, k_cache, v_cache, k_cmp, v_cmp)
    k_cmp, v_cmp = k_cmp[layer], v_cmp[layer]  # read where the dots consume them
    batch, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = k_cache.shape[2:4]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)

    def softmax_attend(k, v, valid):  # k, v [B, N, H_kv, D]; valid [B, H_kv, N]
        logits = jnp.einsum("bhgd,bnhd->bhgn", qg, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(valid[:, :, None], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)
        p = jnp.where(valid[:, :, None], jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
        return jnp.einsum("bhgn,bnhd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32), logits, lse

    visible = compressed_visible(position, k_cmp.shape[1], layout)
    o_cmp, logits, lse = softmax_attend(k_cmp, v_cmp, jnp.broadcast_to(visible[:, None], (batch, num_kv_heads,
                                                                                           k_cmp.shape[1])))
    blocks = blocks_from_logits(logits, lse, position, layout, capacity)  # [B, H_kv, n]

    def gathered(rows, valid):  # rows [B, H_kv, N] -> k, v [B, N, H_kv, D] per head, masked
        safe = jnp.clip(rows, 0, capacity - 1)
        # [B, N, H_kv] rows of the layer, gathered straight from the stacks
        index = (layer, jnp.arange(batch)[:, None, None], jnp.moveaxis(safe, 1, 2), jnp.arange(num_kv_heads))
        take = lambda cache: cache[index]
        return take(k_cache), take(v_cache), valid

    select_rows = (jnp.maximum(blocks, 0)[..., None] * layout.select_block
                   + jnp.arange(layout.select_block)).reshape(batch, num_kv_heads, -1)
    select_valid = (jnp.repeat(blocks >= 0, layout.select_block, axis=-1)
                    & (select_rows <= position[:, None, None]))
    window_rows = position[:, None, None] - layout.window + 1 + jnp.arange(layout.window)
    window_rows = jnp.broadcast_to(window_rows, (batch, num_kv_heads, layout.window))
    window_valid = window_rows >= 0
    if kind == "nsa-view":
        in_selected = jnp.any((window_rows // layout.select_block)[..., None] == blocks[:, :, None, :], axis=-1)
        rows = jnp.concatenate([select_rows, window_rows], axis=-1)
        valid = jnp.concatenate([select_valid, window_valid & ~in_selected], axis=-1)
        out = softmax_attend(*gathered(rows, valid))[0]
    else:
        o_slc = softmax_attend(*gathered(select_rows, select_valid))[0]
        o_win = softmax_attend(*gathered(window_rows, window_valid))[0]
        g = gates.reshape(batch, num_kv_heads, group, 3, 1).astype(jnp.float32)
        out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
