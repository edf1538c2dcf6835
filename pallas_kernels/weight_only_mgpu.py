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

from pallas_kernels._common import stacked_layer

MAX_ROWS = 16  # wgmma's N: x^T is padded to 8 or 16 columns
WGMMA_M = 64  # rows of the weight one wgmma instruction multiplies


def padded_rows(m: int) -> int:
    return 8 if m <= 8 else 16


def _swizzled(block_cols: int, bits: int):
    """The transforms of a [rows, block_cols] block of `bits`-bit values in shared memory (tiled, swizzled)."""
    swizzle = plgpu.find_swizzle(block_cols * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


@functools.partial(jax.jit, static_argnames=("group", "zero_point", "block_n", "block_k", "splits", "stages",
                                             "out_dtype", "interpret"))
def weight_only_matmul_mgpu(x, wt, scale, offset=None, layer=None, *, group: int, zero_point: int = 0,
                            block_n: int = 128, block_k: int = 256, splits: int = 1, stages: int = 4,
                            out_dtype=None, interpret: bool = False):
    """x [M, K] @ w -> [M, N] in out_dtype (default x's), x rounded to bf16. wt [N, K] int4 or int8 codes
    (signed), w[k, n] = (wt[n, k] + zero_point) * scale[k // group, n] + offset[k // group, n]; scale and offset
    [K / group, N] (offset may be None). layer (int32 []): wt, scale and offset hold every layer's weight stacked
    [L, ...] and the product is layer `layer`'s, which the kernel reads in place (its TMA copies start at the
    layer). block_k: K positions a pipeline step loads, whole groups or a part of one; splits: how many programs
    share each block of features along K; stages: blocks in flight."""
    m, k = x.shape
    (wt, scale, offset), layer = stacked_layer(layer, wt, scale, offset)
    num_layers, n, k2 = wt.shape
    bits = jax.dtypes.itemsize_bits(wt.dtype)
    if k2 != k or bits not in (4, 8) or m > MAX_ROWS:
        raise ValueError(f"x {x.shape} and codes {wt.shape} ({wt.dtype}): K must match, 4- or 8-bit codes, "
                         f"at most {MAX_ROWS} rows")
    step_group = min(group, block_k)  # K positions under one scale within a step
    if (k % group or block_k % step_group or group % step_group or k % (splits * block_k) or n % block_n
            or block_n % WGMMA_M):
        raise ValueError(f"K = {k}, N = {n}, group {group} do not tile into {splits} splits of "
                         f"{block_k} x {block_n} blocks")
    if scale.shape != (num_layers, k // group, n) or (offset is not None and offset.shape != scale.shape):
        raise ValueError(f"scale {scale.shape[1:]} (offset {None if offset is None else offset.shape[1:]}) must be "
                         f"[K / group, N] = [{k // group}, {n}] (layers alike)")
    rows = padded_rows(m)
    xp = jnp.zeros((rows, k), jnp.bfloat16).at[:m].set(x.astype(jnp.bfloat16))
    shifted = offset is not None or zero_point != 0  # the dequantized weight has an additive term
    steps = k // splits // block_k
    w_transforms, x_transforms = _swizzled(step_group, bits), _swizzled(step_group, 16)
    scale_rows = max(1, block_k // group)  # rows of the scales a step reads (a step inside one group reads one)

    # The kernel reads scales and offsets in bf16. Others (float32 models') are converted here, a buffer made per
    # call either way: of the layer's alone, a stack of one (whose layer 0 the kernel reads; the codes' is `layer`).
    groups, group_layer = (scale,) if offset is None else (scale, offset), layer
    if scale.dtype != jnp.bfloat16:
        groups = tuple(lax.dynamic_index_in_dim(g, layer).astype(jnp.bfloat16) for g in groups)
        group_layer = jnp.int32(0)
    layers = jnp.stack([layer, group_layer])  # the layer the kernel reads of the codes, and of the groups
    multiply = functools.partial(_multiply_step, block_k=block_k, step_group=step_group, group=group,
                                 shifted=shifted, zero_point=zero_point, interpret=interpret)
    def kernel(x_gmem, layers_gmem, w_gmem, s_gmem, o_gmem, out_gmem, out_smem, a_smem):
        feature_block, split = lax.axis_index("n"), lax.axis_index("split")
        code_layer, group_layer = layers_gmem[0], layers_gmem[1]
        features = pl.ds(feature_block * block_n, block_n)
        positions = pl.ds(split * steps * block_k, steps * block_k)
        groups_of_split = pl.ds(split * steps * block_k // group, max(1, steps * block_k // group))

        def compute(acc_ref):
            def step(_, w_smem, x_smem, s_smem, *o_smem):
                multiply(acc_ref, w_smem, x_smem, s_smem, o_smem[0] if o_smem else None, a_smem)

            w_spec = plgpu.BlockSpec((block_n, block_k), lambda i: (0, i), transforms=w_transforms)
            x_spec = plgpu.BlockSpec((rows, block_k), lambda i: (0, i), transforms=x_transforms)
            g_spec = plgpu.BlockSpec((scale_rows, block_n), lambda i: (i * block_k // group // scale_rows, 0))
            groups = [s_gmem] + ([] if o_gmem is None else [o_gmem])
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=[w_spec, x_spec] + [g_spec] * len(groups),
                                max_concurrent_steps=min(stages, steps))(
                w_gmem.at[code_layer, features, positions], x_gmem.at[:, positions],
                *(g.at[group_layer, groups_of_split, features] for g in groups))
            out_smem[...] = acc_ref[...]

        pl.run_scoped(compute, plgpu.ACC((block_n, rows), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, features])
        plgpu.wait_smem_to_gmem(0)

    def without_offset(x_gmem, layers_gmem, w_gmem, s_gmem, out_gmem, out_smem, a_smem):
        kernel(x_gmem, layers_gmem, w_gmem, s_gmem, None, out_gmem, out_smem, a_smem)

    partial = plgpu.kernel(
        kernel if offset is not None else without_offset,
        out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
        grid=(n // block_n, splits),
        grid_names=("n", "split"),
        scratch_types=[plgpu.SMEM((block_n, rows), jnp.float32),
                       plgpu.SMEM((block_n, step_group), jnp.bfloat16, transforms=x_transforms)
                       if interpret else None],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="weight_only_matmul_mgpu",
    )(xp, layers, wt, *groups)
    return partial.sum(axis=0)[:, :m].T.astype(out_dtype or x.dtype)


def _multiply_step(acc_ref, w_smem, x_smem, s_smem, o_smem, a_smem, *, block_k, step_group, group, shifted,
                   zero_point, interpret):
    """One pipeline step: a block of codes dequantized in registers (scale and offset per
    row, one bf16 rounding) and multiplied into acc_ref by x's block, transposed."""
    for j in range(block_k // step_group):
        cols = pl.ds(j * step_group, step_group)
        row = j * step_group // group
        a = w_smem.at[:, cols][...].astype(jnp.bfloat16)
        s = s_smem[row, :].astype(jnp.float32)
        a = a * lax.broadcast_in_dim(s.astype(jnp.bfloat16), a.shape, (0,))
        if shifted:  # (q + zero_point) s + o = q s + (zero_point s + o), one rounding to bf16
            o = zero_point * s + (o_smem[row, :].astype(jnp.float32) if o_smem is not None else 0.0)
            a = a + lax.broadcast_in_dim(o.astype(jnp.bfloat16), a.shape, (0,))
        if interpret:  # GPU interpret mode multiplies shared memory only
            a_smem[...] = a
            plgpu.commit_smem()
            a = a_smem
        plgpu.wgmma(acc_ref, a, x_smem.at[:, cols].transpose((1, 0)))
    plgpu.wgmma_wait(0)


def weight_only_matmul_mgpu_reference(x, wt, scale, offset=None, layer=None, *, group: int, zero_point: int = 0):
    """The same product in float32 jnp, the weight dequantized exactly (no bf16 rounding); with a layer, that
    layer's of stacked wt, scale and offset."""
    if layer is not None:
        wt, scale, offset = (None if a is None else a[layer] for a in (wt, scale, offset))
    codes = wt.astype(jnp.float32).T + zero_point
    w = codes.reshape(-1, group, wt.shape[0]) * scale.astype(jnp.float32)[:, None]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[:, None]
    return jnp.dot(x.astype(jnp.float32), w.reshape(-1, wt.shape[0]),
                   precision=lax.Precision.HIGHEST).astype(x.dtype)
