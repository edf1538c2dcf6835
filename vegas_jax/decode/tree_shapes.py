"""Static draft-tree shapes: which drafted node follows which (a parents array; a chain is the tree whose every node
has one child).

Node 0 is the root: the newest emitted token, which has no K/V yet. Nodes 1..N are drafts, in topological order
(a parent before its children; within a level, a parent's children side by side, its first child the drafter's
first choice). The shape is static and hashable, part of what a loop compiles for; the tokens in it change every
iteration. `DEPTHxBRANCHING` (`4x2`) names the full tree of that depth in which every node has BRANCHING children.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from vegas_jax.inputs import InputError

MAX_TREE_NODES = 64  # drafted nodes (the root not counted): one verification pass of at most 65 rows


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
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """The nodes at each depth 0..depth, in order."""
        return tuple(tuple(int(i) for i in np.flatnonzero(self.depths == d)) for d in range(self.depth + 1))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)

    def describe(self) -> str:
        """`DEPTHxBRANCHING` for a full tree, else its size."""
        branching = self.children.shape[1]
        if self == TreeShape.full(self.depth, branching):
            return f"{self.depth}x{branching}"
        return f"{self.num_nodes} nodes, depth {self.depth}"


_SPEC = re.compile(r"(\d+)x(\d+)")


def parse_tree(spec: str, name: str = "draft_tree") -> TreeShape:
    """`DEPTHxBRANCHING` (e.g. 4x2; 6x1 is a chain of 6) as a TreeShape; InputError naming `name` otherwise."""
    match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise InputError("{" + name + "} must be DEPTHxBRANCHING (e.g. 4x2; 6x1 is a chain), got {!r}", spec)
    depth, branching = int(match.group(1)), int(match.group(2))
    if depth < 1 or branching < 1:
        raise InputError("{" + name + "} {}: depth and branching must be >= 1", spec)
    nodes = sum(branching**d for d in range(1, depth + 1))
    if nodes > MAX_TREE_NODES:
        raise InputError("{" + name + "} {}: {} drafted nodes, more than " + str(MAX_TREE_NODES), spec, nodes)
    return TreeShape.full(depth, branching)
