"""An EAGLE-style draft head: one decoder layer that predicts the target's next last-layer hidden state from the
current one and the next token, read out through the target's own final norm and LM head.

Row p of the head takes (f_p, x_{p+1}): f_p the target's last-layer output (before its final norm) at position p,
x_{p+1} the token after it. Its output f'_{p+1} stands for f_{p+1}, so LM_head(norm(f'_{p+1})) is a distribution
over x_{p+2}. Drafting feeds f' back in as the next row's feature (vegas_jax.decode.drafters.HeadDrafter). The
head's rows attend to each other through its own KV cache (one layer's, a row per position), with RoPE at p.

Params are a plain nested dict (flax.nnx defines them, as models.decoder does); `features` and `logits` are pure
functions of it. The head owns only the fusing projection and its layer: the token embedding, final norm and LM
head are the target's, read from the target's params, so a head adds ~1 layer of weights.

A draft vocabulary (FR-Spec's reduced readout): the head's params may carry a READOUT entry, the LM head's rows of
K chosen tokens (`vocabulary_readout`), and `logits` then reads those K rows instead of all V. At a 128K
vocabulary the whole LM head is the head's largest read (a sixth of a head-drafted chain's GPU time at 8B shapes);
verification reads the whole, so drafting stays lossless: a token outside the K is never drafted, and sampling
draws it through the residual.
Einsum axes as in models.decoder (B, S, T, D, N, K, H, F), and G query heads per KV head.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import apply_rope, rope_tables
from models.config import ModelConfig, rope_inverse_frequencies
from models.decoder import RMSNorm, vocabulary_logits
from models.logical_axes import Axes

Params = dict[str, Any]
# The optional entry of a head's params holding a draft vocabulary's readout: {"tokens": [K] int32, "rows": [K, D]}.
READOUT = "readout"
# Attention weight of a row a query may not see: finite, so a row that sees nothing (an unused pending row)
# averages garbage instead of making NaNs.
_HIDDEN = float(jnp.finfo(jnp.float32).min)


class DraftHead(nnx.Module):
    def __init__(self, config: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        c, init = config, nnx.initializers.normal(0.02)
        d = c.hidden_size
        # The target's hidden state is normalised first: its residual stream's scale differs from the embedding's.
        self.feature_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.fuse = nnx.Param(init(rngs.params(), (2, d, d), dtype))  # [feature, embedding] -> width
        self.attn_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.qkv_proj = nnx.Param(init(rngs.params(), (d, c.num_heads + 2 * c.num_kv_heads, c.head_dim), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.o_proj = nnx.Param(init(rngs.params(), (c.num_heads, c.head_dim, d), dtype))
        self.mlp_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (d, 2, c.intermediate_size), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (c.intermediate_size, d), dtype))
        self.split = (c.num_heads, c.num_heads + c.num_kv_heads)
        self.qk_norm = c.qk_norm

    def __call__(self, features, embeddings, rope, past_k, past_v, write, visible, read=None):
        fuse = self.fuse[...]
        x = (jnp.einsum("BSD,DE->BSE", self.feature_norm(features), fuse[0])
             + jnp.einsum("BSD,DE->BSE", embeddings.astype(fuse.dtype), fuse[1]))
        h = self.attn_norm(x)
        q, k, v = jnp.split(jnp.einsum("BSD,DNH->BSNH", h, self.qkv_proj[...]), self.split, axis=2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        rows = jnp.arange(x.shape[0])[:, None]
        past_k = past_k.at[rows, write].set(k.astype(past_k.dtype), mode="drop")
        past_v = past_v.at[rows, write].set(v.astype(past_v.dtype), mode="drop")
        keys, values = past_k, past_v
        if read is not None:  # a window of the slots: attention costs its width, not the whole cache's
            keys = jnp.take_along_axis(past_k, read[:, :, None, None], axis=1, mode="clip")
            values = jnp.take_along_axis(past_v, read[:, :, None, None], axis=1, mode="clip")
        batch, new, heads, dim = q.shape
        kv_heads = past_k.shape[2]
        grouped = q.reshape(batch, new, kv_heads, heads // kv_heads, dim)
        scores = jnp.einsum("BSKGH,BTKH->BKGST", grouped, keys, preferred_element_type=jnp.float32) * dim**-0.5
        weights = jax.nn.softmax(jnp.where(visible[:, None, None], scores, _HIDDEN), axis=-1)
        out = jnp.einsum("BKGST,BTKH->BSKGH", weights, values.astype(jnp.float32)).reshape(batch, new, heads, dim)
        x = x + jnp.einsum("BSNH,NHD->BSD", out.astype(x.dtype), self.o_proj[...])
        gate_up = jnp.einsum("BSD,DGF->BSGF", self.mlp_norm(x), self.gate_up_proj[...])
        x = x + jnp.einsum("BSF,FD->BSD", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], self.down_proj[...])
        return x, past_k, past_v


@functools.lru_cache(maxsize=None)
def _split_abstract(config: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: DraftHead(config, rngs=nnx.Rngs(0))))


def init_params(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> Params:
    """A new head for a target of this config (its layer shaped like one of the target's)."""
    return nnx.to_pure_dict(nnx.state(DraftHead(config, dtype, rngs=nnx.Rngs(seed))))


def param_shapes(config: ModelConfig) -> Params:
    return jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(_split_abstract(config)[1]))


def param_axes(head: Params) -> Params:
    """Every parameter whole on every device: the head is one layer, cheaper to repeat than to split."""
    return jax.tree.map(lambda x: Axes(*(None,) * x.ndim), head)


def empty_cache(config: ModelConfig, batch: int, slots: int, dtype) -> tuple[jax.Array, jax.Array]:
    """The head's K and V rows, [B, slots, K, H] each."""
    shape = (batch, slots, config.num_kv_heads, config.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def features(head: Params, target: Params, config: ModelConfig, hidden: jax.Array, tokens: jax.Array,
             positions: jax.Array, past_k: jax.Array, past_v: jax.Array, write: jax.Array, visible: jax.Array,
             read: jax.Array | None = None):
    """The head over S rows: hidden [B, S, D] (target or head features at `positions` [B, S]), tokens [B, S] (the
    token after each). Each row's K/V is first written into past_k / past_v [B, T, K, H] at slot write [B, S]
    (slots >= T: not kept); row s then attends to the slots where visible [B, S, T], or with read [B, R] (slot
    indices, clipped to the cache) to those slots where visible [B, S, R]. Returns (the predicted next features
    [B, S, D], past_k, past_v)."""
    graphdef, abstract = _split_abstract(config)
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, {k: v for k, v in head.items() if k != READOUT})
    model = nnx.merge(graphdef, state)
    rope = rope_tables(positions, jnp.asarray(rope_inverse_frequencies(config), jnp.float32))
    embeddings = jnp.take(target["embed"], tokens, axis=0)
    return model(hidden, embeddings, rope, past_k, past_v, write, visible, read)


def vocabulary_readout(target: Params, config: ModelConfig, tokens) -> Params:
    """A draft vocabulary's readout for a head's READOUT entry: the token ids [K] (int32) and the target's LM head
    rows of them [K, D] (a copy: drafts then read K rows contiguously)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if config.tie_word_embeddings:
        rows = jnp.take(target["embed"], tokens, axis=0)
    else:
        rows = jnp.take(target["lm_head"], tokens, axis=1).T
    return {"tokens": tokens, "rows": rows}


def logits(target: Params, config: ModelConfig, hidden: jax.Array, readout: Params | None = None) -> jax.Array:
    """float32 [B, S, V]: the target's final norm and LM head over features [B, S, D] (the target's readout); with a
    draft vocabulary's `readout`, [B, S, K] over its tokens only."""
    x32 = hidden.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + config.rms_norm_eps)
    x = (normed * target["final_norm"]["scale"].astype(jnp.float32)).astype(target["embed"].dtype)
    if readout is not None:
        return vocabulary_logits("BSD,KD->BSK", x, readout["rows"])
    if config.tie_word_embeddings:
        return vocabulary_logits("BSD,VD->BSV", x, target["embed"])
    return vocabulary_logits("BSD,DV->BSV", x, target["lm_head"])
