"""Dense draft-tree verification attention on the GPU (pallas_kernels.tree_attention) against the jnp path, one layer
of random bf16 caches at full length, binary trees of T rows (the root included) at the cache's end:

    python benchmarks/bench_tree_attention.py --quick   # 32K and 128K, trees of 16 and 64, batch 1 and 8 (< 3 min)
    python benchmarks/bench_tree_attention.py           # 8K to 128K, trees of 4 to 64, batch 1 to 64 (~400
                                                        # compilations: run it in pieces with the flags below)
    python benchmarks/bench_tree_attention.py --contexts 131072 --batches 1,64 --trees 64 --shapes smollm2
    python benchmarks/bench_tree_attention.py --smoke   # 512 tokens, kernels in interpret mode: checks the script

Shapes (--shapes): nsa-1b (32 query / 2 KV heads, D 64: the NSA kernels' records, bench_nsa_kernels) or smollm2
(9 / 3, D 64). Implementations per (context, batch, tree), all kernel "dense-tree":
- pallas: the tree kernel, outputs only;
- pallas-logit: with the logit scores of the Vegas rows (root and deepest nodes), what `--method vegas` verifies with;
- jnp: tree_attention_reference, dense masked attention over the capacity (what TreeAttention runs without kernels),
  where its float32 logits [B, H_q, T, context] fit in --jnp-limit-gb;
- linear-causal: the linear verification kernel over the same rows with a causal mask (wrong for a tree, so not
  checked): what the tree's rows cost in the chain's kernel.
Both Pallas variants are checked first against the twin on the first sequence (bf16 outputs to 0.05 absolute, scores
to 1e-3 relative); a kernel that fails to run or to match goes to `failures` with its error and the run goes on,
exiting 1 at the end. Per record: kernel, impl, tree_nodes, context, batch, time_ms (median), bytes (the K/V rows read
once: context rows per KV head and sequence), gb_per_s, copy_gb_per_s (benchmarks.suite_scale.measure_bandwidth),
max_abs_error. Results: benchmarks/results/tree-attention-<date>.json (and $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from benchmarks.suite_scale import measure_bandwidth, median_seconds  # noqa: E402
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference  # noqa: E402
from pallas_kernels.verify_attention import verify_attention  # noqa: E402
from vegas_jax.attention.tree import score_weights  # noqa: E402
from vegas_jax.decode.tree_shapes import TreeShape  # noqa: E402

SHAPES = {"nsa-1b": dict(heads=32, kv_heads=2, head_dim=64), "smollm2": dict(heads=9, kv_heads=3, head_dim=64)}
RESULTS = Path(__file__).parent / "results"


def binary_tree(rows: int) -> TreeShape:
    """A complete binary tree of `rows` nodes, root included, in breadth-first order (bench_nsa_kernels' trees)."""
    return TreeShape(tuple([-1] + [(i - 1) // 2 for i in range(1, rows)]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode (CPU)")
    parser.add_argument("--shapes", choices=SHAPES, default="nsa-1b")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated, e.g. 32768,131072")
    parser.add_argument("--batches", type=_ints, default=None)
    parser.add_argument("--trees", type=_ints, default=None, help="tree rows, root included (2 to 65)")
    parser.add_argument("--jnp-limit-gb", type=float, default=16.0,
                        help="time the jnp path only where its float32 logits take at most this many GB")
    args = parser.parse_args(argv)
    contexts = [32768, 131072] if args.quick else [8192, 32768, 65536, 131072]
    batches = [1, 8] if args.quick else [1, 4, 8, 16, 64]
    trees = [16, 64] if args.quick else [4, 8, 16, 32, 64]
    if args.smoke:
        contexts, batches, trees = [512], [1], [8]
    contexts, batches, trees = args.contexts or contexts, args.batches or batches, args.trees or trees
    if not all(2 <= t <= 65 for t in trees):
        parser.error(f"--trees must be tree sizes from 2 to 65 rows, got {trees}")
    shape = SHAPES[args.shapes]
    heads, kv_heads, dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    interpret = args.smoke
    bandwidth = measure_bandwidth(2**20) if args.smoke else measure_bandwidth()
    records, failures = [], []

    def timed(record: dict, fn, check=None):
        """record + time_ms and GB/s; check() (the comparison with the twin) first, its max_abs_error recorded. A
        kernel that fails to run or to match is recorded with its error and the run goes on (exit 1 at the end)."""
        try:
            if check is not None:
                record["max_abs_error"] = check()
            seconds = median_seconds(lambda _: fn(), None)
        except Exception as e:  # noqa: BLE001: one kernel's failure must not cost the rest of the run
            failures.append(record | {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            print("FAILED", failures[-1], flush=True)
            return
        record |= dict(time_ms=seconds * 1e3, gb_per_s=record["bytes"] / seconds / 1e9,
                       copy_gb_per_s=bandwidth["copy_bandwidth_gbps"])
        records.append(record)
        print(record, flush=True)

    key = jax.random.PRNGKey(0)
    for context in contexts:
        for batch in batches:
            kk, kv, kq = jax.random.split(jax.random.fold_in(key, context * 1000 + batch), 3)
            k_cache = jax.random.normal(kk, (batch, context, kv_heads, dim), jnp.bfloat16)
            v_cache = jax.random.normal(kv, (batch, context, kv_heads, dim), jnp.bfloat16)
            for rows in trees:
                tree = binary_tree(rows)
                ancestors = jnp.asarray(tree.ancestors)
                weights = jnp.asarray(score_weights("boundary", rows, tree.levels[-1]))
                base = jnp.full((batch,), context - rows, jnp.int32)  # the tree's rows end the cache
                q = jax.random.normal(jax.random.fold_in(kq, rows), (batch, rows, heads, dim), jnp.bfloat16)
                common = dict(kernel="dense-tree", tree_nodes=rows, context=context, batch=batch,
                              bytes=batch * 2 * context * kv_heads * dim * 2)
                first = (q[:1], k_cache[:1], v_cache[:1], base[:1], ancestors)
                want_out, want_scores = tree_attention_reference(*first, score_weights=weights)

                for impl, scored in (("pallas", False), ("pallas-logit", True)):
                    run = jax.jit(lambda q, k, v, b, w: tree_attention(q, k, v, b, ancestors, score_weights=w,
                                                                       interpret=interpret))
                    w = weights if scored else None

                    def check(run=run, w=w):
                        out, scores = run(q, k_cache, v_cache, base, w)
                        error = float(jnp.max(jnp.abs(out[:1].astype(jnp.float32) - want_out.astype(jnp.float32))))
                        if not error <= 0.05:
                            raise AssertionError(f"max abs error {error} against tree_attention_reference")
                        if w is not None:
                            finite = jnp.isfinite(want_scores)
                            gap = jnp.max(jnp.abs(jnp.where(finite, scores[:1] - want_scores, 0.0)))
                            relative = float(gap / jnp.max(jnp.abs(jnp.where(finite, want_scores, 0.0))))
                            if not relative <= 1e-3:
                                raise AssertionError(f"scores relative error {relative} against the twin")
                        return error

                    timed(common | dict(impl=impl), lambda run=run, w=w: run(q, k_cache, v_cache, base, w), check)
                if batch * heads * rows * context * 4 <= args.jnp_limit_gb * 1e9:
                    reference = jax.jit(lambda q, k, v, b: tree_attention_reference(q, k, v, b, ancestors)[0])
                    timed(common | dict(impl="jnp"), lambda: reference(q, k_cache, v_cache, base))
                causal = jax.jit(lambda q, k, v, b: verify_attention(q, k, v, b, interpret=interpret)[0])
                timed(common | dict(impl="linear-causal"), lambda: causal(q, k_cache, v_cache, base))
    doc = run_metadata(shapes=dict(name=args.shapes, **shape), bandwidth=bandwidth, records=records,
                       failures=failures)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(doc, f"tree-attention-{args.shapes}-{stamp}.json", None if args.smoke else RESULTS)
    return 1 if failures else 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    raise SystemExit(main())
