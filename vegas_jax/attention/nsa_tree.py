"""NSA attention over the nodes of a draft tree (vegas_jax.decode.tree_shapes; rows and positions as in
vegas_jax.attention.tree: node j's K/V in scratch row base + j, its RoPE position base + its depth): the exact
verification pass, and the self drafter's cheaper pass.

- NSATreeVerify: every node attends exactly as plain NSA decoding of its root-to-node path would
  (pallas_kernels.nsa_verify.nsa_tree_verify: each node's selection computed in the pass, the compressed blocks its
  path completes included; the selected rows through TREE_SCHEDULE, as Pallas kernels on the kernel backend
  and as their XLA twin elsewhere). Only the nodes' raw K/V are written (to their scratch rows); the compressed
  rows of the blocks a path completes are pooled when the accepted path is committed (NSAFamily.commit_path).
  With an approximate mode (vegas_jax.ssv.precision.ApproxMode) it verifies the mode's modified target instead:
  refresh layers give each node its span anchor's selection (the node's, an ancestor's, or the span's stored in
  the cache), reuse layers the nearest refresh layer's (vegas_jax.attention.nsa_approx.tree_reselect).
- SinkWindowDraft, the self drafter of an NSA model: one softmax over the sink rows [0, sink), the `window` rows
  before the tree and the node's own path; no compressed or selected branch, no gates. It reads
  sink + window + nodes rows per node whatever the context, which is what makes it cheap; its output is not the
  target's, and need not be: verification decides what is emitted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import NSALayout
from models.kv_cache import write_layer_rows
from models.nsa_cache import NSALayerCache
from pallas_kernels.nsa_tree_select import V1Launch
from pallas_kernels.nsa_verify import nsa_tree_verify
from vegas_jax.attention.core import masked_attention
from vegas_jax.attention.nsa_approx import ApproxLayerCache, tree_reselect
from vegas_jax.ssv.precision import ApproxMode
from vegas_jax.sharding import Placement


def kernels_of(placement: Placement) -> str | None:
    """nsa_tree_verify's `kernels` for a backend: None (XLA) on the reference backend."""
    if not placement.uses_kernels:
        return None
    return "interpret" if placement.interpret else "pallas"


def write_tree_rows(cache, k: jax.Array, v: jax.Array, rows: jax.Array):
    """The nodes' rotated k, v [B, S, H_kv, D] in their scratch rows [B, S] of an NSA layer cache (or an
    approximate mode's; with stacks, scattered into the layer's in place); the compressed rows and stored
    selections untouched."""
    if isinstance(cache, ApproxLayerCache):
        return dataclasses.replace(cache, nsa=write_tree_rows(cache.nsa, k, v, rows))
    return dataclasses.replace(cache, k=write_layer_rows(cache.k, cache.layer, k, rows),
                               v=write_layer_rows(cache.v, cache.layer, v, rows))


def raw_rows(cache) -> NSALayerCache:
    return cache.nsa if isinstance(cache, ApproxLayerCache) else cache


# V0 (each node its own blocks), not V1's union: the H200 ran the whole pass faster with V0 in every cell measured,
# 0.68-0.98x V1's time at NSA-1B's shapes (8K-128K, 16-64 nodes) and 0.84x at the loop's own (SmolLM2's view,
# batch 8 x 8K, a 4x2 tree's 31 nodes; docs/nsa-ssv.md): blocks of 16 keys make
# V0's re-reads cheap.
TREE_SCHEDULE = "v0"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NSATreeVerify:
    """The verification pass of a draft tree over NSA layer caches (models.attention.FamilyAttention), of the
    exact target or of `mode`'s modified target (ApproxLayerCaches then). The pass's new tokens are the tree's rows
    in order (node 0, the root, first). aux: each node's selected blocks [B, R, H_kv, n] (n: the mode's widened
    top_n) with a mode or return_blocks, else None. `carried`: the last refresh layer's, in this pass."""

    base: jax.Array  # [B] int32 the root's row (the committed length)
    parents: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # the tree (vegas_jax.decode.tree_shapes.TreeShape)
    layout: NSALayout = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(default="nsa", metadata=dict(static=True))
    placement: Placement = dataclasses.field(default=Placement(), metadata=dict(static=True))
    schedule: str = dataclasses.field(default=TREE_SCHEDULE, metadata=dict(static=True))
    return_blocks: bool = dataclasses.field(default=False, metadata=dict(static=True))
    mode: ApproxMode | None = dataclasses.field(default=None, metadata=dict(static=True))
    carried: jax.Array | None = None  # [B, R, H_kv, n]

    def __call__(self, layer, new, positions, cache):
        q, k, v = new.rotated()
        parents = np.asarray(self.parents, np.int32)  # static: the tree's masks are constants (ancestor_mask)
        mode = self.mode
        layout = self.layout if mode is None else mode.selection_layout(self.layout)
        stored = injected = None
        if mode is not None and not mode.refreshes(layer):
            injected = self.carried
        elif mode is not None and mode.share_span > 1:  # the root's span, read by nodes whose anchor precedes it
            slot = jnp.clip(self.base // mode.share_span, 0, cache.spans.shape[-3] - 1)
            index = (jnp.arange(self.base.shape[0]), slot)
            stored = cache.spans[index if cache.nsa.layer is None else (cache.nsa.layer, *index)]  # [B, H_kv, n]

        batch, num_nodes, num_q_heads = q.shape[:3]
        num_kv_heads = k.shape[2]
        launch = V1Launch.for_batch(batch, num_kv_heads, num_nodes * (num_q_heads // num_kv_heads))

        def one(q, layer_cache, k, v, gates, length, stored, injected, stacks, seq):
            reselect = None if mode is None else tree_reselect(mode, stored, injected)
            return nsa_tree_verify(q, layer_cache, k, v, gates, length, parents, layout=layout, kind=self.kind,
                                   schedule=self.schedule, kernels=kernels_of(self.placement), v1_launch=launch,
                                   batch=batch, return_blocks=True, reselect=reselect, stacks=stacks, seq=seq)

        # The nodes' rows are written first and the pass reads the written cache (it reads only rows before the
        # root, and masks the rest by position, so the result is the same): had it read the cache as it came, XLA
        # could not order the reads before the write and would copy every layer's K and V once an iteration.
        rows = self.base[:, None] + jnp.arange(len(self.parents))[None, :]
        cache = write_tree_rows(cache, k, v, rows)
        raw = raw_rows(cache)
        # The sequences are mapped over the stacks' batch axis 1 where they lie; the layer is shared. The kernels
        # take that mapped view (Pallas's batching indexes the block, the stacks stay as they lie). The jnp row
        # gathers (the prefix rows of the compressed blocks a path completes, the window, the selected rows without
        # kernels) would batch from the mapped view as gathers whose operand JAX moves to axis 0, a transpose of
        # the whole raw stacks in the lowered program (on the GPU possibly a copy of the cache per layer and pass);
        # so they read the whole stacks passed unmapped, at the sequence's index (mapped): stacks[layer, b, rows],
        # batched through the gather's indices alone (issue 52; tests/test_scan_layers_in_place.py).
        if raw.layer is None:
            in_cache, stacks, seqs = 0, None, None
        else:
            in_cache, stacks, seqs = NSALayerCache(1, 1, 1, 1, None), raw, jnp.arange(batch)
        out, blocks = jax.vmap(one, in_axes=(0, in_cache, 0, 0, 0, 0, 0, 0, None, 0))(
            q, raw, k, v, new.gates, self.base, stored, injected, stacks, seqs)
        keep = self.return_blocks or mode is not None
        return out, cache, blocks if keep else None

    @property
    def layer_specific(self) -> bool:
        """A mode's refresh and reuse layers differ and hand selections on: the decoder runs them unrolled."""
        return self.mode is not None

    def after_layer(self, layer: int, aux) -> "NSATreeVerify":
        """The next layer's attention: a refresh layer's selections carried on (models.decoder calls it)."""
        if self.mode is not None and self.mode.refreshes(layer):
            return dataclasses.replace(self, carried=aux)
        return self


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

    def __call__(self, layer, new, positions, cache):
        q, k, v = new.rotated()
        cache = write_tree_rows(cache, k, v, self.rows)
        raw = raw_rows(cache)
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
        safe = jnp.clip(rows, 0, raw.capacity - 1)
        if raw.layer is None:
            gather = lambda x: jnp.take_along_axis(x, safe[:, :, None, None], axis=1)
        else:  # the layer's rows straight from the stacks
            gather = lambda x: x[raw.layer, jnp.arange(batch)[:, None], safe]
        return masked_attention(q, gather(raw.k), gather(raw.v), mask), cache, None
