"""Precision classes: what a user allows speculation to change. `exact` never changes the output (plain decoding
of the model as it is); `approximate` allows the modified targets of the approximate NSA kernel modes (ApproxMode)
whose measured distance from the exact target is within a tolerance the user can tighten.

An ApproxMode DEFINES a modified target model, independently of how speculation groups tokens. For layer l, the
query at position t and KV head h (NSA's rules of models.nsa_selection otherwise):

- refresh layers are those with l % refresh_every == 0; R(l) = l - l % refresh_every is the nearest refresh layer at
  or before l (layer 0 always refreshes);
- the span anchor of t is a(t) = floor(t / share_span) * share_span, and share_span divides the selection block, so
  every query of a span has the anchor's own block (its forced local blocks and its causal bound);
- the selection of (l, t, h) is the NSA top-n rule with top_n widened to widen * top_n, applied in layer R(l) to the
  anchor's query (its compressed scores over the compressed blocks complete at a(t), summed over the KV group);
- every branch other than the selection is exact at (l, t): the compressed branch (its own query's probabilities
  over the blocks complete at t), the selected rows of those blocks up to t, the window, and the gates.

Why the anchor and not a window's aggregated scores: a(t) <= t, so plain decoding at t has already computed the
anchor's selection, and in a draft tree the anchor is the node itself, one of its ancestors (at most one per span
on a path) or a committed position, so tree verification computes each node's selection exactly from the
selections it already derives per node (V1) by a gather. An aggregate over the span's queries would include
queries after t (not causal) and differ between a tree's paths.

share_span = widen = refresh_every = 1 is the exact target, which the exact class always uses.
"""

from __future__ import annotations

import dataclasses

from models.config import NSALayout
from vegas_jax.inputs import InputError

PRECISION_CLASSES = ("exact", "approximate")
# The approximate class's default bound, on the measured top-1 disagreement of next-token logits with the exact
# target (1 - top-1 agreement); the user may tighten it down to 0, and not loosen it past MAX_TOLERANCE.
DEFAULT_TOLERANCE = 0.05
MAX_TOLERANCE = 0.5


@dataclasses.dataclass(frozen=True)
class ApproxMode:
    """One approximate kernel mode: the modified target of the module docstring."""

    share_span: int = 1  # aligned spans of positions sharing their first query's selection (V2)
    widen: int = 1  # the shared selection keeps widen * top_n blocks (forced ones counted)
    refresh_every: int = 1  # layers l with l % refresh_every == 0 derive selections; the others reuse them

    def __post_init__(self):
        for name in ("share_span", "widen", "refresh_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError("{mode}: " + name + " must be an integer >= 1, got {!r}", value)

    @property
    def is_exact(self) -> bool:
        return self.share_span == self.widen == self.refresh_every == 1

    def refreshes(self, layer: int) -> bool:
        return layer % self.refresh_every == 0

    def selection_layout(self, layout: NSALayout) -> NSALayout:
        """The layout whose top-n rule the anchors apply (top_n widened); InputError if the span straddles
        selection blocks."""
        if layout.select_block % self.share_span:
            raise InputError("{mode}: share_span {} must divide the selection block {}", self.share_span,
                             layout.select_block)
        return dataclasses.replace(layout, top_n=layout.top_n * self.widen)

    def name(self) -> str:
        """A short label: s<span>w<widen>r<refresh_every> ("exact" for the exact target)."""
        return "exact" if self.is_exact else f"s{self.share_span}w{self.widen}r{self.refresh_every}"

    @classmethod
    def from_name(cls, label: str) -> "ApproxMode":
        """The inverse of name(); InputError naming mode otherwise."""
        if label == "exact":
            return cls()
        try:
            span, rest = label.removeprefix("s").split("w")
            widen, refresh = rest.split("r")
            return cls(int(span), int(widen), int(refresh))
        except ValueError:
            raise InputError("{mode} must be 'exact' or s<span>w<widen>r<refresh> (e.g. s8w2r2), got {!r}",
                             label) from None


EXACT_MODE = ApproxMode()


@dataclasses.dataclass(frozen=True)
class PrecisionClass:
    """What speculation may change: "exact" (nothing; tolerance 0) or "approximate" (modes whose measured top-1
    disagreement with the exact target is at most tolerance)."""

    name: str = "exact"
    tolerance: float = 0.0

    def allows(self, mode: ApproxMode, disagreement: float | None) -> bool:
        """Whether this class may run `mode`, whose measured top-1 disagreement is `disagreement` (None:
        never measured, so only the exact mode is allowed)."""
        if mode.is_exact:
            return True
        return self.name == "approximate" and disagreement is not None and disagreement <= self.tolerance


def parse_precision(name, tolerance=None) -> PrecisionClass:
    """A PrecisionClass from the user's precision name and optional tolerance (a fraction in [0, MAX_TOLERANCE],
    only for "approximate"); one-line InputError naming precision or precision_tolerance otherwise."""
    if name not in PRECISION_CLASSES:
        raise InputError("{precision} must be one of {}, got {!r}", ", ".join(PRECISION_CLASSES), name)
    if name == "exact":
        if tolerance not in (None, 0, 0.0):
            raise InputError("{precision_tolerance} {!r}: the exact class has no tolerance (it never changes the "
                             "output); give {precision} approximate", tolerance)
        return PrecisionClass("exact", 0.0)
    if tolerance is None:
        return PrecisionClass("approximate", DEFAULT_TOLERANCE)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise InputError("{precision_tolerance} must be a number, got {!r}", tolerance)
    if not 0.0 <= tolerance <= MAX_TOLERANCE:
        raise InputError("{precision_tolerance} {!r}: must be in [0, {}] (the largest top-1 disagreement with the "
                         "exact target allowed)", tolerance, MAX_TOLERANCE)
    return PrecisionClass("approximate", float(tolerance))
