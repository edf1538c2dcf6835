"""Which weights a draft pass reads quantized, in what layout, and their logical axes.

The draft tree holds a QuantizedWeight (models.quantized) for each layer's fused q/k/v, o, fused gate/up and down
projections, and for the LM head; everything else (norms, the embedding lookup, Qwen2's q/k/v bias) the draft reads
from the model's own parameters (`models.quantized.overlay`). The LM head is quantized too: at a vocabulary of
128K it is a large read of every draft step (6 % of Llama-3.1-8B's weights, a fifth of SmolLM2's), and since
verification decides every token a coarser head costs acceptance, never correctness; but never below int8
(`precision_of`): SmolLM2's int4 drafts, whose layers were the very weights the model runs (the GGUF's own Q4_1
blocks), reached only 0.84x the τ of bf16 drafts with an int4 head (H200, 2026-12-01,
benchmarks/results/draft-precision-2026-12-01-real-s16-real.json): the head, which makes the logits, is where a
draft's error shows. A tied model's draft head is the quantized transpose of its embedding.

Quantized codes keep the original weight's output axes, and with them its logical axes; the contracted axes are
flattened into one (o's [heads, head_dim] into heads x head_dim, split over devices in contiguous blocks of whole
heads as before; int4 codes packed two a byte within each group, so a device's block of bytes holds whole
groups), and groups of the scales split with it where it is split (row-parallel o and down).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from models.config import ModelConfig
from models.decoder import axes_of_param
from models.logical_axes import Axes
from models.quantized import QuantizedWeight, group_size_for, quantize

# Per quantized weight: (its number of axes, how many leading ones the projection contracts).
LAYER_WEIGHTS = {"qkv_proj": (3, 1), "o_proj": (3, 2), "gate_up_proj": (3, 1), "down_proj": (2, 1)}
LM_HEAD = "lm_head"
_LAYOUT = LAYER_WEIGHTS | {LM_HEAD: (2, 1)}


class DraftWeightsError(ValueError):
    """The model's shapes (or a checkpoint's blocks on this mesh) admit no quantized draft of this precision."""


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The full-precision shapes of the weights the draft quantizes (the LM head as [hidden, vocabulary])."""
    c, qkv_heads = config, config.num_heads + 2 * config.num_kv_heads
    return {
        "qkv_proj": (c.hidden_size, qkv_heads, c.head_dim),
        "o_proj": (c.num_heads, c.head_dim, c.hidden_size),
        "gate_up_proj": (c.hidden_size, 2, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
        LM_HEAD: (c.hidden_size, c.vocab_size),
    }


def _in_ndim(name: str) -> int:
    return _LAYOUT[name][1]


def _full_axes(name: str) -> Axes:
    return axes_of_param(name, _LAYOUT[name][0])


def local_input(config: ModelConfig, name: str, model_shards: int) -> int:
    """Input positions of `name` held by one device."""
    k = math.prod(weight_shapes(config)[name][: _in_ndim(name)])
    return k // model_shards if _full_axes(name)[0] is not None else k


def largest_model_axis(config: ModelConfig) -> int:
    """The most model shards this model can be split over (vegas_jax.sharding.check_model_fits: a model axis
    divides the KV heads, the query heads and the MLP units)."""
    return math.gcd(config.num_kv_heads, config.num_heads, config.intermediate_size)


def int4_group(config: ModelConfig, name: str) -> int:
    """The int4 group size of `name`: the largest preferred size that tiles one device's input positions on any
    mesh the model can run on, so that the draft weights (and with them the drafts) do not depend on the mesh."""
    k = local_input(config, name, largest_model_axis(config))
    group = group_size_for(k)
    if group is None:
        raise DraftWeightsError(f"int4 draft weights: {name}'s {k} input positions per device on its largest model "
                                f"axis ({largest_model_axis(config)}) are not a multiple of 32")
    return group


def check_groups(config: ModelConfig, name: str, group: int, model_shards: int) -> None:
    """A group size (a checkpoint's own blocks) must tile one device's slice of the input axis."""
    k = local_input(config, name, model_shards)
    if k % group:
        raise DraftWeightsError(f"{name}: groups of {group} input positions straddle devices ({k} per device on "
                                f"{model_shards} model shards)")


def precision_of(name: str, precision: str) -> str:
    """The precision of weight `name` in a draft of `precision`: the LM head's is never below int8."""
    return "int8" if name == LM_HEAD else precision


def quantize_weight(config: ModelConfig, name: str, w: jax.Array, precision: str):
    """One weight in its draft form (of the draft precision `precision`: `precision_of`); the LM head from
    `lm_head_source` (a tied model's embedding, transposed here so that no transposed copy is ever made outside the
    quantizer)."""
    if name == LM_HEAD and config.tie_word_embeddings:
        w = w.T
    precision = precision_of(name, precision)
    group = int4_group(config, name) if precision == "int4" else None
    return quantize(w, precision, _in_ndim(name), group)


def lm_head_source(params: dict, config: ModelConfig) -> jax.Array:
    """What the draft's LM head is quantized from: the LM head, or a tied model's embedding."""
    return params["embed"] if config.tie_word_embeddings else params[LM_HEAD]


def quantize_params(params: dict, config: ModelConfig, precision: str) -> dict:
    """The draft tree of `params` (jnp; works under jax.eval_shape for shapes alone): its "layers" stacked as the
    parameters' are, each layer's weight quantized on its own."""
    layers = {
        name: jax.vmap(lambda w, name=name: quantize_weight(config, name, w, precision))(params["layers"][name])
        for name in LAYER_WEIGHTS
    }
    head = quantize_weight(config, LM_HEAD, lm_head_source(params, config), precision)
    return {"layers": layers, LM_HEAD: head}


def weight_axes(name: str, weight: QuantizedWeight, stacked: bool = False) -> QuantizedWeight:
    """The logical axes of one quantized weight's arrays (a QuantizedWeight of Axes); `stacked`: every layer's,
    behind a leading layer axis that no mesh splits."""
    full = _full_axes(name)
    k_axis, out_axes = full[0], tuple(full[_in_ndim(name):])
    if any(a is not None for a in full[1 : _in_ndim(name)]):
        raise ValueError(f"{name}: only the outermost contracted axis may be split")
    groups = weight.scale.shape[1 if stacked else 0]
    group_axis = k_axis if groups > 1 else None  # one group (per channel): whole on every device
    layer = (None,) if stacked else ()
    offset = None if weight.offset is None else Axes(*layer, group_axis, *out_axes)
    return dataclasses.replace(weight, values=Axes(*layer, k_axis, *out_axes),
                               scale=Axes(*layer, group_axis, *out_axes), offset=offset, kernel=None)


def draft_axes(tree: dict) -> dict:
    """The logical axes of a draft tree (arrays or ShapeDtypeStructs as leaves), in its structure."""
    return {
        "layers": {name: weight_axes(name, w, stacked=True) for name, w in tree["layers"].items()},
        LM_HEAD: weight_axes(LM_HEAD, tree[LM_HEAD]),
    }


def leaves_with_axes(tree: dict) -> list[tuple[Any, Axes]]:
    """(array, its Axes) for every array of a draft tree."""
    is_axes = lambda x: isinstance(x, Axes)  # noqa: E731
    return list(zip(jax.tree.leaves(tree), jax.tree.leaves(draft_axes(tree), is_leaf=is_axes)))
