"""Where a decode iteration's GPU time goes: runs a few iterations of the compiled while loop under the JAX profiler
and tallies the GPU kernels it launched, by kernel and by kind (GEMM, Pallas kernel, XLA fusion, copy).

    python benchmarks/profile_decode.py --batch 64 --prompt-tokens 7936 --methods ar,vegas [--model PATH.gguf]
    python benchmarks/profile_decode.py --shapes llama-3.1-8b --batch 1 --prompt-tokens 32768 --draft-weights int4

SSV on a dense model's NSA view: `--attention nsa-view --methods ar,ssv --draft-tree 4x2 --drafter self` (`ssv` is
plain decoding with the draft tree; `--precision approximate --approx-mode s8w1r2` for the approximate class);
drafted by a head: `--drafter head --draft-head FOLDER` (a trained head) or `--draft-head random` (its cost alone).
A dense model's self-drafted tree: `--methods ar,vegas,vegas-tree --draft-tree 6x1`.
Without --model the weights are random with SmolLM2-135M's shapes, or another model's (--shapes llama-3.1-8b;
kernel times do not depend on the weights; how many tokens an iteration yields does). Per method it reports kernels per iteration, GPU busy time per
iteration (the sum of kernel durations) against wall time per iteration (the gap is launch and host overhead),
the same split by enclosing command buffer (the draft steps' inner loop is one CUDA graph, the rest of the
iteration another), and the kernels taking the most time, each XLA fusion with the lines of code it was traced from
(benchmarks/hlo_sources.py), beside the program's matrix products by shape and line (library GEMMs run under
names that say nothing of their op). Prints a table; writes JSON to --out (and $OUT if set).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hlo_sources import kernel_sources, products  # noqa: E402
from benchmarks.prompts import long_prompts, stdlib_corpus  # noqa: E402
from benchmarks.random_model import SHAPES, random_engine, with_random_head  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from models.config import NSA_VIEW_LAYOUT  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.attention.backend import default_backend  # noqa: E402
from vegas_jax.cli.arguments import flag  # noqa: E402
from vegas_jax.inputs import InputError  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.decode.tree_shapes import parse_tree  # noqa: E402

_KINDS = (
    # NCCL's kernels (a mesh's reductions): before "gemm", which their names can match.
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter", re.I)),
    # The names pallas_kernels gives its pallas_calls.
    ("pallas", re.compile(r"sparse_decode_attention|verify_attention|count_at_least|compact_selected|weight_only|nsa_|"
                          r"tree_attention|split_selected")),
    ("gemm", re.compile(r"gemm|cutlass|cublas|sm90_|nvjet|matmul|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_kind(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "xla_fusion"


def gpu_kernel_events(log_dir: Path) -> list[dict]:
    """Complete ('X') events on the GPU's stream timelines of the one trace under log_dir."""
    (trace_file,) = log_dir.glob("plugins/profile/*/*.trace.json.gz")
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def summarize(events: list[dict], iterations: int, wall_s: float, top: int, sources: dict | None = None) -> dict:
    sources = sources or {}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    # The enclosing HLO op of a kernel inside the loop is its command buffer (a CUDA graph): the draft steps'
    # inner loop is one, the rest of the iteration (verification, acceptance, selection) another.
    by_enclosing_op = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        op = e["args"].get("hlo_op", e["name"]) if isinstance(e.get("args"), dict) else e["name"]
        label = f"{e['name'][:60]} [{op[:40]}]" if op != e["name"] else e["name"][:100]
        for table, key in ((by_name, label), (by_kind, kernel_kind(e["name"])), (by_enclosing_op, op)):
            table[key][0] += 1
            table[key][1] += e["dur"]
    busy_us = sum(e["dur"] for e in events)
    per_iter = lambda x: x / iterations
    tally = lambda table: {k: {"kernels_per_iteration": per_iter(c), "ms_per_iteration": per_iter(us) / 1e3}
                           for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])}
    return {
        "iterations": iterations,
        "wall_ms_per_iteration": 1e3 * wall_s / iterations,
        "gpu_busy_ms_per_iteration": per_iter(busy_us) / 1e3,
        "kernels_per_iteration": per_iter(len(events)),
        "by_kind": tally(by_kind),
        "by_enclosing_op": tally(by_enclosing_op),
        "top_kernels": [{"kernel": k, "calls_per_iteration": per_iter(c), "ms_per_iteration": per_iter(us) / 1e3,
                         "mean_us": us / c, **sources.get(k.split(" [")[0], {})}
                        for k, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def profile_method(engine: Engine, prompts, options: GenerationOptions, warmup: int, iterations: int, top: int,
                   hlo_path: Path | None):
    started = engine.start(prompts, options)
    hlo = started.decode.as_text()
    if hlo_path:
        with gzip.open(hlo_path, "wt") as f:
            f.write(hlo)
    params = engine.model.params
    everyone = jnp.int32(len(prompts))  # finished_limit: run until the whole batch is done
    state = started.decode(params, started.draft_params, started.state, jnp.int32(warmup), everyone)
    jax.block_until_ready(state.output)
    limit = jnp.int32(warmup + iterations)
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t0 = time.perf_counter()
            state = started.decode(params, started.draft_params, state, limit, everyone)
            jax.block_until_ready(state.output)
            wall_s = time.perf_counter() - t0
        events = gpu_kernel_events(Path(log_dir))
    ran = int(np.asarray(state.step)) - warmup
    return summarize(events, max(ran, 1), wall_s, top, kernel_sources(hlo)) | {"products": products(hlo)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF/HF/Orbax path; default: random weights of --shapes")
    p.add_argument("--shapes", default="smollm2-135m", choices=sorted(SHAPES), help="without --model")
    p.add_argument("--methods", default="ar,vegas")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=7936)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--score-mode", default="logit")
    p.add_argument("--draft-weights", default="bf16", choices=("bf16", "int8", "int4"), help="vegas's draft weights")
    p.add_argument("--attention", default="dense", choices=("dense", "nsa-view"), help="nsa-view: the NSA view")
    p.add_argument("--draft-tree", default="4x2", help="the tree of methods ssv and vegas-tree")
    p.add_argument("--drafter", default="self", help="method ssv's drafter")
    p.add_argument("--draft-head", default=None,
                   help="with --drafter head: a head checkpoint (vegas_jax.train_draft_head), or `random`: an "
                        "untrained head of the model's shapes attending over the default training span, whose passes "
                        "cost what a trained head's do (its drafts are rejected, so an iteration yields one token)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="with --draft-head: draft from this many tokens (a checkpoint's most frequent, the first ids "
                        "for random; 0: the whole vocabulary)")
    p.add_argument("--precision", default="exact", help="method ssv's precision class")
    p.add_argument("--approx-mode", default=None, help="method ssv's approximate mode")
    p.add_argument("--warmup", type=int, default=2, help="iterations run before the profiled ones")
    p.add_argument("--iterations", type=int, default=4, help="iterations profiled")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--hlo", action="store_true", help="also save each method's optimized HLO (gzipped) to --out")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if (args.drafter == "head") != bool(args.draft_head):
        p.error("--drafter head and --draft-head go together")
    check_writable("--out", args.out)

    if args.model:
        engine = Engine(load_model(args.model, jnp.bfloat16))
        prompts = long_prompts(engine.tokenizer, args.batch, args.prompt_tokens, stdlib_corpus())
    else:
        engine = random_engine(SHAPES[args.shapes])
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, engine.config.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    if args.attention == "nsa-view":
        engine = Engine(dataclasses.replace(engine.model, config=with_attention(engine.config, "nsa-view",
                                                                                NSA_VIEW_LAYOUT)))
    if args.draft_vocab and not args.draft_head:
        p.error("--draft-vocab: only with --draft-head")
    try:
        if args.draft_head == "random":
            engine = with_random_head(engine, args.draft_vocab)
        elif args.draft_head:
            engine.use_draft_head(args.draft_head, vocabulary=args.draft_vocab)
    except InputError as e:
        p.error(e.render(flag))
    depth = max(args.gamma, parse_tree(args.draft_tree).depth)
    max_new = (args.warmup + args.iterations + 1) * (depth + 1) + 1
    results = {}
    hlo_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else Path("."))
    for method in args.methods.split(","):
        common = dict(max_new_tokens=max_new, max_model_len=args.prompt_tokens + max_new)
        if method == "ssv":
            options = GenerationOptions(method="ar", draft_tree=args.draft_tree, drafter=args.drafter,
                                        precision=args.precision, approx_mode=args.approx_mode, **common)
        elif method == "vegas-tree":  # a dense model's self-drafted tree over Vegas's selection
            options = GenerationOptions(method="vegas", draft_tree=args.draft_tree, drafter="self",
                                        score_mode=args.score_mode, **common)
        else:
            options = GenerationOptions(method=method, gamma=args.gamma, score_mode=args.score_mode,
                                        draft_weights=args.draft_weights if method == "vegas" else "bf16", **common)
        hlo_path = hlo_dir / f"decode-{method}{'-' + args.tag if args.tag else ''}.hlo.txt.gz" if args.hlo else None
        if hlo_path:
            hlo_dir.mkdir(parents=True, exist_ok=True)
        results[method] = profile_method(engine, prompts, options, args.warmup, args.iterations, args.top, hlo_path)

    doc = run_metadata(weights=args.model or f"random ({args.shapes} shapes)", attention_backend=default_backend(),
                       attention=args.attention, draft_tree=args.draft_tree, drafter=args.drafter,
                       draft_head=args.draft_head, draft_vocab=args.draft_vocab,
                       draft_weights=args.draft_weights, xla_flags=os.environ.get("XLA_FLAGS", ""), batch=args.batch,
                       prompt_tokens=args.prompt_tokens, gamma=args.gamma, methods=results)
    save_results(doc, f"profile-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json",
                 args.out)
    for method, r in results.items():
        print(f"\n== {method}: {r['wall_ms_per_iteration']:.2f} ms/iteration wall, "
              f"{r['gpu_busy_ms_per_iteration']:.2f} ms GPU busy, {r['kernels_per_iteration']:.0f} kernels")
        for kind, k in [*r["by_kind"].items(), *list(r["by_enclosing_op"].items())[:3]]:
            print(f"   {kind:11} {k['kernels_per_iteration']:7.1f} kernels {k['ms_per_iteration']:7.3f} ms")
        for k in r["top_kernels"]:
            print(f"   {k['ms_per_iteration']:7.3f} ms {k['calls_per_iteration']:6.1f}x {k['mean_us']:7.1f} us  "
                  f"{k['kernel']}" + (f"  <- {k['op']} at {k['source']}" if k.get("source") else ""))
        print("   products in the program (count, output shape, line):")
        for prod in r["products"][:12]:
            print(f"   {prod['count']:5d}x {prod['shape']:24} {prod['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
