"""Weight-only quantized GEMM for draft steps: x [M, K] (M small: the batch) times int8 or packed int4 weights
[K, N] with a scale per group of input positions (one group: per output channel), dequantized in registers so that
HBM carries only the integer weights.

Layouts: int8 values [K, N]; int4 values packed two a byte as uint8 [K / 2, N], split-half within each group of
`group` input positions: byte row j of group g holds row g * group + j in its low nibble and row
g * group + group / 2 + j in its high nibble, each as q + 8 in [0, 15] (`pack_int4`). Then one group's product is
two dots, x[:, first half] @ low nibbles + x[:, second half] @ high nibbles, and no nibble ever needs
interleaving. Scales [G, N]; an offset [G, N] (asymmetric int4) adds (sum of x over each group) @ offset, a
[M, G] x [G, N] product done by XLA next to the kernel.

Grid: (N / block_n, splits): each program reads a strip of block_n output channels over K / splits input
positions, a group at a time, and writes its partial [M, block_n] (only the M real rows; x is padded to 16 rows,
the smallest Triton dot); the partials are summed by XLA. Splitting K gives a launch enough programs at decode
shapes (4096 x 4096 is 32 strips of 128). Triton backend; on CPU interpret=True.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import TARGET_PROGRAMS, next_power_of_2

MIN_ROWS = 16  # Triton dots need every dimension >= 16
MAX_BLOCK_N = 128


def pack_int4(values: jax.Array, group: int) -> jax.Array:
    """int4 (or int8 in [-8, 7]) values [K, N] -> uint8 [K / 2, N] in the split-half layout (module docstring)."""
    k, n = values.shape
    codes = (values.astype(jnp.int32) + 8).astype(jnp.uint8).reshape(k // group, 2, group // 2, n)
    return (codes[:, 0] | (codes[:, 1] << 4)).reshape(k // 2, n)


def unpack_int4(packed: jax.Array, group: int) -> jax.Array:
    """uint8 [K / 2, N] in the split-half layout -> int8 values [K, N] in [-8, 7]."""
    half, n = packed.shape
    p = packed.reshape(half * 2 // group, 1, group // 2, n)
    codes = jnp.concatenate([p & 0x0F, p >> 4], axis=1)
    return (codes.astype(jnp.int8) - 8).reshape(half * 2, n)


def _block_n(n: int) -> int:
    block = MAX_BLOCK_N
    while n % block:
        block //= 2
    if block < 16:
        raise ValueError(f"the output width {n} is not a multiple of 16")
    return block


def _per_channel_chunk(k: int) -> int:
    """Input positions per loop step with per-channel scales: the largest power of two up to 128 dividing K."""
    chunk = 128
    while k % chunk and chunk > 16:
        chunk //= 2
    return chunk


def _splits(k: int, group: int, strips: int) -> int:
    """Splits of K: enough programs for the launch, each a whole number of groups."""
    groups = k // group
    want = max(1, TARGET_PROGRAMS // strips)
    return max(s for s in range(1, groups + 1) if groups % s == 0 and s <= want)


def _kernel(x_ref, w_ref, scale_ref, o_ref, *, bits: int, group: int, groups_per_split: int, rows: int,
            per_channel: bool):
    split = pl.program_id(1)
    block_n = o_ref.shape[-1]
    dtype = x_ref.dtype

    def one_group(i, acc):
        g = split * groups_per_split + i
        k0 = g * group
        if bits == 8:
            w = w_ref[pl.ds(k0, group), :].astype(dtype)
            part = plt.dot(x_ref[:, pl.ds(k0, group)], w, allow_tf32=False)
        else:
            packed = w_ref[pl.ds(g * (group // 2), group // 2), :].astype(jnp.int32)
            low = ((packed & 0x0F) - 8).astype(dtype)
            high = ((packed >> 4) - 8).astype(dtype)
            part = (plt.dot(x_ref[:, pl.ds(k0, group // 2)], low, allow_tf32=False)
                    + plt.dot(x_ref[:, pl.ds(k0 + group // 2, group // 2)], high, allow_tf32=False))
        if per_channel:
            return acc + part
        return acc + part * scale_ref[g, :].astype(jnp.float32)[None, :]

    acc = jax.lax.fori_loop(0, groups_per_split, one_group, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    if per_channel:
        acc = acc * scale_ref[0, :].astype(jnp.float32)[None, :]
    real = jnp.arange(x_ref.shape[0]) < rows
    plt.store(o_ref, acc, mask=real[:, None])


@functools.partial(jax.jit, static_argnames=("bits", "group", "splits", "num_warps", "interpret"))
def weight_only_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None = None, *,
                       bits: int, group: int | None = None, splits: int | None = None, num_warps: int = 4,
                       interpret: bool = False) -> jax.Array:
    """x [M, K] times the weight [K, N] -> float32 [M, N]. values: int8 [K, N] (bits 8) or uint8 [K / 2, N]
    (bits 4, `pack_int4`); scale [G, N] with G = K / group (group None: K, per output channel; int8 only);
    offset [G, N] or None."""
    m, k = x.shape
    n = values.shape[1]
    per_channel = group is None
    if per_channel and bits != 8:
        raise ValueError("per-channel scales are for int8 weights; int4 weights need groups")
    chunk = _per_channel_chunk(k) if per_channel else group  # per channel: one scale at the end
    if k % chunk or chunk % 16 or (bits == 4 and chunk % 32):
        raise ValueError(f"K {k} must be a multiple of the group {chunk}, itself a multiple of 16 (int4: 32)")
    if values.shape[0] != (k if bits == 8 else k // 2) or scale.shape != (1 if per_channel else k // group, n):
        raise ValueError(f"weights {values.shape} / scales {scale.shape} do not fit x {x.shape} in {bits} bits")
    block_n = _block_n(n)
    strips = n // block_n
    splits = splits or _splits(k, chunk, strips)
    padded = max(MIN_ROWS, next_power_of_2(m))
    xp = jnp.zeros((padded, k), x.dtype).at[:m].set(x)
    kernel = functools.partial(_kernel, bits=bits, group=chunk, groups_per_split=k // chunk // splits, rows=m,
                               per_channel=per_channel)
    partials = pl.pallas_call(
        kernel,
        grid=(strips, splits),
        in_specs=[
            pl.BlockSpec((padded, k), lambda j, s: (0, 0)),
            pl.BlockSpec((values.shape[0], block_n), lambda j, s: (0, j)),
            pl.BlockSpec((scale.shape[0], block_n), lambda j, s: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, padded, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, padded, n), jnp.float32),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
    )(xp, values, scale)
    y = partials[:, :m].sum(axis=0)
    if offset is not None:
        sums = x.astype(jnp.float32).reshape(m, -1, group).sum(-1)
        y = y + sums @ offset.astype(jnp.float32)
    return y


def weight_only_matmul_reference(x: jax.Array, values: jax.Array, scale: jax.Array, offset: jax.Array | None = None,
                                 *, bits: int, group: int | None = None) -> jax.Array:
    """The same product in plain jnp, float32: the weight dequantized, then one dot."""
    ints = unpack_int4(values, group) if bits == 4 else values
    k, n = ints.shape
    g = k if group is None else group
    w = ints.astype(jnp.float32).reshape(k // g, g, n) * scale.astype(jnp.float32)[:, None]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[:, None]
    return jnp.dot(x.astype(jnp.float32), w.reshape(k, n), precision=jax.lax.Precision.HIGHEST)
