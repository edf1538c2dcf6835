"""The fused NSA decode kernel of a reuse layer (vegas_jax.ssv.precision.ApproxMode): the selection comes injected (the
nearest refresh layer's), so no compressed scoring, no top-n and no second launch stand between the branches. One
pallas_call does the compressed, selected and window branches and the gates.

Grid (KV head, split). Every program takes an equal share of each branch: a chunk of the compressed rows (block_c
at a time), a slice of the injected blocks (one contiguous [l', D] load each) and a slice of the window's rows
(16 at a time, gathered), keeping one online softmax per branch ("nsa") or one for the selected rows and the window
together ("nsa-view", whose window skips rows of selected blocks so no row counts twice). Each branch's partial
output leaves the kernel already multiplied by its gate (the gate is a per-head constant, so it commutes with the
split-K merge); the merge over splits (rescale by the log-sum-exps, divide, add the branches) is the XLA epilogue
every split kernel here has. Splitting each branch over the same programs keeps one sequence with 2 KV heads busy.

The jnp twin is vegas_jax.attention.nsa_approx.branches_with_blocks (masks over the whole cache).
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
from pallas_kernels._common import MASK_VALUE, check_power_of_2, next_power_of_2, online_softmax_start, stacked_layer

WINDOW_STEP = 16  # window rows per inner step
GATE_COLUMNS = 4  # gates [H_q, 3] padded to a power of two for the Triton load


def _step(carry, q, k, v, valid, sm_scale):
    """One online-softmax step; masked columns add nothing (a split that sees no row keeps l = 0)."""
    o_prev, m_prev, l_prev = carry
    logits = jnp.where(valid[None, :], plt.dot(q, k, trans_b=True) * sm_scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(valid[None, :], jnp.exp(logits - m_next[:, None]), 0.0)
    return (o_prev * correction[:, None] + plt.dot(p.astype(v.dtype), v), m_next,
            l_prev * correction + p.sum(axis=1))


def fused_kernel(q_ref, k_ref, v_ref, kc_ref, vc_ref, layer_ref, blocks_ref, gates_ref, position_ref, *out_refs,
                 sm_scale, group, block_h, layout: NSALayout, top_n, block_c, cmp_chunk, blocks_per_split,
                 window_steps_per_split, joint):
    kv_head, split = pl.program_id(0), pl.program_id(1)
    position = position_ref[()]
    layer = layer_ref[()]  # the caches' refs hold every layer's rows of one KV head [L, rows, D]
    lane = jnp.arange(block_h)
    heads = kv_head * group + jnp.minimum(lane, group - 1)
    q = q_ref[heads, :]
    start = online_softmax_start(block_h, q.shape[1])
    sel, capacity = layout.select_block, k_ref.shape[1]

    def selected(carry):
        first = split * blocks_per_split

        def body(step, carry):
            block = blocks_ref[first + step]
            base = jnp.maximum(block, 0) * sel
            valid = (block >= 0) & (base + jnp.arange(sel) <= position)
            return _step(carry, q, k_ref[layer, pl.ds(base, sel), :], v_ref[layer, pl.ds(base, sel), :], valid,
                         sm_scale)

        return lax.fori_loop(0, jnp.clip(top_n - first, 0, blocks_per_split), body, carry)

    def window(carry):
        listed_blocks = blocks_ref[...] if joint else None
        first = position - layout.window + 1 + split * window_steps_per_split * WINDOW_STEP

        def body(step, carry):
            rows = first + step * WINDOW_STEP + jnp.arange(WINDOW_STEP)
            valid = (rows >= 0) & (rows <= position)
            if joint:
                hit = jnp.where((rows // sel)[:, None] == listed_blocks[None, :], 1, 0)
                valid = valid & (jnp.max(hit, axis=1) == 0)
            safe = jnp.clip(rows, 0, capacity - 1)
            return _step(carry, q, k_ref[layer, safe, :], v_ref[layer, safe, :], valid, sm_scale)

        total = layout.window // WINDOW_STEP
        steps = jnp.clip(total - split * window_steps_per_split, 0, window_steps_per_split)
        return lax.fori_loop(0, steps, body, carry)

    def compressed(carry):
        l, d = layout.compress_block, layout.compress_stride
        complete = jnp.where(position >= l - 1, (position - l + 1) // d + 1, 0)
        first = split * cmp_chunk

        def body(step, carry):
            row = first + step * block_c
            valid = row + jnp.arange(block_c) < complete
            return _step(carry, q, kc_ref[layer, pl.ds(row, block_c), :], vc_ref[layer, pl.ds(row, block_c), :],
                         valid, sm_scale)

        return lax.fori_loop(0, jnp.clip(pl.cdiv(complete - first, block_c), 0, cmp_chunk // block_c), body, carry)

    if joint:
        branches = [window(selected(start))]
        gates = [None]
    else:
        branches = [compressed(start), selected(start), window(start)]
        g = gates_ref[heads, :]  # [block_h, GATE_COLUMNS]
        column = jnp.arange(GATE_COLUMNS)[None, :]
        gates = [jnp.sum(jnp.where(column == c, g, 0.0), axis=1) for c in range(3)]
    real = lane < group
    for b, ((o, m, l), gate) in enumerate(zip(branches, gates)):
        o_ref, l_ref, m_ref = out_refs[3 * b:3 * b + 3]
        plt.store(o_ref, o if gate is None else o * gate[:, None], mask=real[:, None])
        plt.store(l_ref, l, mask=real)
        plt.store(m_ref, m, mask=real)


def _merge(o, l, m):
    """One branch's split partials o [splits, ..., D], l, m [splits, ...] -> its (gated) normalised output; zero
    for a head that saw no row."""
    m_max = m.max(axis=0)
    correction = jnp.exp(m - m_max[None])
    total = (l * correction).sum(axis=0)
    return (o * correction[..., None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]


def default_splits(top_n: int) -> int:
    """Splits per KV head: one per injected block (each split then also takes about 1/splits of the compressed
    rows and of the window)."""
    return next_power_of_2(top_n)


def _unbatched(q, k, v, k_cmp, v_cmp, layer, blocks, gates, position, *, layout, kind, block_c, num_splits,
               interpret):
    num_q_heads, head_dim = q.shape
    num_layers, capacity, num_kv_heads, _ = k.shape
    rows = k_cmp.shape[1]
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    top_n = blocks.shape[1]
    listed = next_power_of_2(top_n)
    blocks = jnp.pad(blocks.astype(jnp.int32), ((0, 0), (0, listed - top_n)), constant_values=-1)
    joint = kind == "nsa-view"
    window_steps = layout.window // WINDOW_STEP
    kernel = functools.partial(
        fused_kernel, sm_scale=1.0 / math.sqrt(head_dim), group=group, block_h=block_h, layout=layout, top_n=top_n,
        block_c=block_c, cmp_chunk=pl.cdiv(rows // block_c, num_splits) * block_c,
        blocks_per_split=pl.cdiv(top_n, num_splits),
        window_steps_per_split=pl.cdiv(window_steps, num_splits), joint=joint)
    head_rows = lambda n: pl.BlockSpec((num_layers, n, None, head_dim), lambda h, s: (0, 0, h, 0))
    branches = 1 if joint else 3
    out_specs = [pl.BlockSpec((None, None, block_h, head_dim), lambda h, s: (s, h, 0, 0)),
                 pl.BlockSpec((None, None, block_h), lambda h, s: (s, h, 0)),
                 pl.BlockSpec((None, None, block_h), lambda h, s: (s, h, 0))] * branches
    out_shape = [jax.ShapeDtypeStruct((num_splits, num_kv_heads, block_h, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, num_kv_heads, block_h), jnp.float32),
                 jax.ShapeDtypeStruct((num_splits, num_kv_heads, block_h), jnp.float32)] * branches
    outs = pl.pallas_call(
        kernel, grid=(num_kv_heads, num_splits),
        in_specs=[pl.BlockSpec((num_q_heads, head_dim), lambda h, s: (0, 0)), head_rows(capacity),
                  head_rows(capacity), head_rows(rows), head_rows(rows), pl.BlockSpec((), lambda h, s: ()),
                  pl.BlockSpec((None, listed), lambda h, s: (h, 0)),
                  pl.BlockSpec((num_q_heads, GATE_COLUMNS), lambda h, s: (0, 0)), pl.BlockSpec((), lambda h, s: ())],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
        name="nsa_reuse_fused_decode",
    )(q, k, v, k_cmp, v_cmp, layer, blocks, gates, position)
    out = sum(_merge(*(x[:, :, :group] for x in outs[3 * b:3 * b + 3])) for b in range(branches))
    return out.reshape(num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("layout", "kind", "block_c", "num_splits", "interpret"))
def nsa_reuse_decode(q, k_cache, v_cache, k_cmp, v_cmp, blocks, position, gates=None, *, layer=None,
                     layout: NSALayout, kind: str = "nsa", block_c: int = 64, num_splits: int | None = None,
                     interpret: bool = False):
    """NSA attention of one rotated query per sequence q [B, H_q, D] at position [B] with its selection injected:
    blocks [B, H_kv, n] (any n; -1 pads). Caches as pallas_kernels.nsa_decode (raw [B, T, H_kv, D] holding the
    query's row; compressed [B, C, H_kv, D]); gates [B, H_q, 3] exactly for kind "nsa". Returns [B, H_q, D] in
    q's dtype. With `layer`, the caches are every layer's stacked [L, ...], read in place as
    pallas_kernels.nsa_decode reads them."""
    (k_cache, v_cache, k_cmp, v_cmp), layer = stacked_layer(layer, k_cache, v_cache, k_cmp, v_cmp)
    batch, num_q_heads, head_dim = q.shape
    if (k_cache.shape != v_cache.shape or k_cmp.shape != v_cmp.shape or k_cache.shape[1] != batch
            or blocks.shape[:2] != (batch, k_cache.shape[3])):
        raise ValueError(f"caches [B, T, H_kv, D], [B, C, H_kv, D] and blocks [B, H_kv, n]; got {k_cache.shape}, "
                         f"{k_cmp.shape}, {blocks.shape} for q {q.shape}")
    if (kind == "nsa") != (gates is not None):
        raise ValueError(f"gates are needed exactly for kind 'nsa', got kind {kind!r} with gates {gates is not None}")
    check_power_of_2("head_dim", head_dim, 16)
    check_power_of_2("select_block", layout.select_block, 16)
    if layout.window % WINDOW_STEP or k_cmp.shape[2] % block_c:
        raise ValueError(f"window {layout.window} must be a multiple of {WINDOW_STEP} and compressed rows "
                         f"{k_cmp.shape[2]} of block_c {block_c}")
    splits = num_splits or default_splits(blocks.shape[2])
    if gates is None:
        gates = jnp.zeros((batch, num_q_heads, GATE_COLUMNS), jnp.float32)
    else:
        gates = jnp.pad(gates.astype(jnp.float32), ((0, 0), (0, 0), (0, GATE_COLUMNS - 3)))
    fused = functools.partial(_unbatched, layout=layout, kind=kind, block_c=block_c, num_splits=splits,
                              interpret=interpret)
    out = jax.vmap(fused, in_axes=(0, 1, 1, 1, 1, None, 0, 0, 0))(q, k_cache, v_cache, k_cmp, v_cmp, layer, blocks,
                                                                gates, position.astype(jnp.int32))
    return out.astype(q.dtype)
