"""End-to-end decode throughput: plain decoding vs Vegas (and the other selection policies) on real prompts.

    python benchmarks/bench_decode.py --model PATH.gguf --methods ar,vegas --batches 1,8,32,64 \
        --prompt-tokens 4096,8192 --max-new-tokens 256 [--breakdown] [--temperature 0.7] [--requests 128] \
        [--repetition-penalty 1.1 --frequency-penalty 0.3 --presence-penalty 0.3 --logprobs 5 --stop TEXT] \
        [--trees self:4x2,self:6x1,ngram:4x2,ngram:6x1 --tree-method vegas] [--attention nsa-view]

Decode tokens/s exclude compilation and prefill (reported separately). Each configuration runs twice and the
second run is reported (the first warms up allocations). With --requests N, N prompts queue for each batch size's
slots and are admitted as others finish (continuous batching, `Engine.serve`, one run); the record adds the
steady throughput of the decode calls that started with every slot busy. With --breakdown, one iteration's phases
(draft, verify, accept, select) are also timed separately, each jitted on its own with the cache donated, on the
state right after prefill. Greedy records of methods other than ar also say, per sequence, where its output first
leaves plain decoding's. The generation controls (penalties, logprobs, stop strings) are passed through, so that
their cost per iteration can be measured against a run without them (a stop string that never occurs keeps the
token counts equal). With --trees, each DRAFTER:DEPTHxBRANCHING runs after the methods as one more record (draft
trees, vegas_jax.decode.tree_iteration; the self drafter selects its KV by --tree-method), with the tree, the drafter and
the accepted-depth histogram: τ per tree shape and drafter against plain decoding. With --attention nsa-view the
model decodes as its NSA view: method ar is plain NSA decoding and a tree is exact SSV (with --requests, both
under continuous batching, whose steady throughput leaves out a static batch's stragglers). Prints a table; writes
JSON to --out (and $OUT if set).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompt_splits import split_prompts  # noqa: E402
from benchmarks.prompts import long_prompts, stdlib_corpus  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from vegas_jax.decode import adaptive_gamma  # noqa: E402
from vegas_jax.attention.backend import default_backend  # noqa: E402
from vegas_jax.attention.family import ATTENTION_CHOICES, with_attention  # noqa: E402
from vegas_jax.cli.arguments import flag  # noqa: E402
from vegas_jax.cli.option_flags import numbers  # noqa: E402
from vegas_jax.decode.tree_shapes import shaped_by_rates  # noqa: E402
from vegas_jax.inputs import InputError  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.runtime.metrics import accepted_histogram, rank_rates  # noqa: E402
from vegas_jax.runtime.phase_timing import time_phases  # noqa: E402
from vegas_jax.sharding import make_mesh, parse_mesh  # noqa: E402


def configuration(options: GenerationOptions, prompts) -> dict:
    """The fields every record starts with: what ran, on which prompts."""
    return {
        "method": options.method,
        "prompt_tokens": int(np.mean([len(p) for p in prompts])),
        "max_new_tokens": options.max_new_tokens,
        "gamma": options.effective_gamma,
        "sparse_ratio": options.sparse_ratio if options.effective_gamma else None,
        "score_mode": options.score_mode if options.effective_gamma else None,
        "temperature": options.temperature,
        "controls": {k: getattr(options, k) for k in CONTROLS},
        "draft_tree": options.draft_tree,
        "drafter": options.drafter if options.draft_tree else None,
        **({"tree_nodes": options.tree.num_nodes, "tree_depth": options.tree.depth,
            "tree_rates": options.tree_rates} if options.draft_tree and shaped_by_rates(options.draft_tree) else {}),
    }


def runs(methods: str, trees: str, tree_method: str) -> list[tuple[str, str | None, str]]:
    """(method, draft tree, drafter) per record: the methods' chains, then each DRAFTER:TREE of --trees."""
    specs = [(m, None, "self") for m in methods.split(",")]
    for item in filter(None, trees.split(",")):
        drafter, _, tree = item.partition(":")
        specs.append((tree_method if drafter == "self" else "ar", tree, drafter))
    return specs


def is_plain(method: str, tree: str | None) -> bool:
    """Whether a run is plain decoding, the baseline of the speedups and of the identity checks: method ar without a
    tree (the head's and n-gram drafter's trees run method ar too)."""
    return method == "ar" and tree is None


# GenerationOptions fields passed through from flags of the same name.
CONTROLS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "stop")


def run_one(engine: Engine, prompts, options: GenerationOptions, with_breakdown: bool,
            repeats: int, reuse_prefill=None) -> tuple[dict, list[np.ndarray]]:
    """The last of `repeats` runs; with `reuse_prefill` (vegas_jax.runtime.prefill_reuse), runs over prompts it holds the
    prefill of start from that (their prefill_s is then the copy's)."""
    compile_s = None
    for attempt in range(repeats):
        started = engine.start(prompts, options, reuse_prefill=reuse_prefill)
        # Later attempts reuse the compiled loop: the first one's compile time is the one to report.
        compile_s = started.timings["compile_s"] if compile_s is None else compile_s
        if with_breakdown and attempt == repeats - 1:
            phases = time_phases(engine, started)
            started = engine.start(prompts, options, reuse_prefill=reuse_prefill)
        t0 = time.perf_counter()
        rows = started.state.committed.shape[0]  # the batch, padded to a multiple of a mesh's data axis
        state = started.decode(engine.model.params, started.draft_params, started.state, jnp.int32(2**31 - 1), jnp.int32(rows))
        jax.block_until_ready(state.output)
        decode_s = time.perf_counter() - t0
    n, gamma = len(prompts), options.effective_gamma
    generated = np.asarray(state.num_generated)[:n]
    iterations = np.asarray(state.metrics.iterations)[:n]
    accepted = np.asarray(state.metrics.accepted)[:n, :gamma]
    drafted = np.asarray(state.metrics.drafted)[:n, :gamma]
    decode_tokens = int((generated - 1).sum())
    record = {
        **configuration(options, prompts),
        "batch": len(prompts),
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s,
        "ms_per_iteration": 1e3 * decode_s / max(1, iterations.max()),
        "tau": float((iterations.sum() + accepted.sum()) / max(1, iterations.sum())),
        # A static batch runs until its slowest sequence is done: tokens/s = batch x τ x this / iteration time.
        "batch_occupancy": float(iterations.sum() / (n * max(1, iterations.max()))),
        "acceptance_by_position": (accepted.sum(0) / np.maximum(drafted.sum(0), 1)).tolist(),
        "accepted_depth_histogram": accepted_histogram(int(iterations.sum()), accepted.sum(0)),
        "acceptance_by_rank": (None if state.metrics.rank_offered is None else
                               rank_rates(np.asarray(state.metrics.rank_offered)[:n],
                                          np.asarray(state.metrics.rank_accepted)[:n])),
        "compile_s": compile_s,
        "prefill_s": started.timings["prefill_s"],
        "prefill_reused": started.timings["prefill_reused"],
        "outputs": np.asarray(state.output)[:n, :8].tolist(),
    }
    if with_breakdown:
        record["breakdown"] = phases
    if state.gamma_control is not None:  # adaptive γ: the drafts its iterations chose
        record.update(adaptive_gamma.summary(started.config.placement.fetch(state.gamma_control.chosen)))
    output = np.asarray(state.output)
    return record, [output[b, : generated[b]] for b in range(len(prompts))]


def run_served(engine: Engine, prompts, options: GenerationOptions, slots: int,
               refill: int | None) -> tuple[dict, list[np.ndarray]]:
    """Continuous batching (`Engine.serve`): the prompts queue for `slots` decode slots."""
    result = engine.serve(prompts, options, slots=slots, refill=refill)
    m = result.metrics
    record = {
        **configuration(options, prompts),
        "batch": m["slots"],
        "requests": len(prompts),
        "refill": m["refill"],
        "decode_s": m["decode_s"],
        "decode_tokens": m["decode_tokens"],
        "decode_tokens_per_s": m["decode_tokens_per_s"],
        "steady_decode_s": m["steady_decode_s"],
        "steady_decode_tokens": m["steady_decode_tokens"],
        "steady_decode_tokens_per_s": m["steady_decode_tokens_per_s"],
        "decode_calls": m["decode_calls"],
        "ms_per_iteration": 1e3 * m["decode_s"] / max(1, m["loop_iterations"]),
        "tau": m["tau"],
        "acceptance_by_position": m["acceptance_by_position"],
        "acceptance_by_rank": m["acceptance_by_rank"],
        "compile_s": m["compile_s"],
        "prefill_s": m["prefill_s"],
        "outputs": [r.tokens[:8] for r in result.requests],
    }
    return record, [np.asarray(r.tokens) for r in result.requests]


def first_differences(tokens, reference) -> list[int | None]:
    """Per sequence, the first position where tokens and reference differ (a length difference counts), or None."""
    positions = []
    for got, want in zip(tokens, reference):
        common = min(len(got), len(want))
        mismatch = np.flatnonzero(got[:common] != want[:common])
        positions.append(int(mismatch[0]) if mismatch.size else (None if len(got) == len(want) else common))
    return positions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--methods", default="ar,vegas")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-tokens", default="4096")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--sparse-ratio", type=float, default=0.07)
    p.add_argument("--min-sparse-tokens", type=int, default=256)
    p.add_argument("--score-mode", default="logit")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=GenerationOptions.repetition_penalty)
    p.add_argument("--presence-penalty", type=float, default=GenerationOptions.presence_penalty)
    p.add_argument("--frequency-penalty", type=float, default=GenerationOptions.frequency_penalty)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--trees", default="", help="draft trees after the methods: DRAFTER:TREE,... (drafter self, "
                                               "ngram or head; TREE DEPTHxBRANCHING or NODES[dDEPTH]; e.g. "
                                               "self:4x2,ngram:6x1,head:16d6)")
    p.add_argument("--tree-rates", type=numbers, default=None,
                   help="rank acceptance rates shaping the NODES[dDEPTH] trees (generate's --tree-rates)")
    p.add_argument("--draft-head", default=None, help="the trained draft head of drafter head "
                                                      "(vegas_jax.train_draft_head's --out)")
    p.add_argument("--head-windows", default="trained",
                   help="the head's attention windows to run its trees with: positions, 0 (every one) or trained "
                        "(the span it was trained over, its default), comma-separated")
    p.add_argument("--draft-vocabs", default="0",
                   help="the draft vocabularies to run the head's trees with: sizes (the most frequent tokens of its "
                        "training sequences; 0: the whole vocabulary), comma-separated")
    p.add_argument("--heldout", action="store_true",
                   help="prompts from the held-out split (benchmarks/prompt_splits.py) instead of the stdlib corpus")
    p.add_argument("--tree-method", default="vegas", help="the self drafter's KV selection for --trees")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the last is reported")
    p.add_argument("--requests", type=int, default=0,
                   help="continuous batching: this many prompts queue for --batches slots each (0: one static batch)")
    p.add_argument("--refill", type=int, default=None,
                   help="with --requests: admit queued requests once this many slots are free (default slots // 8)")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--mesh", default=None, help="data=D,model=M: run on a mesh of all devices (default: one)")
    p.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                   help="decode the model as this attention (nsa-view: its NSA view, trees exact SSV)")
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    try:
        head_windows = [None if w == "trained" else int(w) for w in args.head_windows.split(",")]
    except ValueError:
        head_windows = [-1]
    if any(w is not None and w < 0 for w in head_windows):
        p.error(f"--head-windows: positions, 0 or trained, comma-separated; got {args.head_windows!r}")
    try:
        draft_vocabs = [int(v) for v in args.draft_vocabs.split(",")]
    except ValueError:
        draft_vocabs = [-1]
    if any(v < 0 for v in draft_vocabs):
        p.error(f"--draft-vocabs: token counts (0: the whole vocabulary), comma-separated; got {args.draft_vocabs!r}")
    if args.tree_rates is not None and not any(shaped_by_rates(tree) for _, tree, _ in
                                               runs(args.methods, args.trees, args.tree_method) if tree):
        p.error("--tree-rates: only with a NODES[dDEPTH] tree in --trees (a tree they shape)")

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    mesh = make_mesh(parse_mesh(args.mesh)) if args.mesh else None
    loaded = load_model(args.model, dtype, mesh)
    try:
        engine = Engine(dataclasses.replace(loaded, config=with_attention(loaded.config, args.attention)),
                        draft_head=args.draft_head)
    except InputError as e:
        p.error(e.render(flag))
    head_setting = (None, 0)  # the window and draft vocabulary the engine's head has (as loaded)
    corpus = stdlib_corpus()
    records = []
    meta = run_metadata(model=args.model or "embedded:SmolLM2-135M-Instruct", dtype=args.dtype,
                        attention=engine.config.attention, attention_backend=default_backend(),
                        mesh=args.mesh or "one device",
                        gpus=jax.device_count() if args.mesh else 1)
    name = f"e2e-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    for prompt_tokens in [int(x) for x in args.prompt_tokens.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            if args.heldout:
                prompts = split_prompts(engine.tokenizer, "heldout", args.requests or batch, prompt_tokens).prompts
            else:
                prompts = long_prompts(engine.tokenizer, args.requests or batch, prompt_tokens, corpus)
            ar_rate, ar_steady, ar_tokens = None, None, None
            for method, tree, drafter, window, vocab in (
                    (*run, w, v) for run in runs(args.methods, args.trees, args.tree_method)
                    for w in (head_windows if run[2] == "head" else [None])
                    for v in (draft_vocabs if run[2] == "head" else [0])):
                if drafter == "head" and (window, vocab) != head_setting:
                    try:
                        engine.use_draft_head(args.draft_head, window, vocab)
                    except InputError as e:
                        p.error(e.render(lambda name: "--draft-vocabs" if name == "draft_vocab" else flag(name)))
                    head_setting = (window, vocab)
                options = GenerationOptions.check(GenerationOptions(
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, method=method,
                    gamma=args.gamma if tree is None else GenerationOptions.gamma, sparse_ratio=args.sparse_ratio,
                    min_sparse_tokens=args.min_sparse_tokens, score_mode=args.score_mode,
                    max_model_len=prompt_tokens + args.max_new_tokens, draft_tree=tree, drafter=drafter,
                    tree_rates=args.tree_rates if tree is not None and shaped_by_rates(tree) else None,
                    **{k: tuple(getattr(args, k)) if k == "stop" else getattr(args, k) for k in CONTROLS},
                ))
                if args.requests:
                    rec, tokens = run_served(engine, prompts, options, batch, args.refill)
                else:
                    rec, tokens = run_one(engine, prompts, options, args.breakdown and tree is None, args.repeats)
                if drafter == "head":
                    rec["head_window"], rec["draft_vocab"] = engine.draft_head_window, vocab
                if is_plain(method, tree):
                    ar_rate, ar_tokens = rec["decode_tokens_per_s"], tokens
                    ar_steady = rec.get("steady_decode_tokens_per_s")
                rec["speedup_vs_ar"] = rec["decode_tokens_per_s"] / ar_rate if ar_rate else None
                if args.requests:
                    steady = rec["steady_decode_tokens_per_s"]
                    rec["steady_speedup_vs_ar"] = steady / ar_steady if steady and ar_steady else None
                if ar_tokens is not None and options.effective_gamma and args.temperature == 0:
                    # Greedy speculative decoding should reproduce plain greedy decoding; in bf16 the two passes
                    # round differently, so a near-tie can send a sequence another way (float32 should not).
                    rec["first_difference_to_ar"] = first_differences(tokens, ar_tokens)
                    rec["sequences_identical_to_ar"] = rec["first_difference_to_ar"].count(None)
                records.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "outputs"}), flush=True)
                # After every record: a run cut short by a time limit keeps what it measured.
                save_results({**meta, "records": records}, name, args.out)

    print(f"\n{'method':10} {'batch':>5} {'prompt':>6} {'tok/s':>9} {'tau':>5} {'ms/it':>7} {'speedup':>7} "
          f"{'same':>5}  {'breakdown(ms)' if not args.requests else 'steady tok/s, speedup'}")
    fmt = lambda x, spec: format(x, spec) if x is not None else "-"
    for r in records:
        if args.requests:
            extra = f"{fmt(r['steady_decode_tokens_per_s'], '.1f')} {fmt(r['steady_speedup_vs_ar'], '.2f')}"
        else:
            extra = " ".join(f"{k[:-3]}={v:.2f}" for k, v in r.get("breakdown", {}).items())
        same = r.get("sequences_identical_to_ar", "-")
        label = f"{r['drafter']}:{r['draft_tree']}" if r.get("draft_tree") else r["method"]
        label += f"@{r['head_window']}" if r.get("head_window") else ""
        label += f"/v{r['draft_vocab']}" if r.get("draft_vocab") else ""
        print(f"{label:10} {r['batch']:5d} {r['prompt_tokens']:6d} {r['decode_tokens_per_s']:9.1f} "
              f"{r['tau']:5.2f} {fmt(r['ms_per_iteration'], '7.2f'):>7} {fmt(r['speedup_vs_ar'], '.2f'):>7} "
              f"{same:>5}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
