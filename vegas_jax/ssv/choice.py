"""SSV's choice for one run of an NSA model (or of a dense one, with a profile): which draft tree (or plain
decoding) and which target (the exact model, or an approximate mode's modified target) the run decodes with, within
the user's precision class (vegas_jax.ssv.precision).

- With a device profile (`ssv_profile`, benchmarks/profile_ssv.py writes one): the planner (vegas_jax.ssv.planner)
  chooses the tree shape, the mode and with it the refresh schedule for the run's longest prompt and batch, at the
  running acceptance (`acceptance`, each drafter's, kept by the engine across its runs and fed each run's accepted
  depths). The user gives no draft_tree nor approx_mode then: the planner owns both; with `drafter` auto it also
  chooses the drafter among those the profile times and the engine can run (`drafters`: the head only where the
  engine has one). A dense model takes a profile of a dense model (its exact passes, the head's and n-gram
  lookup's drafts): the planner then chooses between plain decoding and those drafters' trees, as for NSA.
- Without a profile, the default plan: the user's draft tree (or plain decoding), and the exact target unless
  the user pins an approximate mode (`approx_mode`, with precision approximate). No approximate mode is chosen on
  the user's behalf, since only a profile carries the modes' measured distances that the class's tolerance bounds.

Exact never changes the output: the exact class's only mode is the exact target, whatever the profile says.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from vegas_jax.decode.tree_shapes import shaped_by_rates
from vegas_jax.inputs import InputError
from vegas_jax.ssv.planner import DrafterAcceptance, Plan, Planner, load_profile
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode, parse_precision

AUTO_DRAFTER = "auto"  # drafter: the planner's choice (with ssv_profile)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one run decodes with: its draft tree (None: plain decoding) and drafter (the user's, or the
    planner's), its target's mode (None: the exact target), and the planner's Plan (None: the default plan, the
    user's own)."""

    draft_tree: str | None
    drafter: str
    approx_mode: str | None
    plan: Plan | None

    @classmethod
    def of_plan(cls, plan: Plan) -> "Choice":
        """The planner's choice (plain decoding: no tree)."""
        return cls(plan.tree_spec, plan.drafter, None if plan.mode == "exact" else plan.mode, plan)

    def applied_to(self, options):
        """The options the run decodes with: the caller's, with this choice's tree and mode (the same options
        under the default plan)."""
        if self.plan is None:
            return options
        # Plain decoding: the drafting options of a run without a tree (a drafter auto would ask for one).
        drafting = (dataclasses.replace(options.drafting, draft_tree=self.draft_tree, drafter=self.drafter)
                    if self.draft_tree is not None else type(options.drafting)())
        return dataclasses.replace(options, drafting=drafting,
                                   ssv=dataclasses.replace(options.ssv, approx_mode=self.approx_mode))


def approx_mode_of(options) -> ApproxMode:
    """The mode the options run (the exact target unless approx_mode names another)."""
    return EXACT_MODE if options.ssv.approx_mode is None else ApproxMode.from_name(options.ssv.approx_mode)


def choose(options, config: ModelConfig, prompt_lengths: list[int], acceptance: DrafterAcceptance,
           drafters: tuple[str, ...]) -> Choice:
    """The run's Choice, for options that GenerationOptions.check has checked; InputError naming the option at
    fault. drafters: those the engine can run."""
    ssv = options.ssv
    precision = parse_precision(ssv.precision, ssv.precision_tolerance)
    mode = approx_mode_of(options)
    default = Choice(options.drafting.draft_tree, options.drafting.drafter, ssv.approx_mode, None)
    dense = config.attention == "dense"
    if dense and (precision.name != "exact" or not mode.is_exact):
        raise InputError("{precision} approximate: precision classes are for NSA models (an NSA checkpoint, or "
                         "{attention} nsa-view); this model is dense")
    if not mode.is_exact:
        mode.selection_layout(config.nsa)  # the span must divide the selection block
    if ssv.profile is None:
        return default
    if dense and options.method != "ar":
        raise InputError("{ssv_profile}: on a dense model the planner chooses trees of the draft head or n-gram "
                         "lookup, which read no KV selection: leave {method} ar, got {!r}", options.method)
    for given, value in (("draft_tree", options.drafting.draft_tree), ("approx_mode", ssv.approx_mode)):
        if value is not None:
            raise InputError("{" + given + "} {}: with {ssv_profile} the planner chooses the tree and the mode; "
                             "give one or the other", value)
    profile = load_profile(ssv.profile)
    profile.check_model(config.attention)
    profiled = sorted({drafter for drafter, _ in profile.drafts})
    drafter = options.drafting.drafter
    if drafter == AUTO_DRAFTER:
        choices = tuple(d for d in profiled if d in drafters)
        if not choices:
            raise InputError("{drafter} auto: the profile {} times none of the drafters this engine can run ({})",
                             ssv.profile, ", ".join(drafters))
    elif drafter not in profiled:
        raise InputError("{drafter} {}: the profile {} has no draft times for it (it has: {}); give {drafter} one of "
                         "them", drafter, ssv.profile, ", ".join(profiled) or "none")
    else:
        choices = (drafter,)
    plan = Planner(profile, precision, choices).plan(max(prompt_lengths), len(prompt_lengths),
                                                     acceptance.alphas(choices))
    return Choice.of_plan(plan)


def observe(acceptance: DrafterAcceptance, options, depth_histogram: list[int]) -> None:
    """A finished run's tree passes (accepted_depth_histogram: passes by drafts accepted) into its drafter's
    running acceptance."""
    tree = options.tree
    if tree is None or shaped_by_rates(options.drafting.draft_tree):  # its model is of full trees' levels
        return
    branching, tracker = tree.children.shape[1], acceptance.of(options.drafting.drafter)
    for accepted, passes in enumerate(depth_histogram):
        for _ in range(passes):
            tracker.observe(accepted, tree.depth, branching)


def report(options, plan: dict | None, decode_s: float, decode_tokens: int, requests: int) -> dict:
    """The metrics of the run's SSV choice: class, mode, and the plan (Plan.report, None: the default plan) with
    its predicted time per token against the measured one (ms per step over tokens per sequence and step, as the
    planner predicts it)."""
    precision = parse_precision(options.ssv.precision, options.ssv.precision_tolerance)
    doc = {"precision": precision.name, "precision_tolerance": precision.tolerance,
           "approx_mode": approx_mode_of(options).name()}
    if plan is None:
        doc["ssv_plan"] = {"source": "default", "tree": options.drafting.draft_tree, "mode": doc["approx_mode"]}
        return doc
    doc["ssv_plan"] = {"source": options.ssv.profile, **plan}
    if decode_tokens and decode_s > 0:
        measured = 1000.0 * decode_s / (decode_tokens / requests)
        doc["ssv_plan"] |= {"measured_ms_per_token": measured,
                            "measured_over_predicted": measured / plan["predicted_ms_per_token"]}
    return doc
