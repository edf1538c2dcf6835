"""The attention interface the models call.

A model projects the new tokens to query, key and value heads and hands them, before RoPE, with the layer's cache,
to an `Attention`. The attention object rotates the query and key heads (a kernel can do it in registers while it
reads them, where a separate pass would cost a launch per layer), decides what the layer attends to (all of the
cache, a selected subset, ...), writes the new rows into the cache, and may return an auxiliary output (for
example the scores that guide KV selection). A dense layer's cache is the pair (k_cache, v_cache); another family's
(NSA: raw, compressed) is one pytree its attention takes and returns whole (`attend`), so the model never looks
inside a layer cache. Dense, sparse-draft and verification attention are implementations
of this protocol living outside the model code, passed to `forward` as a pytree, so their dynamic inputs
(indices, lengths) are traced arrays and their configuration static.

The layer index an attention receives is a traced int32 scalar when the decoder scans its layers (one body for
all of them: models.decoder) and a Python int when it runs them unrolled. An attention whose behaviour or aux
depends on which layer it serves (a static decision: only the last layer collects scores, refresh and reuse
layers of an NSA approximate mode) sets `layer_specific` true; the decoder then runs its layers unrolled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Full-width RoPE tables for rotate-half RoPE (HF convention), float32 [..., D] for positions [...]:
    cos repeated over both halves, sin negated in the first half, so that
    rope(x) = x * cos + swap_halves(x) * sin."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, D] rotated at tables cos, sin [..., D] (rope_tables), in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    swapped = jnp.concatenate([x2, x1], axis=-1)
    return (x32 * cos[..., None, :] + swapped * sin[..., None, :]).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NewTokens:
    """One layer's attention input for the S new tokens of each sequence."""

    heads: jax.Array  # [B, S, H_q + 2 H_kv, D] query heads, then key heads, then value heads; no RoPE yet
    rope_cos: jax.Array  # [B, S, D] float32 tables at the tokens' positions (rope_tables)
    rope_sin: jax.Array
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))
    # [B, S, H_q, 3] float32 NSA's branch gates (compressed, selected, window), sigmoids of the layer's gate
    # projection of the hidden state; None for a model without gates.
    gates: jax.Array | None = None

    def rotated(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q [B, S, H_q, D], k [B, S, H_kv, D], v) with RoPE applied to q and k."""
        num_q_heads = self.heads.shape[2] - 2 * self.num_kv_heads
        q, k, v = jnp.split(self.heads, (num_q_heads, num_q_heads + self.num_kv_heads), axis=2)
        return apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin), v


class Attention(Protocol):
    def __call__(
        self,
        layer: int,
        new: NewTokens,
        positions: jax.Array,  # [B, S] int32, absolute positions of the S new tokens
        k_cache: jax.Array,  # [L, B, T, H_kv, D] every layer's keys (models.kv_cache.KVCache)
        v_cache: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
        """Returns (output [B, S, H_q, D], k_cache, v_cache, aux): the stacks with the new tokens' rows written at
        `layer`, which is read in place (never sliced out and written back: models.kv_cache.KVCache)."""
        ...


class FamilyAttention(Protocol):
    """An attention over one pytree per layer cache (the NSA family)."""

    def __call__(self, layer: int, new: NewTokens, positions: jax.Array, cache: Any) -> tuple[jax.Array, Any, Any]:
        """Returns (output [B, S, H_q, D], cache, aux)."""
        ...


def attend(attention, layer: int, new: NewTokens, positions: jax.Array, cache) -> tuple[jax.Array, Any, Any]:
    """(output, layer cache, aux) of `attention` over one layer's cache: a dense cache (k, v) (every layer's
    stacks, of which the attention reads and writes `layer`) goes to an
    `Attention`, any other to a `FamilyAttention`."""
    if isinstance(cache, tuple):
        out, k_cache, v_cache, aux = attention(layer, new, positions, *cache)
        return out, (k_cache, v_cache), aux
    return attention(layer, new, positions, cache)
