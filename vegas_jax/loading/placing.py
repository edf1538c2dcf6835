"""Parameters go to their devices as a loader produces them: a layer at a time, each device receiving only its
slice (`Placement.put`), so no loader holds the whole model on the host or on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decoder import axes_of_param, fuse_layer, fused_head_order
from vegas_jax.sharding import Placement, check_model_fits

_FUSED_HEAD_AXIS = {"qkv_proj": 1, "qkv_bias": 0}


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

    def layer(self, host: dict) -> dict:
        """One layer in the checkpoint layout (models.decoder.checkpoint_param_shapes), fused for the mesh's
        model axis and placed."""
        return self.tree(fuse_layer(host, self.config, self.placement.model_shards))


def relayout(params: dict, config: ModelConfig, from_shards: int, mesh=None) -> dict:
    """Parameters in the model's layout for `from_shards` model shards (device or host arrays) laid out for `mesh`
    (None: the default device): the fused q/k/v heads reordered (models.decoder.fused_head_order), every array
    moved to its shards."""
    placement = Placement(mesh=mesh)
    check_model_fits(config, placement)
    to_shards = placement.model_shards
    order = np.argsort(fused_head_order(config, from_shards))[fused_head_order(config, to_shards)]

    def move(path, x):
        name = path[-1].key
        sharding = placement.sharding(axes_of_param(name, x.ndim))
        if name in _FUSED_HEAD_AXIS and from_shards != to_shards:
            return jax.jit(lambda x: jnp.take(x, order, axis=_FUSED_HEAD_AXIS[name]), out_shardings=sharding)(x)
        return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

    return jax.tree_util.tree_map_with_path(move, params)
