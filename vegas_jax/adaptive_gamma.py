"""Adaptive γ (`--gamma auto`): the number of drafts of each iteration, chosen to maximise expected tokens per
second from the cost of a draft step against a verification pass and the running acceptance by draft position.

Compiled shapes are fixed: each g <= γ_max has its own branch of the loop (`lax.switch`), which drafts g tokens in
a loop of g steps known at compile time (a traced count made the GPU wait on the host at every draft step) and
verifies them in the narrowest of a few compiled passes that holds g drafts (`pass_widths`: 2, 4 and 8 drafts for
γ_max 8; a pass of γ_max + 1 rows whatever g is cost a fixed γ of 4 seven per cent at batch 32 x 8K), counting only
the first g drafts (the others are treated as rejected, so acceptance and the bonus token are those of an iteration
of g drafts); g = 0 is a plain decoding step (a one-row verification, no score collection, no selection; the
selection of the last speculative iteration stays, its recent range covering everything since). Choosing g from
earlier iterations' outcomes keeps the output exact: speculative sampling emits the target's distribution for any
number of drafts fixed before the iteration's draws.

The model, in units of a plain step:

    E[tokens | g] = 1 + sum_{k=1..g} β_k        (β_k: P(the first k drafts are all accepted))
    cost(0) = 1,  cost(g) = verify - row * (γ_max - w(g)) + g * draft
                         (verify: the iteration's fixed part with the widest pass, its verification, score collection
                          and selection; row: what a pass saves per draft it holds less; w(g): the drafts of g's pass;
                          draft: one draft step)

and g maximises E / cost. β_k is estimated from decayed counts pooled over the batch (on a mesh over every data
shard: one g for the whole batch, the same on all devices), made non-increasing in k, with a prior at each
position that continues the acceptance before it: β_{k-1} times the conditional acceptance β_{k-1} / β_{k-2} of
position k-1 (the drafts' usual geometric decay; position 1's prior is PRIOR_RATE, a good draft's), raised by
OPTIMISM standard errors of its evidence (an upper confidence bound: a position with a few unlucky samples gets
tried again). A run that starts from no counts (a later run of a configuration, its costs kept) climbs to its
best g as its drafted positions show their acceptance, instead of stopping where a fixed prior says the next
draft will not pay; positions not drafted for a while drift towards their prior as their counts decay, and a run
that fell back to plain decoding probes speculation again now and then: when the prior says drafts pay, or at the
latest once position 1's counts have decayed below PROBE_BELOW (a run with no counts at all probes first).

The costs come from timing the compiled loop itself at the start of a run (`Warmup`: a few iterations each with g
forced to γ_max, the widest pass's fewest drafts, 1 and 0, which decode real tokens, timed without the calls' own
overhead), or are given (`GenerationOptions.draft_cost`, `verify_cost`, `verify_row_cost`).
On the host, `RunControl` sets each decode call's force and costs and times the call, and an engine's `CostBook`
keeps the measured costs so that a later run of the same loop does not time it again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.logical_axes import Axes, axes_field

# Per iteration: the estimates follow about the last 200 iterations. With useless drafts a probe (a few drafts)
# comes every ~log(batch) / -log(DECAY) iterations or more: about 1 % of plain decoding's time at batch 1.
DECAY = 0.995
# The prior: PRIOR_WEIGHT pseudo-observations at each position; with no evidence anywhere drafts 1..k are
# accepted with probability PRIOR_RATE ** k, a good draft's.
PRIOR_WEIGHT, PRIOR_RATE = 1.0, 0.9
# Optimism for what is little sampled: a position's estimate is raised by OPTIMISM standard errors, so a few
# unlucky samples at the edge of the drafted positions do not stop the loop below its best g for hundreds of
# iterations (until their counts decay); at positions drafted every iteration the raise is about 1 %.
OPTIMISM = 1.0
# A probe: with fewer than this many (decayed) drafts at position 1 the loop drafts at least the narrowest pass's,
# whatever the model says: at the start of a run with no counts, and after a fall-back to plain steps, whose
# evidence never grows (with a prior or costs that say drafts lose, g = 0 would otherwise hold for good: the
# H200 suite's adaptive stage at batch 8 x 4,096, code c6e47ed, ran 255 plain steps where γ 2 gives 1.2x).
# After a probe of a batch of B the next comes within ln(2 B) / (1 - DECAY) iterations: 140 at batch 1.
PROBE_BELOW = 0.5
DEFAULT_GAMMA_MAX = 8
AUTO = "auto"
# Costs are clamped to what an iteration can cost: its fixed part at least a plain step, a draft step above 0.
MIN_VERIFY, MIN_DRAFT = 1.0, 1e-3
UNTIMED = (MIN_DRAFT, MIN_VERIFY, 0.0)  # the costs a loop holds until they are given or timed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GammaControl:
    """Part of the decode state; every array is whole (the same) on every device."""

    drafted: jax.Array = axes_field(None)  # [γ_max] float32 decayed count of drafts made at each position
    accepted: jax.Array = axes_field(None)  # [γ_max] float32 decayed count of those accepted
    costs: jax.Array = axes_field(None)  # [3] float32 (draft step, verify, row): the cost model, in plain steps
    force: jax.Array = axes_field()  # int32: -1 chooses g; g >= 0 forces it (warm-up timing)
    chosen: jax.Array = axes_field(None)  # [γ_max + 1] int32 iterations run with each g

    @classmethod
    def create(cls, gamma_max: int) -> "GammaControl":
        zeros = jnp.zeros((gamma_max,), jnp.float32)
        return cls(zeros, zeros, jnp.asarray(UNTIMED, jnp.float32), jnp.asarray(-1, jnp.int32),
                   jnp.zeros((gamma_max + 1,), jnp.int32))


def acceptance(control: GammaControl) -> jax.Array:
    """[γ_max] β_k: estimated P(drafts 1..k all accepted), non-increasing; each position's prior continues the
    conditional acceptance of the position before it (the module doc)."""

    def position(carry, counts):
        before, rate = carry  # β_{k-1}, and position k-1's conditional acceptance
        drafted, accepted = counts
        weight = drafted + PRIOR_WEIGHT
        mean = (accepted + PRIOR_WEIGHT * before * rate) / weight
        # A standard error of the evidence only: the prior's single pseudo-observation would make one of about
        # 0.3-0.5 at any position never drafted, and every such position look certain.
        optimism = OPTIMISM * (drafted / weight) * jnp.sqrt(mean * (1 - mean) / weight)
        estimate = jnp.minimum(mean + optimism, before)
        return (estimate, jnp.where(before > 0, estimate / before, 0.0)), estimate

    start = (jnp.float32(1.0), jnp.float32(PRIOR_RATE))
    # Unrolled: a rolled scan is a loop of its own inside every iteration (γ_max launches of a few tiny kernels).
    return jax.lax.scan(position, start, (control.drafted, control.accepted), unroll=True)[1]


def pass_widths(gamma_max: int) -> tuple[int, ...]:
    """The drafts each compiled verification pass holds, narrowest first: powers of two from 2 that leave the
    widest pass (γ_max) at least two draft counts of its own, so that the warm-up can time a draft step inside it."""
    narrower = []
    while 2 ** (len(narrower) + 1) <= gamma_max - 2:
        narrower.append(2 ** (len(narrower) + 1))
    return (*narrower, gamma_max)


def pass_width(g: int, gamma_max: int) -> int:
    """The drafts of the narrowest pass in pass_widths(γ_max) that holds g >= 1 drafts."""
    return next(width for width in pass_widths(gamma_max) if width >= g)


def iteration_costs(gamma_max: int, draft_cost, verify_cost, row_cost) -> jax.Array:
    """[γ_max + 1] cost(g) in plain steps (the module doc), cost(0) = 1."""
    width = np.asarray([gamma_max] + [pass_width(g, gamma_max) for g in range(1, gamma_max + 1)])
    g = jnp.arange(gamma_max + 1)
    fixed = jnp.maximum(verify_cost - row_cost * (gamma_max - width), MIN_VERIFY)
    return jnp.where(g == 0, 1.0, fixed + g * draft_cost)


def best_gamma(beta: jax.Array, draft_cost, verify_cost, row_cost=0.0) -> jax.Array:
    """The g in [0, γ_max] maximising (1 + sum_{k<=g} β_k) / cost(g) (the smallest on ties)."""
    tokens = 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(beta)])
    return jnp.argmax(tokens / iteration_costs(beta.shape[0], draft_cost, verify_cost, row_cost)).astype(jnp.int32)


def choose(control: GammaControl, most_useful: jax.Array) -> jax.Array:
    """This iteration's g: forced, or the model's best, at least the narrowest pass's drafts when position 1 has
    next to no evidence (a probe, `PROBE_BELOW`); never more than `most_useful` (the most drafts any unfinished
    request may still take)."""
    draft_cost = jnp.maximum(control.costs[0], MIN_DRAFT)
    verify_cost = jnp.maximum(control.costs[1], MIN_VERIFY)
    best = best_gamma(acceptance(control), draft_cost, verify_cost, jnp.maximum(control.costs[2], 0.0))
    probe = jnp.where(control.drafted[0] < PROBE_BELOW, pass_widths(control.drafted.shape[0])[0], 0)
    g = jnp.where(control.force >= 0, control.force, jnp.maximum(best, probe))
    return jnp.clip(g, 0, jnp.minimum(most_useful, control.drafted.shape[0])).astype(jnp.int32)


def update(control: GammaControl, g: jax.Array, drafted: jax.Array, accepted: jax.Array) -> GammaControl:
    """After an iteration with g drafts, whose rows (the whole batch's) made `drafted` [γ_max] and accepted
    `accepted` [γ_max] drafts at each position."""
    return dataclasses.replace(
        control,
        drafted=DECAY * control.drafted + drafted,
        accepted=DECAY * control.accepted + accepted,
        chosen=control.chosen.at[g].add(1),
    )


def summary(chosen: np.ndarray) -> dict:
    """The metrics' report of a run's choices: iterations by g, and the mean g."""
    chosen = np.asarray(chosen)
    total = int(chosen.sum())
    mean = float((np.arange(len(chosen)) * chosen).sum() / total) if total else None
    return {"gamma_chosen_mean": mean, "gamma_chosen_histogram": chosen.tolist()}


class Warmup:
    """Host side of the cost measurement: which g the next decode calls force, for how many iterations, and the
    costs from their timings. Each forced g runs an untimed call of one iteration (its branch's first execution
    does one-off work: 6 ms against 0.4 ms an iteration for a tiny model on a CPU), then a call of SHORT and one
    of LONG iterations: the difference of their times over the difference of their iterations is an iteration's
    time t(g) without the call's own (dispatch, host transfers: about 3 ms on the H200, inferred from the costs
    reported against the iterations the suite measured at 9bb8ff8; divided over a few iterations, it made a plain
    step look up to a third dearer than it is). The forced g: γ_max and the fewest drafts of the
    widest pass (a draft step: the difference over the difference of drafts), 1 (the narrowest pass's fixed part,
    hence the saving per draft a pass holds less) and 0 (the unit), each divided by t(0)."""

    SHORT, LONG = 2, 8

    def __init__(self, gamma_max: int, costs: tuple[float, float, float] | None):
        self.gamma_max = gamma_max
        self.costs = costs
        widths = pass_widths(gamma_max)
        self.fewest_in_widest = widths[-2] + 1 if len(widths) > 1 else 1
        plan = []
        for g in dict.fromkeys((gamma_max, self.fewest_in_widest, 1, 0)):
            plan += [(g, 1, False), (g, self.SHORT, True), (g, self.LONG, True)]
        self.pending = [] if costs is not None else plan
        self.calls: dict[int, list[tuple[int, float]]] = {}  # per forced g: (iterations, seconds) of its calls

    @property
    def done(self) -> bool:
        return not self.pending

    def next_call(self) -> tuple[int, int | None]:
        """(force: g or -1, most iterations this call may run or None)."""
        if not self.pending:
            return -1, None
        g, iterations, _ = self.pending[0]
        return g, iterations

    def record(self, iterations: int, seconds: float) -> None:
        """A decode call that ran under `next_call`'s force: once its phase has run, the next one's turn."""
        if not self.pending or iterations <= 0:
            return
        g, _, timed = self.pending.pop(0)
        if timed:
            self.calls.setdefault(g, []).append((iterations, seconds))
        if not self.pending:
            self.costs = self._fit()

    def _per_iteration(self) -> dict[int, float]:
        """t(g) per forced g: the difference of its two calls over their difference of iterations; where any g's
        calls cannot give one (the batch ended during them, or the timer's noise swamped the difference), every
        g's long call over its iterations, the calls' own time left in alike rather than in some g only."""
        differences = {}
        for g, ((short, short_s), (long, long_s)) in self.calls.items():
            if long - short >= self.SHORT and long_s > short_s:
                differences[g] = (long_s - short_s) / (long - short)
        if len(differences) == len(self.calls):
            return differences
        return {g: long_s / long for g, (_, (long, long_s)) in self.calls.items()}

    def _fit(self) -> tuple[float, float, float]:
        gamma_max, fewest = self.gamma_max, self.fewest_in_widest
        t = self._per_iteration()
        plain = t[0]
        if gamma_max == 1:
            return max(t[1] - plain, MIN_DRAFT * plain) / plain, 1.0, 0.0
        draft = max((t[gamma_max] - t[fewest]) / (gamma_max - fewest), MIN_DRAFT * plain)
        widest = max(t[gamma_max] - gamma_max * draft, MIN_VERIFY * plain)
        narrowest = max(t[1] - draft, MIN_VERIFY * plain)
        narrowest_width = pass_widths(gamma_max)[0]
        row = max(widest - narrowest, 0.0) / (gamma_max - narrowest_width) if narrowest_width < gamma_max else 0.0
        return draft / plain, widest / plain, row / plain


def with_control(state, placement, force: int, costs: tuple[float, float, float]):
    """The decode state with adaptive γ's force (-1: choose) and cost model (draft step, verify, row) set."""
    control = dataclasses.replace(state.gamma_control, force=placement.put(np.int32(force), Axes()),
                                  costs=placement.put(np.asarray(costs, np.float32), Axes(None)))
    return dataclasses.replace(state, gamma_control=control)


class RunControl:
    """Adaptive γ over one run's decode calls: before each call the force and costs its `Warmup` asks for (and
    the call's step limit, cut to the warm-up phase's iterations), after it the call's timing. A run without
    adaptive γ passes through unchanged."""

    def __init__(self, config, book: CostBook, given: tuple[float, float, float] | None, key: tuple):
        self.placement = config.placement
        self.book, self.given, self.key = book, given, key
        self.warmup = None if not config.adaptive_gamma else Warmup(config.gamma, given or book.costs.get(key))

    def before_call(self, state, step: int, limit: int):
        """(the state with the control set for the next decode call, that call's step limit)."""
        if self.warmup is None:
            return state, limit
        force, most = self.warmup.next_call()
        costs = self.warmup.costs or UNTIMED
        limit = limit if most is None else min(limit, step + most)
        return with_control(state, self.placement, force, costs), limit

    def after_call(self, iterations: int, seconds: float) -> None:
        """A decode call's timing to the measurement; once measured, the costs kept for the engine's later runs."""
        if self.warmup is None or self.warmup.done:
            return
        self.warmup.record(iterations, seconds)
        if self.warmup.done and self.given is None:
            self.book.costs[self.key] = self.warmup.costs

    def report(self, state) -> dict:
        """The metrics' adaptive γ entries: the choices (`summary`) and the costs they were made with."""
        if self.warmup is None:
            return {}
        report = summary(self.placement.fetch(state.gamma_control.chosen))
        costs = self.warmup.costs
        report["gamma_costs"] = None if costs is None else dict(zip(("draft", "verify", "row"), costs))
        return report


class CostBook:
    """The costs adaptive γ measured in an engine's runs, per (loop configuration, batch rows, cache capacity): a
    later run of the same loop starts from them instead of timing the loop again."""

    def __init__(self):
        self.costs: dict[tuple, tuple[float, float, float]] = {}

    def for_run(self, config, given: tuple[float, float, float] | None, rows: int, capacity: int) -> RunControl:
        return RunControl(config, self, given, (config, rows, capacity))
