"""What a return to the host costs: the decode loop run as one call against the same iterations in many calls (as
streaming and continuous batching run it), on random weights of SmolLM2's shapes.

    python benchmarks/bench_call_overhead.py --batch 64 --prompt-tokens 7424 --tag b64

Per method: milliseconds per iteration inside one call, the median milliseconds of a call of `--iterations-per-call`
iterations (plain decoding: 8, Vegas: 1) as is, after allocating a cache-sized array and after reading results back
to the host (what continuous batching does between calls), and of a call whose step limit is already reached (the launch
and the loop's first condition alone). Then a profile of four such Vegas calls: the GPU's idle
time per call between the host's read of the state and the first kernel of the iteration. Writes JSON to --out and
$OUT.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.profile_decode import gpu_kernel_events  # noqa: E402
from benchmarks.random_model import SMOLLM2_135M, random_smollm2_engine  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from vegas_jax.runtime.engine import GenerationOptions  # noqa: E402

CALLS = 10


def timed_calls(decode, params, state, per_call: int, everyone, between=None):
    """Runs CALLS calls of per_call iterations; returns (state, milliseconds per call)."""
    times = []
    for _ in range(CALLS):
        if between:
            between(state)
        step = int(state.step)
        t0 = time.perf_counter()
        state = decode(params, state, jnp.int32(step + per_call), everyone)
        jax.block_until_ready(state.done)
        times.append(1e3 * (time.perf_counter() - t0))
    return state, times


def idle_before_iteration(decode, params, state, everyone):
    """Profiles four one-iteration calls: per call, GPU-idle milliseconds from the first event of the call (the
    host's read of the loop step) to the first kernel of the iteration, and the iteration's GPU span."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(4):
                step = int(state.step)
                state = decode(params, state, jnp.int32(step + 1), everyone)
                jax.block_until_ready(state.done)
        events = sorted(gpu_kernel_events(Path(log_dir)), key=lambda e: e["ts"])
    if not events:  # no GPU timeline (a CPU run)
        return state, []
    # The iteration is the one run of many kernels; calls are separated by the loop step's read-back.
    groups, current = [], [events[0]]
    for a, b in zip(events, events[1:]):
        if b["ts"] - (a["ts"] + a["dur"]) > 300:
            groups.append(current)
            current = []
        current.append(b)
    groups.append(current)
    calls, start = [], None
    for group in groups:
        if start is None:
            start = group[0]["ts"]
        if len(group) > 100:
            end = group[-1]["ts"] + group[-1]["dur"]
            calls.append({"idle_ms_before_iteration": (group[0]["ts"] - start) / 1e3,
                          "iteration_span_ms": (end - group[0]["ts"]) / 1e3})
            start = None
    return state, calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=7424)
    p.add_argument("--methods", default="ar,vegas")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)

    engine = random_smollm2_engine()
    prompts = np.random.default_rng(0).integers(0, SMOLLM2_135M.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    records = []
    for method in args.methods.split(","):
        per_call = 1 if method == "vegas" else 8
        # Room for every call below without a sequence finishing (random weights accept few drafts).
        options = GenerationOptions(method=method, max_new_tokens=512, max_model_len=args.prompt_tokens + 512)
        started = engine.start(prompts, options)
        params, state = engine.model.params, started.state

        def decode(params, state, *limits):
            return started.decode(params, started.draft_params, state, *limits)

        everyone = jnp.int32(args.batch)
        state, _ = timed_calls(decode, params, state, per_call, everyone)  # warm-up
        step = int(state.step)
        t0 = time.perf_counter()
        state = decode(params, state, jnp.int32(step + CALLS * per_call), everyone)
        jax.block_until_ready(state.done)
        one_call_ms = 1e3 * (time.perf_counter() - t0) / (CALLS * per_call)
        state, plain = timed_calls(decode, params, state, per_call, everyone)
        held = []

        def allocate(_):
            held.append(jnp.ones((8, args.prompt_tokens + 640, 3, 64), jnp.bfloat16).block_until_ready())
            del held[:-3]

        state, allocated = timed_calls(decode, params, state, per_call, everyone, allocate)
        read_back = lambda s: (np.asarray(s.output), np.asarray(s.num_generated), np.asarray(s.done))
        state, after_reads = timed_calls(decode, params, state, per_call, everyone, read_back)
        state, no_iteration = timed_calls(decode, params, state, 0, everyone)
        record = {
            "method": method,
            "batch": args.batch,
            "prompt_tokens": args.prompt_tokens,
            "ms_per_iteration_in_one_call": one_call_ms,
            "iterations_per_call": per_call,
            "call_ms": float(np.median(plain)),
            "call_ms_after_allocating": float(np.median(allocated)),
            "call_ms_after_reading_back": float(np.median(after_reads)),
            "overhead_ms_per_call": float(np.median(plain)) - per_call * one_call_ms,
            "call_ms_without_iterations": float(np.median(no_iteration)),
        }
        if method == "vegas":
            state, record["profiled_calls"] = idle_before_iteration(decode, params, state, everyone)
        records.append(record)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                       if k != "profiled_calls"), flush=True)
        for call in record.get("profiled_calls", []):
            print(f"  profiled call: GPU idle {call['idle_ms_before_iteration']:.2f} ms before an iteration of "
                  f"{call['iteration_span_ms']:.2f} ms")
    meta = run_metadata(weights="random (SmolLM2-135M shapes)")
    name = f"call-overhead-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    save_results({**meta, "records": records}, name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
