"""The selected branch of NSA tree verification over the committed prefix, as Pallas kernels: V0 and V1
(pallas_kernels.nsa_verify for the semantics). Both return, per KV head, node and group head, the softmax over
the prefix rows (< length) of the node's selected blocks as (o normalised, lse), which nsa_verify merges with the
tree's own rows, the window and the compressed branch.

- v0_selected: grid (KV head, node, split of the node's blocks); each program holds one node's G query heads
  (padded to 16 rows) and reads its own blocks, one contiguous [l', D] load each: T * top_n block reads.
- v0_view: V0 for an NSA view (one softmax over every key a node sees), whose programs also read the window's
  prefix rows in the blocks the node did not select and the tree's rows it sees, so the kernel's output is the
  view's attention: no products, masks or merges of the window and the tree beside it. A step gathers several
  listed blocks' rows into one tile, and the batch sets the splits (one once its nodes fill the GPU).
- v1_selected: grid (KV head, split, row block); each program holds up to 128 of the T * G rows (row r: node
  r // G, head r % G) and walks its row block's own list of union blocks, those some node of the block selected
  (row_block_slots, from the member masks), reading each once for all the block's rows and masking its columns
  for the rows whose node did not select it (the block's member mask, a bit per node). The splits divide the
  list's count. (Until 2026-12-03 a row block walked the whole union and skipped, behind a branch, the blocks
  none of its nodes selected; the branch kept Triton from pipelining the loads.)
  Splitting gives a small batch (2 KV heads) enough programs. A program's accumulator holds at most MAX_ROWS
  rows, so at NSA-1B's G = 16 a 64-node tree (1024 rows) takes 8 row blocks, each reading its union from memory
  or L2: V1 reads at most 8 |U| blocks against V0's T n, and its advantage rests on the unions of 8 neighbouring
  nodes being small, or on the re-reads hitting a cache: in L2 (one program per row block), or in the SM's own
  cache with row_loop (one program runs its split's row blocks in turn; fewer programs). The benchmark measures
  both.
"""

from __future__ import annotations

import dataclasses
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
    next_power_of_2,
    normalised_with_lse,
    online_softmax_start,
    previous_power_of_2,
    stacked_layer,
)

MAX_ROWS = 128  # query rows per V1 program: beyond this the accumulator tile no longer fits in registers
MEMBER_BITS, MEMBER_WORDS = 32, 2  # a union block's member mask: one bit per tree node, 64 nodes at most
VIEW_STEP_KEYS = 64  # keys a v0_view step reads: four of SmolLM2's 16-key blocks, gathered into one tile
MAX_VIEW_SPLITS = 4  # v0_view's splits at most: four already leave a split two of a node's 7 steps of 64 keys


@dataclasses.dataclass(frozen=True)
class V1Launch:
    """How v1_selected splits its work: union splits per KV head, query rows per row block (a power of two, 16
    to MAX_ROWS), and whether a program runs all row blocks of its split (row_loop) or one."""

    num_splits: int = 16
    block_rows: int = MAX_ROWS
    row_loop: bool = False

    @classmethod
    def for_batch(cls, batch: int, num_kv_heads: int, rows: int) -> "V1Launch":
        """Union splits for about TARGET_PROGRAMS programs when the call is vmapped over `batch` sequences of
        `rows` query rows (nodes x G): more splits fill the GPU, but each adds a partial output to write and merge.
        On the H200 at 32K x 64 nodes, 16 splits were fastest at batch 1 and 4 at batch 8 (2026-12-03), the
        counts this picks."""
        row_blocks = pl.cdiv(rows, row_block_size(rows, MAX_ROWS))
        wanted = TARGET_PROGRAMS // (batch * num_kv_heads * row_blocks)
        return cls(num_splits=min(cls.num_splits, next_power_of_2(wanted)))  # at most the default; 0 wanted: 1


def row_block_size(rows: int, block_rows: int) -> int:
    """V1's query rows per row block: block_rows, or fewer (a power of two, at least 16) for a smaller tree."""
    return min(block_rows, max(16, next_power_of_2(rows)))


def _step(carry, q, k, v, valid, sm_scale):
    o_prev, m_prev, l_prev = carry
    logits = jnp.where(valid, plt.dot(q, k, trans_b=True) * sm_scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(logits - m_next[:, None]), 0.0)
    return (o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v), m_next,
            l_prev * correction + p.sum(axis=1))


def _store(o_ref, l_ref, m_ref, carry):
    o, m, l = carry
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def v0_kernel(q_ref, k_ref, v_ref, layer_ref, blocks_ref, length_ref, o_ref, l_ref, m_ref, *, sm_scale, group,
              num_q_heads, block_h, select_block, top_n, per_split):
    kv_head, node, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, layer = length_ref[()], layer_ref[()]  # k_ref, v_ref [L, T_cap, D]
    lane = jnp.arange(block_h)
    q = q_ref[node * num_q_heads + kv_head * group + jnp.minimum(lane, group - 1), :]
    first = split * per_split

    def body(step, carry):
        block = blocks_ref[first + step]
        base = jnp.maximum(block, 0) * select_block
        valid = (block >= 0) & (base + jnp.arange(select_block) < length)
        k = k_ref[layer, pl.ds(base, select_block), :]
        v = v_ref[layer, pl.ds(base, select_block), :]
        return _step(carry, q, k, v, valid[None, :], sm_scale)

    steps = jnp.clip(top_n - first, 0, per_split)
    _store(o_ref, l_ref, m_ref, lax.fori_loop(0, steps, body, online_softmax_start(block_h, q.shape[1])))


def v0_view_kernel(q_ref, k_ref, v_ref, layer_ref, blocks_ref, length_ref, depth_ref, ancestors_ref, tree_k_ref,
                   tree_v_ref, o_ref, l_ref, m_ref, *, sm_scale, group, num_q_heads, block_h, select_block, top_n,
                   listed, window, blocks_per_step, steps_total, per_split):
    """V0 with every key of an NSA view's node: its selected blocks' prefix rows, then the window's prefix rows in
    blocks it did not select (blocks_ref past top_n: the window's blocks), then (split 0) the tree's rows that it
    sees, an ancestor in a selected block or in its window. One softmax, as the view's decoding has. A step reads
    blocks_per_step listed blocks at once, their rows gathered into one [blocks_per_step l', D] tile."""
    kv_head, node, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, layer = length_ref[()], layer_ref[()]  # k_ref, v_ref [L, T_cap, D]
    position = length + depth_ref[node]  # the node's own position
    lane = jnp.arange(block_h)
    q = q_ref[node * num_q_heads + kv_head * group + jnp.minimum(lane, group - 1), :]
    chosen = jnp.where(jnp.arange(listed) < top_n, blocks_ref[...], -1)  # the node's selected blocks
    selected = lambda blocks: jnp.max((chosen[None, :] == blocks[:, None]).astype(jnp.int32), axis=1) > 0
    key = jnp.arange(blocks_per_step * select_block)  # a step's keys: block key // l', row key % l' in it
    first = split * per_split

    def body(step, carry):
        index = (first + step) * blocks_per_step + key // select_block  # each key's place in the list
        block = blocks_ref[index]
        rows = jnp.maximum(block, 0) * select_block + key % select_block
        # A window block counts only the rows in the node's window, and none in a block the node selected.
        in_window = (rows > position - window) & ~selected(block)
        valid = (block >= 0) & (rows < length) & ((index < top_n) | in_window)
        return _step(carry, q, k_ref[layer, rows, :], v_ref[layer, rows, :], valid[None, :], sm_scale)

    steps = jnp.clip(steps_total - first, 0, per_split)
    carry = lax.fori_loop(0, steps, body, online_softmax_start(block_h, q.shape[1]))
    at = length + depth_ref[...]  # the tree's rows' positions
    sees = (ancestors_ref[...] != 0) & (selected(at // select_block) | (at > position - window)) & (split == 0)
    _store(o_ref, l_ref, m_ref, _step(carry, q, tree_k_ref[...], tree_v_ref[...], sees[None, :], sm_scale))


def v1_kernel(q_ref, k_cache_ref, v_cache_ref, layer_ref, union_ref, slots_ref, counts_ref, member_ref, length_ref,
              o_ref, l_ref, m_ref, *, sm_scale, group, num_q_heads, num_nodes, block_r, row_blocks_here, select_block,
              num_splits):
    kv_head, split, program_rows = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, layer = length_ref[()], layer_ref[()]  # k_cache_ref, v_cache_ref [L, T_cap, D]
    # Row blocks one after another in this program (row_loop): the union blocks just read for one row block may
    # be read again from this SM's cache by the next.
    for here in range(row_blocks_here):
        row_block = program_rows * row_blocks_here + here
        # This row block's own list of union slots, those some node of its rows selected: every step attends, and
        # no branch stands between a step's loads and the previous step's math, so the loop pipelines as V0's.
        # The splits share the list's `count` slots, not its padded width.
        count = counts_ref[row_block]
        per_split = (count + num_splits - 1) // num_splits
        first = split * per_split
        steps = jnp.clip(count - first, 0, per_split)
        row = row_block * block_r + jnp.arange(block_r)
        node = jnp.minimum(row // group, num_nodes - 1)  # rows past the tree repeat its last node; never read back
        q = q_ref[node * num_q_heads + kv_head * group + row % group, :]
        word_of_row = (node // MEMBER_BITS)[:, None] == jnp.arange(MEMBER_WORDS)[None, :]
        bit_of_row = node % MEMBER_BITS

        def body(step, carry, q=q, word_of_row=word_of_row, bit_of_row=bit_of_row, row_block=row_block):
            u = slots_ref[row_block, first + step]
            base = union_ref[u] * select_block
            # Which rows' nodes selected this union block: bit (node % 32) of the block's member word node // 32.
            word = jnp.sum(jnp.where(word_of_row, member_ref[u, :][None, :], 0), axis=1)
            takes = lax.shift_right_logical(word, bit_of_row) & 1 != 0  # [block_r]
            valid = takes[:, None] & (base + jnp.arange(select_block) < length)[None, :]
            k = k_cache_ref[layer, pl.ds(base, select_block), :]
            v = v_cache_ref[layer, pl.ds(base, select_block), :]
            return _step(carry, q, k, v, valid, sm_scale)

        o, m, l = lax.fori_loop(0, steps, body, online_softmax_start(block_r, q.shape[1]))
        rows_here = pl.ds(here * block_r, block_r)
        o_ref[rows_here, :] = o
        l_ref[rows_here] = l
        m_ref[rows_here] = m


def row_block_slots(member: jax.Array, group: int, block_r: int) -> tuple[jax.Array, jax.Array]:
    """Each row block's union slots: member [H_kv, T, U] bool -> (slots [H_kv, RB, U] int32, ascending, the
    slots some node with rows in the block selected first; counts [H_kv, RB]). Row r is node r // G."""
    num_kv_heads, num_nodes, width = member.shape
    row_blocks = pl.cdiv(num_nodes * group, block_r)
    # Row block b holds rows [b block_r, (b + 1) block_r): nodes first..last, static ranges, so each block's wanted
    # slots are an `any` over a slice of nodes (an integer einsum over a [RB, T] membership was an 11 us XLA dot
    # at batch 8 x 64 nodes on the H200, 2026-12-04).
    wanted = jnp.stack([member[:, b * block_r // group:min(num_nodes, pl.cdiv((b + 1) * block_r, group))].any(axis=1)
                        for b in range(row_blocks)], axis=1)  # [H_kv, RB, U]
    counts = wanted.sum(axis=-1)
    # A wanted slot's place in its block's list is the number of wanted slots before it (as union_schedule).
    place = jnp.where(wanted, jnp.cumsum(wanted, axis=-1) - 1, width)  # width: dropped
    heads, blocks = jnp.arange(num_kv_heads)[:, None, None], jnp.arange(row_blocks)[None, :, None]
    slots = jnp.zeros((num_kv_heads, row_blocks, width), jnp.int32).at[heads, blocks, place].set(
        jnp.arange(width, dtype=jnp.int32)[None, None], mode="drop")
    return slots, counts


def pack_members(member: jax.Array) -> jax.Array:
    """member [H_kv, T, U] bool (T <= 64) -> [H_kv, U, MEMBER_WORDS] int32: bit b of word w says node 32 w + b
    selected union block u. A kernel step then reads 8 bytes per block instead of a [T] row."""
    num_kv_heads, num_nodes, width = member.shape
    nodes = MEMBER_WORDS * MEMBER_BITS
    if num_nodes > nodes:
        raise ValueError(f"member masks hold at most {nodes} nodes, got {num_nodes}")
    bits = jnp.pad(jnp.swapaxes(member, 1, 2), ((0, 0), (0, 0), (0, nodes - num_nodes))).astype(jnp.uint32)
    words = (bits.reshape(num_kv_heads, width, MEMBER_WORDS, MEMBER_BITS)
             << jnp.arange(MEMBER_BITS, dtype=jnp.uint32)).sum(axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32)


def _head_rows(num_layers, capacity, head_dim):
    """One KV head's rows of every layer of stacked caches [L, T_cap, H_kv, D] on a grid whose first axis is the
    KV head (the kernel indexes the layer)."""
    return pl.BlockSpec((num_layers, capacity, None, head_dim), lambda h, a, b: (0, 0, h, 0))


@functools.partial(jax.jit, static_argnames=("select_block", "num_splits", "interpret"))
def v0_selected(q, k_cache, v_cache, blocks, length, *, layer=None, select_block: int, num_splits: int = 4,
                interpret: bool = False):
    """q [T, H_q, D] (rotated); caches [T_cap, H_kv, D], or with `layer` (an int or traced int32) every layer's
    stacked [L, T_cap, H_kv, D], read in place (the stacks and the layer are the kernel's operands); blocks
    [T, H_kv, n] (-1 pads); length []. Returns (o [H_kv, T, G, D] float32, lse [H_kv, T, G])."""
    (k_cache, v_cache), layer = stacked_layer(layer, k_cache, v_cache)
    num_nodes, num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group, top_n = num_q_heads // num_kv_heads, blocks.shape[2]
    block_h = max(16, next_power_of_2(group))
    listed = next_power_of_2(top_n)
    blocks = jnp.pad(blocks.astype(jnp.int32), ((0, 0), (0, 0), (0, listed - top_n)), constant_values=-1)
    per_split = pl.cdiv(top_n, num_splits)
    kernel = functools.partial(v0_kernel, sm_scale=1.0 / math.sqrt(head_dim), group=group, num_q_heads=num_q_heads,
                               block_h=block_h, select_block=select_block, top_n=top_n, per_split=per_split)
    part = lambda *tail: pl.BlockSpec((None, None, None, block_h, *tail),
                                      lambda h, t, s: (s, h, t, 0, *(0,) * len(tail)))
    shape = lambda *tail: jax.ShapeDtypeStruct((num_splits, num_kv_heads, num_nodes, block_h, *tail), jnp.float32)
    o, l, m = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_nodes, num_splits),
        in_specs=[pl.BlockSpec((num_nodes * num_q_heads, head_dim), lambda h, t, s: (0, 0)),
                  _head_rows(num_layers, capacity, head_dim), _head_rows(num_layers, capacity, head_dim),
                  pl.BlockSpec((), lambda h, t, s: ()),
                  pl.BlockSpec((None, None, listed), lambda h, t, s: (t, h, 0)),
                  pl.BlockSpec((), lambda h, t, s: ())],
        out_specs=[part(head_dim), part(), part()], out_shape=[shape(head_dim), shape(), shape()],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_tree_v0_selected",
    )(q.reshape(num_nodes * num_q_heads, head_dim), k_cache, v_cache, layer, blocks, length.astype(jnp.int32))
    return normalised_with_lse(o[..., :group, :], l[..., :group], m[..., :group])


@functools.partial(jax.jit, static_argnames=("select_block", "window", "batch", "interpret"))
def v0_view(q, k_cache, v_cache, blocks, length, tree_k, tree_v, ancestors, *, layer=None, select_block: int,
            window: int, batch: int = 1, interpret: bool = False):
    """An NSA view's whole attention of a tree's nodes in one kernel (v0_view_kernel): q [T, H_q, D], caches as
    v0_selected's, blocks [T, H_kv, n] (-1 pads), length [], the tree's rotated rows tree_k, tree_v [T, H_kv, D],
    ancestors [T, T] (node j is node i or an ancestor; node i at position length + its depth); batch: how many
    sequences the caller vmaps this over (it sizes the splits). Returns (o [H_kv, T, G, D] float32 normalised,
    lse [H_kv, T, G])."""
    (k_cache, v_cache), layer = stacked_layer(layer, k_cache, v_cache)
    num_nodes, num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group, top_n = num_q_heads // num_kv_heads, blocks.shape[2]
    block_h = max(16, next_power_of_2(group))
    # The window's prefix rows [length - window, length) lie in window // select_block + 1 blocks at most (ids
    # below 0 read nothing); they follow each node's selected blocks in its list.
    window_blocks = window // select_block + 1
    first_window = (length - window) // select_block
    in_window = jnp.broadcast_to(first_window + jnp.arange(window_blocks, dtype=jnp.int32),
                                 (num_nodes, num_kv_heads, window_blocks))
    # A step reads VIEW_STEP_KEYS keys (whole blocks): with one 16-key block a step, a node's program ran 25
    # dependent steps, and the kernel took 9.3 us a layer at batch 1 and 39 us at batch 8 for SmolLM2's 4x2 tree
    # on an H100 (benchmarks/results/profile-2026-12-07-h100-ssv-ab-view-kernel-b*-4x2.json).
    blocks_per_step = max(1, VIEW_STEP_KEYS // select_block)
    steps_total = pl.cdiv(top_n + window_blocks, blocks_per_step)
    listed = next_power_of_2(steps_total * blocks_per_step)
    blocks = jnp.concatenate([blocks.astype(jnp.int32), in_window], axis=-1)
    blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, listed - top_n - window_blocks)), constant_values=-1)
    padded = max(16, next_power_of_2(num_nodes))  # the tree's rows, a power of two (Triton's loads and dots)
    ancestors = jnp.asarray(ancestors)
    depth = jnp.pad(ancestors.sum(axis=1).astype(jnp.int32) - 1, (0, padded - num_nodes))
    ancestors = jnp.pad(ancestors.astype(jnp.int32), ((0, 0), (0, padded - num_nodes)))
    tree_rows = lambda x: jnp.pad(x, ((0, padded - num_nodes), (0, 0), (0, 0)))
    # Splits only while the batch's nodes leave SMs idle: each adds a partial output to write and merge.
    wanted = pl.cdiv(TARGET_PROGRAMS, batch * num_kv_heads * num_nodes)
    num_splits = max(1, min(MAX_VIEW_SPLITS, previous_power_of_2(wanted), steps_total))
    per_split = pl.cdiv(steps_total, num_splits)
    kernel = functools.partial(v0_view_kernel, sm_scale=1.0 / math.sqrt(head_dim), group=group,
                               num_q_heads=num_q_heads, block_h=block_h, select_block=select_block, top_n=top_n,
                               listed=listed, window=window, blocks_per_step=blocks_per_step,
                               steps_total=steps_total, per_split=per_split)
    part = lambda *tail: pl.BlockSpec((None, None, None, block_h, *tail),
                                      lambda h, t, s: (s, h, t, 0, *(0,) * len(tail)))
    shape = lambda *tail: jax.ShapeDtypeStruct((num_splits, num_kv_heads, num_nodes, block_h, *tail), jnp.float32)
    tree_spec = pl.BlockSpec((padded, None, head_dim), lambda h, t, s: (0, h, 0))
    o, l, m = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_nodes, num_splits),
        in_specs=[pl.BlockSpec((num_nodes * num_q_heads, head_dim), lambda h, t, s: (0, 0)),
                  _head_rows(num_layers, capacity, head_dim), _head_rows(num_layers, capacity, head_dim),
                  pl.BlockSpec((), lambda h, t, s: ()),
                  pl.BlockSpec((None, None, listed), lambda h, t, s: (t, h, 0)),
                  pl.BlockSpec((), lambda h, t, s: ()),
                  pl.BlockSpec((padded,), lambda h, t, s: (0,)),
                  pl.BlockSpec((None, padded), lambda h, t, s: (t, 0)),
                  tree_spec, tree_spec],
        out_specs=[part(head_dim), part(), part()], out_shape=[shape(head_dim), shape(), shape()],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_tree_v0_view",
    )(q.reshape(num_nodes * num_q_heads, head_dim), k_cache, v_cache, layer, blocks, length.astype(jnp.int32),
      depth, ancestors, tree_rows(tree_k), tree_rows(tree_v))
    return normalised_with_lse(o[..., :group, :], l[..., :group], m[..., :group])


@functools.partial(jax.jit, static_argnames=("select_block", "launch", "interpret"))
def v1_selected(q, k_cache, v_cache, union, member, length, *, layer=None, select_block: int,
                launch: V1Launch = V1Launch(), interpret: bool = False):
    """q [T, H_q, D]; caches [T_cap, H_kv, D] (or stacked with `layer`, as v0_selected's); union [H_kv, U]
    (ascending, -1 past its count); member [H_kv, T, U] bool; length []. Returns (o [H_kv, T, G, D] float32,
    lse [H_kv, T, G]).

    launch.row_loop: each program runs all row blocks of its union split one after another (the split's blocks
    come from its SM's cache after the first), instead of one program per row block (more programs, the
    re-reads left to L2)."""
    (k_cache, v_cache), layer = stacked_layer(layer, k_cache, v_cache)
    num_nodes, num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    rows = num_nodes * group
    block_r = row_block_size(rows, launch.block_rows)
    row_blocks = pl.cdiv(rows, block_r)
    width = next_power_of_2(union.shape[1])  # Triton loads a power-of-two number of elements
    pad = width - union.shape[1]
    union = jnp.pad(jnp.maximum(union, 0).astype(jnp.int32), ((0, 0), (0, pad)))
    slots, counts = row_block_slots(member, group, block_r)
    slots = jnp.pad(slots, ((0, 0), (0, 0), (0, pad)))
    member = jnp.pad(pack_members(member), ((0, 0), (0, pad), (0, 0)))
    num_splits = max(1, min(launch.num_splits, width))
    here = row_blocks if launch.row_loop else 1
    kernel = functools.partial(v1_kernel, sm_scale=1.0 / math.sqrt(head_dim), group=group, num_q_heads=num_q_heads,
                               num_nodes=num_nodes, block_r=block_r, row_blocks_here=here,
                               select_block=select_block, num_splits=num_splits)
    part = lambda *tail: pl.BlockSpec((None, None, here * block_r, *tail),
                                      lambda h, s, r: (s, h, r, *(0,) * len(tail)))
    shape = lambda *tail: jax.ShapeDtypeStruct((num_splits, num_kv_heads, row_blocks * block_r, *tail), jnp.float32)
    o, l, m = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_splits, row_blocks // here),
        in_specs=[pl.BlockSpec((num_nodes * num_q_heads, head_dim), lambda h, s, r: (0, 0)),
                  _head_rows(num_layers, capacity, head_dim), _head_rows(num_layers, capacity, head_dim),
                  pl.BlockSpec((), lambda h, s, r: ()), pl.BlockSpec((None, width), lambda h, s, r: (h, 0)),
                  pl.BlockSpec((None, row_blocks, width), lambda h, s, r: (h, 0, 0)),
                  pl.BlockSpec((None, row_blocks), lambda h, s, r: (h, 0)),
                  pl.BlockSpec((None, width, MEMBER_WORDS), lambda h, s, r: (h, 0, 0)),
                  pl.BlockSpec((), lambda h, s, r: ())],
        out_specs=[part(head_dim), part(), part()], out_shape=[shape(head_dim), shape(), shape()],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_tree_v1_selected",
    )(q.reshape(num_nodes * num_q_heads, head_dim), k_cache, v_cache, layer, union, slots, counts.astype(jnp.int32),
      member, length.astype(jnp.int32))
    unpack = lambda x: x[:, :, :rows].reshape(num_splits, num_kv_heads, num_nodes, group, *x.shape[3:])
    return normalised_with_lse(unpack(o), unpack(l), unpack(m))
