"""SSV's choice for one run of an NSA model: which draft tree (or plain decoding) and which target (the exact model,
or an approximate mode's modified target) the run decodes with, within the user's precision class
(vegas_jax.ssv.precision).

- With a device profile (`ssv_profile`, benchmarks/profile_ssv.py writes one): the planner (vegas_jax.ssv.planner)
  chooses the tree shape, the mode and with it the refresh schedule for the run's longest prompt and batch, at the
  running acceptance (`acceptance`, each drafter's, kept by the engine across its runs and fed each run's accepted
  depths). The user gives no draft_tree nor approx_mode then: the planner owns both; with `drafter` auto it also
  chooses the drafter among those the profile times and the engine can run (`drafters`: the head only where the
  engine has one).
- Without a profile, the default plan: the user's draft tree (or plain decoding), and the exact target unless
  the user pins an approximate mode (`approx_mode`, with precision approximate). No approximate mode is chosen on
  the user's behalf, since only a profile carries the modes' measured distances that the class's tolerance bounds.

Exact never changes the output: the exact class's only mode is the exact target, whatever the profile says.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig
from vegas_jax.inputs import InputError
from vegas_jax.ssv.planner import DrafterAcceptance, Plan, Planner, load_profile
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode, parse_precision

AUTO_DRAFTER = "auto"  # drafter: the planner's choice (with ssv_profile)


def approx_mode_of(options) -> ApproxMode:
    """The mode the options run (the exact target unless approx_mode names another)."""
    return EXACT_MODE if options.approx_mode is None else ApproxMode.from_name(options.approx_mode)


def check(options) -> None:
    """GenerationOptions.validate's checks of precision, precision_tolerance and approx_mode."""
    precision = parse_precision(options.precision, options.precision_tolerance)
    if options.approx_mode is None:
        return
    try:
        mode = ApproxMode.from_name(options.approx_mode)
    except InputError:
        raise InputError("{approx_mode} must be 'exact' or s<span>w<widen>r<refresh> (e.g. s8w2r2), got {!r}",
                         options.approx_mode) from None
    if not mode.is_exact and precision.name != "approximate":
        raise InputError("{approx_mode} {}: an approximate mode changes the output; only with {precision} "
                         "approximate", options.approx_mode)


def resolve(options, config: ModelConfig, prompt_lengths: list[int], acceptance: DrafterAcceptance,
            drafters: tuple[str, ...]):
    """(the options the run decodes with, the planner's Plan or None for the default plan); InputError naming
    the option at fault. drafters: those the engine can run."""
    precision = parse_precision(options.precision, options.precision_tolerance)
    mode = approx_mode_of(options)
    if config.attention == "dense":
        if precision.name != "exact" or not mode.is_exact or options.ssv_profile is not None:
            flag = "{ssv_profile}" if options.ssv_profile is not None else "{precision} approximate"
            raise InputError(flag + ": precision classes and the SSV planner are for NSA models (an NSA checkpoint, "
                             "or {attention} nsa-view); this model is dense")
        return options, None
    if not mode.is_exact:
        mode.selection_layout(config.nsa)  # the span must divide the selection block
    if options.ssv_profile is None:
        return options, None
    for given in ("draft_tree", "approx_mode"):
        if getattr(options, given) is not None:
            raise InputError("{" + given + "} {}: with {ssv_profile} the planner chooses the tree and the mode; "
                             "give one or the other", getattr(options, given))
    profile = load_profile(options.ssv_profile)
    profiled = sorted({drafter for drafter, _ in profile.drafts})
    if options.drafter == AUTO_DRAFTER:
        choices = tuple(d for d in profiled if d in drafters)
        if not choices:
            raise InputError("{drafter} auto: the profile {} times none of the drafters this engine can run ({})",
                             options.ssv_profile, ", ".join(drafters))
    elif options.drafter not in profiled:
        raise InputError("{drafter} {}: the profile {} has no draft times for it (it has: {}); give {drafter} one of "
                         "them", options.drafter, options.ssv_profile, ", ".join(profiled) or "none")
    else:
        choices = (options.drafter,)
    plan = Planner(profile, precision, choices).plan(max(prompt_lengths), len(prompt_lengths),
                                                      acceptance.alphas(choices))
    return with_plan(options, plan), plan


def with_plan(options, plan: Plan):
    """options with the plan's tree and mode (plain decoding: no tree, the default drafter)."""
    tree = plan.tree_spec
    return dataclasses.replace(options, draft_tree=tree, drafter=plan.drafter if tree else "self",
                               approx_mode=None if plan.mode == "exact" else plan.mode)


def observe(acceptance: DrafterAcceptance, options, depth_histogram: list[int]) -> None:
    """A finished run's tree passes (accepted_depth_histogram: passes by drafts accepted) into its drafter's
    running acceptance."""
    tree = options.tree
    if tree is None:
        return
    branching, tracker = tree.children.shape[1], acceptance.of(options.drafter)
    for accepted, passes in enumerate(depth_histogram):
        for _ in range(passes):
            tracker.observe(accepted, tree.depth, branching)


def report(options, plan: dict | None, decode_s: float, decode_tokens: int, requests: int) -> dict:
    """The metrics of the run's SSV choice: class, mode, and the plan (Plan.report, None: the default plan) with
    its predicted time per token against the measured one (ms per step over tokens per sequence and step, as the
    planner predicts it)."""
    precision = parse_precision(options.precision, options.precision_tolerance)
    doc = {"precision": precision.name, "precision_tolerance": precision.tolerance,
           "approx_mode": approx_mode_of(options).name()}
    if plan is None:
        doc["ssv_plan"] = {"source": "default", "tree": options.draft_tree, "mode": doc["approx_mode"]}
        return doc
    doc["ssv_plan"] = {"source": options.ssv_profile, **plan}
    if decode_tokens and decode_s > 0:
        measured = 1000.0 * decode_s / (decode_tokens / requests)
        doc["ssv_plan"] |= {"measured_ms_per_token": measured,
                            "measured_over_predicted": measured / plan["predicted_ms_per_token"]}
    return doc
