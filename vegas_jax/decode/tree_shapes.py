"""Static draft-tree shapes: which drafted node follows which (a parents array; a chain is the tree whose every node
has one child).

Node 0 is the root: the newest emitted token, which has no K/V yet. Nodes 1..N are drafts, in topological order
(a parent before its children; within a level, a parent's children side by side, its first child the drafter's
first choice). The shape is static and hashable, part of what a loop compiles for; the tokens in it change every
iteration. `DEPTHxBRANCHING` (`4x2`) names the full tree of that depth in which every node has BRANCHING children;
`NODES` or `NODESdDEPTH` (`16`, `24d6`) the tree of that many drafted nodes (at most that deep) with the most
expected accepted drafts under a drafter's rank acceptance rates (`TreeShape.for_rates`): most of a full tree's nodes
hang below second choices, which are seldom accepted, so a tree shaped by the rates reaches a full tree's τ with
fewer nodes, or a higher τ with as many.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import re

import numpy as np

from vegas_jax.inputs import InputError

MAX_TREE_NODES = 64  # drafted nodes (the root not counted): one verification pass of at most 65 rows
# The chance that a node's first and second children are the accepted one, given that the node was: the shipped
# SmolLM2 head's on held-out 8K prompts (H100, docs/trees.md), where a 6-node chain's τ 3.05 gives its first choice
# 0.70 a level and a 4x2 tree's 0.82 a level adds 0.12 for its second.
DEFAULT_RANK_RATES = (0.70, 0.12)


def tree_nodes(depth: int, branching: int) -> int:
    """Drafted nodes of the full tree DEPTHxBRANCHING: the most a tree of that depth with that many ranks holds."""
    return sum(branching**d for d in range(1, depth + 1))


@dataclasses.dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parents[i] is node i's parent (< i); parents[0] = -1 (the root)

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a tree's node 0 is its root (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"every node's parent must come before it: {self.parents}")
        if not 1 <= self.num_nodes <= MAX_TREE_NODES:
            raise ValueError(f"a draft tree has 1 to {MAX_TREE_NODES} drafted nodes, got {self.num_nodes}")

    @classmethod
    def full(cls, depth: int, branching: int) -> "TreeShape":
        """Every node above `depth` has `branching` children, numbered level by level."""
        parents, level = [-1], [0]
        for _ in range(depth):
            nxt = []
            for parent in level:
                for _ in range(branching):
                    nxt.append(len(parents))
                    parents.append(parent)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def chain(cls, length: int) -> "TreeShape":
        return cls.full(length, 1)

    @classmethod
    def for_rates(cls, nodes: int, rates: tuple[float, ...], max_depth: int | None = None) -> "TreeShape":
        """The tree of `nodes` drafted nodes, none deeper than `max_depth`, with the most expected accepted drafts
        (`expected_tokens`) when a node's r-th child is the accepted one with probability rates[r - 1] given that
        the node was. Built by adding, one at a time, the candidate whose path is likeliest: a child's path is no
        likelier than its parent's, nor a later sibling's than an earlier one's (rates non-increasing), so every
        tree of the greedy's size has no larger sum (SpecInfer, Sequoia). Nodes are numbered level by level, a
        parent's children in rank order."""
        limit = nodes if max_depth is None else max_depth
        built = [(-1, 0, 0)]  # (parent's index in `built`, depth, rank) in the order added
        candidates = [(-rates[0], 0, 0, 1, 0, 1.0)]  # (-path probability, order, parent, depth, rank, parent's)
        while len(built) <= nodes and candidates:
            negative, _, parent, depth, rank, parent_probability = heapq.heappop(candidates)
            built.append((parent, depth, rank))
            here = len(built) - 1
            if depth < limit:
                heapq.heappush(candidates, (negative * rates[0], len(built), here, depth + 1, 0, -negative))
            if rank + 1 < len(rates):
                heapq.heappush(candidates, (-parent_probability * rates[rank + 1], len(built), parent, depth,
                                            rank + 1, parent_probability))
        number, parents = {0: 0}, [-1]
        for depth in range(1, max(d for _, d, _ in built) + 1):
            level = sorted((number[p], r, i) for i, (p, d, r) in enumerate(built) if d == depth)
            for parent, _, i in level:
                number[i] = len(parents)
                parents.append(parent)
        if len(parents) <= nodes:
            raise ValueError(f"{len(rates)} ranks {limit} deep hold {len(parents) - 1} nodes, not {nodes}")
        return cls(tuple(parents))

    @property
    def num_nodes(self) -> int:
        """Drafted nodes (the root not counted)."""
        return len(self.parents) - 1

    @property
    def rows(self) -> int:
        """Rows of a verification pass: the root and every drafted node."""
        return len(self.parents)

    @property
    def num_parents(self) -> int:
        """Nodes 0..num_parents-1 include every node with children (all of them, for a level-ordered tree)."""
        return max(self.parents) + 1

    @functools.cached_property
    def path_nodes(self) -> np.ndarray:
        """[rows, depth + 1] int32: node i's ancestor at each depth (itself at its own depth; 0 past it)."""
        table = np.zeros((self.rows, self.depth + 1), np.int32)
        for i in range(self.rows):
            node = i
            while node > 0:
                table[i, self.depths[node]] = node
                node = self.parents[node]
        return table

    @functools.cached_property
    def depths(self) -> np.ndarray:
        """[rows] int32: the root is at depth 0, its children at 1, ..."""
        depth = np.zeros(self.rows, np.int32)
        for i in range(1, self.rows):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        """[rows, rows] bool: ancestors[i, j] iff node j is node i or one of its ancestors (the tree attention mask:
        node i attends to its own root-to-node path)."""
        mask = np.eye(self.rows, dtype=bool)
        for i in range(1, self.rows):
            mask[i] |= mask[self.parents[i]]
        return mask

    @functools.cached_property
    def children(self) -> np.ndarray:
        """[rows, max children] int32: node i's children in order, -1 past the last."""
        kids = [[j for j in range(1, self.rows) if self.parents[j] == i] for i in range(self.rows)]
        width = max(1, max(map(len, kids)))
        return np.asarray([k + [-1] * (width - len(k)) for k in kids], np.int32)

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        """[rows] int32: node i's place among its parent's children (0: the first; the root: 0)."""
        rank = np.zeros(self.rows, np.int32)
        for parent_children in self.children:
            for r, child in enumerate(parent_children[parent_children >= 0]):
                rank[child] = r
        return rank

    @functools.cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """The nodes at each depth 0..depth, in order."""
        return tuple(tuple(int(i) for i in np.flatnonzero(self.depths == d)) for d in range(self.depth + 1))

    def expected_tokens(self, rates: tuple[float, ...]) -> float:
        """τ of this tree under rank acceptance rates (for_rates): the root's token plus each node's chance that its
        path is accepted, the product of rates[rank - 1] along it (a rank past the rates: 0)."""
        chance = np.ones(self.rows)
        for i in range(1, self.rows):
            rank = self.ranks[i]
            chance[i] = chance[self.parents[i]] * (rates[rank] if rank < len(rates) else 0.0)
        return float(chance.sum())

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def describe(self) -> str:
        """`DEPTHxBRANCHING` for a full tree, else its size."""
        branching = self.children.shape[1]
        if self.num_nodes == tree_nodes(self.depth, branching) and self == TreeShape.full(self.depth, branching):
            return f"{self.depth}x{branching}"
        return f"{self.num_nodes} nodes, depth {self.depth}"


_FULL = re.compile(r"(\d+)x(\d+)")
_SHAPED = re.compile(r"(\d+)(?:d(\d+))?")


def check_rates(rates, name: str = "tree_rates") -> tuple[float, ...]:
    """Rank acceptance rates: each in (0, 1), none above the one before, their sum at most 1; InputError naming
    `name` otherwise."""
    rates = tuple(float(r) for r in rates)
    if not rates or not all(0 < r < 1 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])) \
            or sum(rates) > 1 + 1e-9:
        raise InputError("{" + name + "} must be rates in (0, 1), non-increasing, summing to at most 1 (the chance "
                         "that a node's first, second, .. child is the one accepted), got {}", ",".join(map(str, rates)))
    return rates


def shaped_by_rates(spec: str) -> bool:
    """Whether `spec` names a tree shaped by rank acceptance rates (NODES[dDEPTH]), not a full one."""
    return isinstance(spec, str) and _SHAPED.fullmatch(spec.strip()) is not None


def parse_tree(spec: str, name: str = "draft_tree", rates: tuple[float, ...] | None = None) -> TreeShape:
    """`DEPTHxBRANCHING` (e.g. 4x2; 6x1 is a chain of 6) as a full TreeShape; `NODES` or `NODESdDEPTH` (16, 24d6)
    as TreeShape.for_rates under `rates` (default DEFAULT_RANK_RATES); InputError naming `name` otherwise."""
    text = spec.strip() if isinstance(spec, str) else ""
    full, shaped = _FULL.fullmatch(text), _SHAPED.fullmatch(text)
    if full is None and shaped is None:
        raise InputError("{" + name + "} must be DEPTHxBRANCHING (e.g. 4x2; 6x1 is a chain) or NODES[dDEPTH] (e.g. "
                         "16 or 24d6: that many nodes shaped by {tree_rates}), got {!r}", spec)
    if shaped is not None:
        nodes, depth = int(shaped.group(1)), None if shaped.group(2) is None else int(shaped.group(2))
        if not 1 <= nodes <= MAX_TREE_NODES or depth == 0:
            raise InputError("{" + name + "} {}: 1 to " + str(MAX_TREE_NODES) + " nodes, at least 1 deep", spec)
        rates = DEFAULT_RANK_RATES if rates is None else check_rates(rates)
        if depth is not None and nodes > tree_nodes(depth, len(rates)):
            raise InputError("{" + name + "} {}: a tree {} deep with {} ranks of rates ({tree_rates}) holds fewer "
                             "nodes", spec, depth, len(rates))
        return TreeShape.for_rates(nodes, rates, depth)
    depth, branching = int(full.group(1)), int(full.group(2))
    if depth < 1 or branching < 1:
        raise InputError("{" + name + "} {}: depth and branching must be >= 1", spec)
    nodes = tree_nodes(depth, branching)
    if nodes > MAX_TREE_NODES:
        raise InputError("{" + name + "} {}: {} drafted nodes, more than " + str(MAX_TREE_NODES), spec, nodes)
    return TreeShape.full(depth, branching)
