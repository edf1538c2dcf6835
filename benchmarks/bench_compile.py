"""Where a decode loop's compile time goes: for each configuration, `Engine.start`'s programs (prefill chunk,
bootstrap step, decode loop) split into tracing + lowering (Python, under its lock) and XLA's compilation (its own
threads), first one at a time, then several configurations side by side in threads, as the benchmark suite's
tuning compiles them (benchmarks/suite.py, compile_ahead). Random weights of SmolLM2's shapes: compile time does
not depend on the weights' values.

    python benchmarks/bench_compile.py --batch 64 --prompt-tokens 7936 --workers 4,8 --tag s25

With --layer-loops (scanned,unrolled), each layer loop (models.decoder's scanned body or unrolled layers,
VEGAS_SCAN_LAYERS) compiles a Vegas loop of fixed γ 6 and one of adaptive γ (γ_max 8: a lax.switch over its
passes) one at a time, each program's lowering and compile seconds recorded; small batches and prompts keep
the programs that start runs cheap to run on a CPU, and compile time hardly depends on them:

    python benchmarks/bench_compile.py --model smollm2-135m --batch 2 --prompt-tokens 64 \
        --layer-loops scanned,unrolled --tag layer-loops

Writes compile-DATE-TAG.json to benchmarks/results/ (or --out) and $OUT.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.random_model import SHAPES, random_engine  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, current_layer_loop, run_metadata  # noqa: E402
from vegas_jax.runtime import compilation  # noqa: E402
from vegas_jax.runtime.engine import GenerationOptions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Configurations of the suite's tuning grid: the first compiles alone, the next ones serially, the rest in threads.
FIRST = ("vegas", 6)
SERIAL = [("vegas", 4), ("streaming", 6)]
SIDE_BY_SIDE = [("vegas", 2), ("vegas", 3), ("vegas", 8), ("streaming", 2), ("streaming", 3), ("quest", 4),
                ("quest", 6), ("retrieval", 6)]
# --layer-loops: the configurations each layer loop compiles, one at a time ("auto": adaptive γ, γ_max 8).
LAYER_LOOP_CONFIGURATIONS = [("vegas", 6), ("vegas", "auto")]
SCAN_LAYERS = {"scanned": "1", "unrolled": "0"}  # --layer-loops names -> VEGAS_SCAN_LAYERS


class ProgramTimes:
    """compile_jitted with each program's lowering and compile seconds recorded, per thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.by_thread: dict[int, list[dict]] = {}

    def compile_jitted(self, fn, *args, donate=()):
        name = getattr(getattr(fn, "func", fn), "__qualname__", "program")
        t0 = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=compilation.compiler_options())
        t2 = time.perf_counter()
        with self._lock:
            self.by_thread.setdefault(threading.get_ident(), []).append(
                {"program": name, "lower_s": t1 - t0, "compile_s": t2 - t1})
        return compiled

    def take(self) -> list[dict]:
        with self._lock:
            programs = [p for ps in self.by_thread.values() for p in ps]
            self.by_thread.clear()
        return programs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=7936)
    p.add_argument("--workers", default="4,8", help="threads side by side (comma-separated)")
    p.add_argument("--layer-loops", default=None,
                   help="compare layer loops (comma-separated: scanned, unrolled) on a fixed and an adaptive-γ Vegas "
                        "loop, in place of the tuning grid's rounds")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU: checks the script")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    if args.smoke:
        args.model, args.batch, args.prompt_tokens, args.workers = "tiny", 2, 64, "2"

    times = ProgramTimes()
    compilation.compile_jitted = times.compile_jitted  # how the engine's programs (compilation.Programs) compile
    engine = random_engine(SHAPES[args.model])
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, engine.config.vocab_size, (args.batch, args.prompt_tokens)).tolist()

    def start(configuration) -> float:
        method, gamma = configuration
        options = GenerationOptions(method=method, gamma=gamma, gamma_max=8 if gamma == "auto" else None,
                                    max_new_tokens=16,
                                    max_model_len=args.prompt_tokens + 256)
        t0 = time.perf_counter()
        engine.start(prompts, options, chat_template=False)
        return time.perf_counter() - t0

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = f"compile-{date}{'-' + args.tag if args.tag else ''}{'-smoke' if args.smoke else ''}.json"
    log = RecordLog(run_metadata(model=f"{args.model} (random weights)", batch=args.batch,
                                 prompt_tokens=args.prompt_tokens), name,
                    None if args.smoke else (args.out or RESULTS), args.out if args.smoke else None)
    print(f"{'how':>12} {'configs':>7} {'wall s':>7} {'s each':>7} {'lower s':>8} {'compile s':>9}")
    if args.layer_loops:
        loops = args.layer_loops.split(",")
        if not set(loops) <= set(SCAN_LAYERS):
            p.error(f"--layer-loops: comma-separated {', '.join(SCAN_LAYERS)}, got {args.layer_loops!r}")
        rounds = [(f"{loop} {c[0]} {c[1]}", 1, [c], loop) for loop in loops for c in LAYER_LOOP_CONFIGURATIONS]
    else:
        rounds = [("first", 1, [FIRST], None), ("serial", 1, SERIAL, None)]
        rounds += [(f"{w} threads", w, SIDE_BY_SIDE[:w], None) for w in map(int, args.workers.split(","))]
    for how, workers, configurations, layer_loop in rounds:
        if layer_loop is not None:  # read by the engine's placement at each start
            os.environ["VEGAS_SCAN_LAYERS"] = SCAN_LAYERS[layer_loop]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            starts = list(pool.map(start, configurations))
        wall = time.perf_counter() - t0
        programs = times.take()
        record = {"how": how, "workers": workers, "configurations": [list(c) for c in configurations],
                  "layer_loop": layer_loop or current_layer_loop(),
                  "wall_s": wall, "seconds_per_configuration": wall / len(configurations), "start_s": starts,
                  "lower_s": sum(p["lower_s"] for p in programs), "compile_s": sum(p["compile_s"] for p in programs),
                  "programs": programs}
        log.add(record)
        print(f"{how:>12} {len(configurations):7d} {wall:7.1f} {record['seconds_per_configuration']:7.2f} "
              f"{record['lower_s']:8.1f} {record['compile_s']:9.1f}")
    log.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
