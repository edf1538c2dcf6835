"""Parameters go to their devices as a loader produces them: a layer at a time, each device receiving only its
slice (`Placement.put`), so no loader holds the whole model on the host or on one device."""

from __future__ import annotations

import dataclasses
import functools

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import draft_weights
from models.config import ModelConfig
from models.decoder import axes_of_param, fuse_layer, fused_head_order, param_axes
from models.quantized import QuantizedWeight
from vegas_jax.sharding import Placement, check_model_fits

# The fused q/k/v head axis of the stacked layer parameters (behind the leading layer axis).
_FUSED_HEAD_AXIS = {"qkv_proj": 2, "qkv_bias": 1}


class ParamPlacer:
    def __init__(self, config: ModelConfig, dtype, mesh=None):
        self.config = config
        self.dtype = np.dtype(dtype)
        self.placement = Placement(mesh=mesh)
        check_model_fits(config, self.placement)  # before reading any tensor

    def tensor(self, name: str, host: np.ndarray) -> jax.Array:
        return self.placement.put(host, axes_of_param(name, np.ndim(host)), self.dtype)

    def tree(self, host: dict) -> dict:
        """A (nested) dict of host arrays in the model's layout, placed."""
        return {k: self.tree(v) if isinstance(v, dict) else self.tensor(k, v) for k, v in host.items()}

    def stack(self, layers: dict[int, dict]) -> dict:
        """The placed layers ({i: layer}, every index of the model) as the model's stacked "layers"."""
        return stack_placed([layers[i] for i in range(self.config.num_layers)])

    def layer(self, host: dict) -> dict:
        """One layer in the checkpoint layout (models.decoder.checkpoint_param_shapes), fused for the mesh's
        model axis and placed."""
        return self.tree(fuse_layer(host, self.config, self.placement.model_shards))


def stack_placed(layers: list) -> Any:
    """Per-layer trees of placed arrays as one tree of stacked arrays [L, ...], each split over the mesh as its
    layers were, the leading layer axis whole on every device. Both are held until the caller drops the layers:
    a transient second copy of the layer weights."""
    def stack(*xs):
        sharding = xs[0].sharding
        if isinstance(sharding, NamedSharding):
            out = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
            return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=out)(*xs)
        return jnp.stack(xs)

    return jax.tree.map(stack, *layers)


def relayout(params: dict, config: ModelConfig, from_shards: int, mesh=None) -> dict:
    """Parameters in the model's layout for `from_shards` model shards (device or host arrays) laid out for `mesh`
    (None: the default device): the fused q/k/v heads reordered (models.decoder.fused_head_order), every array
    moved to its shards."""
    placement = Placement(mesh=mesh)
    check_model_fits(config, placement)
    to_shards = placement.model_shards
    order = np.argsort(fused_head_order(config, from_shards))[fused_head_order(config, to_shards)]

    def move(x, axes, name):
        sharding = placement.sharding(axes)
        if name in _FUSED_HEAD_AXIS and from_shards != to_shards:
            return jax.jit(lambda x: jnp.take(x, order, axis=_FUSED_HEAD_AXIS[name]), out_shardings=sharding)(x)
        return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

    axes = param_axes(params)
    return jax.tree_util.tree_map_with_path(lambda path, x, a: move(x, a, path[-1].key), params, axes)


def quantize_draft(params: dict, config: ModelConfig, precision: str, mesh=None, given: dict | None = None) -> dict:
    """The draft tree (models.draft_weights) of placed parameters: each weight quantized on the devices that hold
    it, one weight at a time (a jitted quantizer per distinct shape), laid out by its logical axes. `given`: part
    of the tree already made (a checkpoint's own quantized blocks), kept as it is.
    DraftWeightsError when the model's shapes admit no draft of that precision."""
    placement = Placement(mesh=mesh)
    given = given or {"layers": {}}

    def made(name: str, w: jax.Array):
        fn = functools.partial(draft_weights.quantize_weight, config, name, precision=precision)
        layout = placement.shardings(draft_weights.weight_axes(name, jax.eval_shape(fn, w)))
        return _jitted(fn, layout, w.shape, str(w.dtype))(w)

    # Each layer's weight is quantized (or taken from `given`, whose layers are the checkpoint's, one by one)
    # from its slice of the stacked parameter, then the layers are stacked as the parameters are.
    layers = {}
    for name in draft_weights.LAYER_WEIGHTS:
        per_layer = [given["layers"].get(i, {}).get(name) or made(name, params["layers"][name][i])
                     for i in range(config.num_layers)]
        layers[name] = stack_placed(per_layer)
    head = given.get(draft_weights.LM_HEAD) or made(draft_weights.LM_HEAD, draft_weights.lm_head_source(params, config))
    return {"layers": layers, draft_weights.LM_HEAD: head}


_quantizers: dict = {}


def _jitted(fn: functools.partial, layout, shape, dtype):
    """One compiled quantizer per (weight, precision, layout, shape): layers of the same shapes compile once."""
    key = (fn.args, tuple(sorted(fn.keywords.items())), str(layout), shape, dtype)
    if key not in _quantizers:
        _quantizers[key] = jax.jit(fn, out_shardings=layout)
    return _quantizers[key]


def place_quantized(name: str, host: QuantizedWeight, dtype, mesh=None) -> QuantizedWeight:
    """A host QuantizedWeight (numpy values, scales, offsets) placed by its logical axes, scales and offsets in the
    model's dtype: each device receives only its slice."""
    placement = Placement(mesh=mesh)
    axes = draft_weights.weight_axes(name, host)
    return QuantizedWeight(
        placement.put(host.values, axes.values),
        placement.put(host.scale, axes.scale, dtype),
        None if host.offset is None else placement.put(host.offset, axes.offset, dtype),
        host.in_ndim,
    )


def relayout_draft(tree: dict, config: ModelConfig, from_shards: int, mesh=None) -> dict:
    """A draft tree made for `from_shards` model shards laid out for `mesh`: the fused q/k/v heads reordered as
    `relayout` reorders the parameters', every array moved to its shards. DraftWeightsError when its groups would
    straddle the new mesh's devices."""
    placement = Placement(mesh=mesh)
    to_shards = placement.model_shards
    order = np.argsort(fused_head_order(config, from_shards))[fused_head_order(config, to_shards)]

    def move(name: str, w: QuantizedWeight, stacked: bool = False) -> QuantizedWeight:
        # A stacked layer weight's groups are checked on one layer's shapes; its head axis is behind the layer's.
        layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), w) if stacked else w
        if layer.groups > 1:
            draft_weights.check_groups(config, name, layer.group_size, to_shards)
        axes = draft_weights.weight_axes(name, w, stacked)
        head_axis = 2 if stacked else 1

        def one(x, x_axes):
            if x is None:
                return None
            if name == "qkv_proj" and from_shards != to_shards:
                return jax.jit(lambda x: jnp.take(x, order, axis=head_axis),
                               out_shardings=placement.sharding(x_axes))(x)
            sharding = placement.sharding(x_axes)
            return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

        return dataclasses.replace(w, values=one(w.values, axes.values), scale=one(w.scale, axes.scale),
                                   offset=one(w.offset, axes.offset))

    return {
        "layers": {n: move(n, w, stacked=True) for n, w in tree["layers"].items()},
        draft_weights.LM_HEAD: move(draft_weights.LM_HEAD, tree[draft_weights.LM_HEAD]),
    }
