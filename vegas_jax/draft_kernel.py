"""Where kernels run (the GPU), the draft pass multiplies by its quantized weights through the Pallas weight-only
matmul (pallas_kernels/weight_only_matmul.py): XLA keeps the int -> bf16 convert out of its GEMMs at decode shapes
and reads no fewer bytes than for bf16 weights (on the H200, 4096 x 6144 at rows 1-16: int8 0.37 TB/s through XLA,
1.6-1.9 TB/s through the kernel; benchmarks/results/weight-only-2026-12-01-kernel-times.json).

`with_kernel` gives every quantized weight of a draft tree that the kernel tiles the kernel as its product
(models.quantized.QuantizedWeight.kernel), which models.quantized.quantized_matmul then calls; weights it does not
tile (an output width that is no multiple of 16, such as a 4-token vocabulary) keep XLA's product. On a mesh it
runs inside the program on each device's shard, whose groups are whole (models.draft_weights).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from models.quantized import QuantizedWeight
from pallas_kernels.weight_only_matmul import weight_only_matmul
from vegas_jax.sharding import Placement

# The largest blocks (block_k, block_n) tried, by whether x is one row: the fastest measured on the H200 at
# Llama-3.1-8B's shapes (benchmarks/results/weight-only-2026-12-02-int4-variants.json); 16: Triton's smallest dot.
MAX_BLOCKS = {True: (32, 256), False: (64, 128)}
MIN_BLOCK = 16


def with_kernel(draft_params, placement: Placement):
    """The draft tree with the kernel as the product of every weight it tiles (unchanged without kernels)."""
    if draft_params is None or not placement.uses_kernels:
        return draft_params
    product = functools.partial(_product, interpret=placement.interpret)

    def attach(w):
        if not isinstance(w, QuantizedWeight) or _blocks(w, rows=2) is None:
            return w
        return dataclasses.replace(w, kernel=product)

    return jax.tree.map(attach, draft_params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


def _largest_power_of_2_dividing(n: int, most: int) -> int:
    block = most
    while block > MIN_BLOCK and n % block:
        block //= 2
    return block


def _blocks(w: QuantizedWeight, rows: int) -> tuple[int, int] | None:
    """(block_k, block_n) that tile this weight for the kernel at `rows` rows of x, or None. Whether a weight
    tiles does not depend on rows (both shrink to MIN_BLOCK)."""
    n = math.prod(w.values.shape[1:])
    rows_per_group = w.group_size // (2 if w.bits == 4 else 1)  # rows of the stored codes under one scale
    most_k, most_n = MAX_BLOCKS[rows == 1]
    block_k = _largest_power_of_2_dividing(rows_per_group, most_k)
    block_n = _largest_power_of_2_dividing(n, most_n)
    if rows_per_group % block_k or n % block_n:
        return None
    return block_k, block_n


def _product(x: jax.Array, w: QuantizedWeight, out_dtype, *, interpret: bool) -> jax.Array:
    """models.quantized's kernel signature: x [M, K] times the weight -> [M, prod(out)] in out_dtype."""
    block_k, block_n = _blocks(w, x.shape[0])
    flat = lambda a: None if a is None else a.reshape(a.shape[0], -1)  # noqa: E731
    return weight_only_matmul(x, flat(w.values), flat(w.scale), flat(w.offset), bits=w.bits, group=w.group_size,
                              block_k=block_k, block_n=block_n, interpret=interpret, out_dtype=out_dtype)
