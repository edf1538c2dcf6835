"""The attention interface the models call.

A model computes q, k, v (RoPE applied) and hands them, with the layer's cache, to an `Attention`. The attention
object decides what the layer attends to (all of the cache, a selected subset, ...), writes the new rows into the
cache, and may return an auxiliary output (for example the scores that guide KV selection). Dense, sparse-draft
and verification attention are implementations of this protocol living outside the model code, passed to
`forward` as a pytree, so their dynamic inputs (indices, lengths) are traced arrays and their configuration static.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax


class Attention(Protocol):
    def __call__(
        self,
        layer: int,
        q: jax.Array,  # [B, S, H_q, D]
        k: jax.Array,  # [B, S, H_kv, D]
        v: jax.Array,  # [B, S, H_kv, D]
        positions: jax.Array,  # [B, S] int32, absolute positions of the S new tokens
        k_cache: jax.Array,  # [B, T, H_kv, D]
        v_cache: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """Returns (output [B, S, H_q, D], k_cache, v_cache, aux)."""
        ...
