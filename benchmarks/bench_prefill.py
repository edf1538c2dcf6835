"""Prefill time: the verification kernel (query rows tiled in row blocks) against XLA's dense attention, on random
weights of SmolLM2's shapes (prefill's cost does not depend on the weights' values).

    python benchmarks/bench_prefill.py --batches 1,8,64 --prompt-tokens 7936 --chunks 512,2048 --tag h200
    python benchmarks/bench_prefill.py --batches 64 --prompt-tokens 1100,2600,4600,7936 --xla-chunk 0   # chunk rules

Each configuration prefills twice and reports the second (compilation excluded, reported apart); the XLA path
runs at --xla-chunk (512; 0 leaves it out), which the engine shrinks to keep its score arrays under 8 GiB. The
caches each run leaves over the prompt's rows are compared with the first run's (largest difference relative to
the largest value): a check of the kernel on the device. Writes JSON to --out and $OUT.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.random_model import SMOLLM2_135M, random_smollm2_engine  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from vegas_jax.runtime.engine import GenerationOptions  # noqa: E402


def prefill(engine, prompts, chunk: int, backend: str, repeats: int):
    """(the last run's timings, the first run's compile seconds, the cache left) with VEGAS_KERNELS=backend."""
    os.environ["VEGAS_KERNELS"] = backend
    options = GenerationOptions(method="ar", max_new_tokens=16, prefill_chunk=chunk,
                                max_model_len=len(prompts[0]) + 16)
    compile_s = None
    for _ in range(repeats):
        started = engine.start(prompts, options)
        compile_s = started.timings["compile_s"] if compile_s is None else compile_s
    return started.timings, compile_s, started.state.cache


def relative_difference(cache, reference, rows: int) -> float:
    """Over the prompt's rows: past them each chunk size leaves its own padding."""
    worst = 0.0
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(reference)):
        got, want = np.asarray(got[:, :rows], np.float32), np.asarray(want[:, :rows], np.float32)
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt-tokens", default="7936", help="comma-separated prompt lengths")
    p.add_argument("--chunks", default="512,2048", help="comma-separated chunk sizes for the kernel path")
    p.add_argument("--xla-chunk", type=int, default=512, help="chunk size for the XLA path (0: no XLA run)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tag", default="default")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)

    engine = random_smollm2_engine()
    rng = np.random.default_rng(0)
    records = []
    doc = run_metadata(weights="random (SmolLM2-135M shapes)", records=records)
    name = f"prefill-{datetime.date.today().isoformat()}-{args.tag}.json"
    kernels = "pallas" if jax.default_backend() == "gpu" else "interpret"  # interpret: a CPU check of the script
    runs = [("xla", args.xla_chunk, "reference")] if args.xla_chunk else []
    runs += [("kernel", int(c), kernels) for c in args.chunks.split(",")]
    shapes = [(int(b), int(n)) for b in args.batches.split(",") for n in args.prompt_tokens.split(",")]
    for batch, length in shapes:
        prompts = rng.integers(0, SMOLLM2_135M.vocab_size, (batch, length)).tolist()
        reference = None
        for path, chunk, backend in runs:
            timings, compile_s, cache = prefill(engine, prompts, chunk, backend, args.repeats)
            if reference is None:
                reference = cache
            prefill_s = timings["prefill_s"]
            # chunk: as asked; effective_chunk: as the engine ran it (smaller where memory bounds it)
            record = dict(path=path, batch=batch, prompt_tokens=length, chunk=chunk,
                          effective_chunk=timings["prefill_chunk"], prefill_s=prefill_s, compile_s=compile_s,
                          prefill_tokens_per_s=batch * length / prefill_s,
                          cache_difference=relative_difference(cache, reference, length))
            del cache
            xla = [r["prefill_s"] for r in records + [record]
                   if r["path"] == "xla" and (r["batch"], r["prompt_tokens"]) == (batch, length)]
            record["speedup_vs_xla"] = xla[0] / prefill_s if xla else None
            records.append(record)
            save_results(doc, name, args.out)  # after every record: a run cut short keeps what it measured
            print(f"B{batch:<3} {length:6} {path:6} chunk {record['effective_chunk']:5}  prefill {prefill_s:7.3f} s  "
                  f"{record['prefill_tokens_per_s']:10.0f} tok/s  cache difference {record['cache_difference']:.1e}",
                  flush=True)
        del reference
    print(f"\n{'batch':>5} {'prompt':>6} {'path':6} {'chunk':>5} {'prefill s':>9} {'tok/s':>10} {'vs xla':>6} "
          f"{'cache diff':>10}")
    for r in records:
        speedup = f"{r['speedup_vs_xla']:6.2f}" if r["speedup_vs_xla"] else f"{'-':>6}"
        print(f"{r['batch']:5} {r['prompt_tokens']:6} {r['path']:6} {r['effective_chunk']:5} {r['prefill_s']:9.3f} "
              f"{r['prefill_tokens_per_s']:10.0f} {speedup} {r['cache_difference']:10.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
