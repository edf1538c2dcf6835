"""The draft pass's weight products at Llama-3.1-8B's shapes, as the drafts run them: the kernel table of GB/s and
% of the read bandwidth measured in the same process, per matrix, precision, code layout and rows.

    python benchmarks/bench_draft_products.py [--rows 1,2,4,8,16] [--bits 4,8] [--layouts transposed,bytes]
    python benchmarks/bench_draft_products.py --smoke --out /tmp/dp   # tiny shapes on a CPU: checks this script
    python benchmarks/bench_draft_products.py --rows 1,8 --bits 4 --layouts transposed --tokamax   # beside tokamax

Each weight is quantized from random bf16 values as the drafts quantize the model's (models.quantized: int4 in groups
of 128 with offsets, int8 per channel), held in a layout of vegas_jax.decode.draft_kernel.CODE_LAYOUTS ("transposed": the
Mosaic GPU kernel, pallas_kernels/weight_only_mgpu.py; "bytes": the Triton-lowered kernels,
pallas_kernels/weight_only_matmul.py) and multiplied through models.quantized.quantized_matmul with the kernel
draft_kernel.with_kernel attaches, so a time counts everything a draft's product launches (x's padding, the
split-K sums). Beside them, the bf16 weight through XLA (cuBLAS). A product is timed chained over --layers distinct
weights (together beyond the L2 cache) by its kernels' durations (bench_weight_only.time_chain_ms), after its
output is checked against the float32 product of the dequantized weight (relative error above 2 % is an error,
not timed). GB/s counts every byte of the quantized weight (codes, scales, offsets).

`--tokamax` adds the library candidate issue 47 names: tokamax's Mosaic GPU quantized ragged_dot (Hopper: a
persistent kernel, a warpgroup issuing TMA loads for two that dequantize and multiply) over a qwix weight of the
same bits (symmetric: int4 with a scale per 128 input positions, int8 one per output channel), one group of
all the rows, at each tiling of TOKAMAX_TILINGS, timed and checked the same way. tokamax and qwix are imported
only then (they are not dependencies of this package).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_weight_only import time_chain_ms  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from benchmarks.suite_scale import measure_bandwidth  # noqa: E402
from models.quantized import QuantizedWeight, dequantize, group_size_for, nbytes, quantize, quantized_matmul  # noqa: E402
from vegas_jax.decode.draft_kernel import CODE_LAYOUTS, with_kernel  # noqa: E402
from vegas_jax.sharding import Placement  # noqa: E402

# (K, N) of Llama-3.1-8B's products as a draft makes them: fused q/k/v, o, fused gate/up, down, the LM head.
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
SMOKE_SHAPES = {"small": (256, 256)}
MAX_RELATIVE_ERROR = 0.02  # the kernels round x and each dequantized weight to bf16
# tokamax's (block_n, pipeline stages): its kernel's x block is 8 or 16 rows (the fewest that hold the rows), its
# K block one int4 scale group (128), and each of its two compute warpgroups owns block_n output features, which
# must fill one 128-byte swizzle of its output: 64 in bf16 (its output here, in x's dtype).
TOKAMAX_TILINGS = ((64, 2), (64, 3), (64, 4))
TOKAMAX_GROUP = 128


def _list(text: str, cast=str) -> list:
    return [cast(v) for v in text.split(",") if v]


def _weights(k: int, n: int, bits: int, layers: int, layout: str) -> list[QuantizedWeight]:
    keys = jax.random.split(jax.random.key(k * 7 + n + bits), layers)
    out = []
    for key in keys:
        w = jax.random.normal(key, (k, n), jnp.bfloat16) * 0.02
        q = quantize(w, f"int{bits}", 1, group_size_for(k) if bits == 4 else None)
        (q,) = jax.tree.leaves(CODE_LAYOUTS[layout]([q]), is_leaf=lambda a: isinstance(a, QuantizedWeight))
        out.append(q)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--bits", default="4,8")
    p.add_argument("--matrices", default=",".join(SHAPES))
    p.add_argument("--layouts", default="transposed,bytes", help=f"of {', '.join(CODE_LAYOUTS)}")
    p.add_argument("--layers", type=int, default=6, help="distinct weights a timed chain multiplies")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode: checks this script")
    p.add_argument("--tokamax", action="store_true",
                   help="also tokamax's Mosaic GPU quantized product over qwix weights (a GPU, tokamax and qwix)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    if args.tokamax:
        try:
            import qwix  # noqa: F401
            import tokamax  # noqa: F401
        except ImportError as e:
            print(f"error: --tokamax needs tokamax and qwix importable ({e})", file=sys.stderr)
            return 2
        if args.smoke or jax.default_backend() != "gpu":
            print("error: --tokamax runs on a GPU only (its kernel has no interpret mode here)", file=sys.stderr)
            return 2
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    try:
        rows, bits_list, layouts = _list(args.rows, int), _list(args.bits, int), _list(args.layouts)
        matrices = _list(args.matrices) if not args.smoke else list(SMOKE_SHAPES)
        for flag, values, known in (("--bits", bits_list, (4, 8)), ("--layouts", layouts, CODE_LAYOUTS),
                                    ("--matrices", matrices, shapes)):
            if not values or any(v not in known for v in values):
                raise ValueError(f"{flag}: each of {', '.join(map(str, known))}")
        if not rows or min(rows) < 1:
            raise ValueError("--rows: positive integers")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    placement = Placement(backend="interpret" if args.smoke or jax.default_backend() != "gpu" else "pallas")
    bandwidth = measure_bandwidth(2**24 if args.smoke else 2 * 1024**3)
    log = RecordLog(run_metadata(bandwidth=bandwidth, backend=placement.backend), "draft-products.json",
                    args.out if args.smoke else (args.out or Path(__file__).parent / "results"))
    read_gbps = bandwidth["read_bandwidth_gbps"]
    for name in matrices:
        k, n = shapes[name]
        dense = [jax.random.normal(key, (k, n), jnp.bfloat16) for key in jax.random.split(jax.random.key(n), 2)]
        for m in rows:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            ms = time_chain_ms(lambda x, w: x @ w, x, dense * max(1, args.layers // 2), args.repeats)
            log.add({"matrix": name, "K": k, "N": n, "rows": m, "weights": "bf16", "layout": "xla", "ms": ms,
                     "weight_bytes": 2 * k * n, "gb_per_s": 2 * k * n / ms / 1e6,
                     "of_read_bandwidth": 2 * k * n / ms / 1e6 / read_gbps})
            _print(log.records[-1])
            for bits in bits_list:
                for layout in layouts:
                    log.add(_measure(name, k, n, bits, m, layout, x, placement, args, read_gbps))
                    _print(log.records[-1])
                for block_n, stages in TOKAMAX_TILINGS if args.tokamax else ():
                    log.add(_measure_tokamax(name, k, n, bits, m, x, block_n, stages, args, read_gbps))
                    _print(log.records[-1])
    log.finish()
    return 0


def _measure(name, k, n, bits, m, layout, x, placement, args, read_gbps) -> dict:
    """One product through our kernels."""
    record = {"matrix": name, "K": k, "N": n, "rows": m, "weights": f"int{bits}", "layout": layout}
    try:
        weights = _weights(k, n, bits, args.layers, layout)
        record["weight_bytes"] = sum(nbytes(a) for a in jax.tree.leaves(weights[0]))
        record["kernel_layout"] = bool(weights[0].transposed) if layout == "transposed" else layout == "bytes"
        weights = jax.tree.leaves(with_kernel(weights, placement), is_leaf=lambda a: isinstance(a, QuantizedWeight))

        def product(x, w):
            return quantized_matmul(x, w, jnp.float32)

        want = x.astype(jnp.float32) @ dequantize(weights[0], jnp.float32).reshape(k, n)
        _check_and_time(record, product, x, weights, want, args, read_gbps)
    except Exception as e:  # noqa: BLE001 - a failing configuration is a record, the others still run
        record["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
    return record


def _check_and_time(record: dict, product, x, weights: list, want, args, read_gbps: float) -> None:
    """Adds to `record` the product's relative error against `want` (raising above MAX_RELATIVE_ERROR: a wrong
    kernel is not timed) and its time over the chain of `weights`, as GB/s and a share of the read bandwidth."""
    got = jax.jit(product)(x, weights[0])
    record["relative_error"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    if not np.isfinite(record["relative_error"]) or record["relative_error"] > MAX_RELATIVE_ERROR:
        raise ValueError(f"relative error {record['relative_error']:.3g} above {MAX_RELATIVE_ERROR}")
    record["ms"] = time_chain_ms(product, x, weights, args.repeats)
    record["gb_per_s"] = record["weight_bytes"] / record["ms"] / 1e6
    record["of_read_bandwidth"] = record["gb_per_s"] / read_gbps


def _measure_tokamax(name, k, n, bits, m, x, block_n, stages, args, read_gbps) -> dict:
    import qwix
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu, pallas_mosaic_gpu_common

    record = {"matrix": name, "K": k, "N": n, "rows": m, "weights": f"int{bits}", "layout": "tokamax",
              "block_n": block_n, "stages": stages}
    try:
        keys = jax.random.split(jax.random.key(k * 7 + n + bits), args.layers)
        tile_k = TOKAMAX_GROUP if bits == 4 else k
        weights = [qwix.quantize(jax.random.normal(key, (1, k, n), jnp.bfloat16) * 0.02, jnp.int4 if bits == 4 else
                                 jnp.int8, tiled_axes={0: 1, 1: tile_k, 2: 1}) for key in keys]
        record["weight_bytes"] = sum(nbytes(a) for a in (weights[0].qvalue, weights[0].scale))
        config = pallas_mosaic_gpu_common.Config(
            block_m=8 if m <= 8 else 16, block_n=block_n, block_k=min(TOKAMAX_GROUP, k), num_stages=stages,
            split_k=1, persistent=True, grid_minor_dim=pallas_mosaic_gpu_common.MatmulDimension.M)
        op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=config)
        group_sizes = jnp.array([m], jnp.int32)

        def product(x, w):
            return op(x, w, group_sizes=group_sizes)

        want = x.astype(jnp.float32) @ qwix.dequantize(weights[0]).astype(jnp.float32)[0]
        _check_and_time(record, product, x, weights, want, args, read_gbps)
    except Exception as e:  # noqa: BLE001 - a failing configuration is a record, the others still run
        record["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
    return record


def _print(r: dict) -> None:
    tiling = f" {r['block_n']}x{r['stages']}" if "block_n" in r else ""
    head = f"{r['matrix']:8s} {r['weights']:5s} {r['layout'] + tiling:14s} rows {r['rows']:2d}"
    if "error" in r:
        print(f"{head}: ERROR {r['error']}", flush=True)
    else:
        print(f"{head}: {r['ms'] * 1e3:8.1f} us {r['gb_per_s']:7.0f} GB/s {100 * r['of_read_bandwidth']:5.1f} %",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
