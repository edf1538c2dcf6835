"""What the SSV planner chooses from a profile (benchmarks/profile_ssv.py), per precision class and (prompt length,
batch), with its predicted time per token, and beside it the best candidate of each mode and plain decoding of
the exact target, from the same cost model:

    python benchmarks/plan_ssv.py --ssv-profile benchmarks/results/ssv-profile-smollm2-view-<date>.json \
        --prompt-tokens 4096,8192 --batches 1,8,32 --acceptance 0.6

JSON: benchmarks/results/ssv-plans-<date>.json (and $OUT). Predictions only, unless `--against CHECK.json` (a
benchmarks/check_planner.py result, from any profile): then, at that check's prompt length, batch and drafter, every
candidate it measured is listed with this profile's predicted and the check's measured milliseconds per token
(one step's time over the tokens it yields, the batch's sequences together), and the plan chosen here is looked up
among them: a new profile is judged on measurements already made, on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from vegas_jax.inputs import InputError  # noqa: E402
from vegas_jax.ssv.planner import DEFAULT_ACCEPTANCE, Planner, load_profile  # noqa: E402
from vegas_jax.ssv.precision import parse_precision  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ssv-profile", required=True)
    parser.add_argument("--prompt-tokens", default="4096,8192")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--acceptance", type=float, default=DEFAULT_ACCEPTANCE, help="per-token alpha")
    parser.add_argument("--tolerance", type=float, default=None, help="the approximate class's tolerance")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--against", type=Path, default=None, metavar="CHECK.json",
                        help="a planner check's measurements to set the predictions beside")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.ssv_profile)
        classes = [parse_precision("exact"), parse_precision("approximate", args.tolerance)]
    except InputError as e:
        print("error: " + e.render(lambda name: "--" + name.replace("_", "-")), file=sys.stderr)
        return 2
    if args.against is not None:
        return against_check(profile, classes, args)
    records = []
    for length in (int(x) for x in args.prompt_tokens.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for precision in classes:
                planner = Planner(profile, precision, args.drafter)
                plan = planner.plan(length, batch, args.acceptance)
                candidates = planner.candidates(length, batch, args.acceptance)
                best_of_mode = {}
                for c in candidates:
                    if c.mode not in best_of_mode or c.ms_per_token < best_of_mode[c.mode].ms_per_token:
                        best_of_mode[c.mode] = c
                plain = next(c for c in candidates if c.mode == "exact" and c.tree is None)
                records.append(dict(prompt_tokens=length, batch=batch, precision=precision.name,
                                    tolerance=precision.tolerance, plan=plan.report(),
                                    predicted_speedup_vs_plain=plain.ms_per_token / plan.ms_per_token,
                                    best_of_mode={m: c.report() for m, c in best_of_mode.items()}))
                print(length, batch, precision.name, plan.report(), flush=True)
    doc = run_metadata(profile=args.ssv_profile, profile_device=profile.device, acceptance=args.acceptance,
                       drafter=args.drafter, plans=records)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(doc, f"ssv-plans-{stamp}.json", RESULTS)
    return 0


def against_check(profile, classes, args) -> int:
    try:
        check = json.loads(args.against.read_text())
        runs = [r for r in check["records"] if r["kind"] == "candidate"]
        batch, length = runs[0]["batch"], runs[0]["prompt_tokens"]
        drafter = check["args"]["drafter"]
        measured = {(r["precision"], r["label"]): 1e3 * batch / r["decode_tokens_per_s"] for r in runs}
    except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        print(f"error: --against {args.against}: not a planner check's JSON ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    records = []
    for precision in classes:
        planner = Planner(profile, precision, drafter)
        chosen = planner.plan(length, batch, args.acceptance)
        rows = [{"label": c.label, **c.report(measured.get((precision.name, c.label)))}
                for c in sorted(planner.candidates(length, batch, args.acceptance), key=lambda c: c.ms_per_token)]
        for row in rows:
            print(f"{precision.name:11s} {row['label']:14s} predicted {row['predicted_ms_per_token']:7.3f}  measured "
                  + (f"{row['measured_ms_per_token']:7.3f}  measured / predicted {row['measured_over_predicted']:.2f}"
                     if "measured_ms_per_token" in row else "      -"))
        timed = [r["measured_ms_per_token"] for r in rows if "measured_ms_per_token" in r]
        mine = measured.get((precision.name, chosen.label))
        record = dict(precision=precision.name, prompt_tokens=length, batch=batch, chosen=chosen.label,
                      candidates=rows, measured=len(timed),
                      chosen_over_best=mine and min(timed) / mine)
        records.append(record)
        print(f"{precision.name}: chooses {record['chosen']}"
              + (f", {record['chosen_over_best']:.3f} of the best measured" if mine else ", not measured in the check"))
    doc = run_metadata(profile=args.ssv_profile, profile_device=profile.device, against=str(args.against),
                       acceptance=args.acceptance, drafter=drafter, comparisons=records)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(doc, f"ssv-plans-against-{stamp}.json", RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
