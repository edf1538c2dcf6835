"""SSV end to end against plain NSA decoding (nsa-ar), for each precision class and drafter.

    python benchmarks/bench_ssv.py [--quick | --smoke] [--batches 1,8,32,64] [--context 8192]
        [--max-new-tokens 128] [--tree 4x2[,2x1,...]] [--classes exact,approximate] [--drafters ngram,self,head]
        [--draft-head FOLDER] [--approx-mode s8w1r2 | --ssv-profile PROFILE.json] [--repeats 3]
        [--nsa-1b-context 32768] [--nsa-1b-batches 1,8] [--tag TAG] [--out benchmarks/results]

Two parts:
- `view`: SmolLM2's NSA view (real weights, `--attention nsa-view`) on real prompts of benchmarks/prompts.py
  (the standard library's text in the chat template, `--context` less the new tokens each), greedy: plain NSA
  decoding, then SSV (draft trees, vegas_jax.decode.tree_iteration) with each drafter (ngram; self: the sink-and-window
  draft) in the exact class and in the approximate class. The approximate class runs `--approx-mode` (pinned), or with `--ssv-profile` the
  planner's choice (tree and mode); the exact class runs `--tree` (or the planner's tree with a profile).
  Approximate records carry greedy_agreement: the fraction of decoded positions equal to plain NSA decoding's.
- `nsa-1b`: random weights of NSA-1B's shapes (16 layers, 32 / 2 heads, head dim 64, NSA-1B's layout) at
  `--nsa-1b-context` tokens, the cache filled with random rows instead of prefill: timing only. Its tokens/s are
  PROJECTIONS: the measured iteration time with the τ that the same configuration reached on the view
  (decode_tokens_per_s = batch * tau_view / ms per iteration), labelled `projection`.

Each configuration compiles once and decodes `--repeats` times: tokens/s median with min and max. Where an
iteration's time goes: its draft pass and its verification pass jitted alone on the state after prefill
(`breakdown`: draft_ms, verify_ms, and the rest of the iteration: acceptance, commit, emission), against a plain
step. Records: method (ssv | nsa-ar), precision, drafter, approx_mode, tree, batch, prompt_tokens,
decode_tokens_per_s (+ _min, _max), speedup_vs_ar, tau, ms_per_iteration, breakdown, greedy_agreement
(approximate), projection (nsa-1b). `--quick` is meant to fit one H200 in 8 minutes (batch 8 of 8K on the view,
batch 1 of NSA-1B at 32K, 64 new tokens, 2 repeats: 10 loop compilations; not yet timed on the GPU); `--smoke` runs both parts end to end on a CPU at tiny sizes
(random weights, random prompts). Prints a table; writes JSON to --out (and $OUT if set).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompt_splits import split_prompts  # noqa: E402
from benchmarks.prompts import long_prompts  # noqa: E402
from benchmarks.random_model import TINY, TINY_NSA_LAYOUT, random_cache_rows, random_engine, random_model  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from models.config import NSA_1B_LAYOUT, NSA_VIEW_LAYOUT, ModelConfig  # noqa: E402
from vegas_jax.decode import iteration as loop
from vegas_jax.decode import tree_iteration as tree_decode  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.cli.arguments import flag  # noqa: E402
from vegas_jax.decode.drafters import make_drafter  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.inputs import InputError  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402

NSA_1B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=2, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
    tie_word_embeddings=True, attention="nsa", nsa=NSA_1B_LAYOUT)
CLASSES = ("exact", "approximate")


def ssv_options(precision: str, drafter: str, args, new_tokens: int, context: int | None = None,
                tree: str | None = None) -> GenerationOptions:
    """The SSV run of a class and drafter: the planner's choice with a profile, else `tree` (and --approx-mode)."""
    common = dict(max_new_tokens=new_tokens, drafter=drafter, precision=precision, max_model_len=context)
    if args.ssv_profile:
        return GenerationOptions(ssv_profile=args.ssv_profile, **common)
    mode = args.approx_mode if precision == "approximate" else None
    return GenerationOptions(draft_tree=tree, approx_mode=mode, **common)


def trees_of(args) -> list[str | None]:
    """The trees each class and drafter runs: --tree's, or the planner's one with a profile."""
    return [None] if args.ssv_profile else args.tree.split(",")


def timed(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / reps


def breakdown(engine: Engine, started) -> dict:
    """ms of one iteration's draft pass and verification pass, each jitted alone on the state after prefill (one
    device; nothing donated, so the state can be reused)."""
    config, state, params = started.config, started.state, engine.model.params
    if config.tree is None:
        return {}
    drafter = make_drafter(config.drafter)
    keys = loop.step_keys(state.keys, loop.request_step(state), config.tree.depth + 2)
    num_drafts = loop.counted_drafts(state, config.tree.depth)
    def draft(p, s, k, n):
        proposal = drafter.propose(p, started.draft_params, s, k, config, n)
        return proposal.cache, proposal.tokens

    propose = jax.jit(draft)
    cache, tokens = propose(params, state, keys, num_drafts)
    verify = jax.jit(lambda p, s, c, t: tree_decode.verify(p, s, c, t, config)[0])
    return {"draft_ms": timed(propose, params, state, keys, num_drafts),
            "verify_ms": timed(verify, params, state, cache, tokens)}


def run(engine: Engine, prompts, options: GenerationOptions, repeats: int, fill_cache=None,
        phases: bool = True) -> tuple[dict, list]:
    """Compile once, decode once untimed, then `repeats` timed times: the record's timing fields and the last
    run's tokens. (The first decode of a compiled loop also pays for its first execution: CUDA graph
    instantiation, allocations; with 2 repeats it made up half of a median.) `phases`: also time the draft and
    verification passes alone (`breakdown`; two more compilations)."""
    speeds, ms_iteration = [], []
    for attempt in range(repeats + 1):
        started = engine.start(prompts, options, fill_cache=fill_cache)
        rows = started.state.committed.shape[0]
        t0 = time.perf_counter()
        state = started.decode(engine.model.params, started.draft_params, started.state, jnp.int32(2**31 - 1),
                               jnp.int32(rows))
        jax.block_until_ready(state.output)
        decode_s = time.perf_counter() - t0
        if attempt == 0:
            continue
        n = len(prompts)
        generated = np.asarray(state.num_generated)[:n]
        iterations = np.asarray(state.metrics.iterations)[:n]
        speeds.append(float((generated - 1).sum()) / decode_s)
        ms_iteration.append(1e3 * decode_s / max(1, int(iterations.max())))
    gamma = started.config.gamma
    accepted = np.asarray(state.metrics.accepted)[:n, :max(gamma, 1)] if gamma else np.zeros((n, 1))
    opts = started.options
    record = {
        "precision": opts.precision, "drafter": opts.drafter if opts.draft_tree else None,
        "approx_mode": started.config.mode.name(), "tree": opts.draft_tree, "ssv_plan": started.ssv_plan,
        "batch": n, "prompt_tokens": int(np.mean([len(p) for p in prompts])), "max_new_tokens": opts.max_new_tokens,
        "decode_tokens_per_s": float(np.median(speeds)), "decode_tokens_per_s_min": min(speeds),
        "decode_tokens_per_s_max": max(speeds), "repeats": repeats,
        "ms_per_iteration": float(np.median(ms_iteration)),
        "tau": float((iterations.sum() + accepted.sum()) / max(1, iterations.sum())),
        "compile_s": started.timings["compile_s"], "prefill_s": started.timings["prefill_s"],
    }
    if phases and engine.placement.mesh is None:
        record["breakdown"] = breakdown(engine, engine.start(prompts, options, fill_cache=fill_cache))
    output = np.asarray(state.output)
    return record, [output[b, 1:generated[b]] for b in range(n)]


def agreement(tokens, reference) -> float:
    """The fraction of decoded positions (over the shorter of each pair) where tokens equal the reference's."""
    same = [np.mean(a[:m] == b[:m]) for a, b in zip(tokens, reference) if (m := min(len(a), len(b)))]
    return float(np.mean(same)) if same else float("nan")


def view_part(engine: Engine, prompts_of, args, new_tokens: int, log: RecordLog) -> dict:
    """The view's records; returns the τ of each (precision, drafter) by batch, for the projections."""
    taus = {}
    for batch in args.batches:
        prompts = prompts_of(batch)
        base, reference = run(engine, prompts, GenerationOptions(max_new_tokens=new_tokens), args.repeats)
        add(log, {"part": "view", "method": "nsa-ar", **base, "speedup_vs_ar": 1.0})
        for precision in args.classes:
            for drafter in args.drafters:
                for tree in trees_of(args):
                    record, tokens = run(engine, prompts, ssv_options(precision, drafter, args, new_tokens,
                                                                      tree=tree), args.repeats)
                    record |= {"part": "view", "method": "ssv",
                               "speedup_vs_ar": record["decode_tokens_per_s"] / base["decode_tokens_per_s"]}
                    if precision == "approximate":
                        record["greedy_agreement"] = agreement(tokens, reference)
                    add(log, record)
                    taus[batch, precision, drafter, tree] = record["tau"]
    return taus


def nsa_1b_part(engine: Engine, args, new_tokens: int, taus: dict, log: RecordLog) -> None:
    context = args.nsa_1b_context
    for batch in args.nsa_1b_batches:
        prompts = [[1] * (context - new_tokens - 80)] * batch
        plain = GenerationOptions(max_new_tokens=new_tokens, max_model_len=context)
        base, _ = run(engine, prompts, plain, args.repeats, fill_cache=random_cache_rows)
        add(log, {"part": "nsa-1b", "method": "nsa-ar", **base, "speedup_vs_ar": 1.0, "tau": 1.0,
                  "projection": False})
        view_batch = min(args.batches, key=lambda b: abs(b - batch))  # the view's τ at the nearest batch
        for precision in args.classes:
            for drafter, tree in ((d, t) for d in args.drafters if d != "head"  # a head is trained for the view only
                                  for t in trees_of(args)):
                options = ssv_options(precision, drafter, args, new_tokens, context, tree=tree)
                record, _ = run(engine, prompts, options, args.repeats, fill_cache=random_cache_rows)
                tau = taus.get((view_batch, precision, drafter, tree))
                projected = batch * tau / record["ms_per_iteration"] * 1e3 if tau else float("nan")
                base_speed = base["decode_tokens_per_s"]
                record |= {"part": "nsa-1b", "method": "ssv", "projection": True, "tau": tau,
                           "tau_on_random_weights": record["tau"], "decode_tokens_per_s": projected,
                           "decode_tokens_per_s_min": None, "decode_tokens_per_s_max": None,
                           "speedup_vs_ar": projected / base_speed}
                add(log, record)


def add(log: RecordLog, record: dict) -> None:
    log.add(record)
    report(record)


def report(r: dict) -> None:
    spread = "" if r.get("decode_tokens_per_s_min") is None else \
        f" [{r['decode_tokens_per_s_min']:.0f}-{r['decode_tokens_per_s_max']:.0f}]"
    label = " PROJECTION" if r.get("projection") else ""
    extra = f" agreement {r['greedy_agreement']:.3f}" if "greedy_agreement" in r else ""
    print(f"{r['part']:7s} {r['method']:6s} {r['precision']:11s} {str(r['drafter']):5s} {r['approx_mode']:8s} "
          f"{str(r['tree']):5s} B{r['batch']:<3d} {r['prompt_tokens']:6d} tok  {r['decode_tokens_per_s']:9.1f} tok/s"
          f"{spread}{label}  x{r['speedup_vs_ar']:.2f}  tau {r['tau'] if r['tau'] is None else round(r['tau'], 2)}"
          f"  {r['ms_per_iteration']:.2f} ms/it{extra}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny random models on any device (CPU)")
    p.add_argument("--model", default=None, help="the dense model whose NSA view runs (default: SmolLM2)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=8192, help="prompt plus new tokens (SmolLM2's context: 8192)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", default="4x2", help="DEPTHxBRANCHING trees, comma-separated: each class and drafter "
                                                 "runs each")
    p.add_argument("--drafters", default="ngram,self", help="the SSV drafters run in each class (head: the view "
                                                             "only, with --draft-head)")
    p.add_argument("--draft-head", default=None, help="the view's trained draft head (vegas_jax.train_draft_head)")
    p.add_argument("--heldout", action="store_true",
                   help="the view's prompts from the held-out split (benchmarks/prompt_splits.py)")
    p.add_argument("--classes", default=",".join(CLASSES), help="the precision classes SSV runs in, comma-separated")
    p.add_argument("--approx-mode", default="s8w1r2", help="the approximate class's mode without a profile")
    p.add_argument("--ssv-profile", default=None, help="the planner chooses tree and mode from this profile")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nsa-1b-context", type=int, default=32768)
    p.add_argument("--nsa-1b-batches", default="1,8", help="empty: the view part only")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    if args.quick:
        args.batches, args.nsa_1b_batches, args.max_new_tokens, args.repeats = "8", "1", 64, 2
    args.batches = [int(b) for b in args.batches.split(",")]
    args.nsa_1b_batches = [int(b) for b in args.nsa_1b_batches.split(",") if b]  # empty: no nsa-1b part
    args.drafters = args.drafters.split(",")
    args.classes = args.classes.split(",")
    if not args.classes or any(c not in CLASSES for c in args.classes):
        p.error(f"--classes: comma-separated, of {', '.join(CLASSES)}; got {','.join(args.classes)!r}")
    if args.smoke:  # each configuration is a loop compilation of a minute on a CPU: the fewest that reach every path
        args.batches, args.nsa_1b_batches, args.repeats, args.nsa_1b_context = [2], [1], 1, 160
        args.drafters, args.tree = ["ngram"], "2x2"
        dense = random_model(TINY, jnp.float32)
        view = Engine(dataclasses.replace(dense, config=with_attention(TINY, "nsa-view", TINY_NSA_LAYOUT)))
        rng = np.random.default_rng(0)
        prompts_of = lambda batch: [rng.integers(0, TINY.vocab_size, 96).tolist() for _ in range(batch)]
        nsa_config = dataclasses.replace(TINY, attention="nsa", nsa=TINY_NSA_LAYOUT)
        new_tokens = 6
    else:
        loaded = load_model(args.model, jnp.bfloat16)
        view = Engine(dataclasses.replace(loaded, config=with_attention(loaded.config, "nsa-view", NSA_VIEW_LAYOUT)))
        prompts_of = functools.partial(long_prompts, view.tokenizer,
                                       prompt_tokens=args.context - args.max_new_tokens)
        if args.heldout:
            prompts_of = lambda batch: split_prompts(view.tokenizer, "heldout", batch,  # noqa: E731
                                                     args.context - args.max_new_tokens).prompts
        if args.draft_head:
            try:
                view.use_draft_head(args.draft_head)
            except InputError as e:
                p.error(e.render(flag))
        nsa_config = NSA_1B
        new_tokens = args.max_new_tokens
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    name = f"ssv-{'smoke' if args.smoke else 'quick' if args.quick else 'full'}-{stamp}{'-' + args.tag if args.tag else ''}.json"
    log = RecordLog(run_metadata(args={k: str(v) for k, v in vars(args).items()}), name, args.out)
    print(f"writing {args.out / name} after every record")
    taus = view_part(view, prompts_of, args, new_tokens, log)
    if args.nsa_1b_batches:
        nsa_1b_part(random_engine(nsa_config, dtype), args, new_tokens, taus, log)
    log.finish()
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
