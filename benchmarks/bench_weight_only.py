"""Weight-only quantized GEMMs at decode shapes: bf16 weights, XLA's int8 / int4 path (convert then dot, scale
after), and the Pallas kernel (pallas_kernels/weight_only_matmul.py) over its block sizes.

    python benchmarks/bench_weight_only.py [--rows 1,8,16,64] [--shapes llama8b] [--integer-dot] [--smoke]

Each measurement chains one matmul per layer through `layers` distinct weights inside one jitted program (the
weights together exceed the L2 cache, and the per-call dispatch cost is spread over the chain, as in a decode
step), and reports the GPU time per matmul (kernel durations from the profiler) and the weight bytes read per
second against a device copy measured in the same run. --integer-dot adds, at up to 16 rows, the kernel's integer
path (x quantized to int8; one row PTX dp4a, more an int8 tensor-core dot), an approximation of the product that a
draft could use, on the codes as stored (backend "pallas-integer") and, at one row, packed four rows a word
(pack_code_words, "pallas-integer-words"). --nibble-unpack ops,prmt times the int4 dot kernels (2+ rows) with
each way of unpacking code bytes (config suffix "/prmt"); --split-factors 1,2,4 each kernel at its default K
splits and at multiples of them (suffix "/splitsN": more programs in flight to hide the loads' latency, where
the default aims at four per SM). Every quantized variant's product is checked against
the float32 product of the dequantised weight first (relative_error; above MAX_RELATIVE_ERROR it is an error,
not timed).
Prints a table; writes JSON to $OUT (or --out).

Under Nsight Compute, `--ncu` runs each configuration once at one layer without JAX's profiler (both would use
CUPTI), and JAX must not preallocate the GPU's memory (ncu saves and restores all of it around each replay):

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:weight_only \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy \
        python benchmarks/bench_weight_only.py --ncu --rows 1 --matrices gate_up --bits 4 --blocks 32x256
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.profile_decode import gpu_kernel_events  # noqa: E402
from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from benchmarks.suite_scale import gpu_seconds, measure_bandwidth, median_seconds  # noqa: E402
from pallas_kernels.weight_only_matmul import (  # noqa: E402
    INT8_DOT_MIN_K, UNPACKS, code_blocks, default_splits, pack_code_words, weight_only_matmul, weight_only_matmul_reference,
)

# (K, N) of Llama-3.1-8B's linear layers, as the engine lays them out: fused q/k/v, o, fused gate/up, down.
SHAPES = {
    "llama8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
    "smoke": {"small": (256, 256)},
}


def time_chain_ms(fn, x, weights: list, repeats: int, untraced: bool = False) -> float:
    """GPU ms per matmul of fn(x, weight) chained over every weight of the list (unrolled: a scan over stacked
    weights would slice, and copy, each one before the dot): the kernels' own durations from the profiler,
    every kernel of the chain counted (padding, split sums), the median over repeats. Off the GPU, or
    `untraced`, wall time."""

    @jax.jit
    def chain(x, weights):
        for w in weights:
            y = fn(x, w)
            # Each matmul depends on the previous one (no overlap between layers); x * 0 is not folded for floats.
            x = x + (y[0, 0] * 0).astype(x.dtype)
        return x

    jax.block_until_ready(chain(x, weights))
    samples = []
    for _ in range(repeats):
        if jax.default_backend() == "gpu" and not untraced:
            with tempfile.TemporaryDirectory() as log_dir:
                with jax.profiler.trace(log_dir):
                    jax.block_until_ready(chain(x, weights))
                samples.append(sum(e["dur"] for e in gpu_kernel_events(Path(log_dir))) / 1e3)
        else:
            start = time.perf_counter()
            jax.block_until_ready(chain(x, weights))
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples) / len(weights)


def quantized(key, k, n, bits, group):
    """Random q, scale and offset of one layer (int4: symmetric, stored as 0..15 with offset -8 * scale)."""
    rows = k if bits == 8 else k // 2
    if bits == 8:
        q = jax.random.randint(key, (rows, n), -127, 128, jnp.int32).astype(jnp.int8)
    else:
        q = jax.random.randint(key, (rows, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jnp.full((k // group, n), 0.01, jnp.float32)
    offset = None if bits == 8 else -8 * scale
    return q, scale, offset


# x quantized to int8 (the integer path) is about 1 % off the product; bf16 outputs round at 0.4 %.
MAX_RELATIVE_ERROR = 0.05


def relative_error(fn, x, weight, want) -> float:
    """max |fn(x, weight) - want| / max |want| for one layer's weight; want: the float32 product of the
    dequantised weight (whatever form the codes take in `weight`)."""
    got = jax.jit(fn)(x, weight).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def xla_path(bits, group):
    """What XLA gets when left alone: dequantise (convert, scale) and a bf16 dot."""
    def fn(x, w):
        q, scale, offset = w
        return weight_only_matmul_reference(x, q, scale, offset, bits=bits, group=group)
    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--shapes", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--blocks", default="64x128,128x128,32x256,64x64",
                   help="Pallas block_k x block_n candidates")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="3")
    p.add_argument("--matrices", default=None, help="comma-separated subset of the shapes' matrices")
    p.add_argument("--bits", default="8,4")
    p.add_argument("--group", type=int, default=128, help="int4 scale group along K (int8: per output channel)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--integer-dot", action="store_true",
                   help="int8 at one row: also x quantized per --x-group and multiplied in integers (dp4a)")
    p.add_argument("--x-group", type=int, default=128, help="--integer-dot: x's quantization group along K")
    p.add_argument("--split-factors", default="1",
                   help="K splits as multiples of the kernel's default (comma-separated, e.g. 1,2,4): more programs "
                        "in flight, more partial sums to add")
    p.add_argument("--nibble-unpack", default="ops",
                   help="int4 at 2+ rows: how the dot kernels unpack code bytes (comma-separated: ops, prmt)")
    p.add_argument("--prefetch", default="auto",
                   help="one row: auto (the kernel's default), 0, 1, comma-separated; 1: each program loads its next "
                        "K block's codes before it multiplies the current one")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--ncu", action="store_true", help="each configuration once, one layer, no profiler trace")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    unpacks = args.nibble_unpack.split(",")
    if not set(unpacks) <= set(UNPACKS):
        print(f"error: --nibble-unpack {args.nibble_unpack}: each one of {', '.join(UNPACKS)}", file=sys.stderr)
        return 2
    if not all(f.isdigit() and int(f) >= 1 for f in args.split_factors.split(",")):
        print(f"error: --split-factors {args.split_factors}: whole numbers >= 1, comma-separated", file=sys.stderr)
        return 2
    prefetch_choices = {"auto": None, "0": False, "1": True}
    if not set(args.prefetch.split(",")) <= set(prefetch_choices):
        print(f"error: --prefetch {args.prefetch}: auto, 0 or 1, comma-separated", file=sys.stderr)
        return 2
    if args.smoke:  # one row count and one block per precision: interpret mode compiles each for seconds
        args.rows, args.blocks, args.layers, args.repeats = ("1,4" if args.integer_dot else "8"), "64x64", 2, 1
    if args.ncu:
        args.layers, args.repeats = 1, 1
    interpret = args.smoke
    shapes = SHAPES["smoke" if args.smoke else args.shapes]
    if args.matrices:
        shapes = {name: shapes[name] for name in args.matrices.split(",")}
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    # Timed as the matmuls are: kernel time from the profiler (wall time put the copy at 1.6 of its 3.4 TB/s on the
    # H200, 2026-12-02, and every kernel above 100 % of it); wall time where the matmuls are untraced (--ncu).
    timer = median_seconds if args.ncu else gpu_seconds
    bandwidth = measure_bandwidth(2**20 if args.smoke else 2**30, timer=timer)["copy_bandwidth_gbps"]
    print(f"device copy {bandwidth:.0f} GB/s (read + write)", flush=True)
    records = []
    key = jax.random.key(0)
    for name, (k, n) in shapes.items():
        keys = jax.random.split(key, args.layers)
        bf16 = [jax.random.normal(kk, (k, n), jnp.bfloat16) for kk in keys]
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            want = {}  # bits -> the reference product of this x and the first layer's weight
            variants = [("bf16", "xla", 16, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                         .astype(x.dtype), bf16, None)]
            for bits in (int(b) for b in args.bits.split(",")):
                group = k if bits == 8 else args.group
                w = [quantized(kk, k, n, bits, group) for kk in keys]
                # The integer path takes up to 16 rows (words: one), in x groups of whole weight groups (int4).
                integer_dot = args.integer_dot and m <= 16 and (bits == 8 or args.x_group % group == 0)
                words = ([(pack_code_words(q), scale, offset) for q, scale, offset in w] if integer_dot and m == 1
                         else None)
                variants.append((f"int{bits}", "xla", bits, xla_path(bits, group), w, None))
                # Every variant of these codes is checked against one product of the first layer's weight.
                want[bits] = xla_path(bits, group)(x.astype(jnp.float32), w[0])
                # Unpacking matters to the int4 dot kernels only (2+ rows); elsewhere "ops" alone.
                variant_unpacks = unpacks if bits == 4 and m > 1 else ["ops"]
                # one-row kernels' own
                prefetches = [prefetch_choices[f] for f in args.prefetch.split(",")] if m == 1 else [None]
                for (bk, bn), warps, stages, unpack, factor, prefetch in (
                        (b, int(wp), int(st), u, int(f), pf) for b in blocks for wp in args.warps.split(",")
                        for st in args.stages.split(",") for u in variant_unpacks
                        for f in args.split_factors.split(",") for pf in prefetches):
                    splits = _splits(bits, k, n, group, bk, bn, factor)  # None: the kernel's own
                    if factor != 1 and splits is None:
                        continue  # the K blocks do not split that many ways: nothing to time
                    fn = functools.partial(_pallas, bits=bits, group=group, block_k=bk, block_n=bn,
                                           num_warps=warps, num_stages=stages, interpret=interpret,
                                           nibble_unpack=unpack, num_splits=splits, prefetch=prefetch)
                    config = f"{bk}x{bn}/w{warps}s{stages}" + PREFETCH_LABELS[prefetch]
                    split_suffix = "" if splits is None else f"/splits{splits}"
                    unpack_suffix = "" if unpack == "ops" else f"/{unpack}"
                    variants.append((f"int{bits}", "pallas", bits, fn, w, config + unpack_suffix + split_suffix))
                    # The integer path (x_group a multiple of block_k: the same K blocks, so the same splits), once
                    # for all unpackings, which it does not use.
                    # Several rows: blocks of at least the int8 dot's K.
                    if integer_dot and args.x_group % bk == 0 and unpack == variant_unpacks[0] and (
                            m == 1 or code_blocks(bits, k, group, bk, args.x_group)[0] >= INT8_DOT_MIN_K):
                        integer = functools.partial(fn, integer_dot=True, x_group=args.x_group)
                        variants += [(f"int{bits}", backend, bits, integer, codes, config + split_suffix)
                                     for backend, codes in (("pallas-integer", w), ("pallas-integer-words", words))
                                     if codes is not None]
            for weights_kind, backend, bits, fn, w, config in variants:
                record = {"matrix": name, "k": k, "n": n, "rows": m, "weights": weights_kind, "backend": backend,
                          "config": config, "weight_bytes": k * n * bits // 8}
                try:
                    if bits != 16:  # checked first: a kernel that computes the wrong product is not timed
                        record["relative_error"] = relative_error(fn, x, w[0], want[bits])
                        if record["relative_error"] > MAX_RELATIVE_ERROR:
                            raise ValueError(f"relative error {record['relative_error']:.3g} against the reference")
                    ms = time_chain_ms(fn, x, w, args.repeats, untraced=args.ncu)
                    record |= {"ms": ms, "weight_gb_per_s": record["weight_bytes"] / ms / 1e6,
                               "fraction_of_copy_read": record["weight_bytes"] / ms / 1e6 / (bandwidth / 2)}
                except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the run
                    record["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    traceback.print_exc(limit=1)
                records.append(record)
                print(_line(record), flush=True)
    doc = run_metadata(copy_gb_per_s=bandwidth, layers=args.layers, group=args.group, records=records)
    save_results(doc, f"weight-only-{datetime.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json",
                 args.out)
    print("\nbest per (matrix, rows, weights): weight GB/s (fraction of the copy's read rate)")
    best = {}
    for r in records:
        if "ms" in r:
            key_ = (r["matrix"], r["rows"], r["weights"])
            if key_ not in best or r["ms"] < best[key_]["ms"]:
                best[key_] = r
    for r in best.values():
        print(_line(r))
    return 0


PREFETCH_LABELS = {None: "", True: "/prefetch", False: "/no-prefetch"}  # None: the kernel's own choice


def _splits(bits: int, k: int, n: int, group: int, block_k: int, block_n: int, factor: int) -> int | None:
    """None (the kernel's default) for factor 1, else that default times `factor` (the float kernels' K blocks;
    the integer path's are the same where x_group is a multiple of block_k); None too where the K blocks do not
    split that many ways."""
    if factor == 1:
        return None
    _, k_blocks = code_blocks(bits, k, group, block_k)
    splits = default_splits(n // block_n, k_blocks) * factor
    return splits if k_blocks % splits == 0 else None


def _pallas(x, w, **kw):
    q, scale, offset = w
    return weight_only_matmul(x, q, scale, offset, **kw)


def _line(r) -> str:
    head = f"{r['matrix']:8} M={r['rows']:<3} {r['weights']:5} {r['backend']:6} {r['config'] or '':14}"
    if "ms" not in r:
        return f"{head} error: {r['error'][:120]}"
    return f"{head} {r['ms'] * 1e3:8.1f} us {r['weight_gb_per_s']:7.0f} GB/s ({r['fraction_of_copy_read']:.0%})"


if __name__ == "__main__":
    sys.exit(main())
