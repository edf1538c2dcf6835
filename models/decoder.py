"""Decoder-only transformer (Llama 2/3.x, SmolLM2, Mistral-style GQA, Qwen2, Qwen3) as a functional Flax model.

Parameters are defined with flax.nnx; every entry point is the pure function `forward(params, ...)` over a plain
nested dict of arrays, so parameters and the KV cache cross `jit` as explicit (donatable, shardable) arrays.
Einsum axes: B batch, S new tokens, T cache positions, D model width, N query heads, K kv heads, H head dim,
F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, NewTokens, rope_tables
from models.config import ModelConfig, rope_inverse_frequencies
from models.kv_cache import KVCache

Params = dict[str, Any]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.normal(0.02)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        # q, k and v heads side by side in one matrix, gate and up likewise: one GEMM launch instead of three (two)
        # per layer, which matters because a decode step is launch-bound at small batch.
        qkv_heads = c.num_heads + 2 * c.num_kv_heads
        self.qkv_proj = nnx.Param(init(rngs.params(), (c.hidden_size, qkv_heads, c.head_dim), dtype))
        if c.attention_bias:
            self.qkv_bias = nnx.Param(jnp.zeros((qkv_heads, c.head_dim), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.o_proj = nnx.Param(init(rngs.params(), (c.num_heads, c.head_dim, c.hidden_size), dtype))
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (c.hidden_size, 2, c.intermediate_size), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (c.intermediate_size, c.hidden_size), dtype))
        self.attention_bias = c.attention_bias
        self.head_split = (c.num_heads, c.num_heads + c.num_kv_heads)
        self.num_kv_heads = c.num_kv_heads
        self.qk_norm = c.qk_norm

    def __call__(self, layer: int, x, positions, rope, k_cache, v_cache, attention: Attention):
        h = self.attn_norm(x)
        qkv = jnp.einsum("BSD,DNH->BSNH", h, self.qkv_proj[...])
        if self.attention_bias:
            qkv = qkv + self.qkv_bias[...]
        if self.qk_norm:
            q, k, v = jnp.split(qkv, self.head_split, axis=2)
            qkv = jnp.concatenate([self.q_norm(q), self.k_norm(k), v], axis=2)
        new = NewTokens(qkv, *rope, num_kv_heads=self.num_kv_heads)
        out, k_cache, v_cache, aux = attention(layer, new, positions, k_cache, v_cache)
        x = x + jnp.einsum("BSNH,NHD->BSD", out.astype(x.dtype), self.o_proj[...])
        h = self.mlp_norm(x)
        gate_up = jnp.einsum("BSD,DGF->BSGF", h, self.gate_up_proj[...])
        x = x + jnp.einsum("BSF,FD->BSD", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], self.down_proj[...])
        return x, k_cache, v_cache, aux


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (config.hidden_size, config.vocab_size), dtype)
            )

    def __call__(self, tokens, positions, kv_cache: KVCache, attention: Attention, logit_rows=None):
        rope = rope_tables(positions, jnp.asarray(rope_inverse_frequencies(self.config), jnp.float32))
        x = jnp.take(self.embed[...], tokens, axis=0)
        k_out, v_out, aux_out = [], [], []
        for i, layer in enumerate(self.layers):
            x, k, v, aux = layer(i, x, positions, rope, kv_cache.k[i], kv_cache.v[i], attention)
            k_out.append(k)
            v_out.append(v)
            aux_out.append(aux)
        if logit_rows is not None:  # only these rows need the (vocabulary-sized) LM head
            x = jnp.take_along_axis(x, logit_rows[:, :, None], axis=1)
        x = self.final_norm(x)
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("BSD,VD->BSV", x, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("BSD,DV->BSV", x, self.lm_head[...], preferred_element_type=jnp.float32)
        return logits, KVCache(k=tuple(k_out), v=tuple(v_out)), tuple(aux_out)


@functools.lru_cache(maxsize=None)
def _split_abstract(config: ModelConfig):
    abstract = nnx.eval_shape(lambda: Decoder(config, jnp.float32, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def param_shapes(config: ModelConfig) -> Params:
    """The nested dict of parameter shapes (`{name: shape}`) that loaders must produce."""
    _, state = _split_abstract(config)
    return jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(state))


_SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
_SEPARATE_BIAS = ("q_bias", "k_bias", "v_bias")


def checkpoint_param_shapes(config: ModelConfig) -> Params:
    """The layout checkpoints store (and loaders fill): q/k/v and gate/up projections apart, as in HF and GGUF
    files. `fuse_projections` turns it into the model's layout."""
    c = config
    layer = {
        "q_proj": (c.hidden_size, c.num_heads, c.head_dim),
        "k_proj": (c.hidden_size, c.num_kv_heads, c.head_dim),
        "v_proj": (c.hidden_size, c.num_kv_heads, c.head_dim),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
    }
    if c.attention_bias:
        layer |= {"q_bias": (c.num_heads, c.head_dim), "k_bias": (c.num_kv_heads, c.head_dim),
                  "v_bias": (c.num_kv_heads, c.head_dim)}
    shapes = param_shapes(config)
    fused = ("qkv_proj", "qkv_bias", "gate_up_proj")
    for i, fused_layer in shapes["layers"].items():
        shapes["layers"][i] = {k: v for k, v in fused_layer.items() if k not in fused} | layer
    return shapes


def fuse_projections(params: Params) -> Params:
    """Checkpoint layout (checkpoint_param_shapes) -> model layout (param_shapes), arrays of any kind."""

    def fuse(layer):
        layer = dict(layer)
        fused = {"qkv_proj": jnp.concatenate([layer.pop(k) for k in _SEPARATE_QKV], axis=1)}
        if "q_bias" in layer:
            fused["qkv_bias"] = jnp.concatenate([layer.pop(k) for k in _SEPARATE_BIAS], axis=0)
        fused["gate_up_proj"] = jnp.stack([layer.pop("gate_proj"), layer.pop("up_proj")], axis=1)
        return layer | fused

    return {**params, "layers": {i: fuse(layer) for i, layer in params["layers"].items()}}


def init_params(config: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> Params:
    """Random parameters (for timing with real shapes and for tests)."""
    model = Decoder(config, dtype, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model))


def forward(
    params: Params,
    tokens: jax.Array,  # [B, S] int32
    positions: jax.Array,  # [B, S] int32
    kv_cache: KVCache,
    attention: Attention,
    *,
    config: ModelConfig,
    logit_rows: jax.Array | None = None,  # [B, R] row indices into S; logits only for these rows
) -> tuple[jax.Array, KVCache, tuple]:
    """Returns (logits [B, S or R, V] float32, updated kv_cache, per-layer attention aux)."""
    graphdef, abstract_state = _split_abstract(config)
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, kv_cache, attention, logit_rows)
