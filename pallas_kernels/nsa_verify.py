"""Exact NSA verification of a draft tree: T tree queries (T <= 64) of one sequence, node i at position
L + depth[i] (L: the committed length; the cache holds rows [0, L) and the compressed rows of the blocks complete
before L), each attending as plain NSA decoding of its root-to-node path would (ssv-nsa.md 4.3). The tree's own
rotated K/V come as separate rows, visible to a node through the ancestor(-or-self) mask.

Per node, the selection is computed in the pass: compressed scores over the prefix's complete compressed rows
(read once for all nodes) plus the blocks that the node's path completes, whose compressed keys are the mean of
their prefix rows and the path's rows; then the layout's top-n rule (models.nsa_selection).

Two schedules of the selected-block reads, equal in their results:
- V0: every node gathers its own top_n blocks (a KV group's heads share them): T * top_n block reads.
- V1, the exact union schedule: per KV head the union U of all nodes' blocks (union_schedule), each block read
  once for all T * G query rows, with a per-block row mask [T, |U|] keeping each node to its own blocks.
The selected prefix rows go through the Pallas kernels of pallas_kernels.nsa_tree_select or through XLA
gathers, and the compressed branch over the prefix's rows (output and selection probabilities) through those of
pallas_kernels.nsa_tree_compressed or its XLA twin; the compressed rows the paths complete, the window and the
tree's own rows (ancestor-masked) are XLA, the window's and the tree's rows one key set of one softmax, and the
segments of a branch are merged by their log-sum-exps; for an NSA view with V0's kernels the window's and the
tree's rows are read by the selected branch's kernel itself (nsa_tree_select.v0_view). `nsa_tree_reference` is
the oracle twin, which copies the cache per node, writes the node's path into it and decodes
(pallas_kernels.nsa_decode_reference).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import NSALayout
from models.nsa_cache import NSALayerCache, write_tokens
from models.nsa_selection import NO_BLOCK, num_select_blocks, select_blocks, selection_scores
from pallas_kernels.nsa_decode import nsa_decode_reference
from pallas_kernels.nsa_tree_compressed import compressed_tree_branch, compressed_tree_branch_reference
from pallas_kernels.nsa_tree_select import V1Launch, v0_selected, v0_view, v1_selected
from pallas_kernels.top_n import top_n

MAX_TREE_NODES = 64


def union_schedule(blocks: jax.Array, num_blocks: int):
    """V1's schedule from per-node blocks [T, H_kv, n] (NO_BLOCK pads): (union [H_kv, U] ascending, NO_BLOCK
    after the count; count [H_kv]; member [H_kv, T, U]: node t selected union block u), U = min(T n, num_blocks)."""
    num_nodes, num_kv_heads, top_n = blocks.shape
    width = min(num_nodes * top_n, num_blocks)
    chosen = jnp.zeros((num_kv_heads, num_blocks + 1), bool)
    heads = jnp.arange(num_kv_heads)[:, None]
    flat = jnp.where(blocks >= 0, blocks, num_blocks).transpose(1, 0, 2).reshape(num_kv_heads, -1)
    chosen = chosen.at[heads, flat].set(True)[:, :num_blocks]
    count = chosen.sum(axis=1)
    # A chosen block's slot is the number of chosen blocks before it: a prefix sum, not a sort of every block.
    slot = jnp.where(chosen, jnp.cumsum(chosen, axis=1) - 1, width)  # width: dropped
    union = jnp.full((num_kv_heads, width), NO_BLOCK, jnp.int32).at[heads, slot].set(
        jnp.arange(num_blocks, dtype=jnp.int32)[None], mode="drop")
    # Each node's blocks marked at their slots: T n writes, where comparing every node's blocks with every union
    # slot was a [H_kv, T, U, n] reduction (most likely the 17 us reduce fusion of a batch-8 64-node tree's 80 us
    # selected branch on the H200, 2026-12-03).
    slots = jnp.take_along_axis(jnp.pad(slot, ((0, 0), (0, 1)), constant_values=width), flat, axis=1)  # pads: width
    member = jnp.zeros((num_kv_heads, num_nodes, width), bool).at[
        heads[:, :, None], jnp.arange(num_nodes)[None, :, None], slots.reshape(num_kv_heads, num_nodes, top_n)].set(
        True, mode="drop")
    return union, count, member


def _path_rows(parents: jax.Array, depth: jax.Array) -> jax.Array:
    """[T, R]: the node at depth r on node i's root path (R = T), -1 past depth[i]."""
    num_nodes = parents.shape[0]

    def ancestor_at(i):
        def step(r, carry):
            node, rows = carry
            at = jnp.where(depth[i] - r >= 0, depth[i] - r, num_nodes)  # past the root: dropped
            rows = rows.at[at].set(node, mode="drop")
            return jnp.where(node >= 0, parents[jnp.maximum(node, 0)], -1), rows
        return jax.lax.fori_loop(0, num_nodes, step, (i, jnp.full((num_nodes,), -1, jnp.int32)))[1]

    rows = jax.vmap(ancestor_at)(jnp.arange(num_nodes))
    return jnp.where(jnp.arange(num_nodes)[None] <= depth[:, None], rows, -1)


def ancestor_mask(parents) -> jax.Array:
    """[T, T] bool: node j is node i or one of its ancestors (parents[i] < i, -1 for the root). A static tree
    (a tuple or numpy array, as decoding's) gives a numpy constant: traced, the mask costs T dependent gathers,
    in every layer of every verification pass that traces it."""
    xp = np if isinstance(parents, (tuple, list, np.ndarray)) else jnp
    parents = xp.asarray(parents)
    num_nodes = parents.shape[0]
    mask = xp.eye(num_nodes, dtype=bool)
    for _ in range(num_nodes):
        mask = mask | xp.where(parents[:, None] >= 0, mask[xp.maximum(parents, 0)], False)
    return mask


def tree_depths(parents: jax.Array) -> jax.Array:
    return ancestor_mask(parents).sum(axis=1) - 1


def nsa_tree_reference(q, cache: NSALayerCache, tree_k, tree_v, gates, length, parents, *, layout: NSALayout,
                       kind: str = "nsa"):
    """Oracle twin, one sequence: node i's output [T, H_q, D] by decoding its path. q [T, H_q, D] rotated;
    cache: one sequence's layer cache [1, ...] holding rows [0, length); tree_k, tree_v [T, H_kv, D] rotated;
    gates [T, H_q, 3] or None; parents [T] int32 (parents[i] < i; -1: the root)."""
    depth = tree_depths(parents)
    path = _path_rows(parents, depth)  # [T, R]
    positions = jnp.where(path >= 0, length + jnp.arange(path.shape[1])[None], cache.capacity)  # dropped

    def one(i):
        rows = jnp.maximum(path[i], 0)
        node_cache = write_tokens(cache, tree_k[rows][None], tree_v[rows][None], positions[i][None], layout)
        g = None if gates is None else gates[i][None]
        return nsa_decode_reference(q[i][None], node_cache.k, node_cache.v, node_cache.k_cmp, node_cache.v_cmp,
                                    (length + depth[i])[None], g, layout=layout, kind=kind)[0]

    return jax.vmap(one)(jnp.arange(q.shape[0]))


def _ancestors_by_depth(anc) -> jax.Array:
    """[T, R]: the node at depth r on node i's root path (itself at its own depth), -1 past its depth; from the
    ancestor mask [T, T]. R is the tree's depth plus one for a static tree (a numpy mask, as decoding's), T for a
    traced one."""
    xp = np if isinstance(anc, np.ndarray) else jnp
    depth = anc.sum(axis=1) - 1
    levels = int(depth.max()) + 1 if xp is np else anc.shape[0]
    at = anc[:, None, :] & (depth[None, None, :] == xp.arange(levels)[None, :, None])  # [T, R, T_j]
    return xp.where(at.any(axis=-1), at.argmax(axis=-1), -1)


def _masked(logits, mask):
    return jnp.where(mask, logits, -jnp.inf)


def _segment(logits, values):
    """A softmax over one segment of keys: logits [H_kv, G, T, N] (-inf masked), values(p) [T, H_kv, G, D].
    Returns (o normalised [T, H_kv, G, D], lse [T, H_kv, G]; -inf and zero for a row that sees nothing)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return values(p), jnp.moveaxis(lse, 2, 0)


def _merge(*segments):
    """One softmax over several segments' keys, from each segment's (o, lse)."""
    lse = functools.reduce(jnp.logaddexp, [s[1] for s in segments])
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight = lambda s_lse: jnp.where(jnp.isfinite(s_lse), jnp.exp(s_lse - safe), 0.0)[..., None]
    return sum(weight(s_lse) * o for o, s_lse in segments)


def _row_source(cache: NSALayerCache, stacks: NSALayerCache | None, seq):
    """(k, v, lead) the XLA row gathers read from: x[(*lead, *index)] is one sequence's rows `index` of its layer.
    The sequence's own arrays [T_cap, ...] (lead ()), its stacks [L, T_cap, ...] ((layer,)), or the caller's whole
    stacks [L, B, T_cap, ...] with the sequence's index ((layer, seq)): under the caller's vmap the whole stacks
    are unmapped and seq mapped, a gather JAX batches through its indices, never moving the stacks' axes (a gather
    from the mapped view [L, T_cap, ...] of stacks batched at axis 1 is lowered with a transpose of the stacks)."""
    if stacks is not None:
        return stacks.k, stacks.v, (stacks.layer, seq)
    return cache.k, cache.v, (() if cache.layer is None else (cache.layer,))


def _layer_rows(cache: jax.Array, lead: tuple, *index) -> jax.Array:
    """cache[(*lead, *index)]: the rows `index` of a sequence's layer (_row_source), gathered in place."""
    return cache[(*lead, *index)]


def _path_compressed(cache_rows, lead, tree_rows, anc, positions, length, layout: NSALayout, num_nodes: int):
    """The compressed rows that node paths complete: blocks c0 + e whose last row is at or past `length`, e <
    E = (T + l) // d + 1. Returns (their rows c [E], valid [T, E]: complete at the node, pooled [T, E, H_kv, D]
    float32: the mean of the block's prefix rows (cache_rows[(*lead, rows)], _row_source) and of the node's path
    rows (tree_rows [T, H_kv, D], at positions [T]) inside it)."""
    l, d = layout.compress_block, layout.compress_stride
    extra = (num_nodes + l) // d + 1
    c = jnp.maximum(-(-(length - l + 1) // d), 0) + jnp.arange(extra)
    start = c * d
    rows = start[:, None] + jnp.arange(l)  # [E, l]
    taken = _layer_rows(cache_rows, lead, jnp.clip(rows, 0, cache_rows.shape[-3] - 1)).astype(jnp.float32)
    prefix = jnp.where((rows < length)[..., None, None], taken, 0.0).sum(axis=1)
    # Sum of the path rows in each block, [T, E, H_kv, D]: a masked sum over each node's ancestors by depth, one
    # fusion (as an einsum, a float32 GEMM of its own and the masks' product before it, in every layer of every
    # pass). Summed over depths, not over every node j of the tree: a 4x2 tree's 5 depths against its 31 nodes.
    ancestors = _ancestors_by_depth(anc)  # [T, R]
    at_depth = length + jnp.arange(ancestors.shape[1])  # the position of depth r
    inside = (at_depth[None, :] >= start[:, None]) & (at_depth[None, :] < start[:, None] + l)  # [E, R]
    on_path = ((ancestors >= 0)[:, None, :] & inside[None])[..., None, None]  # [T, E, R, 1, 1]
    path_rows = tree_rows.astype(jnp.float32)[jnp.maximum(ancestors, 0)]  # [T, R, H_kv, D]
    path = jnp.where(on_path, path_rows[:, None], 0.0).sum(axis=2)
    valid = (start + l - 1)[None, :] <= positions[:, None]
    return c, valid, (prefix[None] + path) / l


def selected_branch(q, cache: NSALayerCache, blocks, length, *, layout: NSALayout, schedule: str,
                    v1_launch: V1Launch = V1Launch(), interpret: bool = False):
    """The Pallas part of the selected branch alone, given each node's blocks [T, H_kv, n]: V0's kernel, or V1's
    union schedule and kernel (pallas_kernels.nsa_tree_select; q [T, H_q, D], cache arrays [T_cap, H_kv, D] or
    stacked with the cache's layer, read in place).
    Returns (o [H_kv, T, G, D] float32, lse [H_kv, T, G]). The SSV paper's kernel speedup compares these; the
    rest of a verification pass (compressed scores, top-n, window) is the same work for both schedules."""
    if schedule == "v0":
        return v0_selected(q, cache.k, cache.v, blocks, length, layer=cache.layer, select_block=layout.select_block,
                           interpret=interpret)
    union, _, member = union_schedule(blocks, num_select_blocks(layout, cache.capacity))
    return v1_selected(q, cache.k, cache.v, union, member, length, layer=cache.layer,
                       select_block=layout.select_block, launch=v1_launch, interpret=interpret)


def _selected_prefix(q, qg, cache: NSALayerCache, blocks, length, layout: NSALayout, schedule: str, kernels,
                     v1_launch: V1Launch, source):
    """(o, lse) of each node's selected blocks' prefix rows (< length): V0 or V1, in XLA (kernels None, gathering
    from `source`, _row_source) or through pallas_kernels.nsa_tree_select (kernels "pallas" or "interpret",
    reading `cache`)."""
    num_nodes, num_kv_heads = blocks.shape[:2]
    sel, capacity = layout.select_block, cache.capacity  # unbatched: [(L,) T_cap, H_kv, D]
    if kernels is not None:
        o, lse = selected_branch(q, cache, blocks, length, layout=layout, schedule=schedule, v1_launch=v1_launch,
                                 interpret=kernels == "interpret")
        return jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0)
    scale = 1.0 / math.sqrt(q.shape[-1])
    k_rows, v_rows, lead = source
    span = jnp.arange(sel)
    if schedule == "v0":
        rows = (jnp.maximum(blocks, 0)[..., None] * sel + span).reshape(num_nodes, num_kv_heads, -1)
        valid = jnp.repeat(blocks >= 0, sel, axis=-1) & (rows < length)  # [T, H_kv, N]
        heads = jnp.arange(num_kv_heads)[None, :, None]
        gather = lambda x: _layer_rows(x, lead, rows, heads)  # [T, H_kv, N, D]
        k_sel, v_sel = gather(k_rows), gather(v_rows)
        logits = jnp.einsum("thgd,thnd->hgtn", qg, k_sel, preferred_element_type=jnp.float32) * scale
        return _segment(_masked(logits, jnp.moveaxis(valid, 1, 0)[:, None]),
                        lambda p: jnp.einsum("hgtn,thnd->thgd", p.astype(v_sel.dtype), v_sel,
                                             preferred_element_type=jnp.float32))
    union, _, member = union_schedule(blocks, num_select_blocks(layout, capacity))
    rows = (jnp.maximum(union, 0)[..., None] * sel + span).reshape(num_kv_heads, -1)  # [H_kv, U l']
    valid = jnp.repeat(member, sel, axis=-1) & (rows < length)[:, None, :]  # [H_kv, T, U l']
    heads = jnp.arange(num_kv_heads)[:, None]
    gather = lambda x: _layer_rows(x, lead, rows, heads)  # [H_kv, U l', D]
    k_sel, v_sel = gather(k_rows), gather(v_rows)
    logits = jnp.einsum("thgd,hnd->hgtn", qg, k_sel, preferred_element_type=jnp.float32) * scale
    return _segment(_masked(logits, valid[:, None]),
                    lambda p: jnp.einsum("hgtn,hnd->thgd", p.astype(v_sel.dtype), v_sel,
                                         preferred_element_type=jnp.float32))


def nsa_tree_verify(q, cache: NSALayerCache, tree_k, tree_v, gates, length, parents, *, layout: NSALayout,
                    kind: str = "nsa", schedule: str = "v1", kernels: str | None = None,
                    v1_launch: V1Launch = V1Launch(), batch: int = 1, return_blocks: bool = False, reselect=None,
                    stacks: NSALayerCache | None = None, seq=None):
    """Exact NSA attention of a tree's nodes, one sequence (arguments as nsa_tree_reference, cache arrays
    [T_cap, H_kv, D] without the batch axis, or every layer's [L, T_cap, H_kv, D] with the cache's layer, which
    every read, kernel or XLA, takes from the stacks in place; length traced, parents traced or static as
    decoding's are: ancestor_mask). schedule: "v0" | "v1" (module docstring); kernels: None (the selected branch
    in XLA), "pallas" or "interpret" (its Pallas kernels); v1_launch: how V1's kernel splits its work
    (pallas_kernels.nsa_tree_select.V1Launch); batch: how many sequences the caller vmaps this over (it sizes the
    compressed branch's grid).
    reselect: None, or (blocks [T, H_kv, n], ancestor mask [T, T], positions [T]) -> the blocks each node attends
    instead of its own (an approximate mode's, vegas_jax.attention.nsa_approx.tree_reselect).
    stacks, seq: for a caller that vmaps this over the batch axis 1 of stacked caches [L, B, T_cap, H_kv, D] (cache:
    the mapped view), those whole stacks with their layer, passed unmapped, and this sequence's index in them
    (mapped): the XLA row gathers (the prefix rows of the blocks a path completes, the window, and without kernels
    the selected rows and the compressed branch's) read stacks[layer, seq, rows], which vmap batches without a
    transpose of the stacks; the kernels read `cache` as before (_row_source).
    Returns out [T, H_q, D] in q's dtype (and the selected blocks [T, H_kv, n] with return_blocks)."""
    if schedule not in ("v0", "v1"):
        raise ValueError(f"schedule must be v0 or v1, got {schedule!r}")
    num_nodes, num_q_heads, head_dim = q.shape
    capacity, num_kv_heads = cache.k.shape[-3:-1]
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes, got {num_nodes}")
    group, sel, w = num_q_heads // num_kv_heads, layout.select_block, layout.window
    scale = 1.0 / math.sqrt(head_dim)
    qg = q.reshape(num_nodes, num_kv_heads, group, head_dim)
    dot = lambda keys, spec: jnp.einsum(spec, qg, keys, preferred_element_type=jnp.float32) * scale
    anc = ancestor_mask(parents)
    positions = length + anc.sum(axis=1) - 1

    # Compressed branch and scores: the prefix's complete rows (read once) and the rows each path completes.
    l, d = layout.compress_block, layout.compress_stride
    visible = jnp.sum(jnp.arange(cache.compressed_rows) * d + l - 1 < length)  # the prefix's complete rows
    source = k_rows, v_rows, lead = _row_source(cache, stacks, seq)
    c_extra, extra_valid, k_extra = _path_compressed(k_rows, lead, tree_k, anc, positions, length, layout, num_nodes)
    # Each node against the few pooled rows its path completes, multiplied and summed in the fusion that pools them
    # (not a product batched over nodes and heads: a cuBLAS call of a few rows).
    pooled_k = k_extra.astype(q.dtype).astype(jnp.float32)  # [T, E, H_kv, D], rounded to q's dtype
    extra_logits = jnp.sum(qg.astype(jnp.float32)[:, None] * pooled_k[:, :, :, None], axis=-1)
    extra_logits = extra_logits.transpose(2, 3, 0, 1)  # [H_kv, G, T, E]
    extra_logits = _masked(extra_logits * scale, extra_valid[None, None])
    branch = compressed_tree_branch_reference if kernels is None else functools.partial(
        compressed_tree_branch, batch=batch, interpret=kernels == "interpret")
    k_cmp, v_cmp, cmp_layer = cache.k_cmp, cache.v_cmp, cache.layer
    if kernels is None and stacks is not None:  # the XLA twin's layer rows from the whole stacks, as _row_source
        k_cmp, v_cmp, cmp_layer = stacks.k_cmp[stacks.layer, seq], stacks.v_cmp[stacks.layer, seq], None
    o_prefix, probs, lse = branch(q, k_cmp, v_cmp, visible, jax.nn.logsumexp(extra_logits, axis=-1), layer=cmp_layer)
    p_extra = jnp.exp(extra_logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    compressed = probs.at[:, :, c_extra].add(p_extra.sum(axis=1), mode="drop")  # [H_kv, T, C]
    scores = selection_scores(compressed, num_select_blocks(layout, capacity), layout)
    top_k = jax.lax.top_k if kernels is None else functools.partial(top_n, interpret=kernels == "interpret")
    blocks = select_blocks(scores, positions[None, :], layout, top_k).transpose(1, 0, 2)  # [T, H_kv, n]
    if reselect is not None:
        blocks = reselect(blocks, anc, positions)

    if kind == "nsa-view" and kernels is not None and schedule == "v0":  # every key of a node in one kernel
        o, _ = v0_view(q, cache.k, cache.v, blocks, length, tree_k, tree_v, anc, layer=cache.layer,
                       select_block=sel, window=w, batch=batch, interpret=kernels == "interpret")
        out = jnp.moveaxis(o, 0, 1).reshape(num_nodes, num_q_heads, head_dim).astype(q.dtype)
        return (out, blocks) if return_blocks else out

    # Selected rows of the prefix: per node (V0) or the union once (V1); the tree's rows through the ancestors.
    selected = _selected_prefix(q, qg, cache, blocks, length, layout, schedule, kernels, v1_launch, source)
    by_head = blocks.transpose(1, 0, 2)  # [H_kv, T, n]
    tree_slc = anc[None] & jnp.any((positions // sel)[None, None, :, None] == by_head[:, :, None, :], axis=-1)
    tree_win = anc & (positions[None, :] > positions[:, None] - w)  # [T, T_j]

    # Window rows of the prefix: the w rows before `length`, each node keeping those within its own window. They
    # and the tree's rows are one key set, in one product for the logits, one for the values and one softmax: as
    # two segments merged, a 4x2 tree's pass at SmolLM2 batch 1 x 8K ran 1,486 kernels in 3.61 ms on an H100, as
    # one 1,275 in 3.23 (benchmarks/results/profile-2026-12-07-h100-ssv-ab-*.json).
    win_rows = length - w + jnp.arange(w)
    win_valid = (win_rows >= 0)[None, :] & (win_rows[None, :] > positions[:, None] - w)  # [T, w]
    safe = jnp.clip(win_rows, 0, capacity - 1)
    k_local, v_local = (jnp.concatenate([_layer_rows(x, lead, safe), tree_x]) for x, tree_x in
                        ((k_rows, tree_k), (v_rows, tree_v)))  # [w + T, H_kv, D]: the window's rows, the tree's
    local_logits = dot(k_local, "thgd,nhd->hgtn")  # [H_kv, G, T, w + T]
    local_values = lambda p: jnp.einsum("hgtn,nhd->thgd", p.astype(v_local.dtype), v_local,
                                        preferred_element_type=jnp.float32)
    if kind == "nsa-view":  # one softmax; the window's prefix rows inside a selected block are counted there
        in_selected = jnp.any((win_rows // sel)[None, None, :, None] == by_head[:, :, None, :], axis=-1)
        local = jnp.concatenate([win_valid[None] & ~in_selected, tree_slc | tree_win[None]], axis=-1)
        out = _merge(selected, _segment(_masked(local_logits, local[:, None]), local_values))
    else:
        tree_values = lambda p: jnp.einsum("hgtj,jhd->thgd", p.astype(tree_v.dtype), tree_v,
                                           preferred_element_type=jnp.float32)
        o_slc = _merge(selected, _segment(_masked(local_logits[..., w:], tree_slc[:, None]), tree_values))
        local = jnp.concatenate([win_valid, tree_win], axis=-1)
        o_win = _segment(_masked(local_logits, local[None, None]), local_values)[0]
        # The pooled values of the rows the paths complete: only NSA's compressed branch has an output.
        _, _, v_extra = _path_compressed(v_rows, lead, tree_v, anc, positions, length, layout, num_nodes)
        o_cmp = o_prefix + jnp.sum(p_extra.transpose(2, 3, 0, 1)[..., None] * v_extra[:, :, :, None], axis=1)
        g = gates.reshape(num_nodes, num_kv_heads, group, 3, 1).astype(jnp.float32)
        out = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    out = out.reshape(num_nodes, num_q_heads, head_dim).astype(q.dtype)
    return (out, blocks) if return_blocks else out
