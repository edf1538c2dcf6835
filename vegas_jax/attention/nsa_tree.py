"""NSA attention over the nodes of a draft tree (vegas_jax.tree; rows and positions as in
vegas_jax.attention.tree: node j's K/V in scratch row base + j, its RoPE position base + its depth): the exact
verification pass, and the self drafter's cheaper pass.

- NSATreeVerify: every node attends exactly as plain NSA decoding of its root-to-node path would
  (pallas_kernels.nsa_verify.nsa_tree_verify: each node's selection computed in the pass, the compressed blocks its
  path completes included; the selected rows through V1's union schedule, as Pallas kernels on the kernel backend
  and as their XLA twin elsewhere). Only the nodes' raw K/V are written (to their scratch rows); the compressed
  rows of the blocks a path completes are pooled when the accepted path is committed (NSAFamily.commit_path).
- SinkWindowDraft, the self drafter of an NSA model: one softmax over the sink rows [0, sink), the `window` rows
  before the tree and the node's own path; no compressed or selected branch, no gates. It reads
  sink + window + nodes rows per node whatever the context, which is what makes it cheap; its output is not the
  target's, and need not be: verification decides what is emitted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import NSALayout
from models.kv_cache import write_rows
from models.nsa_cache import NSALayerCache
from pallas_kernels.nsa_verify import nsa_tree_verify
from vegas_jax.attention.core import masked_attention
from vegas_jax.sharding import Placement


def kernels_of(placement: Placement) -> str | None:
    """nsa_tree_verify's `kernels` for a backend: None (XLA) on the reference backend."""
    if not placement.uses_kernels:
        return None
    return "interpret" if placement.interpret else "pallas"


def write_tree_rows(cache: NSALayerCache, k: jax.Array, v: jax.Array, rows: jax.Array) -> NSALayerCache:
    """The nodes' rotated k, v [B, S, H_kv, D] in their scratch rows [B, S]; the compressed rows untouched."""
    return dataclasses.replace(cache, k=write_rows(cache.k, k, rows), v=write_rows(cache.v, v, rows))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSATreeVerify:
    """The verification pass of a draft tree over NSA layer caches (models.attention.FamilyAttention). The pass's
    new tokens are the tree's rows in order (node 0, the root, first). aux: each node's selected blocks
    [B, R, H_kv, top_n] with return_blocks, else None."""

    base: jax.Array  # [B] int32 the root's row (the committed length)
    parents: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # the tree (vegas_jax.tree.TreeShape)
    layout: NSALayout = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(default="nsa", metadata=dict(static=True))
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))
    schedule: str = dataclasses.field(default="v1", metadata=dict(static=True))
    return_blocks: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __call__(self, layer, new, positions, cache: NSALayerCache):
        q, k, v = new.rotated()
        parents = jnp.asarray(self.parents, jnp.int32)

        def one(q, layer_cache, k, v, gates, length):
            return nsa_tree_verify(q, layer_cache, k, v, gates, length, parents, layout=self.layout, kind=self.kind,
                                   schedule=self.schedule, kernels=kernels_of(self.placement), return_blocks=True)

        out, blocks = jax.vmap(one)(q, cache, k, v, new.gates, self.base)
        rows = self.base[:, None] + jnp.arange(len(self.parents))[None, :]
        return out, write_tree_rows(cache, k, v, rows), blocks if self.return_blocks else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SinkWindowDraft:
    """The self drafter's attention on an NSA model (module docstring) for one level of a tree: new tokens at
    rows [B, S], seeing the tree rows base + r where ancestors [S, R] holds."""

    rows: jax.Array  # [B, S] int32
    base: jax.Array  # [B] int32
    ancestors: jax.Array  # [S, R] bool
    sink: int = dataclasses.field(metadata=dict(static=True))
    window: int = dataclasses.field(metadata=dict(static=True))

    def __call__(self, layer, new, positions, cache: NSALayerCache):
        q, k, v = new.rotated()
        cache = write_tree_rows(cache, k, v, self.rows)
        batch, width = self.base.shape[0], self.ancestors.shape[1]
        base = self.base[:, None]
        sink = jnp.broadcast_to(jnp.arange(self.sink)[None, :], (batch, self.sink))
        recent = base - self.window + jnp.arange(self.window)[None, :]
        tree = base + jnp.arange(width)[None, :]
        rows = jnp.concatenate([sink, recent, tree], axis=1)  # [B, N]
        # The window's rows inside the sink are counted there; rows before 0 are none.
        prefix = jnp.concatenate([sink < base, recent >= self.sink], axis=1)  # [B, sink + window]
        mask = jnp.concatenate([jnp.broadcast_to(prefix[:, None, :], (batch, q.shape[1], prefix.shape[1])),
                                jnp.broadcast_to(self.ancestors[None], (batch,) + self.ancestors.shape)], axis=2)
        safe = jnp.clip(rows, 0, cache.capacity - 1)
        gather = lambda x: jnp.take_along_axis(x, safe[:, :, None, None], axis=1)
        return masked_attention(q, gather(cache.k), gather(cache.v), mask), cache, None
