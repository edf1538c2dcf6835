"""Weight-only quantized GEMMs at a draft step's shapes: bf16 against int8 / int4 weights through XLA, each of
models.quantized's formulations (what a draft pass runs without kernels), under the engine's XLA options (cuBLAS
for GEMMs) and with Triton GEMMs. The Pallas kernel that draft passes use on the GPU is benchmarked over its block
sizes by benchmarks/bench_weight_only.py.

    python benchmarks/bench_quantized_gemm.py                 # the engine's XLA options and Triton GEMMs
    python benchmarks/bench_quantized_gemm.py --variants xla-default --shapes o,down --rows 1,8
    python benchmarks/bench_quantized_gemm.py --kinds bf16,s4 --variants engine,xla-default,triton-any --rows 1,8
    python benchmarks/bench_quantized_gemm.py --smoke         # tiny shapes: checks this script on a CPU

A run stops starting measurements after --budget-s seconds (default 480, so that one command stays under the
device tool's 10 minutes) and saves after every record, so a cut run keeps what it measured.

Shapes: Llama-3.1-8B's layer GEMMs, x [rows, K] times W [K, N] for (K, N) = (4096, 6144) fused q/k/v,
(4096, 4096) o, (4096, 2 x 14336) fused gate/up, (14336, 4096) down, at rows 1, 8, 16 and 64 (the batch of a
draft step). Each call runs COPIES products with different copies of the weight (together far larger than the
L2 cache, so every product reads its weight from HBM; one product is shorter than the dispatch floor). Reported
per product: ms, the bytes of weight it must read (values, scales, offsets), GB/s, its fraction of the device's
read bandwidth measured in the same run (a large sum), and the speedup over bf16 weights at the same shape and
XLA options. Results: benchmarks/results/quantized-gemm-<date>[-tag].json or --out (--smoke: --out only), and $OUT;
prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from models.quantized import FORMULATIONS, integer_codes, quantize_int4, quantize_int8, quantized_matmul  # noqa: E402
from models.quantized import nbytes  # noqa: E402
from vegas_jax.runtime.compilation import GPU_COMPILER_OPTIONS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 8, 16, 64)
# XLA options per variant: the engine's (its decode loop compiles with these), XLA's defaults, and Triton GEMMs for
# every GEMM (which may fuse the integer convert into the GEMM's operand loads).
VARIANTS = {"engine": GPU_COMPILER_OPTIONS, "xla-default": {}, "triton-any": {"xla_gpu_triton_gemm_any": True}}
# (label, weight kind, int4 group or None, formulation: one of models.quantized's)
WEIGHTS = [
    ("bf16", "bf16", None, None),
    ("int8 per channel", "int8", None, None),
    ("int4 g128 grouped", "int4", 128, "grouped"),
    ("int4 g128 dequantized", "int4", 128, "dequantized"),
    ("int4 g32 grouped (GGUF Q4_1)", "int4", 32, "grouped"),
    # XLA's own int4 type (stored two a byte on the GPU), dequantized in one expression that a Triton GEMM may take
    # into its operand loads (variants xla-default, triton-any): the path a Pallas kernel would have to beat
    ("int4 g128 native s4", "s4", 128, None),
]
KINDS = tuple(dict.fromkeys(kind for _, kind, *_ in WEIGHTS))


@dataclasses.dataclass(frozen=True)
class Settings:
    shapes: dict
    rows: tuple
    copies_bytes: int  # total bytes of the weight copies one call reads
    read_elements: int
    repeats: int
    variants: tuple
    dtype: str  # of activations and unquantized weights


FULL = Settings(SHAPES, ROWS, 2**30, 2**30, 5, ("engine", "triton-any"), "bfloat16")
# float32 on the CPU, whose XLA has no bf16 x bf16 -> f32 batched dot
SMOKE = Settings({"o": (256, 256), "down": (512, 256)}, (8,), 2**22, 2**20, 2, ("xla-default",), "float32")


def compiled(fn, options: dict, *args):
    """fn jitted and compiled with these XLA options (none on a CPU, which knows no GPU options)."""
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(compiler_options=options if jax.default_backend() == "gpu" and options else None)


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def read_bandwidth(settings: Settings) -> float:
    """GB/s of a sum over a large array: bytes read alone."""
    x = jnp.ones((settings.read_elements,), settings.dtype)
    ms = median_ms(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x, repeats=settings.repeats)
    return x.nbytes / ms / 1e6


def make_weights(kind: str, group: int | None, k: int, n: int, copies: int, key, dtype):
    """`copies` stacked weights [copies, K, N] of a kind (quantized from random values, one at a time)."""
    out = []
    for i in range(copies):
        w = jax.random.normal(jax.random.fold_in(key, i), (k, n), dtype) * 0.02
        if kind == "bf16":
            out.append(w)
        elif kind == "int8":
            out.append(jax.jit(quantize_int8)(w))
        elif kind == "s4":
            out.append(jax.jit(native_int4)(jax.jit(quantize_int4, static_argnums=1)(w, group)))
        else:
            out.append(jax.jit(quantize_int4, static_argnums=1)(w, group))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out)


def native_int4(w):
    """An int4 weight's codes 0..15 as XLA's signed int4 (code - 8), the offset moved to match: the same weight."""
    codes = (integer_codes(w) - 8).astype(jnp.int4)
    return {"values": codes, "scale": w.scale, "offset": w.offset + 8 * w.scale}


def native_int4_product(x, w):
    k, n = w["values"].shape
    groups = w["scale"].shape[0]
    grouped = w["values"].astype(x.dtype).reshape(groups, k // groups, n)
    full = grouped * w["scale"][:, None].astype(x.dtype) + w["offset"][:, None].astype(x.dtype)
    return jnp.dot(x, full.reshape(k, n), preferred_element_type=jnp.float32)


def weight_bytes(weights, copies: int) -> int:
    return sum(nbytes(x) for x in jax.tree.leaves(weights)) // copies


def product(kind: str, formulation: str | None, copies: int):
    """x [rows, K] times each of the copies, summed: one call, `copies` products."""

    def one(x, w):
        if kind == "bf16":
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
        if kind == "s4":
            return native_int4_product(x, w)
        return quantized_matmul(x, w, jnp.float32, formulation)

    def run(x, weights):
        total = 0.0
        for i in range(copies):
            total = total + one(x, jax.tree.map(lambda a: a[i], weights))
        return total

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one variant: checks the script on a CPU")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--rows", default=None, help="comma-separated rows (default 1,8,16,64)")
    p.add_argument("--kinds", default=None,
                   help=f"comma-separated weight kinds, of {', '.join(KINDS)} (default all)")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    settings = SMOKE if args.smoke else FULL
    if args.variants:
        settings = dataclasses.replace(settings, variants=tuple(args.variants.split(",")))
    if args.shapes:
        settings = dataclasses.replace(settings, shapes={n: SHAPES[n] for n in args.shapes.split(",")})
    if args.rows:
        settings = dataclasses.replace(settings, rows=tuple(int(r) for r in args.rows.split(",")))
    assert set(FORMULATIONS) >= {f for *_, f in WEIGHTS if f}
    kinds = args.kinds.split(",") if args.kinds else KINDS
    if unknown := set(kinds) - set(KINDS):
        p.error(f"--kinds {args.kinds}: unknown {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    stamp = datetime.date.today().isoformat() + (f"-{args.tag}" if args.tag else "")

    read_gb_s = read_bandwidth(settings)
    print(f"read bandwidth {read_gb_s:,.0f} GB/s", flush=True)
    key = jax.random.key(0)
    records = []

    def save():
        for r in records:
            base = next((b for b in records if b["weights"] == "bf16" and b["shape"] == r["shape"]
                         and b["rows"] == r["rows"] and b["variant"] == r["variant"] and "ms" in b), None)
            if base is not None and "ms" in r:
                r["speedup_vs_bf16"] = base["ms"] / r["ms"]
        doc = run_metadata(read_gb_per_s=read_gb_s, records=records,
                           complete=time.perf_counter() - started < args.budget_s)
        save_results(doc, f"quantized-gemm-{stamp}.json", args.out or (None if args.smoke else RESULTS))

    for name, (k, n) in settings.shapes.items():
        for label, kind, group, formulation in (w for w in WEIGHTS if w[1] in kinds):
            if time.perf_counter() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                break
            full_bytes = np.dtype(settings.dtype).itemsize * k * n
            copies = max(2, settings.copies_bytes // full_bytes)  # the same count for every kind of a shape
            weights = make_weights(kind, group, k, n, copies, key, settings.dtype)
            per_weight = weight_bytes(weights, copies)
            fn = product(kind, formulation, copies)
            for rows in settings.rows:
                x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), settings.dtype)
                for variant in settings.variants:
                    record = {"shape": name, "k": k, "n": n, "rows": rows, "weights": label, "variant": variant,
                              "weight_bytes": per_weight, "copies": copies}
                    try:
                        call = compiled(fn, VARIANTS[variant], x, weights)
                        ms = median_ms(call, x, weights, repeats=settings.repeats) / copies
                        record.update(ms=ms, gb_per_s=per_weight / ms / 1e6,
                                      fraction_of_read_bandwidth=per_weight / ms / 1e6 / read_gb_s)
                    except Exception as e:  # a formulation XLA cannot compile is recorded, the others still run
                        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    records.append(record)
                    print(record, flush=True)
                    save()
            del weights
    save()
    print(f"\n{'shape':8} {'rows':>4} {'weights':30} {'variant':12} {'ms':>8} {'GB/s':>8} {'of read':>8} {'vs bf16':>8}")
    for r in records:
        if "ms" in r:
            print(f"{r['shape']:8} {r['rows']:>4} {r['weights']:30} {r['variant']:12} {r['ms']:8.4f} "
                  f"{r['gb_per_s']:8.0f} {r['fraction_of_read_bandwidth']:8.1%} {r.get('speedup_vs_bf16', 0):8.2f}x")
        else:
            print(f"{r['shape']:8} {r['rows']:>4} {r['weights']:30} {r['variant']:12} {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
