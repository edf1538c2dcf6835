"""Benchmarks of the Pallas kernels on the GPU, each checked against its XLA reference before it is timed.

    python benchmarks/bench_kernels.py            # about 3-5 minutes on an H200
    python benchmarks/bench_kernels.py --tune     # sweeps launch parameters at T = 128K instead
    python benchmarks/bench_kernels.py --smoke    # tiny shapes in interpret mode: checks this script on a CPU
    python benchmarks/bench_kernels.py --tune --models smollm2 --batches 64 --lengths 8192 --only verify
                                                  # the shapes of one end-to-end run

Shapes: Qwen3-8B (32 query / 8 KV heads, D 128) and SmolLM2 (9 / 3, D 64), batch 1 and 8, cache length 32K and
128K, bf16 caches, sparse ratio 7%, γ = 6 (verification of S = 7 tokens). Every sequence is at the full length
(the most work). Per record: the median wall time per call over back-to-back asynchronous calls (so a kernel
shorter than the dispatch floor, also reported, measures the floor; sparse draft attention is therefore timed as
30 launches per call, each with its own selection, so none finds its rows in L2, and each writing its new K/V
row into the caches the previous returned), the bytes the operation cannot avoid moving
(K/V rows read, q, outputs, scores), the achieved GB/s next to the device copy bandwidth measured in the same run,
and the speedup over the XLA reference. Results go to benchmarks/results/kernels-<date>.json (--smoke: not there) and $OUT/ if set;
the process exits 1 if any kernel failed its check or failed to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import math
import signal
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import save_results  # noqa: E402
from models.attention import rope_tables  # noqa: E402
from pallas_kernels.select_topk import select_topk, select_topk_reference  # noqa: E402
from pallas_kernels.sparse_decode import (  # noqa: E402
    sparse_decode_attention,
    sparse_decode_attention_reference,
)
from pallas_kernels.verify_attention import verify_attention, verify_attention_reference  # noqa: E402

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
warnings.filterwarnings("ignore", message=".*decode_attention is deprecated.*", category=DeprecationWarning)

MODELS = {"qwen3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head dim
SPARSE_RATIO = 0.07
VERIFY_QUERIES = 7  # γ + 1 with γ = 6
# Rows attended since the last selection: accepted drafts, the newest token and this iteration's drafts (2γ + 1).
RECENT_TOKENS = 13
# Relative error bounds (max |kernel - reference| / max |reference|) for bf16 outputs and float32 scores.
OUTPUT_TOLERANCE = 2e-2
SCORE_TOLERANCE = 1e-3
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Record:
    kernel: str
    shape: dict
    config: dict = dataclasses.field(default_factory=dict)
    correct: bool | None = None
    max_rel_error: float | None = None
    time_ms: float | None = None
    reference_ms: float | None = None
    speedup_vs_reference: float | None = None
    bytes: int | None = None
    gb_per_s: float | None = None
    copy_gb_per_s: float | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    interpret: bool
    models: tuple[str, ...]
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    topk_rows: int  # rows of the large selection benchmark
    copy_elements: int
    seconds_per_measurement: float
    repeats: int
    # Sparse draft attention runs this many launches per timed call (see CacheThreaded): one launch is shorter
    # than the dispatch floor.
    launches_per_call: int


FULL = Settings(False, tuple(MODELS), (1, 8), (32768, 131072), 256, 512 * 2**20, 0.25, 5, 30)
SMOKE = Settings(True, ("smollm2",), (2,), (512,), 4, 2**16, 0.0, 1, 2)  # every kernel once: CI runs it


def measure_ms(settings: Settings, fn, *args) -> float:
    """Median wall time per call of back-to-back calls, after compilation and a warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - start
    calls = int(min(max(settings.seconds_per_measurement / settings.repeats / max(single, 1e-6), 3), 500))
    samples = []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples) * 1e3


def relative_error(actual, expected) -> float:
    actual, expected = jnp.asarray(actual, jnp.float32), jnp.asarray(expected, jnp.float32)
    finite = jnp.isfinite(expected)
    if not bool(jnp.all(jnp.isfinite(actual) == finite)):
        return math.inf
    diff = jnp.where(finite, jnp.abs(actual - expected), 0.0)
    return float(jnp.max(diff) / jnp.max(jnp.where(finite, jnp.abs(expected), 0.0)))


def finish(record: Record, settings: Settings, copy_gb_per_s: float, kernel_fn, reference_fn, args, nbytes: int,
           launches_per_call: int = 1):
    """Times the kernel, and the reference unless it is None, if the check passed; fills in the rates."""
    record.bytes = nbytes
    record.copy_gb_per_s = copy_gb_per_s
    if not record.correct:
        return
    record.time_ms = measure_ms(settings, kernel_fn, *args) / launches_per_call
    record.gb_per_s = nbytes / record.time_ms / 1e6
    if reference_fn is not None:
        record.reference_ms = measure_ms(settings, reference_fn, *args) / launches_per_call
        record.speedup_vs_reference = record.reference_ms / record.time_ms


def run_guarded(records: list[Record], record: Record, body) -> Record:
    """Runs one benchmark; a kernel that fails to compile or run is recorded, and the others still run."""
    try:
        body(record)
    except Exception as exc:  # noqa: BLE001 - one failed kernel must not end a one-shot GPU run
        record.error = f"{type(exc).__name__}: {exc}"[:2000]
        record.correct = False
        traceback.print_exc()
    records.append(record)
    print(summary_line(record), flush=True)
    gc.collect()
    return record


def random_cache(key, batch, length, kv_heads, head_dim):
    k_key, v_key = jax.random.split(key)
    shape = (batch, length, kv_heads, head_dim)
    return jax.random.normal(k_key, shape, jnp.bfloat16), jax.random.normal(v_key, shape, jnp.bfloat16)


def copy_bandwidth(settings: Settings) -> float:
    """Device copy GB/s, counting bytes read plus bytes written."""
    x = jnp.ones((settings.copy_elements,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)
    ms = measure_ms(settings, copy, x)
    return 2 * x.nbytes / ms / 1e6


def dispatch_floor_ms(settings: Settings) -> float:
    """Wall time per call of a trivial jitted op: the floor under every measurement."""
    return measure_ms(settings, jax.jit(lambda x: x + 1), jnp.zeros((8,), jnp.float32))


def sparse_inputs(batch, length, model, index_sets: int, seed=0):
    """Inputs with `index_sets` different selections stacked ([sets, B, K_max]), so that timed launches can each
    read their own rows instead of finding the previous launch's rows in L2."""
    num_q_heads, kv_heads, head_dim = MODELS[model]
    count = math.ceil(SPARSE_RATIO * length)
    recent_start = length - RECENT_TOKENS - 3
    rng = np.random.default_rng(seed)
    # Sorted, as select_topk returns them.
    indices = np.stack([np.stack([np.sort(rng.choice(recent_start, count, replace=False)) for _ in range(batch)])
                        for _ in range(index_sets)])
    key = jax.random.key(seed)
    k_cache, v_cache = random_cache(key, batch, length, kv_heads, head_dim)
    qkv = jax.random.normal(jax.random.fold_in(key, 1), (batch, num_q_heads + 2 * kv_heads, head_dim), jnp.bfloat16)
    full = lambda value: jnp.full((batch,), value, jnp.int32)
    # The recent range holds RECENT_TOKENS rows, the last of them the new token.
    position = full(recent_start + RECENT_TOKENS - 1)
    rope_cos, rope_sin = rope_tables(position, 1e6 ** -(jnp.arange(0, head_dim, 2) / head_dim))
    args = (qkv, rope_cos, rope_sin, k_cache, v_cache, jnp.asarray(indices, jnp.int32),
            jnp.full((index_sets, batch), count, jnp.int32), full(recent_start), position)
    keys_read = count + RECENT_TOKENS - 1
    row_bytes = kv_heads * head_dim * 2 * 2  # K and V
    nbytes = batch * (keys_read * row_bytes + row_bytes + num_q_heads * head_dim * 2 * 2 + count * 4)
    return args, nbytes


class CacheThreaded:
    """`launches` calls of a sparse attention fn(launch, qkv, cos, sin, k_cache, v_cache, *rest) per jitted
    call, each on the caches the previous one returned, and the caches donated from call to call: the way the
    decode loop runs the kernel, with the row writes in place and the dispatch cost spread over the launches."""

    def __init__(self, fn, args, launches: int):
        self.k_cache, self.v_cache = (jnp.copy(x) for x in args[3:5])
        self.others = args[:3] + args[5:]

        def run(k_cache, v_cache, qkv, rope_cos, rope_sin, *rest):
            total = 0.0
            for launch in range(launches):
                out, k_cache, v_cache = fn(launch, qkv, rope_cos, rope_sin, k_cache, v_cache, *rest)
                total += out.astype(jnp.float32)
            return total, k_cache, v_cache

        self.run = jax.jit(run, donate_argnums=(0, 1))

    def __call__(self):
        total, self.k_cache, self.v_cache = self.run(self.k_cache, self.v_cache, *self.others)
        return total


def bench_sparse(settings, copy_gb_per_s, records, model, batch, length, config=None, time_reference=True):
    config = dict(config or {})
    record = Record("sparse_decode", dict(model=model, batch=batch, length=length, ratio=SPARSE_RATIO,
                                          recent=RECENT_TOKENS), config)

    def body(record):
        launches = settings.launches_per_call
        args, nbytes = sparse_inputs(batch, length, model, launches)
        # Partials of the module-level jitted functions: each configuration compiles once.
        kernel = functools.partial(sparse_decode_attention, interpret=settings.interpret, **config)
        reference = functools.partial(sparse_decode_attention_reference, max_recent=RECENT_TOKENS)

        def kernel_launch(launch, *launch_args):
            return kernel(*launch_args, layer=launch)

        def reference_launch(launch, qkv, rope_cos, rope_sin, k_cache, v_cache, indices, counts, *rest):
            return reference(qkv, rope_cos, rope_sin, k_cache, v_cache, indices[launch], counts[launch], *rest)

        got, want = kernel_launch(0, *args), reference_launch(0, *args)
        record.max_rel_error = max(relative_error(a, b) for a, b in zip(got, want))
        record.correct = record.max_rel_error <= OUTPUT_TOLERANCE
        finish(record, settings, copy_gb_per_s, CacheThreaded(kernel_launch, args, launches),
               CacheThreaded(reference_launch, args, launches) if time_reference else None, (), nbytes, launches)

    return run_guarded(records, record, body)


def verify_inputs(batch, length, model, seed=0):
    num_q_heads, kv_heads, head_dim = MODELS[model]
    key = jax.random.key(seed)
    k_cache, v_cache = random_cache(key, batch, length, kv_heads, head_dim)
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, VERIFY_QUERIES, num_q_heads, head_dim), jnp.bfloat16)
    start = jnp.full((batch,), length - VERIFY_QUERIES, jnp.int32)
    kv_bytes = batch * length * kv_heads * head_dim * 2 * 2
    return (q, k_cache, v_cache, start), kv_bytes + 2 * q.nbytes


def bench_verify(settings, copy_gb_per_s, records, model, batch, length, score_mode, config=None,
                 time_reference=True):
    config = dict(config or {})
    record = Record("verify", dict(model=model, batch=batch, length=length, queries=VERIFY_QUERIES),
                    dict(config, score_mode=score_mode))

    def body(record):
        args, nbytes = verify_inputs(batch, length, model)
        kernel = functools.partial(verify_attention, score_mode=score_mode, interpret=settings.interpret, **config)
        reference = functools.partial(verify_attention_reference, score_mode=score_mode)
        (out, scores), (want_out, want_scores) = kernel(*args), reference(*args)
        record.max_rel_error = relative_error(out, want_out)
        record.correct = record.max_rel_error <= OUTPUT_TOLERANCE
        if score_mode is not None:
            score_error = relative_error(scores, want_scores)
            record.config["score_rel_error"] = score_error
            record.correct = record.correct and score_error <= SCORE_TOLERANCE
            nbytes += batch * length * 4
        finish(record, settings, copy_gb_per_s, kernel, reference if time_reference else None, args, nbytes)

    return run_guarded(records, record, body)


def bench_dense(settings, copy_gb_per_s, records, model, batch, length):
    """jax's own Pallas dense decode (gqa) for scale: gqa transposes K and V to head-major on every call, so the
    kernel alone is also timed on a cache transposed beforehand (mqa vmapped over KV heads)."""
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention
    except ImportError as exc:
        print(f"dense decode_attention not importable: {exc}")
        return
    num_q_heads, kv_heads, head_dim = MODELS[model]
    group = num_q_heads // kv_heads
    shape = dict(model=model, batch=batch, length=length)

    def inputs():
        key = jax.random.key(0)
        k_cache, v_cache = random_cache(key, batch, length, kv_heads, head_dim)
        q = jax.random.normal(jax.random.fold_in(key, 1), (batch, num_q_heads, head_dim), jnp.bfloat16)
        return q, k_cache, v_cache

    nbytes = batch * length * kv_heads * head_dim * 2 * 2
    # The ops' default k_splits=16 and block_k=128 need length / 16 to be a multiple of 128.
    launch = dict(k_splits=min(16, length // 128), interpret=settings.interpret)

    def gqa_body(record):
        args = inputs()
        kernel = jax.jit(functools.partial(decode_attention.gqa, **launch))
        reference = jax.jit(decode_attention.gqa_reference)
        record.max_rel_error = relative_error(kernel(*args), reference(*args))
        record.correct = record.max_rel_error <= OUTPUT_TOLERANCE
        finish(record, settings, copy_gb_per_s, kernel, reference, args, nbytes)

    def head_major_body(record):
        q, k_cache, v_cache = inputs()
        head_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H_kv, T, D]
        args = (q.reshape(batch, kv_heads, group, head_dim), head_major(k_cache), head_major(v_cache))
        per_head = jax.vmap(functools.partial(decode_attention.mqa, **launch), in_axes=1, out_axes=1)
        kernel = jax.jit(per_head)
        want = decode_attention.gqa_reference(q, k_cache, v_cache).reshape(args[0].shape)
        record.max_rel_error = relative_error(kernel(*args), want)
        record.correct = record.max_rel_error <= OUTPUT_TOLERANCE
        finish(record, settings, copy_gb_per_s, kernel, None, args, nbytes)

    run_guarded(records, Record("dense_gqa_jax_ops", shape), gqa_body)
    run_guarded(records, Record("dense_mqa_jax_ops_head_major", shape), head_major_body)


def bench_select(settings, copy_gb_per_s, records, rows, length, config=None, time_reference=True):
    config = dict(config or {})
    k_max = math.ceil(SPARSE_RATIO * length)
    record = Record("select_topk", dict(rows=rows, length=length, k=k_max), config)

    def body(record):
        key = jax.random.key(0)
        scores = jax.random.normal(key, (rows, length), jnp.float32)
        # The newest keys of each row are not candidates (verification scores them -inf).
        scores = scores.at[:, -VERIFY_QUERIES + 1 :].set(-jnp.inf)
        k = jnp.full((rows,), k_max, jnp.int32)
        kernel = functools.partial(select_topk, k_max=k_max, interpret=settings.interpret, **config)
        reference = functools.partial(select_topk_reference, k_max=k_max)
        (indices, counts), (want_indices, want_counts) = kernel(scores, k), reference(scores, k)
        chosen_values = lambda idx, n: jnp.sort(
            jnp.where(jnp.arange(k_max) < n[:, None], jnp.take_along_axis(scores, idx, axis=1), -jnp.inf), axis=1)
        record.correct = bool(jnp.array_equal(counts, want_counts)) and bool(
            jnp.array_equal(chosen_values(indices, counts), chosen_values(want_indices, want_counts)))
        record.max_rel_error = 0.0 if record.correct else math.inf
        finish(record, settings, copy_gb_per_s, kernel, reference if time_reference else None, (scores, k),
               rows * (length + k_max) * 4)

    return run_guarded(records, record, body)


def run_benchmarks(settings, copy_gb_per_s, records, only):
    for model in settings.models:
        for batch in settings.batches:
            for length in settings.lengths:
                if "sparse" in only:
                    bench_sparse(settings, copy_gb_per_s, records, model, batch, length)
                if "verify" in only:
                    for score_mode in (None, "logit", "weight"):
                        bench_verify(settings, copy_gb_per_s, records, model, batch, length, score_mode)
                if "dense" in only:
                    bench_dense(settings, copy_gb_per_s, records, model, batch, length)
    if "select" in only:
        bench_select(settings, copy_gb_per_s, records, settings.topk_rows, settings.lengths[-1])
        # Per layer: one row per sequence.
        for batch in settings.batches:
            for length in settings.lengths:
                bench_select(settings, copy_gb_per_s, records, batch, length)


def sweep(options: dict) -> list[dict]:
    return [dict(zip(options, values)) for values in itertools.product(*options.values())]


def run_tuning(settings, copy_gb_per_s, records, only, tiles, launches):
    """Launch-parameter sweeps without timing the references; the best configuration per shape is printed last.
    Attention kernels: the `tiles` product (block_k x num_splits) first, then the `launches` product (num_warps x
    num_stages) around the best of those (a full product would not fit in one 10-minute run)."""
    attention_kernels = {
        "sparse": bench_sparse,
        "verify": functools.partial(bench_verify, score_mode=None),
        "verify-logit": functools.partial(bench_verify, score_mode="logit"),
    }
    for length in settings.lengths:
        for name, bench in attention_kernels.items():
            if name not in only:
                continue
            for model in settings.models:
                for batch in settings.batches:
                    run = lambda config: bench(settings, copy_gb_per_s, records, model, batch, length,
                                               config=config, time_reference=False)
                    timed = [record for record in map(run, sweep(tiles)) if record.time_ms is not None]
                    if not timed:
                        continue
                    best = min(timed, key=lambda record: record.time_ms).config
                    tile = dict(block_k=best["block_k"], num_splits=best["num_splits"])
                    for launch in sweep(launches):
                        run(tile | launch)
        if "select" in only:
            for rows in (settings.topk_rows, settings.batches[-1]):
                for config in sweep(dict(radix_bits=(3, 4, 5), block_size=(512, 1024, 2048))):
                    bench_select(settings, copy_gb_per_s, records, rows, length, config, time_reference=False)


def best_per_shape(records):
    best = {}
    for record in records:
        if record.time_ms is None:
            continue
        key = (record.kernel, json.dumps(record.shape, sort_keys=True), record.config.get("score_mode"))
        if key not in best or record.time_ms < best[key].time_ms:
            best[key] = record
    return list(best.values())


TABLE_HEADER = (f"{'kernel':<28} {'shape':<22} {'config':<34} {'ms':>9} {'GB/s':>6} {'%copy':>5} "
                f"{'ref ms':>9} {'speedup':>7}  check")


def summary_line(record: Record) -> str:
    shape = record.shape
    where = f"{shape['model']} B{shape['batch']}" if "model" in shape else f"rows {shape['rows']}"
    where += f" T{shape['length']}"
    config = " ".join(f"{name}={value}" for name, value in record.config.items() if name != "score_rel_error")
    number = lambda value, fmt: format(value, fmt) if value is not None else "-"
    copy_share = record.gb_per_s / record.copy_gb_per_s * 100 if record.gb_per_s is not None else None
    status = "ok" if record.correct else ("ERROR" if record.error else f"WRONG (error {record.max_rel_error:.1e})")
    return (f"{record.kernel:<28} {where:<22} {config:<34} {number(record.time_ms, '9.4f')} "
            f"{number(record.gb_per_s, '6.0f')} {number(copy_share, '5.0f')} {number(record.reference_ms, '9.4f')} "
            f"{number(record.speedup_vs_reference, '7.2f')}  {status}")


def score_overheads(records) -> list[str]:
    """Verification time with score collection over the time without, per shape (target: <= 1.10 at 128K)."""
    plain = {json.dumps(r.shape, sort_keys=True): r.time_ms for r in records
             if r.kernel == "verify" and r.config.get("score_mode") is None and r.time_ms}
    lines = []
    for record in records:
        key = json.dumps(record.shape, sort_keys=True)
        mode = record.config.get("score_mode")
        if record.kernel == "verify" and mode and record.time_ms and key in plain:
            shape = record.shape
            lines.append(f"  {shape['model']} B{shape['batch']} T{shape['length']} {mode}: "
                         f"x{record.time_ms / plain[key]:.3f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (runs on a CPU)")
    parser.add_argument("--tune", action="store_true", help="sweep launch parameters instead of the benchmark")
    parser.add_argument("--only", default="sparse,verify,select,dense",
                        help="comma-separated subset of sparse, verify, select, dense (--tune: also verify-logit)")
    parser.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--batches", help="comma-separated batch sizes instead of the default 1,8")
    parser.add_argument("--lengths", help="comma-separated cache lengths instead of the default 32K,128K")
    parser.add_argument("--block-k", default="32,64,128", help="--tune: comma-separated block_k values")
    parser.add_argument("--splits", default="1,2,4,8,16,32,64", help="--tune: comma-separated num_splits values")
    parser.add_argument("--warps", default="4,8", help="--tune: comma-separated num_warps values")
    parser.add_argument("--stages", default="2,3,4", help="--tune: comma-separated num_stages values")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    settings = SMOKE if args.smoke else FULL
    if args.models:
        unknown = set(args.models.split(",")) - set(MODELS)
        if unknown:
            parser.error(f"--models: unknown {', '.join(sorted(unknown))} (known: {', '.join(MODELS)})")
        settings = dataclasses.replace(settings, models=tuple(args.models.split(",")))

    def integers(flag):
        try:
            return tuple(int(x) for x in getattr(args, flag).split(","))
        except ValueError:
            parser.error(f"--{flag.replace('_', '-')}: expected comma-separated integers, got {getattr(args, flag)!r}")

    for flag in ("batches", "lengths"):
        if getattr(args, flag):
            settings = dataclasses.replace(settings, **{flag: integers(flag)})
    tiles = dict(block_k=integers("block_k"), num_splits=integers("splits"))
    launches = dict(num_warps=integers("warps"), num_stages=integers("stages"))
    device = jax.devices()[0]
    if not args.smoke and device.platform != "gpu":
        parser.error(f"no GPU (found {device.platform}); use --smoke to check the script on a CPU")

    started = time.time()
    copy_gb_per_s = copy_bandwidth(settings)
    floor_ms = dispatch_floor_ms(settings)
    print(f"{device.device_kind}: copy {copy_gb_per_s:.0f} GB/s (read + write), dispatch floor {floor_ms:.4f} ms")
    print(TABLE_HEADER)
    records: list[Record] = []
    # A run stopped by `timeout` (SIGTERM) still saves what it measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if args.tune:
            run_tuning(settings, copy_gb_per_s, records, only, tiles, launches)
        else:
            run_benchmarks(settings, copy_gb_per_s, records, only)
    except SystemExit:
        print("stopped by SIGTERM: saving the records so far")
    elapsed = time.time() - started

    now = datetime.datetime.now(datetime.timezone.utc)
    result = dict(
        device=device.device_kind,
        jax_version=jax.__version__,
        date=now.isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        copy_gb_per_s=copy_gb_per_s,
        dispatch_floor_ms=floor_ms,
        elapsed_s=elapsed,
        records=[dataclasses.asdict(record) for record in records],
    )
    name = f"kernels-{'smoke-' if args.smoke else ''}{'tune-' if args.tune else ''}{now:%Y-%m-%d-%H%M%S}.json"
    save_results(result, name, None if args.smoke else RESULTS_DIR)  # a smoke's records are no measurements

    failed = [record for record in records if not record.correct]
    print(f"\n{device.device_kind}, jax {jax.__version__}, copy {copy_gb_per_s:.0f} GB/s, "
          f"dispatch floor {floor_ms:.4f} ms, {elapsed:.0f} s; wrote {name}")
    if not args.tune and (overheads := score_overheads(records)):
        print("verification time with score collection / without:", *overheads, sep="\n")
    print(TABLE_HEADER)
    for record in best_per_shape(records) if args.tune else records:
        print(summary_line(record))
    if failed:
        print(f"\n{len(failed)} FAILED:")
        for record in failed:
            print(summary_line(record), record.error or "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
