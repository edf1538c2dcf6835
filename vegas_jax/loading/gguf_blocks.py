"""GGUF's Q8_0, Q4_0 and Q4_1 blocks read as they are into the quantized form of models.quantized, for draft
weights straight from the file (no float detour).

A quantized GGUF tensor of [rows, K] (rows = output channels, K = input positions, contiguous) is stored row by row
in blocks of 32 consecutive input positions, each a float16 scale d (Q4_1: and a float16 min m) followed by the
values: Q8_0 32 int8 q, weight d * q; Q4_0 16 bytes of nibbles, weight d * (q - 8); Q4_1 the same nibbles, weight
d * q + m. Position j of a block is the low nibble of byte j, position j + 16 its high nibble (ggml's layout). In
models.quantized's form the 4-bit values are shifted to [-8, 7], so Q4_1's offset is m + 8 d.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np

from models.quantized import QuantizedWeight

T = gguf.GGMLQuantizationType
BLOCK = 32
# GGUF type -> (bytes per block, the draft precision its values have)
BLOCK_TYPES = {T.Q8_0: (34, "int8"), T.Q4_0: (18, "int4"), T.Q4_1: (20, "int4")}


def precision_of(tensor_type) -> str | None:
    """The draft precision a tensor of this type provides as it is stored; None: it would be quantized anew."""
    return BLOCK_TYPES[tensor_type][1] if tensor_type in BLOCK_TYPES else None


def read_blocks(data: np.ndarray, tensor_type, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor's raw bytes [rows, bytes per row] -> (values int8 [rows, K], scale float32 [rows, K / 32], offset
    float32 [rows, K / 32] or None), values of 4-bit types in [-8, 7]."""
    size, _ = BLOCK_TYPES[tensor_type]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, size)  # [rows, G, bytes]
    half = lambda b: b.copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    d = half(blocks[..., 0:2])
    if tensor_type == T.Q8_0:
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), d, None
    nibbles = blocks[..., 4:] if tensor_type == T.Q4_1 else blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8) - 8  # [rows, G, 32]
    offset = half(blocks[..., 2:4]) + 8 * d if tensor_type == T.Q4_1 else None
    return q.reshape(rows, -1), d, offset


def as_weight(values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, out_shape: tuple[int, ...],
              precision: str, in_ndim: int = 1) -> QuantizedWeight:
    """Blocks [out channels, K] (`read_blocks`, rows possibly reordered) as a host QuantizedWeight of
    [K, *out_shape] (the input axis first, as the model's weights are stored), values int4 or int8."""
    k, groups = values.shape[1], scale.shape[1]
    to_ours = lambda x, n: np.ascontiguousarray(x.T).reshape((n,) + out_shape)  # noqa: E731
    stored = values.astype(ml_dtypes.int4) if precision == "int4" else values
    return QuantizedWeight(to_ours(stored, k), to_ours(scale, groups),
                           None if offset is None else to_ours(offset, groups), in_ndim)
