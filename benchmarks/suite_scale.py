"""The paper's model scale, timing only: random weights of Llama-3.1-8B's and Qwen3-8B's shapes at 32K and 128K of
context, the cache filled with random rows instead of prefill (`Engine.start(fill_cache=...)`).

Per (model, context, batch): a plain step, a Vegas iteration and a Stream iteration (γ 6, ratio 7 %), and an
iteration of plain decoding verifying a 6-node chain drafted by an untrained EAGLE-style draft head (`head`: one
layer and the LM head's rows of a 32K-token draft vocabulary a draft, where Vegas's drafts read every weight), each
timed over a few iterations of the compiled loop, then profiled over a few more (GPU time by kernel kind, and by
phase: the draft loop's command buffer against the rest of the iteration); the memory roofline fraction: the bytes a
step or iteration must read (weights, and the KV rows each pass attends to) over the read bandwidth measured in the
same process, divided by the time it took. Acceptance on random weights means nothing: throughput at SmolLM2's measured
τ is a projection, made by the report, never measured here.
"""

from __future__ import annotations

import collections
import functools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.profile_decode import gpu_kernel_events, summarize
from benchmarks.random_model import SHAPES, random_cache_rows, random_engine, with_random_head
from benchmarks.suite_presets import SCALE_CASE_S, SCALE_METHODS, SCALE_MODEL_S, Preset
from models import draft_head
from models.config import ModelConfig
from vegas_jax.decode.tree_shapes import parse_tree
from vegas_jax.runtime.engine import GenerationOptions
from vegas_jax.runtime.options import DEFAULTS
from vegas_jax.inputs import InputError

WARMUP_ITERATIONS = 2
PROFILED_ITERATIONS = 3
BANDWIDTH_BYTES = 2**32
KERNEL_TIME, WALL_TIME = "gpu kernel time", "wall"  # what a time was measured by (kernel_profile's clock)
HEAD_DRAFTS = "6x1"  # the `head` method's draft: as many drafts as Vegas's default γ, a chain
# The `head` method's draft vocabulary (models.draft_head.vocabulary_readout), as EAGLE-3's: a quarter of
# Llama-3.1-8B's 128K tokens, a fifth of Qwen3-8B's 152K (SmolLM2's shipped head drafts as well from 4K of its 49K:
# docs/draft-head.md).
HEAD_VOCAB = 32768


def median_seconds(fn, x, reps: int = 10) -> float:
    """Median wall seconds of fn(x), after one untimed call."""
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def gpu_seconds(fn, x, reps: int = 5) -> float:
    """Mean GPU seconds of fn(x): the summed durations of the kernels it launches (the profiler's), over reps
    calls after one untimed call. A lone jitted call's wall time adds its dispatch and sync (about 0.1 ms), which
    the decode loop's kernels, run back to back in one CUDA graph, do not pay. Off the GPU: median wall seconds."""
    if jax.default_backend() != "gpu":
        return median_seconds(fn, x, reps)
    jax.block_until_ready(fn(x))
    return sum(e["dur"] for e in _traced_kernels(fn, x, reps)) / 1e6 / reps


def kernel_profile(fn, x, reps: int = 5, top: int = 4) -> dict:
    """Both clocks of fn(x): gpu_s (gpu_seconds), wall_s (median_seconds: what a lone call costs, dispatch and sync
    included), and on the GPU the kernels one call launches and the `top` longest of them, so that a time can be
    told apart as launch-bound (many short kernels) or bound by one kernel. Off the GPU, gpu_s is the wall time;
    `clock` says which it is."""
    wall = median_seconds(fn, x)
    if jax.default_backend() != "gpu":
        return {"gpu_s": wall, "wall_s": wall, "clock": WALL_TIME, "kernels": None, "top_kernels": []}
    summary = summarize(_traced_kernels(fn, x, reps), reps, 0.0, top)
    return {"gpu_s": summary["gpu_busy_ms_per_iteration"] / 1e3, "wall_s": wall, "clock": KERNEL_TIME,
            "kernels": summary["kernels_per_iteration"],
            "top_kernels": [{"kernel": k["kernel"], "mean_us": k["mean_us"]} for k in summary["top_kernels"]]}


def _traced_kernels(fn, x, reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(reps):
                jax.block_until_ready(fn(x))
        return gpu_kernel_events(Path(log_dir))


def measure_bandwidth(nbytes: int = BANDWIDTH_BYTES, timer=median_seconds) -> dict:
    """GB/s of two read-only passes over nbytes of bf16, a sum and a matrix-vector product (the read a decode
    step's GEMMs make; on the H200 it reads faster than the sum, which had put a plain step above 100 % of the
    sum's rate), the faster of them as read_bandwidth_gbps; and of a copy (bytes read plus written). `timer`
    times one pass: the scale stage's is gpu_seconds, kernel time, since its decode loop runs its kernels back to
    back and a lone call's wall time adds its dispatch and sync to a ~1 ms pass (timed so, the plain steps of
    2026-12-02's paper-preset calls read at 102-117 % of the probe's rate). bench_nsa_kernels times its kernels
    and the probe by kernel time too; the other kernel benchmarks time lone calls by wall time, and the probe
    with them."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    summed = nbytes / timer(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x) / 1e9
    copied = 2 * nbytes / timer(jax.jit(lambda a: a + jnp.bfloat16(1)), x) / 1e9
    columns = 4096
    rows = nbytes // 2 // columns
    matrix, vector = x[: rows * columns].reshape(rows, columns), jnp.ones((1, rows), jnp.bfloat16)
    gemv = 2 * rows * columns / timer(jax.jit(lambda w: vector @ w), matrix) / 1e9
    del x, matrix
    return {"read_bandwidth_gbps": max(summed, gemv), "read_bandwidth_sum_gbps": summed,
            "read_bandwidth_gemv_gbps": gemv, "copy_bandwidth_gbps": copied}


def tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def weight_bytes_read(config: ModelConfig, params) -> int:
    """Bytes of parameters a decode step reads: all of them, but for an untied embedding table, of which a step
    reads only its tokens' rows."""
    total = tree_bytes(params)
    if not config.tie_word_embeddings:
        total -= tree_bytes(params["embed"])
    return total


def kv_bytes_per_token(config: ModelConfig, itemsize: int = 2) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def bytes_per_iteration(weights: int, kv_token: int, batch: int, length: int, gamma: int, budget: int) -> int:
    """What an iteration must read: γ draft steps of the weights and `budget` cached rows per sequence, then one
    verification (a plain step when γ = 0) of the weights and every cached row."""
    return gamma * (weights + batch * budget * kv_token) + weights + batch * length * kv_token


def head_pass_bytes(config: ModelConfig, params, head, batch: int, window: int) -> int:
    """What one pass of the draft head must read: its own weights (with a draft vocabulary, its rows of the LM
    head), else the target's LM head (the embedding table when tied), the target's final norm, and its K/V rows
    over its window."""
    readout = ({} if draft_head.READOUT in head else
               params["embed"] if config.tie_word_embeddings else params["lm_head"])
    head_kv_token = kv_bytes_per_token(config) // config.num_layers  # the head is one layer
    return tree_bytes(head) + tree_bytes(readout) + tree_bytes(params["final_norm"]) + batch * window * head_kv_token


def phase_split(events: list[dict], iterations: int) -> dict[str, float]:
    """GPU milliseconds per iteration by phase: the kernels of each enclosing command buffer go to the draft if it
    runs the sparse draft attention kernel, to verification (with acceptance and selection) if it runs the
    verification kernel, else to "other"."""
    by_op = collections.defaultdict(list)
    for e in events:
        by_op[(e.get("args") or {}).get("hlo_op", e["name"])].append(e)
    phases = collections.Counter()
    for group in by_op.values():
        names = " ".join(e["name"] for e in group)
        phase = ("draft" if "sparse_decode_attention" in names else
                 "verify, accept, select" if "verify_attention" in names else "other")
        phases[phase] += sum(e["dur"] for e in group) / 1e3 / iterations
    return dict(phases)


def _profile(decode, state, limit: int, everyone) -> tuple[object, dict]:
    before = int(np.asarray(state.step))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t0 = time.perf_counter()
            state = decode(state, jnp.int32(limit), everyone)
            jax.block_until_ready(state.output)
            wall = time.perf_counter() - t0
        events = gpu_kernel_events(Path(log_dir))
    ran = max(1, int(np.asarray(state.step)) - before)
    summary = summarize(events, ran, wall, top=12)
    return state, {
        "wall_ms_per_iteration": summary["wall_ms_per_iteration"],
        "gpu_busy_ms_per_iteration": summary["gpu_busy_ms_per_iteration"],
        "kernels_per_iteration": summary["kernels_per_iteration"],
        "by_kind": {k: v["ms_per_iteration"] for k, v in summary["by_kind"].items()},
        "phases": phase_split(events, ran),
        "top_kernels": summary["top_kernels"],
    }


def time_iterations(engine, batch: int, context: int, method: str, iterations: int) -> dict:
    """ms per iteration of `method` (a plain step for ar) on a random cache of `context` rows, and its profile."""
    gamma, sparse_ratio = scale_cell(method)
    max_new = (1 + WARMUP_ITERATIONS + iterations + PROFILED_ITERATIONS) * (gamma + 1) + 1
    options = scale_options(method, max_new, context)
    prompts = [[1] * (context - max_new)] * batch
    started = engine.start(prompts, options, fill_cache=random_cache_rows)
    held = bytes_in_use_per_device()  # the parameters and the run's state: what the run holds on each device
    params, draft, everyone = engine.model.params, started.draft_params, jnp.int32(batch)
    state = started.decode(params, draft, started.state, jnp.int32(WARMUP_ITERATIONS), everyone)
    jax.block_until_ready(state.output)
    first = int(np.asarray(state.step))
    t0 = time.perf_counter()
    state = started.decode(params, draft, state, jnp.int32(first + iterations), everyone)
    jax.block_until_ready(state.output)
    wall = time.perf_counter() - t0
    ran = int(np.asarray(state.step)) - first
    state, profile = _profile(functools.partial(started.decode, params, draft), state,
                              first + iterations + PROFILED_ITERATIONS, everyone)
    budget = started.config.policy.budget.k_max if started.config.policy else 0
    return {
        "ms_per_iteration": 1e3 * wall / max(ran, 1),
        "iterations": ran,
        "length": context - max_new,
        "gamma": gamma,
        "sparse_ratio": sparse_ratio,
        "draft_budget_tokens": budget,
        "compile_s": started.timings["compile_s"],
        "bytes_in_use_per_device": held,
        "profile": profile,
    }


def bytes_in_use_per_device() -> list[int] | None:
    """Bytes each local device holds now (None where the backend keeps no statistics, as a CPU's)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    return None if any(s is None for s in stats) else [int(s["bytes_in_use"]) for s in stats]


def scale_options(method: str, max_new_tokens: int, context: int) -> GenerationOptions:
    """A scale method's options: `head` is plain decoding verifying the head's chain (the engine's head)."""
    if method == "head":
        return GenerationOptions(method="ar", draft_tree=HEAD_DRAFTS, drafter="head", max_new_tokens=max_new_tokens,
                                 max_model_len=context)
    return GenerationOptions(method=method, max_new_tokens=max_new_tokens, max_model_len=context)


def fits(engine, batch: int, context: int, method: str) -> str | None:
    """None if the run fits the device (vegas_jax.runtime.memory's plan), else the refusal."""
    options = scale_options(method, 64, context)
    try:
        engine.plan([[1] * (context - 64)] * batch, options)
    except InputError as e:
        return str(e)
    return None


def run_scale(session, preset: Preset) -> None:
    """Every ScaleCase of the preset, through session.measure (which skips what the log has)."""
    bandwidth = None
    for model in dict.fromkeys(case.model for case in preset.scale):
        cases = [c for c in preset.scale if c.model == model]
        wanted = [(c, b, m) for c in cases for b in c.batches for m in SCALE_METHODS
                  if session.missing(_fields(model, c.context, b, m))]
        if not wanted:
            continue
        session.check_time(SCALE_MODEL_S + SCALE_CASE_S, f"scale {model}")
        if bandwidth is None:
            bandwidth = {**measure_bandwidth(timer=gpu_seconds), "bandwidth_timer": KERNEL_TIME}
            print(f"read {bandwidth['read_bandwidth_gbps']:.0f} GB/s, copy {bandwidth['copy_bandwidth_gbps']:.0f} GB/s",
                  flush=True)
        config = SHAPES[model]
        engine = random_engine(config)
        if any(m == "head" for _, _, m in wanted):
            engine = with_random_head(engine, HEAD_VOCAB)
        weights, kv_token = weight_bytes_read(config, engine.model.params), kv_bytes_per_token(config)
        timed_plain = {}  # (context, batch): a plain step timed here, shared by the case's methods
        for case, batch, method in wanted:
            session.measure(_fields(model, case.context, batch, method), SCALE_CASE_S,
                            functools.partial(_case, session, engine, timed_plain, model, bandwidth, weights, kv_token,
                                              case.context, batch, method, preset.scale_iterations))
        del engine


def _fields(model: str, context: int, batch: int, method: str) -> dict:
    gamma, sparse_ratio = scale_cell(method)
    return {"stage": "scale", "model": model, "context": context, "batch": batch, "method": method,
            "gamma": gamma, "sparse_ratio": sparse_ratio, "weights": "random", "dtype": "bfloat16",
            **({"draft_vocab": HEAD_VOCAB} if method == "head" else {})}


def scale_cell(method: str) -> tuple[int, float | None]:
    """(γ, sparse ratio) a scale case runs at: plain decoding's, the head's chain (its drafts, no selection), or the
    engine's defaults."""
    if method == "head":
        return parse_tree(HEAD_DRAFTS).depth, None
    return (0, None) if method == "ar" else (DEFAULTS["gamma"], DEFAULTS["sparse_ratio"])


def plain_step_ms(session, engine, timed: dict, model, context, batch, iterations) -> tuple[float, str]:
    """(a plain step's ms at this case, where it comes from): the log's plain record if this card made it, else a
    plain step timed now (once per case: `timed` keeps it for the case's other methods). A log may hold the plain
    records of another card (the H200's plain step is faster than the H100's by their bandwidths), and an
    iteration over another card's step is no ratio at all."""
    device = str(jax.devices()[0].device_kind)
    same_card = [r for r in session.log.find(**_fields(model, context, batch, "ar"))
                 if r.get("fits") and r.get("device") == device]
    if same_card:
        return same_card[0]["ms_per_iteration"], "the log's plain record"
    if (context, batch) not in timed:
        timed[context, batch] = time_iterations(engine, batch, context, "ar", iterations)["ms_per_iteration"]
    return timed[context, batch], "timed with this record"


def _case(session, engine, timed_plain, model, bandwidth, weights, kv_token, context, batch, method,
          iterations) -> dict:
    refusal = fits(engine, batch, context, method)
    if refusal:
        return {"fits": False, "reason": refusal}
    try:
        timing = time_iterations(engine, batch, context, method, iterations)
    except jax.errors.JaxRuntimeError as e:  # a miss of the plan, recorded as measured so later cases still run
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        reason = "the memory plan let it start, but XLA ran out of memory: " + str(e).splitlines()[0][:300]
        print(f"scale {model} {context} x {batch} {method}: {reason}", flush=True)
        return {"fits": False, "reason": reason, "plan_missed": True}
    plain, plain_source = timing["ms_per_iteration"], "this record"
    if method != "ar":
        plain, plain_source = plain_step_ms(session, engine, timed_plain, model, context, batch, iterations)
    if method == "head":  # its drafts read the head, not the model: γ head passes, then the verification
        needed = (timing["gamma"] * head_pass_bytes(engine.config, engine.model.params, engine.draft_head, batch,
                                                    engine.draft_head_window)
                  + bytes_per_iteration(weights, kv_token, batch, timing["length"], 0, 0))
    else:
        needed = bytes_per_iteration(weights, kv_token, batch, timing["length"], timing["gamma"],
                                     timing["draft_budget_tokens"])
    at_roofline_ms = 1e3 * needed / (bandwidth["read_bandwidth_gbps"] * 1e9)
    return {
        "fits": True,
        **timing,
        **bandwidth,
        "plain_ms_per_step": plain,
        "plain_source": plain_source,
        "plain_steps_per_iteration": timing["ms_per_iteration"] / plain if plain else None,
        "bytes_per_iteration": needed,
        "weight_bytes": weights,
        "roofline_ms": at_roofline_ms,
        "roofline_fraction": at_roofline_ms / timing["ms_per_iteration"],
    }
