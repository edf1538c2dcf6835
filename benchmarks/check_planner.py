"""Is the SSV planner's choice within 10 % of the best? Every plan the planner weighs for a (prompt length, batch)
and precision class (`Planner.candidates`: plain decoding of each allowed mode and each profiled tree, its drafter's
passes) is run end to end and measured, then the run the planner chooses from the same profile; the target (issue
21) is the chosen plan's measured tokens/s >= 0.9 x the best candidate's.

    python benchmarks/check_planner.py --ssv-profile benchmarks/results/ssv-profile-smollm2-view-<date>.json \
        [--batch 8] [--context 8192] [--max-new-tokens 64] [--precision exact,approximate] [--drafter self]
        [--repeats 2] [--budget-s 480] [--resume P.json] [--measured Q.json] [--smoke --ssv-profile P.json]

SmolLM2's NSA view on real prompts (benchmarks/prompts.py), greedy; `--smoke`: a tiny random model's view on random
prompts (CPU). Records, saved after each: `kind` planner | candidate, precision, mode, tree, drafter, predicted
ms per token, measured decode tokens/s (median, min, max over --repeats), τ; then one `summary` record per class
with the best candidate, the planner's choice and their ratio. Per class the planner's run comes first, then the
candidates cheapest-predicted first; none is started past --budget-s (the summary then says how many were left,
and compares the choice with the best of those measured). A candidate compiles its own loop (about 100 s on the
H200 at batch 8 x 8K), so the whole grid takes several device calls: `--resume P.json` continues the check that
P.json saved, skipping the runs it holds, and saves into it. A candidate's run depends on its plan alone, so a plan
two classes share runs once (the second class's record says `measured_as`), and `--measured Q.json` takes the runs
of a check made with another profile (same arguments, device and JAX; `measured_in` names it): a new profile's
choice is then checked at the cost of the planner's run alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_ssv import run  # noqa: E402
from benchmarks.prompts import long_prompts  # noqa: E402
from benchmarks.random_model import TINY, TINY_NSA_LAYOUT, random_model  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from models.config import NSA_VIEW_LAYOUT  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.ssv.planner import DEFAULT_ACCEPTANCE, Plan, Planner, load_profile  # noqa: E402
from vegas_jax.ssv.precision import parse_precision  # noqa: E402
from vegas_jax.ssv.choice import Choice  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGET = 0.9  # the chosen plan's tokens/s over the best candidate's


def check_class(engine: Engine, prompts, profile, precision: str, args, log: RecordLog, started: float,
                measured_before: list) -> dict:
    """The class's planner run and candidate records, then its summary record. A run already measured is not run
    again: one `log` holds for this class; a candidate's run, which depends on its plan alone, from any class or
    from `measured_before` (another check's runs); the planner's run from another class that weighs the same
    candidates (the same choice, made the same way). None is started past the budget."""
    prompt_tokens, batch = max(len(p) for p in prompts), len(prompts)
    planner = Planner(profile, parse_precision(precision), args.drafter)
    in_budget = lambda: time.perf_counter() - started <= args.budget_s
    chosen = planner.plan(prompt_tokens, batch, DEFAULT_ACCEPTANCE)
    candidates = sorted(planner.candidates(prompt_tokens, batch, DEFAULT_ACCEPTANCE), key=lambda p: p.ms_per_token)
    grid = sorted(plan.label for plan in candidates)
    planned = next((r for r in log.records if r["kind"] == "planner" and r["label"] == chosen.label
                    and (r["precision"] == precision or r.get("grid") == grid)), None)
    if planned is not None and planned["precision"] != precision:
        planned = reuse(log, planned, precision, chosen)
    if planned is None and in_budget():
        options = GenerationOptions(max_new_tokens=args.max_new_tokens, precision=precision, drafter=args.drafter,
                                    ssv_profile=args.ssv_profile)
        planned = measure(engine, prompts, options, "planner", chosen, precision, args, log, grid=grid)
    measured, left = [], 0
    for plan in candidates:
        earlier = [r for r in log.records if r["kind"] == "candidate" and r["label"] == plan.label]
        mine = next((r for r in earlier if r["precision"] == precision), None)
        other = next(iter(earlier), None) or next(
            (r for r in measured_before if r["kind"] == "candidate" and r["label"] == plan.label), None)
        if mine is not None:
            measured.append(mine)
        elif other is not None:
            measured.append(reuse(log, other, precision, plan))
        elif not in_budget():
            left += 1
        else:
            options = Choice.of_plan(plan).applied_to(
                GenerationOptions(max_new_tokens=args.max_new_tokens, precision=precision, drafter=args.drafter))
            measured.append(measure(engine, prompts, options, "candidate", plan, precision, args, log))
    summary = {"kind": "summary", "precision": precision, "batch": batch, "prompt_tokens": prompt_tokens,
               "candidates": len(candidates), "measured": len(measured), "left_by_budget": left,
               "planner_measured": planned is not None, "chosen": chosen.label,
               "chosen_tokens_per_s": planned and planned["decode_tokens_per_s"], "target": TARGET,
               "best": None, "best_tokens_per_s": None, "chosen_over_best": None, "met": None}
    if measured:
        best = max(measured, key=lambda r: r["decode_tokens_per_s"])
        summary |= {"best": best["label"], "best_tokens_per_s": best["decode_tokens_per_s"]}
        if planned is not None:
            ratio = planned["decode_tokens_per_s"] / best["decode_tokens_per_s"]
            summary |= {"chosen_over_best": ratio, "met": bool(ratio >= TARGET) if not left else None}
    add(log, summary)
    return summary


def measure(engine: Engine, prompts, options: GenerationOptions, kind: str, plan: Plan, precision: str, args,
            log: RecordLog, **extra) -> dict:
    record, _ = run(engine, prompts, options, args.repeats, phases=False)
    record = {"kind": kind, "label": plan.label, "predicted_ms_per_token": plan.ms_per_token, **record,
              "precision": precision, **extra}
    add(log, record)
    return record


def reuse(log: RecordLog, record: dict, precision: str, plan: Plan) -> dict:
    """record's measurement, filed under this class with this profile's prediction; `measured_as` says where it
    was run."""
    copy = {**record, "precision": precision, "predicted_ms_per_token": plan.ms_per_token,
            "measured_as": record.get("measured_as", record["precision"])}
    add(log, copy)
    return copy


def add(log: RecordLog, record: dict) -> None:
    log.add(record)
    if record["kind"] == "summary":
        verdict = {True: "met", False: "MISSED", None: "not all measured"}[record["met"]]
        chosen = (f"{record['chosen_tokens_per_s']:.1f} tok/s" if record["planner_measured"] else "not run")
        best = ("no candidate measured" if record["best"] is None
                else f"best measured {record['best']} {record['best_tokens_per_s']:.1f}")
        ratio = "" if record["chosen_over_best"] is None else f": {record['chosen_over_best']:.3f}"
        print(f"{record['precision']}: planner {record['chosen']} {chosen}, {best}{ratio} ({record['measured']} of "
              f"{record['candidates']} candidates; target >= {TARGET}: {verdict})", flush=True)
    else:
        where = f" (run as {record['measured_as']})" if "measured_as" in record else ""
        print(f"{record['kind']:9s} {record['label']:14s} predicted {record['predicted_ms_per_token']:.3f} ms/token, "
              f"measured {record['decode_tokens_per_s']:.1f} tok/s, tau {record['tau']:.2f}{where}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ssv-profile", required=True)
    p.add_argument("--model", default=None, help="the dense model whose NSA view runs (default: SmolLM2)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8192, help="prompt plus new tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--precision", default="exact,approximate")
    p.add_argument("--drafter", default="self")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=480.0, help="no new run is started past it")
    p.add_argument("--resume", type=Path, default=None, help="an unfinished check's JSON: continue it, into it")
    p.add_argument("--measured", type=Path, default=None,
                   help="another check's JSON (same arguments, device and JAX; any profile): its candidate runs "
                        "are reused, each with this profile's prediction")
    p.add_argument("--smoke", action="store_true", help="a tiny random model's view (CPU); the profile must fit it")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    check_writable("--out", None if args.smoke else args.out)
    started = time.perf_counter()
    profile = load_profile(args.ssv_profile)
    meta = run_metadata(args={k: str(v) for k, v in vars(args).items() if k not in ("resume", "measured", "budget_s")},
                        ssv_profile_sha256=hashlib.sha256(Path(args.ssv_profile).read_bytes()).hexdigest())
    earlier = read_check(args.resume, meta, "--resume") if args.resume else None
    measured_before = [{**r, "measured_in": args.measured.name}
                       for r in read_check(args.measured, meta, "--measured", same_profile=False)["records"]] \
        if args.measured else []
    if args.smoke:
        dense = random_model(TINY, jnp.float32)
        engine = Engine(dataclasses.replace(dense, config=with_attention(TINY, "nsa-view", TINY_NSA_LAYOUT)))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, TINY.vocab_size, args.context - args.max_new_tokens).tolist()
                   for _ in range(args.batch)]
    else:
        loaded = load_model(args.model, jnp.bfloat16)
        engine = Engine(dataclasses.replace(loaded, config=with_attention(loaded.config, "nsa-view", NSA_VIEW_LAYOUT)))
        prompts = long_prompts(engine.tokenizer, args.batch, prompt_tokens=args.context - args.max_new_tokens)
    if earlier is not None:
        log = RecordLog(meta, args.resume.name, args.resume.parent)
        log.records = [r for r in earlier["records"] if r["kind"] != "summary"]
    else:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
        name = f"planner-check-{'smoke-' if args.smoke else ''}{stamp}{'-' + args.tag if args.tag else ''}.json"
        log = RecordLog(meta, name, None if args.smoke else args.out)
    summaries = [check_class(engine, prompts, profile, precision, args, log, started, measured_before)
                 for precision in args.precision.split(",")]
    log.finish(complete=all(s["left_by_budget"] == 0 and s["planner_measured"] for s in summaries))
    return 0


def read_check(path: Path, meta: dict, flag: str, same_profile: bool = True) -> dict:
    """The check at path, refused (one line naming flag and path) unless it ran with the same arguments, device,
    JAX and (if same_profile) profile by content."""
    try:
        doc = json.loads(path.read_text())
        for record in doc["records"]:
            if record["kind"] != "summary":
                record["label"], record["precision"], float(record["decode_tokens_per_s"])
        ignored = ("out", "tag") if same_profile else ("out", "tag", "ssv_profile")
        where = ("ssv_profile_sha256", "device", "jax_version") if same_profile else ("device", "jax_version")
        differ = sorted(k for k, v in meta["args"].items() if k not in ignored and doc["args"].get(k) != v)
        differ += [k for k in where if doc.get(k) != meta[k]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"error: {flag} {path}: not a planner check's JSON ({type(e).__name__}: {e})") from None
    if differ:
        raise SystemExit(f"error: {flag} {path}: it ran with other arguments or elsewhere ({', '.join(differ)})")
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
