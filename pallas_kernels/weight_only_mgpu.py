"""Weight-only quantized products for decode shapes on Mosaic GPU (Hopper): x [M, K] (bf16, M <= 16 rows) times a
weight stored transposed, w^T [N, K] in signed int4 or int8 codes with a scale and an offset per group of K
positions, so that w[k, n] = q[n, k] * scale[k // group, n] + offset[k // group, n].

The product is computed transposed, out^T [N, R] = w^T [N, K] @ x^T [K, R] (R: the rows padded to 8 or 16), so
the weight is the tensor-core product's first operand and x the small second one (wgmma's N, as narrow as 8):
TMA streams blocks of codes into shared memory, a pipeline of `stages` blocks deep; the warpgroup loads each
group's codes into registers in the tensor cores' operand layout, converts them to bf16 there (CUTLASS's
prmt/lop3 conversion for int4) and applies its scale and offset per row (one bf16 fused multiply-add per two
weights), and multiplies without the codes ever passing through shared memory as floats. That is the design of
the fast mixed-precision GEMV kernels (Marlin, Machete); the Triton-lowered kernels of weight_only_matmul.py
convert in a blocked layout and shuffle each tile through shared memory into the dot's layout, and issue about
four times the instructions a weight (1.0 TB/s of int4 codes on the H200, 2026-12-04).

Each program owns `block_n` output features and a share of K (split-K, so that narrow weights still occupy every
SM); the splits' partial products are summed in float32 by XLA after the kernel. The dequantized weight is
rounded to bf16 before the product (as models.quantized's "dequantized" formulation does); drafts are verified
by the model's own weights, so this only moves acceptance, within bf16 rounding of each weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

MAX_ROWS = 16  # wgmma's N: x^T is padded to 8 or 16 columns
WGMMA_M = 64  # rows of the weight one wgmma instruction multiplies


def padded_rows(m: int) -> int:
    return 8 if m <= 8 else 16


def _swizzled(block_cols: int, bits: int):
    """(transforms, swizzle in bytes) for a [rows, block_cols] block of `bits`-bit values in shared memory."""
    swizzle = plgpu.find_swizzle(block_cols * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)), swizzle


@functools.partial(jax.jit, static_argnames=("group", "block_n", "block_k", "splits", "stages", "out_dtype",
                                             "interpret"))
def weight_only_matmul_mgpu(x, wt, scale, offset, *, group: int, block_n: int = 128, block_k: int = 256,
                            splits: int = 1, stages: int = 4, out_dtype=None, interpret: bool = False):
    """x [M, K] bf16 @ w -> [M, N] in out_dtype (default x's). wt [N, K] int4 or int8 codes (signed); scale and
    offset [K / group, N] bf16 (offset may be None). block_k: K positions a pipeline step loads, whole groups
    or a part of one; splits: how many programs share each block of features along K."""
    m, k = x.shape
    n, k2 = wt.shape
    bits = jax.dtypes.itemsize_bits(wt.dtype)
    if k2 != k or bits not in (4, 8) or m > MAX_ROWS:
        raise ValueError(f"x {x.shape} and codes {wt.shape} ({wt.dtype}): K must match, 4- or 8-bit codes, "
                         f"at most {MAX_ROWS} rows")
    step_group = min(group, block_k)  # K positions under one scale within a step
    if block_k % step_group or group % step_group or k % (splits * block_k) or n % block_n or block_n % WGMMA_M:
        raise ValueError(f"K = {k}, N = {n}, group {group} do not tile into {splits} splits of "
                         f"{block_k} x {block_n} blocks")
    rows = padded_rows(m)
    out_dtype = out_dtype or x.dtype
    xp = jnp.zeros((rows, k), jnp.bfloat16).at[:m].set(x.astype(jnp.bfloat16))
    if offset is None:
        offset = jnp.zeros_like(scale)
    steps = k // splits // block_k
    groups_per_step = block_k // step_group
    w_transforms, _ = _swizzled(step_group, bits)
    x_transforms, _ = _swizzled(step_group, 16)
    scale_rows = max(1, block_k // group)  # scale rows a step reads (a step inside one group reads one)

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, out_gmem, out_smem, a_smem):
        feature_block, split = lax.axis_index("n"), lax.axis_index("split")
        features = pl.ds(feature_block * block_n, block_n)
        k_steps = pl.ds(split * steps * block_k, steps * block_k)

        def compute(acc_ref):
            def step(idx, w_smem, x_smem, s_smem, o_smem):
                for j in range(groups_per_step):
                    cols = pl.ds(j * step_group, step_group)
                    a = w_smem.at[:, cols][...].astype(jnp.bfloat16)
                    srow = j * step_group // group if block_k >= group else 0
                    s = lax.broadcast_in_dim(s_smem[srow, :], (block_n, step_group), (0,))
                    o = lax.broadcast_in_dim(o_smem[srow, :], (block_n, step_group), (0,))
                    a = a * s + o
                    if interpret:  # GPU interpret mode multiplies shared memory only
                        a_smem[...] = a
                        plgpu.commit_smem()
                        a = a_smem
                    plgpu.wgmma(acc_ref, a, x_smem.at[:, cols].transpose((1, 0)))
                plgpu.wgmma_wait(0)

            w_spec = plgpu.BlockSpec((block_n, block_k), lambda i: (0, i), transforms=w_transforms)
            x_spec = plgpu.BlockSpec((rows, block_k), lambda i: (0, i), transforms=x_transforms)
            g_spec = plgpu.BlockSpec((scale_rows, block_n),
                                     lambda i: (i * block_k // group // scale_rows, 0))
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=[w_spec, x_spec, g_spec, g_spec],
                                max_concurrent_steps=min(stages, steps))(
                w_gmem.at[features, k_steps], x_gmem.at[:, k_steps],
                s_gmem.at[pl.ds(split * steps * block_k // group, max(1, steps * block_k // group)), features],
                o_gmem.at[pl.ds(split * steps * block_k // group, max(1, steps * block_k // group)), features])
            out_smem[...] = acc_ref[...]

        pl.run_scoped(compute, plgpu.ACC((block_n, rows), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, features])
        plgpu.wait_smem_to_gmem(0)

    partial = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
        grid=(n // block_n, splits),
        grid_names=("n", "split"),
        scratch_types=[plgpu.SMEM((block_n, rows), jnp.float32),
                       plgpu.SMEM((block_n, step_group), jnp.bfloat16, transforms=_swizzled(step_group, 16)[0])
                       if interpret else None],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, wt, scale.astype(jnp.bfloat16), offset.astype(jnp.bfloat16))
    return partial.sum(axis=0)[:, :m].T.astype(out_dtype)


def weight_only_matmul_mgpu_reference(x, wt, scale, offset, *, group: int):
    """The same product in float32 jnp, the weight dequantized exactly (no bf16 rounding)."""
    w = wt.astype(jnp.float32).T.reshape(-1, group, wt.shape[0]) * scale.astype(jnp.float32)[:, None]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[:, None]
    return jnp.dot(x.astype(jnp.float32), w.reshape(-1, wt.shape[0]),
                   precision=lax.Precision.HIGHEST).astype(x.dtype)
