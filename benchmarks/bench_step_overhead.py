"""Per-step fixed cost of the decode loop: milliseconds per plain step and per Vegas iteration, on random weights
of SmolLM2's shapes (timing only: acceptance means nothing on random weights, so τ is not reported).

    python benchmarks/bench_step_overhead.py --batches 1,64 --prompt-tokens 4096 --tag default
    XLA_FLAGS=--xla_gpu_enable_command_buffer=... python benchmarks/bench_step_overhead.py --tag while-graphs

Compare runs under different XLA flags (for example command buffers, i.e. CUDA graphs, for the while loop) to
see what launch overhead costs. Writes JSON to --out and $OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.random_model import SMOLLM2_135M, random_smollm2_engine  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from vegas_jax.attention.backend import default_backend  # noqa: E402
from vegas_jax.runtime.engine import GenerationOptions  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="ar,vegas")
    p.add_argument("--tag", default="default")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)

    engine = random_smollm2_engine()
    rng = np.random.default_rng(0)
    records = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(0, SMOLLM2_135M.vocab_size, (batch, args.prompt_tokens)).tolist()
        for method in args.methods.split(","):
            options = GenerationOptions(method=method, max_new_tokens=args.max_new_tokens,
                                        max_model_len=args.prompt_tokens + args.max_new_tokens)
            started = engine.start(prompts, options)
            t0 = time.perf_counter()
            state = started.decode(engine.model.params, started.draft_params, started.state, jnp.int32(2**31 - 1), jnp.int32(batch))
            jax.block_until_ready(state.output)
            decode_s = time.perf_counter() - t0
            iterations = int(np.asarray(state.metrics.iterations).max())
            rec = {"method": method, "batch": batch, "prompt_tokens": args.prompt_tokens,
                   "gamma": options.effective_gamma, "iterations": iterations,
                   "ms_per_iteration": 1e3 * decode_s / max(iterations, 1),
                   "ms_per_forward": 1e3 * decode_s / max(iterations, 1) / (options.effective_gamma + 1)}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    doc = run_metadata(xla_flags=os.environ.get("XLA_FLAGS", ""), attention_backend=default_backend(),
                       weights="random (SmolLM2-135M shapes)", records=records)
    name = f"step-overhead-{datetime.date.today().isoformat()}-{args.tag}.json"
    save_results(doc, name, args.out)
    for r in records:
        print(f"[{args.tag}] {r['method']:6} B{r['batch']:<3} {r['ms_per_iteration']:8.2f} ms/iteration "
              f"{r['ms_per_forward']:6.2f} ms/forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
