"""GGUF's Q8_0, Q4_0 and Q4_1 blocks read as they are into the quantized form of models.quantized, for draft
weights straight from the file (no float detour).

A quantized GGUF tensor of [rows, K] (rows = output channels, K = input positions, contiguous) is stored row by row
in blocks of 32 consecutive input positions, each a float16 scale d (Q4_1: and a float16 min m) followed by the
codes: Q8_0 32 int8 q, weight d * q; Q4_0 16 bytes of nibbles, weight d * (q - 8); Q4_1 the same nibbles, weight
d * q + m. Position j of a block is the low nibble of byte j, position j + 16 its high nibble: exactly
models.quantized's split-half int4 layout for groups of 32, so the nibble bytes are kept as they are (Q4_0's
offset is -8 d).
"""

from __future__ import annotations

import gguf
import numpy as np

from models.quantized import QuantizedWeight

T = gguf.GGMLQuantizationType
BLOCK = 32
# GGUF type -> (bytes per block, the draft precision its codes have)
BLOCK_TYPES = {T.Q8_0: (34, "int8"), T.Q4_0: (18, "int4"), T.Q4_1: (20, "int4")}


def precision_of(tensor_type) -> str | None:
    """The draft precision a tensor of this type provides as it is stored; None: it would be quantized anew."""
    return BLOCK_TYPES[tensor_type][1] if tensor_type in BLOCK_TYPES else None


def read_blocks(data: np.ndarray, tensor_type, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A tensor's raw bytes [rows, bytes per row] -> (codes: int8 [rows, K], or the nibble bytes uint8
    [rows, K / 2]; scale float32 [rows, K / 32]; offset float32 [rows, K / 32] or None)."""
    size, _ = BLOCK_TYPES[tensor_type]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, size)  # [rows, G, bytes]
    half = lambda b: b.copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    d = half(blocks[..., 0:2])
    if tensor_type == T.Q8_0:
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), d, None
    if tensor_type == T.Q4_1:
        return blocks[..., 4:].reshape(rows, -1).copy(), d, half(blocks[..., 2:4])
    return blocks[..., 2:].reshape(rows, -1).copy(), d, -8 * d


def as_weight(values: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, out_shape: tuple[int, ...],
              in_ndim: int = 1) -> QuantizedWeight:
    """Blocks [out channels, ...] (`read_blocks`, rows possibly reordered) as a host QuantizedWeight of
    [K (int4: K / 2 bytes), *out_shape]: the input axis first, as the model's weights are stored."""
    to_ours = lambda x: np.ascontiguousarray(x.T).reshape((x.shape[1],) + out_shape)  # noqa: E731
    return QuantizedWeight(to_ours(values), to_ours(scale), None if offset is None else to_ours(offset), in_ndim)
