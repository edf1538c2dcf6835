"""Masked softmax attention over a whole cache, in plain jnp: the CPU path and the ground truth for kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(positions: jax.Array, capacity: int) -> jax.Array:
    """[B, S, T]: key t is visible to the query at position p iff t <= p.

    Rows past a sequence's length hold stale or draft K/V, but they always lie at positions greater than any query
    that may not see them, so causality alone keeps them out.
    """
    return jnp.arange(capacity)[None, None, :] <= positions[:, :, None]


def attention_logits(q: jax.Array, k_cache: jax.Array) -> jax.Array:
    """Raw q.k (unscaled), float32, [B, K, G, S, T]."""
    b, s, n, h = q.shape
    kv_heads = k_cache.shape[2]
    qg = q.reshape(b, s, kv_heads, n // kv_heads, h)
    return jnp.einsum("BSKGH,BTKH->BKGST", qg, k_cache, preferred_element_type=jnp.float32)


def masked_attention(q, k_cache, v_cache, mask, *, return_logits: bool = False):
    """Softmax attention of q [B, S, N, H] over the cache rows where mask [B, S, T] holds.

    Returns out [B, S, N, H] (q's dtype) and, if asked, the raw logits [B, K, G, S, T] and the row
    log-sum-exp of the scaled logits [B, K, G, S].
    """
    b, s, n, h = q.shape
    raw = attention_logits(q, k_cache)
    scaled = jnp.where(mask[:, None, None], raw * (h**-0.5), -jnp.inf)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    probs = jnp.exp(scaled - lse[..., None])
    out = jnp.einsum("BKGST,BTKH->BSKGH", probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    out = out.reshape(b, s, n, h).astype(q.dtype)
    if return_logits:
        return out, raw, lse
    return out
