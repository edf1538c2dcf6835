"""Decoding on several GPUs of one host against one GPU: tensor parallelism (model=M) and data parallelism (data=D).

    python benchmarks/bench_mesh.py --shapes llama-3.1-8b --batches 8,16 --context 32K --meshes "model=2;data=2" \
        --real-model /root/stage/smollm2.gguf --real-prompts 8 --real-prompt-tokens 4096
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_mesh.py --smoke --out /tmp/mesh

Timing (random weights of --shapes, timing only; vegas_jax's meshes over every GPU of the host): for one GPU and
each mesh, at each batch, a plain step and a Vegas iteration (γ 6, 7 %) on a random cache of --context rows
(suite_scale.time_iterations). Each record: ms per step or iteration, decode tokens/s (plain decoding: batch per
step, measured; Vegas: batch x --tau per iteration, a PROJECTION at SmolLM2's τ, labelled `projected`), the
speedup over one GPU, the collectives' GPU time per iteration and GPU (the profile's NCCL kernels: the two
reductions per layer under `model`, the score reduction, data-parallel flags), the score reduction timed alone (every
layer's verification scores, float32 [layers, batch, cache], averaged across `model` in one collective, as the
loop does) and its share of a Vegas iteration, the memory the planner counts per GPU and what each GPU holds once
the run's state is allocated.

Identity (--real-model, the GGUF in float32): greedy Vegas on each mesh with a data axis against one GPU, on
--real-prompts held-out prompts of --real-prompt-tokens tokens (benchmarks/prompt_splits.py): the tokens must be
the same, each request's first differing position is recorded otherwise.

Records carry mesh ("one", "model=2", ...), gpus, model, batch, context, method, decode_tokens_per_s. No
configuration starts after --budget-s seconds (default 480: the device tool ends a command at 10 minutes). Saved after
every record (benchmarks/results/mesh-<date>[-tag].json, or --out, and $OUT; --smoke: --out and $OUT only). A
table is printed at the end. --smoke: tiny random shapes in float32 on the CPU's devices (it needs two:
XLA_FLAGS above), meshes model=2 and data=2, identity on the tiny model's random prompts.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.random_model import SHAPES, random_model  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from benchmarks.suite_scale import gpu_seconds, time_iterations  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions, InputError  # noqa: E402
from vegas_jax.cli.option_flags import token_count  # noqa: E402
from vegas_jax.sharding import DATA, MODEL, Placement, make_mesh, parse_mesh  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("ar", "vegas")
ONE = "one"
# SmolLM2's held-out τ of Vegas at the default cell (γ 6, 7 %), batch 64 x 7.9K, greedy: README "Results".
DEFAULT_TAU = 6.39


def mesh_of(name: str):
    return None if name == ONE else make_mesh(parse_mesh(name))


def gpus_of(mesh) -> int:
    return 1 if mesh is None else mesh.devices.size


def per_gpu(gpu_ms: float, mesh) -> float:
    """GPU time summed over a mesh's GPUs (the profiler's, which sees each GPU's kernels) as one GPU's share; on a
    CPU, timings are wall time already."""
    return gpu_ms / gpus_of(mesh) if jax.default_backend() == "gpu" else gpu_ms


def score_reduction_ms(mesh, layers: int, batch: int, capacity: int) -> float:
    """GPU ms of one mean across `model` of every layer's scores, float32 [layers, batch, capacity] split over
    `data` (the loop's collective, Placement.mean_over_model), per GPU. 0 without a model axis."""
    placement = Placement(mesh=mesh)
    model = placement.model_shards
    if model == 1:
        return 0.0
    spec = PartitionSpec(MODEL, None, DATA, None)  # each model shard holds its own heads' partial mean
    partials = jax.device_put(jnp.ones((model, layers, batch, capacity), jnp.float32), NamedSharding(mesh, spec))
    mean = jax.jit(jax.shard_map(placement.mean_over_model, mesh=mesh, in_specs=spec,
                                 out_specs=PartitionSpec(None, None, DATA, None)))
    return per_gpu(1e3 * gpu_seconds(mean, partials), mesh)


def over_budget(args) -> bool:
    """Past --budget-s: no configuration starts (the device tool ends a command at 10 minutes)."""
    return time.perf_counter() - args.started > args.budget_s


def timing_part(args, log: RecordLog) -> None:
    config = SHAPES[args.shapes]
    base = random_model(config, args.dtype)
    for name in [ONE, *args.meshes]:
        mesh = mesh_of(name)
        engine = Engine(base if mesh is None else base.on_mesh(mesh))
        for batch in args.batches:
            plain_ms = None
            for method in METHODS:
                if over_budget(args):
                    return
                record = {"part": "timing", "mesh": name, "gpus": gpus_of(mesh), "model": args.shapes,
                          "weights": "random", "batch": batch, "context": args.context, "method": method}
                options = GenerationOptions(method=method, max_new_tokens=64, max_model_len=args.context)
                try:
                    plan = engine.plan([[1] * (args.context - 64)] * batch, options)
                except InputError as e:
                    log.add({**record, "fits": False, "reason": str(e)})
                    print(f"{name} batch {batch} {method}: does not fit: {e}", flush=True)
                    continue
                timing = time_iterations(engine, batch, args.context, method, args.iterations)
                ms = timing["ms_per_iteration"]
                plain_ms = ms if method == "ar" else plain_ms
                tau = 1.0 if method == "ar" else args.tau
                one = [r for r in log.records if r.get("part") == "timing" and r["mesh"] == ONE
                       and r["batch"] == batch and r["method"] == method and r.get("fits")]
                collective = timing["profile"]["by_kind"].get("collective", 0.0)
                record.update(
                    fits=True, ms_per_iteration=ms, plain_ms_per_step=plain_ms,
                    plain_steps_per_iteration=ms / plain_ms if plain_ms else None,
                    decode_tokens_per_s=batch * tau / (ms / 1e3), projected=method != "ar",
                    tau_assumed=None if method == "ar" else tau,
                    speedup_vs_one_gpu=one[0]["ms_per_iteration"] / ms if one else None,
                    collective_ms_per_iteration_per_gpu=per_gpu(collective, mesh),
                    planned_bytes_per_gpu=plan["bytes_per_device"]["total"],
                    **{k: timing[k] for k in ("iterations", "length", "gamma", "sparse_ratio", "draft_budget_tokens",
                                             "bytes_in_use_per_device", "compile_s", "profile")})
                if method != "ar":
                    score_ms = score_reduction_ms(mesh, config.num_layers, batch, plan["cache_capacity"])
                    record.update(score_reduction_ms=score_ms, score_reduction_fraction=score_ms / ms)
                log.add(record)
                print(f"{name} batch {batch} {method}: {ms:.2f} ms, {record['decode_tokens_per_s']:,.0f} tok/s"
                      f"{' PROJECTION' if record['projected'] else ''}", flush=True)
        del engine


def identity_part(args, log: RecordLog) -> None:
    from benchmarks.prompt_splits import split_prompts
    from vegas_jax.loading import load_model

    if args.smoke:
        single, source = random_model(SHAPES["tiny"], jnp.float32), "tiny (random weights, smoke)"
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, single.config.vocab_size, args.real_prompt_tokens).tolist()
                   for _ in range(args.real_prompts)]
    else:
        single, source = load_model(args.real_model, jnp.float32), f"{Path(args.real_model).name} (float32)"
        prompts = split_prompts(single.tokenizer, "heldout", args.real_prompts, args.real_prompt_tokens).prompts
    options = GenerationOptions(method="vegas", max_new_tokens=args.real_new_tokens,
                                max_model_len=args.real_prompt_tokens + args.real_new_tokens)
    one = [r.tokens for r in Engine(single).generate(prompts, options).requests]
    for name in (m for m in args.meshes if parse_mesh(m)[DATA] > 1):
        if over_budget(args):
            return
        mesh = mesh_of(name)
        tokens = [r.tokens for r in Engine(single.on_mesh(mesh)).generate(prompts, options).requests]
        parted = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else
                       min(len(x), len(y))) for x, y in zip(one, tokens)]
        log.add({"part": "identity", "mesh": name, "gpus": gpus_of(mesh), "model": source, "method": "vegas",
                 "batch": len(prompts), "prompt_tokens": args.real_prompt_tokens, "new_tokens": args.real_new_tokens,
                 "dtype": "float32", "identical": [p is None for p in parted], "first_difference": parted})
        print(f"{name}: {sum(p is None for p in parted)} of {len(parted)} requests identical to one GPU", flush=True)


def print_table(records: list[dict]) -> None:
    print(f"\n{'mesh':10s} {'batch':>5s} {'method':6s} {'ms':>8s} {'tok/s':>12s} {'vs 1 GPU':>8s} {'score red.':>10s}")
    for r in records:
        if r.get("part") != "timing" or not r.get("fits"):
            continue
        speedup = f"{r['speedup_vs_one_gpu']:.2f}x" if r.get("speedup_vs_one_gpu") else "-"
        share = f"{100 * r['score_reduction_fraction']:.2f} %" if r.get("score_reduction_ms") else "-"
        rate = f"{r['decode_tokens_per_s']:,.0f}{'*' if r['projected'] else ''}"
        print(f"{r['mesh']:10s} {r['batch']:5d} {r['method']:6s} {r['ms_per_iteration']:8.2f} {rate:>12s} "
              f"{speedup:>8s} {share:>10s}")
    print("* PROJECTION: Vegas's tokens/s at the τ SmolLM2 reached (--tau), from random-weight timing")
    for r in records:
        if r.get("part") == "identity":
            print(f"identity {r['mesh']}: {sum(r['identical'])} of {r['batch']} requests identical to one GPU")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--batches", default=[8, 16], type=lambda t: [int(b) for b in t.split(",")])
    p.add_argument("--context", default=32768, type=token_count)
    p.add_argument("--meshes", default="model=2;data=2", help="meshes separated by ';', each data=D,model=M")
    p.add_argument("--iterations", type=int, default=8, help="timed iterations per configuration")
    p.add_argument("--tau", type=float, default=DEFAULT_TAU, help="τ Vegas's projected tokens/s assume")
    p.add_argument("--real-model", default=None, help="a GGUF: the identity part (skipped without one)")
    p.add_argument("--real-prompts", type=int, default=8)
    p.add_argument("--real-prompt-tokens", default=4096, type=token_count)
    p.add_argument("--real-new-tokens", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=480.0, help="start no configuration after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in float32 on a CPU with two devices")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    args.started = time.perf_counter()
    args.meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    try:
        for name in args.meshes:
            mesh_of(name)  # each mesh must cover every device: refused here, before any work
    except InputError as e:
        print(f"error: --meshes: {e}", file=sys.stderr)
        return 2
    args.dtype = jnp.bfloat16
    if args.smoke:
        args.shapes, args.batches, args.context, args.dtype = "tiny", [2], 256, jnp.float32
        args.iterations, args.real_prompts, args.real_prompt_tokens, args.real_new_tokens = 2, 4, 48, 12
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    name = f"mesh-{date}{'-' + args.tag if args.tag else ''}{'-smoke' if args.smoke else ''}.json"
    log = RecordLog(run_metadata(devices=jax.device_count(), smoke=args.smoke), name,
                    args.out or (None if args.smoke else RESULTS))
    if args.real_model or args.smoke:  # first: a correctness check of a minute, before the budget goes to timing
        identity_part(args, log)
    timing_part(args, log)
    log.finish(complete=not over_budget(args))
    print_table(log.records)
    if over_budget(args):
        print(f"stopped by --budget-s {args.budget_s:g}: the document says \"complete\": false")
    return 0


if __name__ == "__main__":
    sys.exit(main())
