"""Sparse draft attention: one new token per sequence over selected cache rows, a recent range and itself.

For sequence b the key set is the union of the cache rows `indices[b, :counts[b]]` (all below recent_start[b],
distinct), the contiguous rows `[recent_start[b], position[b])` and the new token at position[b]. The kernel
reads the cached K/V rows straight from the cache `[B, T, H_kv, D]`, or from one layer of stacked caches
`[L, B, T, H_kv, D]` (the stacks and the layer are operands: no gathered or sliced copy in HBM) and runs split-K
flash decoding: the listed and recent rows are laid end to end as one list of "virtual keys", each split takes an
equal share of that list, and the per-split partial softmax results are combined in plain JAX afterwards. One
program handles all query heads of a KV head, padded to 16 rows because Triton dots need every dimension >= 16.

The new token comes in as the QKV projection gives it: all heads side by side ([H_q + 2 H_kv, D]) before RoPE,
with the RoPE tables at its position. Each program rotates its query heads and its key head in registers, split
0 attends the new token and writes its K/V row into the cache (the caches are aliased outputs): the draft step
spends no launch per layer on rotating, packing or scattering the new token.

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

from models.attention import NewTokens
from pallas_kernels._common import (
    NUM_SMS,
    TARGET_PROGRAMS,
    check_power_of_2,
    combine_splits,
    next_power_of_2,
    online_softmax_start,
    online_softmax_step,
    split_partial_outputs,
    store_split_partials,
)

_MAX_SPLITS = 32
_LONG_SELECTION = 4096
_KEYS_PER_LONG_SPLIT = 512


def _rope(x, cos, sin, swap_halves):
    """Rotate-half RoPE of rows x [R, D] at tables cos, sin [D] (models.attention.rope_tables), in x's dtype.
    The half swap is a product with a permutation matrix (exact: one nonzero term per output): Triton values
    cannot be sliced and concatenated."""
    swapped = plt.dot(x, swap_halves, allow_tf32=False)
    return (x.astype(jnp.float32) * cos[None, :] + swapped * sin[None, :]).astype(x.dtype)


def _first_row(x):
    """x[0] of rows x [R, D], as a masked sum: Triton values cannot be indexed."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[0])[:, None] == 0, x.astype(jnp.float32), 0.0), axis=0)


def sparse_decode_kernel(
    qkv_ref,  # [H_q + 2 H_kv, D] the new token's query, key and value heads, before RoPE
    cos_ref,  # [D] float32 RoPE tables at the new token's position
    sin_ref,  # [D]
    k_ref,  # [L, T, D] one KV head's keys, every layer's
    v_ref,  # [L, T, D]
    cache_layer_ref,  # [] the layer whose cache this launch reads and writes
    indices_ref,  # [L_s, K_max] every layer's selected rows (or one layer's)
    count_ref,  # [L_s] valid entries of each layer's indices
    layer_ref,  # [] the layer whose selection this launch reads
    recent_start_ref,  # []
    position_ref,  # [] the new token's row: the recent range is [recent_start, position]
    o_ref,  # [block_h, D] this split's unnormalised output
    l_ref,  # [block_h] this split's softmax denominator
    m_ref,  # [block_h] this split's logit maximum
    k_out_ref,  # [L, T, D] aliases k_ref
    v_out_ref,  # [L, T, D] aliases v_ref
    *,
    sm_scale: float,
    block_k: int,
    block_h: int,
    num_splits: int,
    group: int,
    num_kv_heads: int,
):
    head_dim = qkv_ref.shape[1]
    kv_head = pl.program_id(1)  # program_id(0) is the sequence, which the block specs select
    split = pl.program_id(2)
    cache_layer = cache_layer_ref[()]
    layer = layer_ref[()]
    count = count_ref[layer]
    recent_start = recent_start_ref[()]
    position = position_ref[()]
    # Cached keys only: the new token's row is written by this launch, so it is attended from its own K/V.
    num_keys = count + position - recent_start
    # Whole blocks per split so that only a split's last block is partial.
    keys_per_split = pl.cdiv(pl.cdiv(num_keys, num_splits), block_k) * block_k
    split_start = split * keys_per_split
    split_end = jnp.minimum(split_start + keys_per_split, num_keys)

    lane = jnp.arange(block_h)
    column = jnp.arange(head_dim)
    swap_halves = (column[:, None] == (column[None, :] + head_dim // 2) % head_dim).astype(qkv_ref.dtype)
    cos, sin = cos_ref[...], sin_ref[...]
    # Rows past the group repeat its last head (dots need 16 rows); their results are never stored.
    q = _rope(qkv_ref[kv_head * group + jnp.minimum(lane, group - 1), :], cos, sin, swap_halves)
    key_row = group * num_kv_heads + kv_head
    k_new = _first_row(_rope(qkv_ref[key_row + 0 * lane, :], cos, sin, swap_halves))
    v_new = qkv_ref[key_row + num_kv_heads, :].astype(jnp.float32)

    def block_start(block):
        return split_start + block * block_k

    def block_rows(block):
        """Cache rows of the block's virtual keys (row 0 for keys past the split)."""
        key = block_start(block) + jnp.arange(block_k)
        listed = key < count
        in_split = key < split_end
        listed_rows = plt.load(indices_ref.at[layer, pl.ds(block_start(block), block_k)], mask=listed, other=0)
        rows = jnp.where(listed, listed_rows, recent_start + key - count)
        # Lanes past the split read row 0 instead of being masked (interpret mode cannot discharge a masked
        # row gather); they all hit the same cached line and are masked out of the softmax below.
        return jnp.where(in_split, rows, 0)

    def body(block, carry):
        o_prev, m_prev, l_prev, rows = carry
        # Both gathers go out before any math that waits on them, and the next block's index load right after:
        # a program runs only a few blocks, so each serialised memory latency shows in the kernel's time.
        k = k_ref[cache_layer, rows, :]
        v = v_ref[cache_layer, rows, :]
        next_rows = block_rows(block + 1)
        in_split = block_start(block) + jnp.arange(block_k) < split_end
        (o_next, m_next, l_next), _ = online_softmax_step((o_prev, m_prev, l_prev), q, k, v, in_split, sm_scale)
        return o_next, m_next, l_next, next_rows

    num_blocks = pl.cdiv(jnp.maximum(split_end - split_start, 0), block_k)
    o, m, l, _ = lax.fori_loop(0, num_blocks, body, (*online_softmax_start(block_h, head_dim), block_rows(0)))

    # Split 0 also attends the new token (a one-key block, as a row-wise product: dots need 16 columns) and
    # writes its K/V row into the cache.
    new_logit = jnp.sum(q.astype(jnp.float32) * k_new[None, :], axis=1) * sm_scale
    m_with_new = jnp.maximum(m, new_logit)
    correction = jnp.exp(m - m_with_new)
    p_new = jnp.exp(new_logit - m_with_new)
    first = split == 0
    o = jnp.where(first, o * correction[:, None] + p_new[:, None] * v_new[None, :], o)
    l = jnp.where(first, l * correction + p_new, l)
    m = jnp.where(first, m_with_new, m)
    store_split_partials(o_ref, l_ref, m_ref, o, l, m, lane < group)

    @pl.when(first & (position < k_out_ref.shape[1]))
    def _():
        k_out_ref[cache_layer, pl.ds(position, 1), :] = k_new[None, :].astype(k_out_ref.dtype)
        v_out_ref[cache_layer, pl.ds(position, 1), :] = v_new[None, :].astype(v_out_ref.dtype)


def sparse_decode_batched(
    qkv,  # [B, H_q + 2 H_kv, D]
    rope_cos,  # [B, D]
    rope_sin,  # [B, D]
    k_cache,  # [L, B, T, H_kv, D] every layer's
    v_cache,  # [L, B, T, H_kv, D]
    cache_layer,  # [] int32
    indices,  # [L_s, B, K_max] the selections of every layer (L_s = 1: one layer's)
    counts,  # [L_s, B]
    selection_layer,  # [] int32
    recent_start,  # [B]
    position,  # [B]
    *,
    sm_scale: float,
    block_k: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """The launch on a (sequence, KV head, split) grid. The sequences are a grid axis of the call rather than a
    vmap: the caches are aliased outputs, and Pallas's batching moves an aliased operand's batch axis to the front
    (a transpose, a copy of every layer's cache) where these stacks hold it at axis 1."""
    batch, num_heads, head_dim = qkv.shape
    num_layers, _, capacity, num_kv_heads, _ = k_cache.shape
    num_q_heads = num_heads - 2 * num_kv_heads
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    kernel = functools.partial(
        sparse_decode_kernel, sm_scale=sm_scale, block_k=block_k, block_h=block_h, num_splits=num_splits,
        group=group, num_kv_heads=num_kv_heads,
    )
    scalar = pl.BlockSpec((), lambda b, h, s: ())
    per_sequence = lambda *shape: pl.BlockSpec((None, *shape), lambda b, h, s: (b,) + (0,) * len(shape))
    sequence_scalar = pl.BlockSpec((None,), lambda b, h, s: (b,))
    # One KV head of one sequence, every layer's rows: the kernel indexes the layer.
    head_rows = pl.BlockSpec((num_layers, None, capacity, None, head_dim), lambda b, h, s: (0, b, 0, h, 0))
    # Every layer's selections of one sequence, of which the kernel reads the layer's row.
    selections = pl.BlockSpec((indices.shape[0], None, indices.shape[2]), lambda b, h, s: (0, b, 0))
    layer_counts = pl.BlockSpec((counts.shape[0], None), lambda b, h, s: (0, b))
    split_specs, split_shapes = split_partial_outputs(num_splits, num_kv_heads, block_h, head_dim)
    out_specs = [pl.BlockSpec((None, *spec.block_shape), lambda b, h, s, index=spec.index_map: (b, *index(h, s)))
                 for spec in split_specs] + [head_rows, head_rows]
    out_shape = [jax.ShapeDtypeStruct((batch, *shape.shape), shape.dtype) for shape in split_shapes]
    out_shape += [jax.ShapeDtypeStruct(cache.shape, cache.dtype) for cache in (k_cache, v_cache)]
    o, l, m, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            per_sequence(num_heads, head_dim),
            per_sequence(head_dim),
            per_sequence(head_dim),
            head_rows,
            head_rows,
            # The layers as operands, so that one program serves every layer (a static layer made as many
            # Triton kernels to lower and compile as the model has layers).
            scalar,
            selections,
            layer_counts,
            scalar,
            sequence_scalar,
            sequence_scalar,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={3: 3, 4: 4},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_decode_attention",
    )(qkv, rope_cos.astype(jnp.float32), rope_sin.astype(jnp.float32), k_cache, v_cache, cache_layer, indices,
      counts, selection_layer, recent_start, position)
    # Partials [B, splits, H_kv, block_h(, D)]: the splits first for combine_splits.
    o, l, m = (jnp.moveaxis(x[:, :, :, :group], 1, 0) for x in (o, l, m))
    out = combine_splits(o, l, m)  # [B, H_kv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).astype(qkv.dtype), k_cache, v_cache


def default_launch(batch: int, num_kv_heads: int, k_max: int, head_dim: int, block_k: int | None = None):
    """(block_k, num_splits) where not given.

    Enough (sequence, KV head) pairs to give every SM one (large batches, head dim 64): two splits of 128-key
    blocks, which measured 10.0 us against 11.9 us for 64-key blocks in 4 splits (SmolLM2 shapes, B = 64, T = 8K,
    benchmarks/results/kernels-tune-2026-11-30-053038.json).

    Long selections (k_max >= 4096, contexts past ~58K at 7 %): 128-key blocks, splits of at least 512 keys but
    enough of them for two programs per SM. At T = 128K this measured 24.5 us against 31.1 us for the short rule
    at SmolLM2 B = 8 and 90.8 against 101 us at Qwen3-8B B = 8 (kernels-tune-2026-11-30-094612.json,
    kernels-2026-11-30-081546.json); SmolLM2 B = 1 took 12.5 us in 32 such splits (081546) against 13.9 us, and
    Qwen3-8B B = 1 20.5 us in 32 splits of 128-key blocks (kernels-2026-11-30-103114.json) against 22.1 us for
    64-key blocks (081546, before the kernel's loads were reordered).

    Otherwise (few pairs, short selections: the decode loop's regime up to 8K contexts): 64-key blocks and enough
    splits for about TARGET_PROGRAMS programs, but no more splits than blocks of selected keys. Sweeps of the
    kernel alone favour fewer, larger splits there too (kernels-tune-2026-11-30-081015.json), but inside the
    decode loop that launch made a Vegas iteration slower, 10.33 -> 11.47 ms at batch 1 and 6.77 -> 7.16 ms at
    batch 8 (random SmolLM2 weights, 4K prompt; step-overhead-2026-11-30-{B-oldlaunch,A-new}.json)."""
    pairs = batch * num_kv_heads
    if pairs >= NUM_SMS and head_dim <= 64:
        block_k, wanted = block_k or 128, 2
    elif k_max >= _LONG_SELECTION:
        most_full_splits = 1 << ((k_max // _KEYS_PER_LONG_SPLIT).bit_length() - 1)
        block_k, wanted = block_k or 128, max(next_power_of_2(pl.cdiv(2 * NUM_SMS, pairs)), most_full_splits)
    else:
        block_k, wanted = block_k or 64, next_power_of_2(pl.cdiv(TARGET_PROGRAMS, pairs))
    return block_k, max(1, min(wanted, _MAX_SPLITS, pl.cdiv(k_max, block_k)))


def sparse_decode_attention(
    qkv: jax.Array,  # [B, H_q + 2 H_kv, D] the new token's query, key and value heads, before RoPE
    rope_cos: jax.Array,  # [B, D] float32 RoPE tables at the new token's position (models.attention.rope_tables)
    rope_sin: jax.Array,  # [B, D]
    k_cache: jax.Array,  # [B, T, H_kv, D], or [L, B, T, H_kv, D] with `layer`
    v_cache: jax.Array,  # like k_cache
    indices: jax.Array,  # [B, K_max] int32, or [L, B, K_max] with `layer`
    counts: jax.Array,  # [B] int32, or [L, B] with `layer`
    recent_start: jax.Array,  # [B] int32
    position: jax.Array,  # [B] int32 the new token's position
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax attention of one new token per sequence over selected cache rows, a recent range and itself, with
    RoPE applied to its query and key heads; the new token's K/V row is written into the caches in the same launch
    (in place where the caller's jit donates them or, as in the decode loop, carries them).

    Sequence b attends to rows `indices[b, :counts[b]]` (distinct, all < recent_start[b]; entries past counts[b]
    are never read), rows `[recent_start[b], position[b])`, and the new token, whose rotated key and value are
    stored at row position[b] (dropped if position[b] >= T). With `layer`, the caches may be every layer's
    (stacked [L, B, T, H_kv, D], as models.kv_cache.KVCache keeps them), of which the kernel reads and writes layer
    `layer` in place (the stacks are operands and aliased outputs, never sliced), and indices and counts may be
    every layer's (stacked, as the decode loop keeps them), of which it reads layer `layer`'s; the layer is an
    operand, so every layer's call is one traced, lowered and compiled program.
    Returns (out [B, H_q, D] in qkv's dtype, k_cache, v_cache); accumulation is float32.

    block_k: keys per inner step (power of two >= 16). num_splits: split-K parallelism per (sequence, KV head).
    None for either: see default_launch. num_warps, num_stages: Triton launch parameters.
    """
    stacked_caches, stacked_selections = k_cache.ndim == 5, indices.ndim == 3
    if layer is None and (stacked_caches or stacked_selections):
        raise ValueError("stacked caches or selections need the layer to read")
    if stacked_selections and isinstance(layer, int) and not 0 <= layer < indices.shape[0]:
        raise ValueError(f"layer {layer} out of range for {indices.shape[0]} stacked selections")  # traced: unchecked
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    out, k_out, v_out = _sparse_decode_attention(
        qkv, rope_cos, rope_sin, k_cache if stacked_caches else k_cache[None],
        v_cache if stacked_caches else v_cache[None], layer if stacked_caches else zero,
        indices if stacked_selections else indices[None], counts if stacked_selections else counts[None],
        layer if stacked_selections else zero, recent_start, position,
        sm_scale=sm_scale, block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    return (out, k_out, v_out) if stacked_caches else (out, k_out[0], v_out[0])


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_k", "num_splits", "num_warps", "num_stages", "interpret"))
def _sparse_decode_attention(qkv, rope_cos, rope_sin, k_cache, v_cache, cache_layer, indices, counts,
                             selection_layer, recent_start, position, *, sm_scale, block_k, num_splits, num_warps,
                             num_stages, interpret):
    """sparse_decode_attention on stacked caches [L, B, T, H_kv, D] and selections [L_s, B, K_max], the layers
    int32 operands."""
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5 or qkv.ndim != 3 or k_cache.shape[1] != qkv.shape[0]:
        raise ValueError(f"caches must both be [(L,) B, T, H_kv, D] and qkv [B, H_q + 2 H_kv, D]; got "
                         f"{k_cache.shape}, {v_cache.shape}, qkv {qkv.shape}")
    batch, num_heads, head_dim = qkv.shape
    num_kv_heads = k_cache.shape[3]
    num_q_heads = num_heads - 2 * num_kv_heads
    if k_cache.shape[4] != head_dim or num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"qkv {qkv.shape} does not hold query heads and one key and value head per KV head of "
                         f"caches {k_cache.shape}")
    # Every Triton load must have a power-of-two number of elements, and dots need dims >= 16.
    check_power_of_2("head_dim", head_dim, 16)
    if rope_cos.shape != (batch, head_dim) or rope_sin.shape != rope_cos.shape:
        raise ValueError(f"rope_cos and rope_sin must be {(batch, head_dim)}, got {rope_cos.shape} and "
                         f"{rope_sin.shape}")
    for name, value in (("recent_start", recent_start), ("position", position)):
        if value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {value.shape}")
    if indices.ndim != 3 or indices.shape[1] != batch or counts.shape != indices.shape[:2]:
        raise ValueError(f"indices must be [B, K_max] (or [L, B, K_max] with layer), counts [B] ([L, B]); got "
                         f"{indices.shape[1:]} and {counts.shape[1:]} (stacked: {indices.shape}, {counts.shape})")
    if block_k is None or num_splits is None:
        block_k, auto_splits = default_launch(batch, num_kv_heads, indices.shape[2], head_dim, block_k)
        num_splits = num_splits or auto_splits
    check_power_of_2("block_k", block_k, 16)
    as_int32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    return sparse_decode_batched(
        qkv, rope_cos, rope_sin, k_cache, v_cache, cache_layer, as_int32(indices), as_int32(counts),
        selection_layer, as_int32(recent_start), as_int32(position),
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_recent"))
def sparse_decode_attention_reference(
    qkv, rope_cos, rope_sin, k_cache, v_cache, indices, counts, recent_start, position, *, sm_scale=None,
    max_recent=None,
):
    """XLA twin of sparse_decode_attention: rotates q and k as the model does, writes the new rows with a
    scatter, then gathers the selected rows with take_along_axis.

    The recent range (new token included) is gathered too when its length is known to be at most the static
    max_recent (the decode loop knows it: accepted drafts plus this iteration's drafts); with max_recent=None it
    is read as a mask over the whole cache, which is exact for any length but streams every row.
    """
    batch, num_heads, head_dim = qkv.shape
    capacity, num_kv_heads = k_cache.shape[1:3]
    num_q_heads = num_heads - 2 * num_kv_heads
    q, k_new, v_new = NewTokens(qkv[:, None], rope_cos[:, None], rope_sin[:, None], num_kv_heads).rotated()
    q, k_new, v_new = q[:, 0], k_new[:, 0], v_new[:, 0]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    batch_rows = jnp.arange(batch)[:, None]
    k_cache = k_cache.at[batch_rows, position[:, None]].set(k_new[:, None].astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[batch_rows, position[:, None]].set(v_new[:, None].astype(v_cache.dtype), mode="drop")
    recent_end = position + 1
    listed_valid = jnp.arange(indices.shape[1])[None, :] < counts[:, None]
    if max_recent is None:
        k, v = k_cache, v_cache
        t = jnp.arange(capacity)[None, :]
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
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype), k_cache, v_cache
