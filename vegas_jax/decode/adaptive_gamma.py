"""Adaptive γ (`--gamma auto`): the number of drafts of each iteration, chosen to maximise expected tokens per
second from the measured cost of an iteration of each number of drafts and the running acceptance by draft position.

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

    E[tokens | g] = 1 + sum_{k=1..g} β_k        (β_k = c_1 ... c_k: P(the first k drafts are all accepted),
                                                 c_k: P(draft k accepted | drafts 1..k-1 were))
    cost(0) = 1,  cost(g) = the iteration's time over a plain step's, measured (`Warmup`) or given

and g maximises E / cost. Each c_k has a posterior from decayed counts pooled over the batch (on a mesh over every
data shard: one g for the whole batch, the same on all devices): the drafts that reached position k (drafts 1..k-1
accepted) and those of them accepted, plus PRIOR_WEIGHT pseudo-observations at the posterior mean of c_{k-1} (at
position 1, PRIOR_RATE: a good draft's), so that a position little drafted takes its neighbour's acceptance rather
than a few samples' (one rejected draft at batch 1 made every later position look useless for hundreds of
iterations, code cb195a7). g is chosen by Thompson sampling: each iteration draws every c_k from its posterior
(a normal of its mean and standard error, clipped to [0, 1]; the draws' key is the iteration's number) and takes the
best g under the draw. A near-tie is then shared between its sides, and a position whose few samples were unlucky
is drafted again with the probability that it is in fact worth drafting, instead of never until its counts decay.
A run that fell back to plain decoding probes speculation again: when a draw says drafts pay, or at the latest
once position 1's counts have decayed below PROBE_BELOW (a run with no counts at all probes first).

The costs come from timing the compiled loop itself at the start of a run (`Warmup`: a few iterations with g forced
to each pass's full width, the widest pass's fewest drafts and 0, which decode real tokens, timed without the calls'
own overhead), or are given (`GenerationOptions.gamma_costs`). On the host, `RunControl` sets each decode call's
force and costs and times the call, and an engine's `CostBook` keeps the measured costs so that a later run of the
same loop does not time it again.
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
# The prior of each conditional acceptance: PRIOR_WEIGHT pseudo-observations at the position before's posterior
# mean (a batch of 8 outweighs it within an iteration or two, a batch of 1 within ten); at position 1,
# FIRST_PRIOR_WEIGHT at PRIOR_RATE (a good draft's).
PRIOR_WEIGHT, FIRST_PRIOR_WEIGHT, PRIOR_RATE = 8.0, 2.0, 0.9
# A probe: with fewer than this many (decayed) drafts at position 1 the loop drafts at least the narrowest pass's,
# whatever the model says: at the start of a run with no counts, and after a fall-back to plain steps, whose
# evidence never grows (with a prior or costs that say drafts lose, g = 0 would otherwise hold for good: the
# H200 suite's adaptive stage at batch 8 x 4,096, code c6e47ed, ran 255 plain steps where γ 2 gives 1.2x).
# After a probe of a batch of B the next comes within ln(2 B) / (1 - DECAY) iterations: 140 at batch 1.
PROBE_BELOW = 0.5
DEFAULT_GAMMA_MAX = 8
AUTO = "auto"
# An iteration costs at least a plain step; a draft step more than nothing.
MIN_COST, MIN_DRAFT = 1.0, 1e-3
DRAWS_SEED = 0  # Thompson sampling's key, folded with the iteration's number


def untimed(gamma_max: int) -> tuple[float, ...]:
    """The costs a loop holds until they are given or timed: drafts nearly free (the warm-up forces every g that
    runs on them; a caller of `decode` that neither gives nor times costs gets γ_max drafts)."""
    return tuple(MIN_COST + MIN_DRAFT * g for g in range(1, gamma_max + 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GammaControl:
    """Part of the decode state; every array is whole (the same) on every device."""

    reached: jax.Array = axes_field(None)  # [γ_max] float32 decayed count of drafts made after accepted ones
    accepted: jax.Array = axes_field(None)  # [γ_max] float32 decayed count of those accepted
    costs: jax.Array = axes_field(None)  # [γ_max] float32 cost(g) for g = 1..γ_max, in plain steps
    force: jax.Array = axes_field()  # int32: -1 chooses g; g >= 0 forces it (warm-up timing)
    chosen: jax.Array = axes_field(None)  # [γ_max + 1] int32 iterations run with each g

    @classmethod
    def create(cls, gamma_max: int) -> "GammaControl":
        zeros = jnp.zeros((gamma_max,), jnp.float32)
        return cls(zeros, zeros, jnp.asarray(untimed(gamma_max), jnp.float32), jnp.asarray(-1, jnp.int32),
                   jnp.zeros((gamma_max + 1,), jnp.int32))

    @property
    def iteration_key(self) -> jax.Array:
        """This iteration's key for the draws (the same on every device: `chosen` is)."""
        return jax.random.fold_in(jax.random.key(DRAWS_SEED), jnp.sum(self.chosen))

    @property
    def draws(self) -> jax.Array:
        """[γ_max] this iteration's standard normals, one per position (`acceptance`'s noise)."""
        return jax.random.normal(self.iteration_key, self.reached.shape)


def acceptance(control: GammaControl, noise: jax.Array | None = None) -> jax.Array:
    """[γ_max] β_k: P(drafts 1..k all accepted), non-increasing: the product of the conditional acceptances'
    posterior means, or with `noise` ([γ_max] standard normals z) of the draws mean + z sd (the module doc)."""
    gamma_max = control.reached.shape[0]
    noise = jnp.zeros((gamma_max,)) if noise is None else noise

    def position(prior, counts):
        reached, accepted, z, prior_weight = counts
        weight = reached + prior_weight
        mean = (accepted + prior_weight * prior) / weight
        draw = jnp.clip(mean + z * jnp.sqrt(mean * (1 - mean) / weight), 0.0, 1.0)
        return mean, draw

    prior_weights = jnp.full((gamma_max,), PRIOR_WEIGHT).at[0].set(FIRST_PRIOR_WEIGHT)
    # Unrolled: a rolled scan is a loop of its own inside every iteration (γ_max launches of a few tiny kernels).
    rates = jax.lax.scan(position, jnp.float32(PRIOR_RATE), (control.reached, control.accepted, noise, prior_weights),
                         unroll=True)[1]
    return jnp.cumprod(rates)


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


def best_gamma(beta: jax.Array, costs: jax.Array) -> jax.Array:
    """The g in [0, γ_max] maximising (1 + sum_{k<=g} β_k) / cost(g), cost(0) = 1 (the smallest on ties)."""
    tokens = 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(beta)])
    cost = jnp.concatenate([jnp.ones((1,)), jnp.maximum(costs, MIN_COST)])
    return jnp.argmax(tokens / cost).astype(jnp.int32)


def choose(control: GammaControl, most_useful: jax.Array, noise: jax.Array | None = None) -> jax.Array:
    """This iteration's g: forced, or the best under the acceptance (`noise`: a Thompson draw's, the loop's
    `control.draws`; None: the posterior means), at least the narrowest pass's drafts when position 1 has next to
    no evidence (a probe, `PROBE_BELOW`); never more than `most_useful` (the most drafts any unfinished request may
    still take)."""
    gamma_max = control.reached.shape[0]
    best = best_gamma(acceptance(control, noise), control.costs)
    probe = jnp.where(control.reached[0] < PROBE_BELOW, pass_widths(gamma_max)[0], 0)
    g = jnp.where(control.force >= 0, control.force, jnp.maximum(best, probe))
    return jnp.clip(g, 0, jnp.minimum(most_useful, gamma_max)).astype(jnp.int32)


def update(control: GammaControl, g: jax.Array, reached: jax.Array, accepted: jax.Array) -> GammaControl:
    """After an iteration with g drafts, whose rows (the whole batch's) made `reached` [γ_max] drafts after
    accepted ones (or first) and accepted `accepted` [γ_max] of them at each position."""
    return dataclasses.replace(
        control,
        reached=DECAY * control.reached + reached,
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
    step look up to a third dearer than it is). The forced g: each pass's full width (the g that use a pass are
    mostly its widest: fewer drafts in the same pass save only their draft steps), the fewest drafts of the widest
    pass (a draft step: the difference over the difference of drafts) and 0 (the unit). cost(g) is t(g) / t(0)
    where timed, else its pass's full width's less a draft step per draft it holds less. (A linear model of a
    pass's cost in its rows, fitted to γ_max, the widest pass's fewest and 1 draft, put g 2 at 2.18 plain steps
    against the 2.39 it costs at batch 8 x 7,936 on the H200, and auto drafted 2 where 4 is 12 % faster.)"""

    SHORT, LONG = 2, 8

    def __init__(self, gamma_max: int, costs: tuple[float, ...] | None):
        self.gamma_max = gamma_max
        self.costs = costs
        widths = pass_widths(gamma_max)
        self.fewest_in_widest = widths[-2] + 1 if len(widths) > 1 else 1
        plan = []
        for g in dict.fromkeys((gamma_max, self.fewest_in_widest, *reversed(widths[:-1]), 0)):
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

    def _fit(self) -> tuple[float, ...]:
        gamma_max, fewest = self.gamma_max, self.fewest_in_widest
        t = self._per_iteration()
        plain = t[0]
        draft = max((t[gamma_max] - t[fewest]) / (gamma_max - fewest), MIN_DRAFT * plain) if fewest < gamma_max else 0
        costs = []
        for g in range(1, gamma_max + 1):
            width = pass_width(g, gamma_max)
            seconds = t[g] if g in t else t[width] - (width - g) * draft
            costs.append(max(seconds / plain, MIN_COST))
        return tuple(costs)


def with_control(state, placement, force: int, costs: tuple[float, ...]):
    """The decode state with adaptive γ's force (-1: choose) and costs (g = 1..γ_max) set."""
    control = dataclasses.replace(state.gamma_control, force=placement.put(np.int32(force), Axes()),
                                  costs=placement.put(np.asarray(costs, np.float32), Axes(None)))
    return dataclasses.replace(state, gamma_control=control)


class RunControl:
    """Adaptive γ over one run's decode calls: before each call the force and costs its `Warmup` asks for (and
    the call's step limit, cut to the warm-up phase's iterations), after it the call's timing. A run without
    adaptive γ passes through unchanged."""

    def __init__(self, config, book: CostBook, given: tuple[float, ...] | None, key: tuple):
        self.placement = config.placement
        self.book, self.given, self.key = book, given, key
        self.warmup = None if not config.adaptive_gamma else Warmup(config.gamma, given or book.costs.get(key))

    def before_call(self, state, step: int, limit: int):
        """(the state with the control set for the next decode call, that call's step limit)."""
        if self.warmup is None:
            return state, limit
        force, most = self.warmup.next_call()
        costs = self.warmup.costs or untimed(self.warmup.gamma_max)
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
        """The metrics' adaptive γ entries: the choices (`summary`) and the costs they were made with (cost(g) for
        g = 1..γ_max in plain steps; None if the run ended before they were timed)."""
        if self.warmup is None:
            return {}
        report = summary(self.placement.fetch(state.gamma_control.chosen))
        costs = self.warmup.costs
        report["gamma_costs"] = None if costs is None else [float(c) for c in costs]
        return report


class CostBook:
    """The costs adaptive γ measured in an engine's runs, per (loop configuration, batch rows, cache capacity): a
    later run of the same loop starts from them instead of timing the loop again."""

    def __init__(self):
        self.costs: dict[tuple, tuple[float, ...]] = {}

    def for_run(self, config, given: tuple[float, ...] | None, rows: int, capacity: int) -> RunControl:
        return RunControl(config, self, given, (config, rows, capacity))
