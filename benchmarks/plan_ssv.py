"""What the SSV planner chooses from a profile (benchmarks/profile_ssv.py), per precision class and (prompt length,
batch), with its predicted time per token, and beside it the best candidate of each mode and plain decoding of
the exact target, from the same cost model:

    python benchmarks/plan_ssv.py --ssv-profile benchmarks/results/ssv-profile-smollm2-view-<date>.json \
        --prompt-tokens 4096,8192 --batches 1,8,32 --acceptance 0.6

JSON: benchmarks/results/ssv-plans-<date>.json (and $OUT). Predictions only: the measured side comes from the loop.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from vegas_jax.inputs import InputError  # noqa: E402
from vegas_jax.planner import DEFAULT_ACCEPTANCE, Planner, load_profile  # noqa: E402
from vegas_jax.precision import parse_precision  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ssv-profile", required=True)
    parser.add_argument("--prompt-tokens", default="4096,8192")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--acceptance", type=float, default=DEFAULT_ACCEPTANCE, help="per-token alpha")
    parser.add_argument("--tolerance", type=float, default=None, help="the approximate class's tolerance")
    parser.add_argument("--drafter", default="ngram")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.ssv_profile)
        classes = [parse_precision("exact"), parse_precision("approximate", args.tolerance)]
    except InputError as e:
        print("error: " + e.render(lambda name: "--" + name.replace("_", "-")), file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    raise SystemExit(main())
