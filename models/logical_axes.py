"""Logical axis names of the arrays a decoder runs on, which a device mesh maps onto its axes (vegas_jax.sharding).

Arrays say what their axes mean (`batch`, `heads`, ...), never which devices hold them: a dataclass field declares
its array's axes with `axes_field`, and `axes_of` turns a pytree of such dataclasses into the same pytree with an
`Axes` value at every array. Code that moves or shards whole states (the mesh programs, continuous batching's row
admission) reads the axes instead of listing fields by name, so a field added later cannot be forgotten there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

BATCH = "batch"  # one row per sequence (request)
HEADS = "heads"  # query heads, or q/k/v heads fused per shard (models.decoder.fuse_layer)
KV_HEADS = "kv_heads"
MLP = "mlp"  # the MLP's intermediate units


class Axes(tuple):
    """One array's logical axis names, None for an axis no mesh splits. A tuple subclass, so a pytree leaf."""

    def __new__(cls, *names: str | None):
        return super().__new__(cls, names)

    def replace(self, name: str, by: str | None) -> "Axes":
        return Axes(*(by if n == name else n for n in self))


def axes_field(*names: str | None, **kwargs) -> Any:
    """A dataclass field holding an array (or a tuple of arrays) whose axes are `names`."""
    return dataclasses.field(metadata={"axes": Axes(*names)}, **kwargs)


def axes_of(tree: Any) -> Any:
    """`tree` (dataclasses with `axes_field`s, tuples, lists and None; arrays or ShapeDtypeStructs as leaves) with
    each array replaced by its Axes. An array whose axes nothing declares is an error, never a silent default."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        values = {}
        for f in dataclasses.fields(tree):
            if f.metadata.get("static"):
                continue
            value = getattr(tree, f.name)
            declared = f.metadata.get("axes")
            values[f.name] = axes_of(value) if declared is None else _declare(value, declared, f.name)
        return dataclasses.replace(tree, **values)
    if isinstance(tree, (tuple, list)):
        return type(tree)(axes_of(x) for x in tree)
    if tree is None:
        return None
    raise TypeError(f"no logical axes declared for {type(tree).__name__} {getattr(tree, 'shape', '')}")


def _declare(value: Any, axes: Axes, name: str) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_declare(x, axes, name) for x in value)
    if value is None:
        return None
    if len(value.shape) != len(axes):
        raise ValueError(f"field {name}: an array of shape {value.shape} declared with axes {axes}")
    return axes
