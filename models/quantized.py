"""Weight-only quantized linear weights (int8, int4) and the product of activations with them.

A weight W of shape [*in, *out] (its leading `in_ndim` axes contracted, as every projection in models.decoder)
is stored as a `QuantizedWeight`: integer codes for K = prod(in) input positions (the input axes flattened), and
per group of g = K / G consecutive input positions a scale and optionally an offset [G, *out], so that

    W[k, o] = scale[k // g, o] * code[k, o] + offset[k // g, o]        (no offset: 0)

- int8: codes int8 [K, *out], symmetric per output channel here (G = 1), or GGUF's Q8_0 groups of 32.
- int4: codes 0..15 packed two a byte, uint8 [K / 2, *out], split-half within each group: byte row
  G_i * g / 2 + j holds input position G_i * g + j in its low nibble and G_i * g + g / 2 + j in its high nibble.
  That is GGUF's own Q4_0 / Q4_1 block layout for g = 32 (so a file's blocks are taken as they are), the layout
  of the Pallas kernel (pallas_kernels/weight_only_matmul.py), and a split of the input axis over devices keeps
  whole groups, packed bytes included. Quantized here: asymmetric, 16 levels from the group's min to its max.

Groups run along the input axis only, so quantizing commutes with splitting the output axis over devices
(column-parallel), and a row-parallel split keeps whole groups on each device as long as the group size divides
the local input size (`group_size_for`). Scales and offsets are stored in the model's dtype.

`quantized_matmul` is the one place that multiplies by a quantized weight: XLA's formulations, or the weight's
`kernel` (a product function the engine attaches when kernels run), without touching the model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

PRECISIONS = ("bf16", "int8", "int4")  # bf16: the model's own (unquantized) weights
INT4_GROUP_SIZES = (128, 64, 32)  # preferred first: fewer scales to read; at least 32 (two dot-sized halves)
INT8_MAX, INT4_LEVELS = 127, 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    values: jax.Array  # int8 codes [K, *out], or int4 codes packed as uint8 [K / 2, *out]; or those in words
    scale: jax.Array  # [G, *out]
    offset: jax.Array | None  # [G, *out], or None (symmetric)
    in_ndim: int = dataclasses.field(default=1, metadata=dict(static=True))  # leading axes of W contracted
    # kernel(x [M, K], weight, preferred_element_type) -> [M, prod(out)]: the product in place of XLA's.
    kernel: Callable | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Codes of this width held four rows an int32 word ([rows / 4, *out], byte j of word r holding row 4r + j: the
    # layout the weight-only kernel's integer path reads in one load; in_words), or None: one row a byte.
    word_bits: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # Codes held transposed, [prod(out), K], signed: int8 as they are, int4 as jnp.int4 holding code - 8 (the
    # scale and offset unchanged, so W = (value + 8) scale + offset): the layout of the Mosaic GPU kernel
    # (pallas_kernels/weight_only_mgpu.py), whose tensor-core operand is a block of a weight's output features
    # along K; in_transposed.
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # int32 [], or None: the arrays hold every layer's weight stacked [L, ...] and this is layer `layer`'s (how a
    # scanned layer body sees the draft tree's layers). A kernel takes the whole stack and the layer and reads the
    # layer in place: a slice handed to a kernel would be a copy of the weight per layer and draft pass.
    layer: jax.Array | None = None

    @property
    def bits(self) -> int:
        if self.transposed:
            return 4 if self.values.dtype == jnp.int4 else 8
        return self.word_bits or (4 if self.values.dtype == jnp.uint8 else 8)

    @property
    def _layer_axes(self) -> int:
        return 0 if self.layer is None else 1

    @property
    def input_size(self) -> int:
        shape = self.values.shape[self._layer_axes:]
        if self.transposed:
            return shape[1]
        return shape[0] * (4 if self.word_bits else 1) * (2 if self.bits == 4 else 1)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.scale.shape[self._layer_axes + 1:]

    @property
    def groups(self) -> int:
        return self.scale.shape[self._layer_axes]

    def one_layer(self) -> QuantizedWeight:
        """The weight with arrays of its layer alone (sliced out of the stack, for XLA's products); itself when it
        holds one layer."""
        if self.layer is None:
            return self
        take = lambda a: None if a is None else lax.dynamic_index_in_dim(a, self.layer, keepdims=False)  # noqa: E731
        return dataclasses.replace(self, values=take(self.values), scale=take(self.scale), offset=take(self.offset),
                                   layer=None)

    @property
    def group_size(self) -> int:
        return self.input_size // self.groups


def _flat(w: jax.Array, in_ndim: int) -> jax.Array:
    return w.reshape((math.prod(w.shape[:in_ndim]),) + w.shape[in_ndim:])


def pack_int4(codes: jax.Array, group: int) -> jax.Array:
    """Codes 0..15 [K, *out] -> uint8 [K / 2, *out], split-half within each group of `group` (module docstring)."""
    k, out = codes.shape[0], codes.shape[1:]
    halves = codes.astype(jnp.uint8).reshape((k // group, 2, group // 2) + out)
    return (halves[:, 0] | (halves[:, 1] << 4)).reshape((k // 2,) + out)


def unpack_int4(packed: jax.Array, group: int) -> jax.Array:
    """uint8 [K / 2, *out] in the split-half layout -> int32 codes 0..15 [K, *out]."""
    half, out = packed.shape[0], packed.shape[1:]
    p = packed.astype(jnp.int32).reshape((half * 2 // group, 1, group // 2) + out)
    return jnp.concatenate([p & 0x0F, p >> 4], axis=1).reshape((half * 2,) + out)


def in_words(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its codes four rows a word (QuantizedWeight.word_bits), from any layout."""
    if w.word_bits:
        return w
    w = in_bytes(w)
    rows, out = w.values.shape[0], w.values.shape[1:]
    grouped = jnp.moveaxis(w.values.reshape((rows // 4, 4) + out), 1, -1)  # [rows / 4, *out, 4]
    return dataclasses.replace(w, values=lax.bitcast_convert_type(grouped, jnp.int32), word_bits=w.bits)


TRANSPOSED_INT4_ZERO = 8  # a transposed int4 code v stands for the stored code v + 8 (QuantizedWeight.transposed)


def in_transposed(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its codes transposed (QuantizedWeight.transposed), from any layout."""
    if w.transposed:
        return w
    w = in_bytes(w)
    codes = integer_codes(w).reshape(w.input_size, -1).T
    values = (codes - TRANSPOSED_INT4_ZERO).astype(jnp.int4) if w.bits == 4 else codes
    return dataclasses.replace(w, values=values, transposed=True)


def in_bytes(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its codes one row a byte (in_words or in_transposed undone)."""
    if w.transposed:
        codes = w.values.T.reshape((w.input_size,) + w.out_shape)
        if w.bits == 8:
            return dataclasses.replace(w, values=codes, transposed=False)
        codes = codes.astype(jnp.int32) + TRANSPOSED_INT4_ZERO
        return dataclasses.replace(w, values=pack_int4(codes, w.group_size), transposed=False)
    if not w.word_bits:
        return w
    codes = lax.bitcast_convert_type(w.values, jnp.uint8 if w.bits == 4 else jnp.int8)  # [rows / 4, *out, 4]
    rows = w.values.shape[0] * 4
    return dataclasses.replace(w, values=jnp.moveaxis(codes, -1, 1).reshape((rows,) + w.values.shape[1:]),
                               word_bits=None)


def integer_codes(w: QuantizedWeight) -> jax.Array:
    """The integer codes [K, *out] (int4 unpacked), int32 for int4."""
    w = in_bytes(w)
    return unpack_int4(w.values, w.group_size) if w.bits == 4 else w.values


def quantize_int8(w: jax.Array, in_ndim: int = 1) -> QuantizedWeight:
    """Symmetric per output channel: scale = max |W[:, o]| / 127."""
    flat = _flat(w, in_ndim).astype(jnp.float32)
    absmax = jnp.max(jnp.abs(flat), axis=0, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    values = jnp.clip(jnp.round(flat / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedWeight(values, scale.astype(w.dtype), None, in_ndim)


def quantize_int4(w: jax.Array, group: int, in_ndim: int = 1) -> QuantizedWeight:
    """Asymmetric in groups of `group` input positions: 16 levels from the group's min (the offset) to its max."""
    flat = _flat(w, in_ndim).astype(jnp.float32)
    k = flat.shape[0]
    if k % group or group % 32:
        raise ValueError(f"int4 groups of {group} (a multiple of 32) do not tile the input size {k}")
    grouped = flat.reshape((k // group, group) + flat.shape[1:])
    lo, hi = grouped.min(axis=1), grouped.max(axis=1)
    scale = jnp.where(hi > lo, (hi - lo) / INT4_LEVELS, 1.0)
    levels = jnp.clip(jnp.round((grouped - lo[:, None]) / scale[:, None]), 0, INT4_LEVELS)
    return QuantizedWeight(pack_int4(levels.reshape(flat.shape), group), scale.astype(w.dtype), lo.astype(w.dtype),
                           in_ndim)


def quantize(w: jax.Array, precision: str, in_ndim: int, group: int | None = None) -> QuantizedWeight:
    if precision == "int8":
        return quantize_int8(w, in_ndim)
    if precision == "int4":
        return quantize_int4(w, group, in_ndim)
    raise ValueError(f"no quantized form for precision {precision!r}")


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight the quantized form stands for, [K, *out] (input axes flattened)."""
    ints = integer_codes(w)
    grouped = ints.astype(jnp.float32).reshape((w.groups, w.group_size) + ints.shape[1:])
    full = grouped * w.scale.astype(jnp.float32)[:, None]
    if w.offset is not None:
        full = full + w.offset.astype(jnp.float32)[:, None]
    return full.reshape(ints.shape).astype(dtype)


def group_size_for(local_input: int) -> int | None:
    """The int4 group size for a weight whose input axis holds `local_input` positions on one device: the largest
    of INT4_GROUP_SIZES that divides it, None if none does."""
    return next((g for g in INT4_GROUP_SIZES if local_input % g == 0), None)


# How XLA is asked for a product with grouped (G > 1) weights: "grouped" contracts each group with its integer
# codes (converted inside the product) and sums the scaled partial products; "dequantized" forms the weight in
# x's dtype first and multiplies once. On the CPU, XLA fuses a convert into a dot's operand by emitting a naive loop
# instead of calling its GEMM library, and its batched products are slow, so there the dequantized weight is
# 2-4x faster (SmolLM2's shapes, rows 3); elsewhere the grouped form reads each weight once.
# (benchmarks/bench_quantized_gemm.py times both.)
FORMULATIONS = ("grouped", "dequantized")


def default_formulation() -> str:
    return "dequantized" if jax.default_backend() == "cpu" else "grouped"


def quantized_matmul(x: jax.Array, w: QuantizedWeight, preferred_element_type=None,
                     formulation: str | None = None) -> jax.Array:
    """x [..., *in] times the weight [*in, *out] -> [..., *out], in `preferred_element_type` (default x's dtype).

    The weight's kernel where it has one; else XLA: the integer codes converted to x's dtype inside the product
    (a convert XLA can fuse into the GEMM's operand), accumulated in float32; per channel (G = 1) the scale
    multiplies the product. With groups, FORMULATIONS; an offset adds (sum of x over each group) x offset."""
    k, out_shape = w.input_size, w.out_shape
    lead = x.shape[: x.ndim - w.in_ndim]
    rows = x.reshape(-1, k)
    out_dtype = preferred_element_type or x.dtype
    if w.kernel is not None:
        return w.kernel(rows, w, out_dtype).reshape(lead + out_shape)
    w = w.one_layer()
    groups = w.groups
    formulation = formulation or default_formulation()
    if groups > 1 and formulation == "dequantized":
        y = jnp.dot(rows, dequantize(w, x.dtype).reshape(k, -1), preferred_element_type=jnp.float32)
    else:
        ints = integer_codes(w).reshape(groups, k // groups, -1).astype(x.dtype)  # [G, g, O]
        scale = w.scale.reshape(groups, -1).astype(jnp.float32)
        if groups == 1:
            y = jnp.dot(rows, ints[0], preferred_element_type=jnp.float32) * scale
        else:
            per_group = rows.reshape(-1, groups, k // groups)
            partial = jnp.einsum("MGg,GgO->MGO", per_group, ints, preferred_element_type=jnp.float32)
            y = jnp.einsum("MGO,GO->MO", partial, scale)
        if w.offset is not None:
            sums = rows.reshape(-1, groups, k // groups).astype(jnp.float32).sum(-1)
            y = y + sums @ w.offset.reshape(groups, -1).astype(jnp.float32)
    return y.astype(out_dtype).reshape(lead + out_shape)


def overlay(params: Any, replacements: Any) -> Any:
    """`params` (nested dicts) with the entries of `replacements` (nested dicts in the same layout, any subset of
    the keys, possibly keys params lacks) put in their place. No array is copied."""
    if not isinstance(replacements, dict):
        return replacements
    merged = dict(params)
    for key, value in replacements.items():
        merged[key] = overlay(params[key], value) if key in params and isinstance(params[key], dict) else value
    return merged


def nbytes(array) -> int:
    """Bytes an array (or ShapeDtypeStruct) takes on a device (sub-byte types such as int4 packed, as on the GPU)."""
    return -(-int(np.prod(array.shape)) * jax.dtypes.itemsize_bits(array.dtype) // 8)
