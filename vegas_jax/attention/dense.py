"""Plain causal attention over each sequence's whole cache in jnp: the model-level reference that tests compare
against (the engine attends through VerifyAttention, which runs the kernel on a GPU)."""

from __future__ import annotations

import dataclasses

import jax

from models.kv_cache import write_layer_rows
from vegas_jax.attention.core import causal_mask, masked_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttention:
    def __call__(self, layer, new, positions, k_cache, v_cache):
        q, k, v = new.rotated()
        k_cache = write_layer_rows(k_cache, layer, k, positions)
        v_cache = write_layer_rows(v_cache, layer, v, positions)
        out = masked_attention(q, k_cache[layer], v_cache[layer], causal_mask(positions, k_cache.shape[2]))
        return out, k_cache, v_cache, None
