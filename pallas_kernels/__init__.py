"""Pallas (Triton backend) GPU kernels for Vegas: sparse draft attention, verification attention with score
collection (linear and draft-tree), per-row top-k selection (large k) and top-n (small n: NSA's blocks), and a
weight-only quantized matmul for draft steps.
Each module holds a kernel, its jitted public function and a pure-jnp `*_reference` twin; on CPU the kernels run
with interpret=True."""

from pallas_kernels.select_topk import PAD_INDEX, select_topk, select_topk_reference
from pallas_kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference
from pallas_kernels.top_n import top_n, top_n_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference
from pallas_kernels.verify_attention import MAX_QUERY_ROWS, verify_attention, verify_attention_reference
from pallas_kernels.weight_only_matmul import weight_only_matmul, weight_only_matmul_reference

__all__ = [
    "MAX_QUERY_ROWS",
    "PAD_INDEX",
    "select_topk",
    "select_topk_reference",
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "top_n",
    "top_n_reference",
    "tree_attention",
    "tree_attention_reference",
    "verify_attention",
    "verify_attention_reference",
    "weight_only_matmul",
    "weight_only_matmul_reference",
]
