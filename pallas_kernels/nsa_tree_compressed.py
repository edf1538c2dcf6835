"""The compressed branch of NSA tree verification over the prefix's compressed rows, as two Pallas kernels.

Every node of a tree sees the same complete compressed rows of the prefix (those of the blocks its path
completes are few and stay in XLA, pallas_kernels.nsa_verify). Per node and query head the branch needs the
softmax output over them and, for block selection, each row's probability summed over the KV group's heads, with
every head normalised by its log-sum-exp over all it sees. XLA materialises the [H_kv, G, T, C] float32 logits
for that and reads them several times (134 MB at 64 nodes x batch 8 x 32K: most of a verification pass on the
H200, 2026-12-03). The kernels keep the logits in registers and write only [H_kv, T, C] probabilities:
- `compressed_softmax`: grid (KV head, split of the compressed rows, node block); a program holds the G query
  heads of a few nodes (row r: node r // G, head r % G) and streams its split's compressed keys and values once,
  writing split partials (o, l, m).
- `compressed_probs`: the same grid, given each row's total log-sum-exp: it recomputes the logits and writes
  sum over a node's heads of exp(logit - lse) through a 0/1 selector matrix (three bf16 tensor-core dots that
  together carry float32's precision, `_float32_sums`), so no row of logits leaves the program.
The compressed keys are read twice (256 KB per KV head at 32K: from L2 the second time).
`compressed_tree_branch_reference` is the XLA twin.
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
    next_power_of_2,
    normalised_with_lse,
    online_softmax_start,
    online_softmax_step,
    split_partial_outputs,
    stacked_layer,
    store_split_partials,
    whole_block_splits,
)

MAX_ROWS = 128  # query rows (nodes x G) per program: the accumulator and a block of logits stay in registers


def node_rows(num_nodes: int, group: int) -> tuple[int, int]:
    """(nodes per program, query rows per program: a power of two >= 16 holding that many nodes' G heads)."""
    nodes = max(1, min(num_nodes, MAX_ROWS // group))
    return nodes, max(16, next_power_of_2(nodes * group))


def default_splits(batch: int, num_kv_heads: int, node_blocks: int, compressed_rows: int, block_c: int) -> int:
    """Splits of the compressed rows for about TARGET_PROGRAMS programs over `batch` vmapped sequences, dividing
    the row blocks so that every split holds whole blocks."""
    return whole_block_splits(batch * num_kv_heads * node_blocks, compressed_rows // block_c)


def _program_rows(q_ref, kv_head, node_block, *, group, num_q_heads, num_nodes, nodes, block_r):
    """This program's query rows [block_r, D], which are real, and each row's node within the program."""
    r = jnp.arange(block_r)
    local = r // group
    node = node_block * nodes + local
    real = (local < nodes) & (node < num_nodes)
    q = q_ref[jnp.minimum(node, num_nodes - 1) * num_q_heads + kv_head * group + r % group, :]
    return q, real, local


def softmax_kernel(q_ref, k_ref, v_ref, layer_ref, visible_ref, o_ref, l_ref, m_ref, *, sm_scale, block_c, chunk,
                   rows):
    kv_head, split, node_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q, real, _ = _program_rows(q_ref, kv_head, node_block, **rows)
    visible, first, layer = visible_ref[()], split * chunk, layer_ref[()]  # k_ref, v_ref [L, C, D]
    # Only blocks holding a visible row: a block with none would count its masked entries in l.
    steps = jnp.clip(pl.cdiv(visible - first, block_c), 0, chunk // block_c)

    def body(step, carry):
        start = first + step * block_c
        valid = start + jnp.arange(block_c) < visible
        return online_softmax_step(carry, q, k_ref[layer, pl.ds(start, block_c), :],
                                   v_ref[layer, pl.ds(start, block_c), :], valid, sm_scale)[0]

    o, m, l = lax.fori_loop(0, steps, body, online_softmax_start(rows["block_r"], q.shape[1]))
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, real)


def probs_kernel(q_ref, k_ref, layer_ref, lse_ref, visible_ref, probs_ref, *, sm_scale, block_c, chunk, rows,
                 nodes_padded):
    kv_head, split, node_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q, real, local = _program_rows(q_ref, kv_head, node_block, **rows)
    lse = lse_ref[...]
    visible, first, layer = visible_ref[()], split * chunk, layer_ref[()]  # k_ref [L, C, D]
    # selector[n, r]: row r is one of node n's heads; selector @ p sums each node's heads.
    selector = ((jnp.arange(nodes_padded)[:, None] == local[None, :]) & real[None, :]).astype(jnp.bfloat16)

    def body(step, carry):
        start = first + step * block_c
        valid = start + jnp.arange(block_c) < visible
        logits = plt.dot(q, k_ref[layer, pl.ds(start, block_c), :], trans_b=True) * sm_scale
        p = jnp.where(real[:, None] & valid[None, :], jnp.exp(logits - lse[:, None]), 0.0)
        # Only the program's nodes: the selector's padding rows (half of them at G 16) are never written.
        plt.store(probs_ref.at[:, pl.ds(step * block_c, block_c)], _float32_sums(selector, p),
                  mask=(jnp.arange(nodes_padded) < rows["nodes"])[:, None])
        return carry

    # Every block of the split, so rows past `visible` come back as zeros.
    lax.fori_loop(0, chunk // block_c, body, 0)


def _float32_sums(selector, p):
    """selector [N, R] (0/1, bf16) @ p [R, C] float32 to float32 accuracy on the tensor cores: p is the sum of
    three bf16 terms (8 significant bits each, the next 8 and the last 8 of float32's 24), each product of a 0/1
    weight by a term is exact, and the dots accumulate in float32. A float32 dot without TF32 runs on the FMA
    units instead, 16 multiply-adds per probability at 16 nodes a program (until 2026-12-04: 84 us of a 64-node
    batch-8 pass at 32K, the longest kernel, benchmarks/results/nsa-kernels-2026-12-04-050556.json)."""
    high = p.astype(jnp.bfloat16)
    rest = p - high.astype(jnp.float32)
    middle = rest.astype(jnp.bfloat16)
    low = (rest - middle.astype(jnp.float32)).astype(jnp.bfloat16)
    return sum(plt.dot(selector, term) for term in (high, middle, low))  # float32 results


def _unbatched(q, k_cmp, v_cmp, layer, visible, extra_lse, *, block_c, num_splits, interpret):
    num_nodes, num_q_heads, head_dim = q.shape
    num_layers, compressed_rows, num_kv_heads, _ = k_cmp.shape
    group = num_q_heads // num_kv_heads
    nodes, block_r = node_rows(num_nodes, group)
    node_blocks, chunk = pl.cdiv(num_nodes, nodes), compressed_rows // num_splits
    rows = dict(group=group, num_q_heads=num_q_heads, num_nodes=num_nodes, nodes=nodes, block_r=block_r)
    sm_scale = 1.0 / math.sqrt(head_dim)
    grid = (num_kv_heads, num_splits, node_blocks)
    q_rows = pl.BlockSpec((num_nodes * num_q_heads, head_dim), lambda h, s, b: (0, 0))
    head_rows = pl.BlockSpec((num_layers, compressed_rows, None, head_dim), lambda h, s, b: (0, 0, h, 0))
    scalar = pl.BlockSpec((), lambda h, s, b: ())
    params = plt.CompilerParams(num_warps=4, num_stages=2)
    q2 = q.reshape(num_nodes * num_q_heads, head_dim)
    visible = visible.astype(jnp.int32)

    out_specs, out_shape = split_partial_outputs(num_splits, num_kv_heads, block_r, head_dim, row_blocks=node_blocks)
    o, l, m = pl.pallas_call(
        functools.partial(softmax_kernel, sm_scale=sm_scale, block_c=block_c, chunk=chunk, rows=rows),
        grid=grid, in_specs=[q_rows, head_rows, head_rows, scalar, scalar], out_specs=out_specs, out_shape=out_shape,
        compiler_params=params, interpret=interpret, name="nsa_tree_compressed_softmax",
    )(q2, k_cmp, v_cmp, layer, visible)

    o, lse_prefix = normalised_with_lse(o, l, m)  # [H_kv, node_blocks * block_r, (D)]

    def to_nodes(x):  # [H_kv, node_blocks * block_r, ...] -> [H_kv, T, G, ...]
        x = x.reshape(num_kv_heads, node_blocks, block_r, *x.shape[2:])[:, :, :nodes * group]
        return x.reshape(num_kv_heads, node_blocks * nodes, group, *x.shape[3:])[:, :num_nodes]

    def to_rows(x):  # [H_kv, T, G] -> [H_kv, node_blocks * block_r]
        x = jnp.pad(x, ((0, 0), (0, node_blocks * nodes - num_nodes), (0, 0)))
        x = x.reshape(num_kv_heads, node_blocks, nodes * group)
        return jnp.pad(x, ((0, 0), (0, 0), (0, block_r - nodes * group))).reshape(num_kv_heads, -1)

    o, lse_prefix = to_nodes(o), to_nodes(lse_prefix)  # [H_kv, T, G, D], [H_kv, T, G]
    lse = jnp.logaddexp(lse_prefix, jnp.moveaxis(extra_lse, 2, 1))
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    nodes_padded = max(16, next_power_of_2(nodes))
    probs = pl.pallas_call(
        functools.partial(probs_kernel, sm_scale=sm_scale, block_c=block_c, chunk=chunk, rows=rows,
                          nodes_padded=nodes_padded),
        grid=grid,
        in_specs=[q_rows, head_rows, scalar, pl.BlockSpec((None, block_r), lambda h, s, b: (h, b)), scalar],
        out_specs=pl.BlockSpec((None, None, nodes_padded, chunk), lambda h, s, b: (h, b, 0, s)),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, node_blocks, nodes_padded, compressed_rows), jnp.float32),
        compiler_params=params, interpret=interpret, name="nsa_tree_compressed_probs",
    )(q2, k_cmp, layer, to_rows(safe), visible)
    probs = probs[:, :, :nodes].reshape(num_kv_heads, node_blocks * nodes, compressed_rows)[:, :num_nodes]
    weight = jnp.where(jnp.isfinite(lse_prefix), jnp.exp(lse_prefix - safe), 0.0)  # the prefix's share of the mass
    return jnp.moveaxis(o * weight[..., None], 1, 0), probs, jnp.moveaxis(lse, 1, 2)


@functools.partial(jax.jit, static_argnames=("block_c", "batch", "num_splits", "interpret"))
def compressed_tree_branch(q, k_cmp, v_cmp, visible, extra_lse, *, layer=None, block_c: int = 64, batch: int = 1,
                           num_splits: int | None = None, interpret: bool = False):
    """The compressed branch of T tree nodes over the prefix's first `visible` compressed rows, one sequence.
    q [T, H_q, D] rotated; k_cmp, v_cmp [C, H_kv, D] (C a multiple of block_c); visible [] int32; extra_lse
    [H_kv, G, T]: each head's log-sum-exp over the compressed rows the node's path completes (-inf: none).
    batch: how many sequences the caller vmaps this over (it sizes the grid: default_splits, unless num_splits,
    dividing C / block_c, is given). Returns (o [T, H_kv, G, D] float32:
    sum over the visible rows of p v, probs [H_kv, T, C]: sum over the group's heads of p, zero past `visible`,
    lse [H_kv, G, T]: the total), p = exp(logit - lse). With `layer` (an int or traced int32), k_cmp and v_cmp
    are every layer's stacked [L, C, H_kv, D], of which the kernels read that layer in place (the stacks and the
    layer are their operands: no layer's slice, issue 52)."""
    (k_cmp, v_cmp), layer = stacked_layer(layer, k_cmp, v_cmp)
    num_nodes, num_q_heads, _ = q.shape
    _, compressed_rows, num_kv_heads, _ = k_cmp.shape
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if compressed_rows % block_c:
        raise ValueError(f"compressed rows {compressed_rows} must be a multiple of block_c {block_c}")
    nodes, _ = node_rows(num_nodes, num_q_heads // num_kv_heads)
    if num_splits is None:
        num_splits = default_splits(batch, num_kv_heads, pl.cdiv(num_nodes, nodes), compressed_rows, block_c)
    elif (compressed_rows // block_c) % num_splits:
        raise ValueError(f"num_splits {num_splits} must divide the {compressed_rows // block_c} blocks of "
                         "compressed rows")
    return _unbatched(q, k_cmp, v_cmp, layer, visible, extra_lse, block_c=block_c, num_splits=num_splits,
                      interpret=interpret)


def compressed_tree_branch_reference(q, k_cmp, v_cmp, visible, extra_lse, *, layer=None):
    """XLA twin of compressed_tree_branch: the [H_kv, G, T, C] logits materialised."""
    if layer is not None:  # the layer of stacks [L, C, H_kv, D], read where the dots consume it
        k_cmp, v_cmp = k_cmp[layer], v_cmp[layer]
    num_nodes, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cmp.shape[1]
    qg = q.reshape(num_nodes, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("thgd,chd->hgtc", qg, k_cmp, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    logits = jnp.where(jnp.arange(k_cmp.shape[0]) < visible, logits, -jnp.inf)
    lse = jnp.logaddexp(jax.nn.logsumexp(logits, axis=-1), extra_lse)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    o = jnp.einsum("hgtc,chd->thgd", p.astype(v_cmp.dtype), v_cmp, preferred_element_type=jnp.float32)
    return o, p.sum(axis=1), lse
