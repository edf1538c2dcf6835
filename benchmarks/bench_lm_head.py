"""The LM head at decode shapes, written three ways, to pick how models/decoder.py contracts it.

    python benchmarks/bench_lm_head.py [--shape llama8b|smollm2] [--rows 1,7,8,56,64]
    python benchmarks/bench_lm_head.py --smoke      # the smoke shape, rows 1 and 8: checks the script on a CPU

The 8B batch-1 profile (benchmarks/results/profile-2026-12-01-8b-b1-32k.json) shows XLA turning the one-row
bf16 head with float32 output into a convert of the whole 1 GB weight to float32 (0.76 ms) and a float32 GEMV
(0.50 ms) every step, where reading the bf16 weight once should take about 0.25 ms. Jitted alone, as here, the
one-row head does not show it (H200, 2026-12-01: 0.45 ms for every variant and row count,
lm-head-llama8b-2026-12-01.json); inside the decode loop it did, and the padding removed it (the 8B plain step
7.01 -> 6.12 ms). This script keeps the standalone variants' times and errors on record. The variants:
- `f32-out`: einsum with preferred_element_type=float32 (what the decoder did before);
- `bf16-out`: einsum in bf16, then float32 (a bf16 GEMM accumulates in float32 and rounds the result once: logits
  lose their last 8 mantissa bits, which the printed error against float64 measures);
- `decoder`: what models/decoder.py does now (vocabulary_logits: a single row padded to 16, XLA's GEMM path
  instead of its GEMV rewrite), f32-out, sliced; rows as a batch of one-row sequences.
Each row of the table: median wall ms over 20 calls, the weight's read rate, and the largest logit error against
float64. Prints the table; writes JSON to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import check_writable, run_metadata, save_results  # noqa: E402
from benchmarks.suite_scale import measure_bandwidth, median_seconds  # noqa: E402
from models.decoder import vocabulary_logits  # noqa: E402

SHAPES = {"llama8b": (4096, 128256), "smollm2": (576, 49152), "smoke": (64, 512)}


def f32_out(x, w):
    return jnp.einsum("RD,DV->RV", x, w, preferred_element_type=jnp.float32)


def bf16_out(x, w):
    return jnp.einsum("RD,DV->RV", x, w).astype(jnp.float32)


def decoder(x, w):
    return vocabulary_logits("BSD,DV->BSV", x[:, None, :], w)[:, 0]


VARIANTS = {"f32-out": f32_out, "bf16-out": bf16_out, "decoder": decoder}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    p.add_argument("--rows", default="1,7,8,56,64", help="comma-separated rows (batch x rows per sequence)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="--shape smoke --rows 1,8, a small bandwidth probe (CPU)")
    args = p.parse_args(argv)
    check_writable("--out", args.out)
    if args.smoke:
        args.shape, args.rows = "smoke", "1,8"
    dim, vocab = SHAPES[args.shape]
    rows_list = [int(r) for r in args.rows.split(",")]
    key_w, key_x = jax.random.split(jax.random.key(0))
    w = (jax.random.normal(key_w, (dim, vocab), jnp.float32) * dim**-0.5).astype(jnp.bfloat16)
    w64 = np.asarray(w, np.float64)
    bandwidth = measure_bandwidth(2**20) if args.smoke else measure_bandwidth()
    records = []
    for rows in rows_list:
        x = jax.random.normal(jax.random.fold_in(key_x, rows), (rows, dim), jnp.float32).astype(jnp.bfloat16)
        exact = np.asarray(x, np.float64) @ w64
        for name, fn in VARIANTS.items():
            jitted = jax.jit(fn)
            seconds = median_seconds(lambda x: jitted(x, w), x, reps=20)
            error = float(np.max(np.abs(np.asarray(jitted(x, w), np.float64) - exact)))
            records.append({"variant": name, "rows": rows, "dim": dim, "vocab": vocab, "ms": seconds * 1e3,
                            "weight_gb_per_s": w.nbytes / seconds / 1e9, "max_abs_error": error})
            print(f"{name:9s} rows {rows:3d}: {seconds * 1e3:7.3f} ms  {w.nbytes / seconds / 1e9:7.0f} GB/s  "
                  f"max |error| {error:.2e}", flush=True)
    print(f"copy {bandwidth['copy_bandwidth_gbps']:.0f} GB/s, read {bandwidth['read_bandwidth_gbps']:.0f} GB/s")
    meta = run_metadata()
    save_results({**meta, "shape": args.shape, "bandwidth": bandwidth, "records": records},
                 f"lm-head-{args.shape}-{meta['date'][:10]}.json", Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
