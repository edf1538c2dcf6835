"""Decoder-only transformer (Llama 2/3.x, SmolLM2, Mistral-style GQA, Qwen2, Qwen3) as a functional Flax model.

Parameters are defined with flax.nnx; every entry point is the pure function `forward(params, ...)` over a plain
nested dict of arrays, so parameters and the KV cache cross `jit` as explicit (donatable, shardable) arrays.
Einsum axes: B batch, S new tokens, T cache positions, D model width, N query heads, K kv heads, H head dim,
F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import Attention, NewTokens, attend, rope_tables
from models.config import ModelConfig, rope_inverse_frequencies
from models.kv_cache import KVCache
from models.logical_axes import HEADS, MLP, Axes
from models.quantized import QuantizedWeight, quantized_matmul

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Megatron-style tensor parallelism, as one program of `size` sees it: it holds 1/size of every layer's query
    and KV heads (column-parallel q/k/v, row-parallel o) and of the MLP's units (column-parallel gate/up,
    row-parallel down), so it runs the decoder of `local(config)` and adds the two row-parallel projections' partial
    sums across the mesh axis `axis` (bound by the caller's shard_map). size 1: a whole model, no collectives."""

    axis: str | None = None
    size: int = 1

    def local(self, config: ModelConfig) -> ModelConfig:
        if self.size == 1:
            return config
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=config.num_kv_heads // self.size,
            intermediate_size=config.intermediate_size // self.size,
        )

    def row_parallel(self, spec: str, x: jax.Array, w) -> jax.Array:
        """contract(spec, x, w) summed over the shards' slices of the contracted axis, in x's dtype. Partial sums
        are added in float32 and rounded once, as one device's GEMM accumulates and rounds."""
        if self.size == 1:
            return contract(spec, x, w)
        partial = contract(spec, x, w, preferred_element_type=jnp.float32)
        return jax.lax.psum(partial, self.axis).astype(x.dtype)


def contract(spec: str, x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """einsum(spec, x, w) for a weight array; for a QuantizedWeight (a draft pass's copy, models.quantized) its
    weight-only product, which contracts x's trailing axes with the weight's leading ones as every spec here does."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w, preferred_element_type)
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)


# A one-row LM head (batch 1, one logit row) is padded to this many rows along the sequence's rows. With one row,
# XLA on GPU rewrites the bf16 x bf16 -> float32 product into a float32 GEMV and converts the whole weight to
# float32 first, every step: at Llama-3.1-8B's 1 GB head, 1.26 ms where reading the weight takes 0.44 ms
# (profile-2026-12-01-8b-b1-32k.json). Padded, the 8B plain step at batch 1 and 32K fell from 7.01 to 6.12 ms
# (draft-precision-2026-12-01-random-s18-lmhead.json). With more rows XLA keeps the GEMM and padding bought nothing
# measurable (lm-head-llama8b-2026-12-01.json), so only one row is padded. Rows are independent: the real row's
# logits are those of the unpadded product.
LM_HEAD_PADDED_ROWS = 16


def vocabulary_logits(spec: str, x: jax.Array, w) -> jax.Array:
    """The LM head, contract(spec, x, w) in float32, for x of shape (B, S, D)."""
    batch, rows, _ = x.shape
    if isinstance(w, QuantizedWeight) or batch * rows > 1:
        return contract(spec, x, w, preferred_element_type=jnp.float32)
    padded = jnp.pad(x, ((0, 0), (0, LM_HEAD_PADDED_ROWS - 1), (0, 0)))
    return contract(spec, padded, w, preferred_element_type=jnp.float32)[:, :1]


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
        self.gated = c.attention == "nsa"
        if self.gated:  # NSA's branch gates: per query head, (compressed, selected, window)
            self.branch_gate_proj = nnx.Param(init(rngs.params(), (c.hidden_size, c.num_heads, 3), dtype))
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (c.hidden_size, 2, c.intermediate_size), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (c.intermediate_size, c.hidden_size), dtype))
        self.attention_bias = c.attention_bias
        self.head_split = (c.num_heads, c.num_heads + c.num_kv_heads)
        self.num_kv_heads = c.num_kv_heads
        self.qk_norm = c.qk_norm

    def __call__(self, layer: int, x, positions, rope, cache, attention: Attention, tp: TensorParallel):
        h = self.attn_norm(x)
        qkv = contract("BSD,DNH->BSNH", h, self.qkv_proj.get_value())
        if self.attention_bias:
            qkv = qkv + self.qkv_bias[...]
        if self.qk_norm:
            q, k, v = jnp.split(qkv, self.head_split, axis=2)
            qkv = jnp.concatenate([self.q_norm(q), self.k_norm(k), v], axis=2)
        gates = None
        if self.gated:
            gates = jax.nn.sigmoid(contract("BSD,DNG->BSNG", h, self.branch_gate_proj.get_value(),
                                            preferred_element_type=jnp.float32))
        new = NewTokens(qkv, *rope, num_kv_heads=self.num_kv_heads, gates=gates)
        out, cache, aux = attend(attention, layer, new, positions, cache)
        x = x + tp.row_parallel("BSNH,NHD->BSD", out.astype(x.dtype), self.o_proj.get_value())
        h = self.mlp_norm(x)
        gate_up = contract("BSD,DGF->BSGF", h, self.gate_up_proj.get_value())
        x = x + tp.row_parallel("BSF,FD->BSD", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1],
                                self.down_proj.get_value())
        return x, cache, aux


def stacked_layers(config: ModelConfig, dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters hold every layer's, stacked along a leading layer axis [L, ...]: the
    layout the scanned layer body slices (Decoder.__call__). Each layer is initialised as a model of separate
    layers would be, so a seed gives the same weights in either layout."""
    layers = [DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)]
    graphdef, state = nnx.split(layers[0])
    stacked = stack_layers([nnx.to_pure_dict(nnx.state(layer)) for layer in layers])
    nnx.replace_by_pure_dict(state, stacked)
    return nnx.merge(graphdef, state)


def stack_layers(layers: list) -> Any:
    """Per-layer trees (parameters or draft weights, all in one layout) as one tree of stacked arrays [L, ...]."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def layer_of(layers: Any, i: int) -> Any:
    """Layer i's slice of a tree of stacked arrays (params["layers"], a draft tree's "layers")."""
    return jax.tree.map(lambda x: x[i], layers)


def split_quantized(stacked: Any) -> tuple[list, Any]:
    """(the leaves of stacked layer parameters [L, ...] that a layer body takes sliced, QuantizedWeights (a draft
    pass's) left out as None; layer_params(i, those leaves sliced to layer i) -> layer i's parameters). A quantized
    weight stays whole and names its layer (QuantizedWeight.layer), so that its kernel reads the layer in place:
    the scan's per-layer slice of a kernel's operand would be a copy of every draft weight per layer and pass."""
    is_weight = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    leaves, treedef = jax.tree.flatten(stacked, is_leaf=is_weight)

    def layer_params(i, sliced_leaves):
        layer = jnp.asarray(i, jnp.int32)
        return treedef.unflatten([dataclasses.replace(leaf, layer=layer) if is_weight(leaf) else sliced_leaf
                                  for leaf, sliced_leaf in zip(leaves, sliced_leaves)])

    return [None if is_weight(leaf) else leaf for leaf in leaves], layer_params


def pack_vectors(leaves: list) -> tuple[list, Any]:
    """(the scanned leaves with the per-layer vectors, [L, n] arrays (the norms' scales), of each dtype concatenated
    into one [L, sum n] array, unpack(one layer's slices of those) -> the layer's leaves as given). The scan slices
    each leaf per layer, and XLA on the GPU copies a slice that no fusion takes in (a norm's scale: its fusion is a
    Triton normalisation) with a memcpy of its own, 1.8 us a layer on an H100: one slice of one packed array costs
    one memcpy for every norm of the layer. The vectors are never split over a mesh, so packing moves nothing."""
    groups: dict = {}
    for j, leaf in enumerate(leaves):
        if leaf is not None and leaf.ndim == 2:
            groups.setdefault(jnp.dtype(leaf.dtype), []).append(j)
    groups = [members for members in groups.values() if len(members) > 1]
    packed = {j for members in groups for j in members}
    scanned = [None if j in packed else leaf for j, leaf in enumerate(leaves)]
    scanned += [jnp.concatenate([leaves[j] for j in members], axis=1) for members in groups]

    def unpack(layer_leaves: list) -> list:
        layer = list(layer_leaves[: len(leaves)])
        for members, vectors in zip(groups, layer_leaves[len(leaves):]):
            offsets = np.cumsum([0] + [leaves[j].shape[1] for j in members])
            for j, start, end in zip(members, offsets[:-1], offsets[1:]):
                layer[j] = vectors[start:end]
        return layer

    return scanned, unpack


def per_layer(tree: dict) -> dict:
    """A tree whose "layers" are stacked (parameters, a draft tree) with them as {i: layer i's tree} instead, the
    layout checkpoints store: for inspecting a layer (its slices are copies)."""
    num_layers = jax.tree.leaves(tree["layers"])[0].shape[0]
    return tree | {"layers": {i: layer_of(tree["layers"], i) for i in range(num_layers)}}


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = stacked_layers(config, dtype, rngs)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (config.hidden_size, config.vocab_size), dtype)
            )

    def __call__(self, tokens, positions, kv_cache, attention: Attention, logit_rows, tp: TensorParallel,
                 lm_head=None, with_hidden=False, scan_layers: bool = True):
        rope = rope_tables(positions, jnp.asarray(rope_inverse_frequencies(self.config), jnp.float32))
        x = jnp.take(self.embed[...], tokens, axis=0)
        layer_graph, stacked = nnx.split(self.layers)

        def run_layer(i, layer_params, x, cache, attention):
            layer = nnx.merge(layer_graph, layer_params)
            if isinstance(cache, KVCache):
                # A dense layer's attention takes both stacks [L, B, T, H, D] and the layer index: it reads the
                # layer's rows where they lie and scatters only the new tokens' rows into the carried stacks, in
                # place (models.kv_cache.KVCache).
                x, (k, v), aux = layer(i, x, positions, rope, (cache.k, cache.v), attention, tp)
                return x, KVCache(k, v), aux
            # An NSA layer's attention likewise takes the stacks and the layer (NSACache.at_layer, an
            # models.nsa_cache.NSALayerCache view): it reads the layer in place and scatters only the rows it writes.
            x, layer_cache, aux = layer(i, x, positions, rope, cache.at_layer(i), attention, tp)
            return x, type(cache).of(layer_cache), aux

        num_layers = self.config.num_layers
        sliced, layer_params = split_quantized(stacked)
        if scan_layers and not layer_specific(attention):
            scanned, unpack = pack_vectors(sliced)

            def step(carry, layer_leaves):
                # The layer index is carried, not scanned over: a scanned jnp.arange is sliced per layer, and XLA
                # on the GPU makes that slice a memcpy of its own each layer (1.8 us on an H100).
                x, cache, i = carry
                x, cache, aux = run_layer(i, layer_params(i, unpack(layer_leaves)), x, cache, attention)
                return (x, cache, i + 1), aux

            (x, kv_cache, _), stacked_aux = jax.lax.scan(step, (x, kv_cache, jnp.int32(0)), scanned,
                                                         length=num_layers)
            # Per-layer aux as the unrolled layers return it (the selection policies stack the score rows again:
            # [L, B, T] floats, small beside the cache).
            aux_out = tuple(layer_of(stacked_aux, i) for i in range(num_layers))
        else:  # unrolled: the GPU speed comparison's baseline, and attentions that differ by layer
            aux_out = []
            for i in range(num_layers):
                x, kv_cache, aux = run_layer(i, layer_params(i, layer_of(sliced, i)), x, kv_cache, attention)
                aux_out.append(aux)
                if layer_specific(attention) and hasattr(attention, "after_layer"):  # hands a result on (nsa_approx)
                    attention = attention.after_layer(i, aux)
            aux_out = tuple(aux_out)
        hidden = x  # the last layer's output before the final norm: what a draft head reads (models.draft_head)
        if logit_rows is not None:  # only these rows need the (vocabulary-sized) LM head
            x = jnp.take_along_axis(x, logit_rows[:, :, None], axis=1)
        x = self.final_norm(x)
        if lm_head is not None:  # a tied model's draft pass: its own (quantized) copy of the embedding's transpose
            logits = vocabulary_logits("BSD,DV->BSV", x, lm_head)
        elif self.config.tie_word_embeddings:
            logits = vocabulary_logits("BSD,VD->BSV", x, self.embed[...])
        else:
            logits = vocabulary_logits("BSD,DV->BSV", x, self.lm_head.get_value())
        if with_hidden:
            return logits, kv_cache, aux_out, hidden
        return logits, kv_cache, aux_out


def layer_specific(attention) -> bool:
    """Whether `attention` behaves differently by layer (a static layer index decides what it does or returns, or
    it hands a layer's result to the next through `after_layer`): such an attention runs the layers unrolled,
    every other one the scanned body."""
    return bool(getattr(attention, "layer_specific", False))


@functools.lru_cache(maxsize=None)
def _split_abstract(config: ModelConfig):
    abstract = nnx.eval_shape(lambda: Decoder(config, jnp.float32, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def param_shapes(config: ModelConfig) -> Params:
    """The nested dict of parameter shapes (`{name: shape}`) that loaders must produce."""
    _, state = _split_abstract(config)
    return jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(state))


# Parameter name -> logical axes; parameters not listed (norm scales, embedding, LM head) are whole on every device.
# The embedding and LM head are replicated rather than split over the vocabulary: a split LM head needs its logits
# gathered (batch x rows x vocabulary floats) before sampling, which at SmolLM2's sizes moves more bytes per
# verification than the replicated head reads.
_PARAM_AXES = {
    "qkv_proj": Axes(None, HEADS, None),
    "qkv_bias": Axes(HEADS, None),
    "o_proj": Axes(HEADS, None, None),
    "branch_gate_proj": Axes(None, HEADS, None),
    "gate_up_proj": Axes(None, None, MLP),
    "down_proj": Axes(MLP, None),
}


def axes_of_param(name: str, ndim: int) -> Axes:
    """The logical axes of the parameter called `name` (its key in the parameter tree)."""
    return _PARAM_AXES.get(name, Axes(*(None,) * ndim))


def param_axes(params: Params) -> Params:
    """The logical axes of every parameter (any tree in the layout of param_shapes, arrays or shapes as leaves):
    a layer parameter's leading layer axis is never split over a mesh."""

    def axes(path, x):
        ndim = len(x) if isinstance(x, tuple) else x.ndim
        if path[0].key == "layers":
            return Axes(None, *axes_of_param(path[-1].key, ndim - 1))
        return axes_of_param(path[-1].key, ndim)

    return jax.tree_util.tree_map_with_path(axes, params, is_leaf=lambda x: isinstance(x, tuple))


def checkpoint_param_shapes(config: ModelConfig) -> Params:
    """The layout checkpoints store (and loaders fill): layer by layer ({i: layer}), q/k/v and gate/up projections
    apart, as in HF and GGUF files. `fuse_layer` turns a layer of it into the model's layout, `stack_layers` the
    fused layers into the model's stacked "layers"."""
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
    one_layer = jax.tree.map(lambda shape: shape[1:], shapes["layers"], is_leaf=lambda x: isinstance(x, tuple))
    one_layer = {k: v for k, v in one_layer.items() if k not in fused} | layer
    shapes["layers"] = {i: one_layer for i in range(config.num_layers)}
    return shapes


def fused_head_order(config: ModelConfig, shards: int) -> np.ndarray:
    """Where the fused q/k/v head axis of a model split over `shards` takes its heads from the plain order
    [q heads, k heads, v heads]: shard s's block is [its q heads, its k heads, its v heads], so a shard's slice is
    exactly a whole model's layout for its heads and the attention code (and kernels) run unchanged on it."""
    q, kv = config.num_heads // shards, config.num_kv_heads // shards
    k_start, v_start = config.num_heads, config.num_heads + config.num_kv_heads
    return np.concatenate([
        np.concatenate([np.arange(s * q, (s + 1) * q), k_start + np.arange(s * kv, (s + 1) * kv),
                        v_start + np.arange(s * kv, (s + 1) * kv)])
        for s in range(shards)
    ])


def fuse_layer(layer: dict, config: ModelConfig, shards: int = 1) -> dict:
    """One layer of host (numpy) arrays from the checkpoint layout to the model's, for a model split over `shards`
    devices of the mesh's model axis (fused_head_order)."""
    layer = dict(layer)
    order = fused_head_order(config, shards)
    fused = {"qkv_proj": np.concatenate([layer.pop(k) for k in ("q_proj", "k_proj", "v_proj")], axis=1)[:, order]}
    if "q_bias" in layer:
        fused["qkv_bias"] = np.concatenate([layer.pop(k) for k in ("q_bias", "k_bias", "v_bias")], axis=0)[order]
    fused["gate_up_proj"] = np.stack([layer.pop("gate_proj"), layer.pop("up_proj")], axis=1)
    return layer | fused


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
    tensor_parallel: TensorParallel = TensorParallel(),
    with_hidden: bool = False,
    scan_layers: bool = True,
) -> tuple[jax.Array, KVCache, tuple]:
    """Returns (logits [B, S or R, V] float32, updated kv_cache, per-layer attention aux), and with `with_hidden`
    the last layer's output before the final norm [B, S, D] (every row) after them. With tensor parallelism,
    params, cache and attention are this program's shard of them (`TensorParallel`); the logits are whole.

    A draft pass's params may hold QuantizedWeights in place of the linear weights (`draft_params`), and a tied
    model's an `lm_head` of its own (the quantized transpose of the embedding, which the lookup keeps reading).

    scan_layers: run the layers as one `lax.scan` body (one layer compiled, whatever the depth) rather than
    unrolled (one copy per layer); the results are the same. Unrolled is kept to compare decode speed."""
    lm_head = None
    if config.tie_word_embeddings and "lm_head" in params:
        params = dict(params)
        lm_head = params.pop("lm_head")
    graphdef, abstract_state = _split_abstract(tensor_parallel.local(config))
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, kv_cache, attention, logit_rows, tensor_parallel, lm_head, with_hidden,
                 scan_layers)
