"""Symmetric tuning: every speculative method searches the same grid of γ and sparse ratio, plus its own knobs,
by the same coordinate search, on the tuning split; the cell it ends on is its tuned cell.

The search, from the common default cell (γ 6, ratio 7 %, the method's default knobs): sweep γ over the grid with
everything else fixed and keep the fastest; then the ratio at that γ; then each of the method's knobs in turn; with
`refine`, γ once more at the final ratio and knobs. Every sweep includes the cell it starts from, so a step never
makes the result slower on the tuning set. N-gram trees (NGRAM: prompt lookup, vegas_jax.decode.drafters, with plain
decoding's attention) select no KV, so they have no ratio: γ is their tree's depth and their knob its branching,
and a sweep leaves out the trees of more nodes than one verification pass takes. A grid of g γ values, r ratios and k_i values per knob costs at most
g + r + sum(k_i) - (number of sweeps - 1) distinct cells (each compiled once) instead of g * r * prod(k_i).

The search is a pure function of what has been measured (`next_cells`, `tuned_cell`): a run stopped halfway
resumes by replaying it over the records, and a finished one can be audited from them.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from vegas_jax.decode.adaptive_gamma import AUTO
from vegas_jax.runtime.options import DEFAULTS, METHOD_KNOBS
from vegas_jax.decode.tree_shapes import MAX_TREE_NODES, tree_nodes

DEFAULT_GAMMA = DEFAULTS["gamma"]
DEFAULT_RATIO = DEFAULTS["sparse_ratio"]
NGRAM = "ngram"  # the suite's name for n-gram trees: GenerationOptions(method="ar", drafter="ngram", draft_tree=...)
# Knobs of the suite's own methods (no GenerationOptions field of that name): (method, default). A grid that names
# no values for one searches its default only.
SUITE_KNOBS = {"tree_branching": (NGRAM, 1)}


def default_knobs(method: str) -> dict[str, int]:
    """The method's own knobs at their defaults (GenerationOptions field names, or SUITE_KNOBS'); none for Vegas
    and plain decoding."""
    knobs = {knob: DEFAULTS[knob] for knob, owner in METHOD_KNOBS.items() if owner == method}
    return knobs | {knob: default for knob, (owner, default) in SUITE_KNOBS.items() if owner == method}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of a method: γ (0 for plain decoding; "auto" for adaptive γ, which no search visits),
    sparse ratio (None for plain decoding) and the method's knobs as sorted (name, value) pairs."""

    gamma: int | str
    sparse_ratio: float | None
    knobs: tuple[tuple[str, int], ...] = ()

    @classmethod
    def default(cls, method: str) -> "Cell":
        if method == "ar":
            return cls(0, None)
        ratio = None if method == NGRAM else DEFAULT_RATIO
        return cls(DEFAULT_GAMMA, ratio, tuple(sorted(default_knobs(method).items())))

    @classmethod
    def of(cls, record: Mapping) -> "Cell":
        return cls(record["gamma"], record["sparse_ratio"], tuple(sorted((record.get("knobs") or {}).items())))

    def with_value(self, axis: str, value) -> "Cell":
        if axis in ("gamma", "sparse_ratio"):
            return dataclasses.replace(self, **{axis: value})
        return dataclasses.replace(self, knobs=tuple(sorted({**dict(self.knobs), axis: value}.items())))

    @property
    def auto_gamma(self) -> bool:
        return self.gamma == AUTO

    def value(self, axis: str):
        return getattr(self, axis) if axis in ("gamma", "sparse_ratio") else dict(self.knobs)[axis]

    def option_fields(self, method: str) -> dict:
        """The GenerationOptions fields this cell of the method sets (method among them)."""
        if method == NGRAM:
            depth, branching = self.gamma, dict(self.knobs)["tree_branching"]
            return {"method": "ar", "drafter": "ngram", "draft_tree": f"{depth}x{branching}", "gamma": depth}
        fields = {"method": method, **dict(self.knobs)}
        if self.gamma:
            fields.update(gamma=self.gamma, sparse_ratio=self.sparse_ratio)
        return fields

    def label(self) -> str:
        if not self.gamma:
            return "-"
        ratio = "" if self.sparse_ratio is None else f", {100 * self.sparse_ratio:g} %"
        knobs = "".join(f", {k.split('_', 1)[1]} {v}" for k, v in self.knobs)
        return f"γ {self.gamma}{ratio}{knobs}"

    def measurable(self) -> bool:
        """Whether one verification pass takes it: an n-gram tree's nodes at most MAX_TREE_NODES."""
        branching = dict(self.knobs).get("tree_branching")
        return branching is None or self.auto_gamma or tree_nodes(self.gamma, branching) <= MAX_TREE_NODES


def _rounded(cell: Cell) -> Cell:
    # Measured ratios come back from JSON and arithmetic: cells compare with ratios rounded.
    return cell if cell.sparse_ratio is None else dataclasses.replace(cell, sparse_ratio=round(cell.sparse_ratio, 6))


@dataclasses.dataclass(frozen=True)
class Grid:
    gammas: tuple[int, ...]
    ratios: tuple[float, ...]
    knobs: Mapping[str, tuple[int, ...]]  # values of every method's knobs (each method sweeps its own)
    refine: bool = False  # a second γ sweep after the ratio and the knobs

    def __post_init__(self):
        # The default cell is on the grid, so the search starts from a measured cell and can always keep it.
        for name, values, default in [("gammas", self.gammas, DEFAULT_GAMMA), ("ratios", self.ratios, DEFAULT_RATIO),
                                      *[(k, self.knobs.get(k, ()), DEFAULTS[k]) for k in METHOD_KNOBS],
                                      *[(k, self.knobs.get(k, (d,)), d) for k, (_, d) in SUITE_KNOBS.items()]]:
            if default not in values:
                raise ValueError(f"grid {name} {values} must include the default {default}")

    def sweeps(self, method: str) -> list[tuple[str, tuple]]:
        """(axis, values) in search order for this method."""
        own = [(knob, tuple(self.knobs.get(knob, (default,)))) for knob, default in default_knobs(method).items()]
        ratios = [] if method == NGRAM else [("sparse_ratio", self.ratios)]
        steps = [("gamma", self.gammas), *ratios, *own]
        return steps + [("gamma", self.gammas)] if self.refine else steps

    def size(self, method: str) -> int:
        """Distinct cells the search measures at most."""
        sweeps = self.sweeps(method)
        if method == "ar":
            return 1
        first, *rest = sweeps
        # Each later sweep re-visits the cell it starts from; the refining γ sweep may repeat up to all of γ's.
        return len(first[1]) + sum(len(values) - 1 for _, values in rest)


def _replay(method: str, grid: Grid, rates: Mapping[Cell, float]) -> tuple[Cell, list[Cell]]:
    """(the cell the search has reached, the cells of its current sweep still unmeasured: empty when done)."""
    rates = {_rounded(c): r for c, r in rates.items()}
    current = Cell.default(method)
    if method == "ar":
        return current, [] if current in rates else [current]
    for axis, values in grid.sweeps(method):
        sweep = [c for c in (_rounded(current.with_value(axis, v)) for v in values) if c.measurable()]
        missing = [c for c in sweep if c not in rates]
        if missing:
            return current, missing
        # The fastest; a tie keeps the cell the sweep started from, then the earlier value.
        current = max(sweep, key=lambda c: (rates[c], c == current, -sweep.index(c)))
    return current, []


def next_cells(method: str, grid: Grid, rates: Mapping[Cell, float]) -> list[Cell]:
    """The cells to measure next (the rest of the current sweep); empty once the search is complete."""
    return _replay(method, grid, rates)[1]


def tuned_cell(method: str, grid: Grid, rates: Mapping[Cell, float]) -> Cell | None:
    """The cell the search ends on, or None while it is incomplete."""
    cell, missing = _replay(method, grid, rates)
    return None if missing else cell


def rates_of(records) -> dict[Cell, float]:
    """{cell: median decode tokens/s} of tuning records (one method, batch and length)."""
    return {Cell.of(r): r["decode_tokens_per_s"] for r in records}
