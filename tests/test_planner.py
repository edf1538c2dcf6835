"""The SSV planner and the precision classes: the planner never leaves the user's class (and the class is what keeps
it from a faster mode), with a profile that makes speculation useless it decodes plainly (and speculates with one
that does not), its fitted predictions reproduce the profile; bad precision values and bad profile files give one
line naming the flag or the file."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from vegas_jax.inputs import InputError
from vegas_jax.decode.tree_shapes import tree_nodes
from vegas_jax.ssv.planner import DEFAULT_ACCEPTANCE, AcceptanceTracker, Planner, expected_tokens, load_profile
from vegas_jax.ssv.precision import ApproxMode, parse_precision

BATCHES, CONTEXTS = (1, 8, 32), (1024, 8192, 32768)
ROWS = sorted({1} | {tree_nodes(d, k) + 1 for d in range(1, 7) for k in (1, 2, 3) if tree_nodes(d, k) <= 64})
# Each mode's share of the exact target's K/V reads, and its measured top-1 disagreement.
MODES = {"exact": (1.0, None), "s8w1r1": (0.7, 0.01), "s1w1r4": (0.4, 0.2)}


def pass_ms(mode: str, rows: int, batch: int, context: int, tree_cost: float) -> float:
    """A synthetic device: 4 ms of weights per pass, plus per sequence its rows' work and K/V reads; a tree pass
    tree_cost times that."""
    ms = 4.0 + 0.05 * batch * rows + 2e-5 * MODES[mode][0] * batch * context * (1 + 0.02 * rows)
    return ms * tree_cost if rows > 1 else ms


def profile_doc(tree_cost: float = 1.0, self_draft_cost: float | None = None) -> dict:
    """A profile of the synthetic device; with self_draft_cost, self drafts costing that many plain steps a node."""
    passes = [{"mode": m, "rows": r, "batch": b, "context": c, "ms": pass_ms(m, r, b, c, tree_cost)}
              for m in MODES for r in ROWS for b in BATCHES for c in CONTEXTS]
    drafts = [{"drafter": "ngram", "nodes": r - 1, "batch": b, "context": c, "ms": 0.2 + 0.01 * b + 1e-8 * b * c}
              for r in ROWS if r > 1 for b in BATCHES for c in CONTEXTS]
    if self_draft_cost is not None:
        drafts += [{"drafter": "self", "nodes": r - 1, "batch": b, "context": c,
                    "ms": self_draft_cost * (r - 1) * pass_ms("exact", 1, b, c, 1.0)}
                   for r in ROWS if r > 1 for b in BATCHES for c in CONTEXTS]
    distances = {m: {"top1_disagreement": d, "greedy_agreement": 1 - 2 * d} for m, (_, d) in MODES.items() if d}
    return {"format": "vegas-ssv-profile", "version": 1, "device": "synthetic", "passes": passes, "drafts": drafts,
            "distances": distances}


def write(tmp_path, doc, name="profile.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


GRID = list(itertools.product((1024, 4096, 16384, 32768), (1, 4, 16, 32)))


def chosen_modes(planner):
    return {planner.plan(length, batch).mode for length, batch in GRID}


def test_the_planner_never_leaves_the_users_class(tmp_path):
    profile = load_profile(write(tmp_path, profile_doc()))
    assert chosen_modes(Planner(profile, parse_precision("exact"))) == {"exact"}
    assert chosen_modes(Planner(profile, parse_precision("approximate", 0.05))) == {"s8w1r1"}
    # The tolerance is what keeps the fastest mode out: loosened past its disagreement, it is chosen.
    assert "s1w1r4" in chosen_modes(Planner(profile, parse_precision("approximate", 0.25)))
    # A mode the profile never measured the distance of is not allowed at any tolerance.
    unmeasured = profile_doc()
    del unmeasured["distances"]["s8w1r1"]
    loose = Planner(load_profile(write(tmp_path, unmeasured)), parse_precision("approximate", 0.5))
    assert "s8w1r1" not in chosen_modes(loose) and "s8w1r1" not in loose.modes()


def test_with_useless_speculation_the_planner_decodes_plainly(tmp_path):
    useful = Planner(load_profile(write(tmp_path, profile_doc(), "useful.json")), parse_precision("exact"))
    assert all(useful.plan(length, batch).tree is not None for length, batch in GRID)
    # Verification passes 8x the cost of a plain step: no tree yields 8 tokens a step at alpha 0.6.
    useless = Planner(load_profile(write(tmp_path, profile_doc(tree_cost=8.0), "useless.json")),
                      parse_precision("approximate"))
    plans = [useless.plan(length, batch) for length, batch in GRID]
    assert all(p.tree is None and p.rows == 1 and p.tokens_per_step == 1 for p in plans)
    # At acceptance 0 a tree yields only its bonus token: plain decoding even where trees are cheap.
    assert all(useful.plan(length, batch, alpha=0.0).tree is None for length, batch in GRID)


def test_the_planner_costs_trees_with_its_own_drafters_times(tmp_path):
    """Self drafts cost a model pass a level: cheap ones leave trees worth it, drafts dearer than the plain steps
    they could save leave plain decoding; the n-gram drafter's times never stand in for them."""
    cheap = Planner(load_profile(write(tmp_path, profile_doc(self_draft_cost=0.01), "cheap.json")),
                    parse_precision("exact"), drafter="self")
    assert all(cheap.plan(length, batch).tree is not None for length, batch in GRID)
    dear = Planner(load_profile(write(tmp_path, profile_doc(self_draft_cost=1.0), "dear.json")),
                   parse_precision("exact"), drafter="self")
    assert all(dear.plan(length, batch).tree is None for length, batch in GRID)
    assert all(Planner(dear.profile, parse_precision("exact")).plan(length, batch).tree is not None
               for length, batch in GRID)  # the same profile's n-gram drafts are cheap


def test_the_prediction_is_the_fitted_cost_of_the_choice(tmp_path):
    planner = Planner(load_profile(write(tmp_path, profile_doc())), parse_precision("exact"), node_budget=14)
    plan = planner.plan(8192, 4, alpha=0.7)
    depth, branching = plan.tree
    assert tree_nodes(depth, branching) <= 14 and plan.rows == tree_nodes(depth, branching) + 1
    draft = 0.2 + 0.01 * 4 + 1e-8 * 4 * 8192
    assert plan.ms_per_step == pytest.approx(pass_ms("exact", plan.rows, 4, 8192, 1.0) + draft, rel=1e-6)
    assert plan.tokens_per_step == pytest.approx(expected_tokens(depth, branching, 0.7))
    best = min(planner.candidates(8192, 4, 0.7), key=lambda p: p.ms_per_token)
    assert plan.ms_per_token == best.ms_per_token
    report = plan.report(measured_ms_per_token=2 * plan.ms_per_token)
    assert report["measured_over_predicted"] == pytest.approx(2.0) and report["mode"] == "exact"


def one_line(error: InputError) -> str:
    """The error as the CLI renders it (every argument a flag of the same name)."""
    message = error.render(lambda name: "--" + name.replace("_", "-"))
    assert "\n" not in message
    return message


@pytest.mark.parametrize("content, cause", [
    (None, "No such file"),
    ("{not json", "not JSON"),
    ({"format": "something-else", "version": 1}, "not a vegas-ssv-profile"),
    ("passes-bad-ms", "passes[0] needs a positive number ms"),
    ("passes-bad-mode", "unknown mode 'fast'"),
    ("passes-one-batch", "2 batch sizes"),
])
def test_a_missing_or_malformed_profile_is_one_line_naming_the_file(tmp_path, content, cause):
    path = tmp_path / "p.json"
    doc = profile_doc()
    if content == "passes-bad-ms":
        doc["passes"][0]["ms"] = "12"
    elif content == "passes-bad-mode":
        doc["passes"][0]["mode"] = "fast"
    elif content == "passes-one-batch":
        doc["passes"] = [p for p in doc["passes"] if p["batch"] == 1]
    if content is not None:
        write(tmp_path, doc if isinstance(content, str) and content.startswith("passes") else content, "p.json")
    with pytest.raises(InputError) as error:
        load_profile(path)
    message = one_line(error.value)
    assert message.startswith(f"--ssv-profile {path}: ") and cause in message


@pytest.mark.parametrize("name, tolerance, flag", [
    ("fast", None, "--precision"),
    ("approximate", 0.7, "--precision-tolerance"),
    ("approximate", -0.01, "--precision-tolerance"),
    ("approximate", "0.1", "--precision-tolerance"),
    ("exact", 0.05, "--precision-tolerance"),
])
def test_bad_precision_values_are_one_line_naming_the_flag(name, tolerance, flag):
    with pytest.raises(InputError) as error:
        parse_precision(name, tolerance)
    assert one_line(error.value).startswith(flag) and str(error.value).startswith(flag[2:].replace("-", "_"))


def test_precision_classes_and_mode_labels():
    assert parse_precision("exact").tolerance == 0.0
    assert parse_precision("approximate").tolerance == 0.05
    assert parse_precision("approximate", 0.01).tolerance == 0.01  # the user tightens it
    mode = ApproxMode(share_span=8, widen=2, refresh_every=3)
    assert ApproxMode.from_name(mode.name()) == mode and ApproxMode.from_name("exact").is_exact
    with pytest.raises(InputError, match="s<span>w<widen>r<refresh>"):
        ApproxMode.from_name("s8")
    with pytest.raises(InputError, match="refresh_every must be an integer >= 1"):
        ApproxMode(refresh_every=0)


@pytest.mark.parametrize("alpha, depth, branching", [(0.7, 4, 1), (0.5, 3, 2), (0.2, 6, 3)])
def test_the_acceptance_tracker_recovers_alpha_from_accepted_lengths(alpha, depth, branching):
    """Steps drawn from the acceptance model itself (each level passes with 1 - (1 - alpha)^k) from a wrong
    prior: the running estimate comes within 0.06 of alpha (decay 0.995: about 200 steps' memory)."""
    rng = random.Random(depth)
    level = 1 - (1 - alpha) ** branching
    tracker = AcceptanceTracker(prior=0.95, decay=0.995)
    for _ in range(3000):
        accepted = 0
        while accepted < depth and rng.random() < level:
            accepted += 1
        tracker.observe(accepted, depth, branching)
    assert tracker.alpha == pytest.approx(alpha, abs=0.06)


def test_plan_ssv_reports_a_bad_profile_in_one_error_line(tmp_path, capsys):
    from benchmarks import plan_ssv

    path = write(tmp_path, "[1, 2]", "list.json")
    assert plan_ssv.main(["--ssv-profile", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --ssv-profile {path}: not a vegas-ssv-profile")


def test_plan_ssv_sets_a_profiles_predictions_beside_a_checks_measurements(tmp_path, monkeypatch, capsys):
    """Every candidate the check measured gets this profile's prediction and the check's time per token; the
    plan chosen here is looked up among them. The made-up check measured each plan at twice its prediction,
    except the one predicted dearest, measured ten times faster than that, which the comparison must name as the best."""
    from benchmarks import plan_ssv

    monkeypatch.setattr(plan_ssv, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    profile = load_profile(write(tmp_path, profile_doc()))
    batch, length = 8, 8000
    planner = Planner(profile, parse_precision("exact"), "ngram")
    plans = sorted(planner.candidates(length, batch, DEFAULT_ACCEPTANCE), key=lambda c: c.ms_per_token)
    label = lambda c: f"{c.mode} {c.tree_spec or 'plain'}"  # noqa: E731
    fast = plans[-1]
    runs = [{"kind": "candidate", "precision": "exact", "label": label(c), "batch": batch, "prompt_tokens": length,
             "decode_tokens_per_s": 1e3 * batch / (2 * c.ms_per_token) * (10 if c is fast else 1)} for c in plans]
    check = write(tmp_path, {"args": {"drafter": "ngram"}, "records": runs}, "check.json")
    assert plan_ssv.main(["--ssv-profile", str(tmp_path / "profile.json"), "--against", str(check)]) == 0
    (saved,) = tmp_path.glob("ssv-plans-against-*.json")
    exact, approximate = json.loads(saved.read_text())["comparisons"]
    assert exact["chosen"] == label(planner.plan(length, batch, DEFAULT_ACCEPTANCE)) and exact["measured"] == len(plans)
    ratios = {r["label"]: r["measured_over_predicted"] for r in exact["candidates"]}
    assert ratios == pytest.approx({label(c): 2 / (10 if c is fast else 1) for c in plans})
    chosen_ms = 2 * planner.plan(length, batch, DEFAULT_ACCEPTANCE).ms_per_token
    assert 2 * fast.ms_per_token / 10 < chosen_ms  # so the dearest-predicted plan is the best measured
    assert exact["chosen_over_best"] == pytest.approx(2 * fast.ms_per_token / 10 / chosen_ms)
    assert approximate["measured"] == 0 and approximate["chosen_over_best"] is None  # the check ran exact only

    capsys.readouterr()
    assert plan_ssv.main(["--ssv-profile", str(tmp_path / "profile.json"), "--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --against {tmp_path}: not a planner check's JSON")


def test_the_planner_chooses_between_drafters_by_their_cost_and_acceptance(tmp_path):
    """A head drafting at a tenth of a plain step per level beside n-gram lookup (nearly free): at the same
    acceptance the cheaper n-gram trees win; a head accepted far more often than the lookup wins instead, and the
    engine's DrafterAcceptance keeps each drafter's running acceptance apart."""
    from vegas_jax.ssv.planner import DrafterAcceptance

    doc = profile_doc()
    doc["drafts"] += [{"drafter": "head", "nodes": r - 1, "batch": b, "context": c,
                       "ms": 0.1 * pass_ms("exact", 1, b, 1024, 1.0) * min(r - 1, 6)}
                      for r in ROWS if r > 1 for b in BATCHES for c in CONTEXTS]
    planner = Planner(load_profile(write(tmp_path, doc)), parse_precision("exact"), ("head", "ngram"))
    assert planner.plan(16384, 8, 0.6).drafter == "ngram"
    assert planner.plan(16384, 8, {"head": 0.9, "ngram": 0.2}).drafter == "head"
    book = DrafterAcceptance()
    for _ in range(50):
        book.of("ngram").observe(0, 4, 1)
        book.of("head").observe(4, 4, 1)
    alphas = book.alphas(("head", "ngram"))
    assert alphas["head"] > 0.9 and alphas["ngram"] < 0.1
    assert planner.plan(16384, 8, alphas).drafter == "head"
