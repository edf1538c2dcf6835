"""The SSV planner: per prompt (length, batch) it picks how to decode within the user's precision class: plain
decoding or a draft tree (depth, branching; verified rows within a node budget), and the kernel mode (the exact
target, or an approximate mode with its refresh schedule) from a cost model fitted on the device and the running
acceptance. It returns its choice with the predicted time, so metrics can set it against the measured one.

The cost model comes from a profile (benchmarks/profile_ssv.py writes it on the device, `load_profile` reads it):
whole-pass times of the target, `passes` (mode, rows verified per sequence: 1 for a plain decoding step, batch,
context, ms), and of the drafter, `drafts` (drafter, drafted nodes, batch, context, ms), plus each approximate
mode's measured distance from the exact target (`distances`, benchmarks/measure_approx_modes.py). Per (mode, rows)
and per (drafter, nodes) it fits ms = a + b * batch + c * batch * context (weights read once per pass, plus the
K/V each sequence reads) by non-negative least squares over the measured points.

Drafters: each (drafter, nodes) the profile times is a candidate, so a planner given several drafters (the head,
n-gram and self drafts) chooses between them by predicted time per token, each at its own running acceptance.
A dense model's profile has only the exact target's passes (measured whole) and the drafts of the head and n-gram
lookup; it costs plans the same way.

Acceptance: a per-token probability alpha that a drafted token is the target's (running, `AcceptanceTracker`, one
per drafter: `DrafterAcceptance`),
each level of a tree with branching k accepting with 1 - (1 - alpha)^k (candidates independent: a model, not a
measurement), so a step of depth D yields 1 + sum_{d<=D} prod_{j<=d} (1 - (1 - alpha)^k) tokens; plain decoding
yields 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np

from vegas_jax.decode.tree_shapes import tree_nodes
from vegas_jax.inputs import InputError
from vegas_jax.ssv.precision import ApproxMode, PrecisionClass

PROFILE_FORMAT = "vegas-ssv-profile"
PROFILE_VERSION = 1
MAX_TREE_NODES = 64  # drafted nodes of a tree (pallas_kernels.nsa_verify.MAX_TREE_NODES)
DEFAULT_ACCEPTANCE = 0.6  # alpha before any step was observed


def expected_tokens(depth: int, branching: int, alpha: float) -> float:
    """Tokens a verification step of the full tree yields on average (the module docstring's model)."""
    level = 1.0 - (1.0 - alpha) ** branching
    return 1.0 + sum(level ** d for d in range(1, depth + 1))


@dataclasses.dataclass(frozen=True)
class Fit:
    """ms = a + b * batch + c * batch * context over measured points."""

    a: float
    b: float
    c: float
    points: int
    max_relative_error: float

    def __call__(self, batch: int, context: int) -> float:
        return self.a + self.b * batch + self.c * batch * context


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |x c - y| over c >= 0, for few columns: the best unconstrained fit over each subset of columns
    that comes out non-negative (a time is no sum with a negative part, and noisy points would extrapolate so)."""
    best, best_residual = np.zeros(x.shape[1]), float(np.sum(y * y))
    for subset in itertools.product((False, True), repeat=x.shape[1]):
        columns = np.flatnonzero(subset)
        if not len(columns):
            continue
        c = np.zeros(x.shape[1])
        c[columns] = np.linalg.lstsq(x[:, columns], y, rcond=None)[0]
        residual = float(np.sum((x @ c - y) ** 2))
        if (c >= 0).all() and residual < best_residual:
            best, best_residual = c, residual
    return best


def _fit(rows: list[dict], what: str, where: str) -> Fit:
    x = np.array([[1.0, r["batch"], r["batch"] * r["context"]] for r in rows])
    y = np.array([r["ms"] for r in rows])
    if np.linalg.matrix_rank(x) < 3:
        raise InputError("{ssv_profile} " + where + ": " + what + " needs points at 2 batch sizes and 2 contexts at "
                         "least (has {})", len(rows))
    coef = _nonnegative_least_squares(x, y)
    error = float(np.max(np.abs(x @ coef - y) / y))
    return Fit(*map(float, coef), len(rows), error)


@dataclasses.dataclass(frozen=True)
class Profile:
    path: str
    device: str
    passes: dict  # (mode label, rows) -> Fit
    drafts: dict  # (drafter, nodes) -> Fit
    distances: dict  # mode label -> top-1 disagreement with the exact target
    dense: bool = False  # profiled on a dense model (its exact passes only), else on an NSA model or view

    def check_model(self, attention: str) -> None:
        """InputError naming the file unless it profiles a model attending as `attention` does (dense or NSA):
        the other family's passes cost other kernels."""
        if self.dense != (attention == "dense"):
            where = self.path.replace("{", "{{").replace("}", "}}")
            raise InputError("{ssv_profile} " + where + ": profiles " + ("a dense" if self.dense else "an NSA") +
                             " model, and this one is " + ("dense" if attention == "dense" else "NSA") +
                             " (benchmarks/profile_ssv.py --model profiles it)")


def _numbers(entry, keys, where: str, index: int, table: str):
    for key in keys:
        value = entry.get(key) if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError("{ssv_profile} " + where + ": " + table + "[{}] needs a positive number " + key +
                             ", got {!r}", index, value)


def load_profile(path) -> Profile:
    """The profile JSON at `path`, its tables fitted; one-line InputError naming the file otherwise."""
    where = str(path).replace("{", "{{").replace("}", "}}")
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError("{ssv_profile} " + where + ": " + (e.strerror or str(e))) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("{ssv_profile} " + where + ": not JSON ({})", str(e).splitlines()[0]) from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or doc.get("version") != PROFILE_VERSION:
        raise InputError("{ssv_profile} " + where + ": not a " + PROFILE_FORMAT + " version " + str(PROFILE_VERSION) +
                         " file (benchmarks/profile_ssv.py writes one)")
    tables = {}
    for table, key, label in (("passes", "rows", "mode"), ("drafts", "nodes", "drafter")):
        entries = doc.get(table)
        if not isinstance(entries, list) or (table == "passes" and not entries):
            raise InputError("{ssv_profile} " + where + ": needs a list " + table)
        groups = {}
        for i, entry in enumerate(entries):
            _numbers(entry, (key, "batch", "context", "ms"), where, i, table)
            if not isinstance(entry.get(label), str):
                raise InputError("{ssv_profile} " + where + ": " + table + "[{}] needs a string " + label, i)
            if table == "passes":
                try:
                    ApproxMode.from_name(entry[label])
                except InputError:
                    raise InputError("{ssv_profile} " + where + ": passes[{}] has an unknown mode {!r}", i,
                                     entry[label]) from None
            groups.setdefault((entry[label], int(entry[key])), []).append(entry)
        tables[table] = {g: _fit(rows, f"{table} {g[0]} at {key} {g[1]}", where) for g, rows in groups.items()}
    if ("exact", 1) not in tables["passes"]:
        raise InputError("{ssv_profile} " + where + ": passes has no plain decoding step of the exact target "
                         "(mode exact, rows 1)")
    distances = doc.get("distances", {})
    if not isinstance(distances, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("top1_disagreement"), (int, float)) for d in distances.values()):
        raise InputError("{ssv_profile} " + where + ": distances maps mode labels to {{\"top1_disagreement\": x}}")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    return Profile(str(path), str(doc.get("device", "unknown")), tables["passes"], tables["drafts"],
                   {m: float(d["top1_disagreement"]) for m, d in distances.items()},
                   dense=config.get("attention") == "dense")


class AcceptanceTracker:
    """The running per-token acceptance alpha. A verification step of a DEPTHxBRANCHING tree that accepted n
    drafted tokens passed n levels and, if n < DEPTH, failed one: with level acceptance p that is a truncated
    geometric count, whose maximum-likelihood p is passes / (passes + failures). Counts decay by `decay` per step
    (recent steps count more), are kept per branching (p differs with it) and start from `prior_steps` steps'
    worth of the prior; alpha = 1 - (1 - p)^(1/k), averaged over branchings by their counts."""

    def __init__(self, prior: float = DEFAULT_ACCEPTANCE, prior_steps: float = 4.0, decay: float = 0.98):
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance {prior} is no probability")
        self.prior, self.prior_steps, self.decay = prior, prior_steps, decay
        self.counts: dict[int, list[float]] = {}  # branching -> [passes, failures]

    def observe(self, accepted: int, depth: int, branching: int) -> None:
        if not 0 <= accepted <= depth:
            raise ValueError(f"accepted {accepted} drafted tokens of a tree of depth {depth}")
        if branching not in self.counts:
            level = 1.0 - (1.0 - self.prior) ** branching
            self.counts[branching] = [self.prior_steps * level, self.prior_steps * (1.0 - level)]
        for counts in self.counts.values():
            counts[0] *= self.decay
            counts[1] *= self.decay
        self.counts[branching][0] += accepted
        self.counts[branching][1] += accepted < depth

    @property
    def alpha(self) -> float:
        if not self.counts:
            return self.prior
        total = sum(p + f for p, f in self.counts.values())
        return sum((p + f) / total * (1.0 - (f / (p + f)) ** (1.0 / k)) for k, (p, f) in self.counts.items())


class DrafterAcceptance:
    """The running acceptance of each drafter (an engine's, across its runs): drafters propose differently well."""

    def __init__(self):
        self.trackers: dict[str, AcceptanceTracker] = {}

    def of(self, drafter: str) -> AcceptanceTracker:
        return self.trackers.setdefault(drafter, AcceptanceTracker())

    def alphas(self, drafters) -> dict[str, float]:
        return {d: self.of(d).alpha for d in drafters}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to decode: mode (ApproxMode label), tree (depth, branching) or None for plain decoding, and what
    the cost model predicts for it."""

    mode: str
    tree: tuple[int, int] | None
    drafter: str | None
    rows: int  # rows verified per sequence and step (1: plain decoding)
    refresh_every: int
    tokens_per_step: float
    ms_per_step: float

    @property
    def ms_per_token(self) -> float:
        return self.ms_per_step / self.tokens_per_step

    @property
    def tree_spec(self) -> str | None:
        """The tree as --draft-tree spells it ("DEPTHxBRANCHING"), None for plain decoding."""
        return None if self.tree is None else f"{self.tree[0]}x{self.tree[1]}"

    @property
    def label(self) -> str:
        """The plan in a few words, "<mode> <DEPTHxBRANCHING | plain>": how the benchmarks file its runs."""
        return f"{self.mode} {self.tree_spec or 'plain'}"

    def report(self, measured_ms_per_token: float | None = None) -> dict:
        """The choice and its predicted time per token (and the measured one, and their ratio, when given)."""
        doc = {"mode": self.mode, "tree": self.tree_spec,
               "drafter": self.drafter, "rows": self.rows, "refresh_every": self.refresh_every,
               "predicted_tokens_per_step": self.tokens_per_step, "predicted_ms_per_step": self.ms_per_step,
               "predicted_ms_per_token": self.ms_per_token}
        if measured_ms_per_token is not None:
            doc |= {"measured_ms_per_token": measured_ms_per_token,
                    "measured_over_predicted": measured_ms_per_token / self.ms_per_token}
        return doc


class Planner:
    def __init__(self, profile: Profile, precision: PrecisionClass, drafter: str | tuple[str, ...] = "ngram",
                 node_budget: int = MAX_TREE_NODES):
        """drafter: the drafter whose trees are candidates, or several to choose between."""
        if not 1 <= node_budget <= MAX_TREE_NODES:
            raise InputError("{node_budget} must be in [1, {}], got {!r}", MAX_TREE_NODES, node_budget)
        self.profile, self.precision, self.node_budget = profile, precision, node_budget
        self.drafters = (drafter,) if isinstance(drafter, str) else tuple(drafter)

    def modes(self) -> list[str]:
        """The profile's modes this precision class may run."""
        labels = sorted({mode for mode, _ in self.profile.passes})
        return [m for m in labels if self.precision.allows(ApproxMode.from_name(m), self.profile.distances.get(m))]

    def candidates(self, prompt_tokens: int, batch: int, alpha: float | dict[str, float]) -> list[Plan]:
        """Every plan within the class that the profile can cost: plain decoding of each allowed mode, and each
        full tree of each drafter within the node budget whose verification pass (rows = nodes + 1) and draft were
        profiled. alpha: one acceptance for every drafter, or each drafter's."""
        alphas = alpha if isinstance(alpha, dict) else dict.fromkeys(self.drafters, alpha)
        plans = []
        for label in self.modes():
            refresh = ApproxMode.from_name(label).refresh_every
            plain = self.profile.passes.get((label, 1))
            if plain is not None:
                plans.append(Plan(label, None, None, 1, refresh, 1.0, plain(batch, prompt_tokens)))
            for depth in range(1, self.node_budget + 1):
                for branching in range(1, self.node_budget + 1):
                    nodes = tree_nodes(depth, branching)
                    if nodes > self.node_budget:
                        break
                    verify = self.profile.passes.get((label, nodes + 1))
                    for drafter in self.drafters:
                        draft = self.profile.drafts.get((drafter, nodes))
                        if verify is None or draft is None:
                            continue
                        ms = verify(batch, prompt_tokens) + draft(batch, prompt_tokens)
                        plans.append(Plan(label, (depth, branching), drafter, nodes + 1, refresh,
                                          expected_tokens(depth, branching, alphas[drafter]), ms))
        return plans

    def plan(self, prompt_tokens: int, batch: int, alpha: float | dict[str, float] = DEFAULT_ACCEPTANCE) -> Plan:
        """The candidate with the least predicted time per token (ties: plain decoding, then fewer rows)."""
        for a in alpha.values() if isinstance(alpha, dict) else (alpha,):
            if not 0.0 <= a <= 1.0 or math.isnan(a):
                raise ValueError(f"acceptance {a} is no probability")
        plans = self.candidates(prompt_tokens, batch, alpha)
        if not plans:
            raise InputError("{ssv_profile} {}: no plan of precision class {} is profiled", self.profile.path,
                             self.precision.name)
        return min(plans, key=lambda p: (p.ms_per_token, p.tree is not None, p.rows))
