"""NSA verification and decoding on the GPU at NSA-1B shapes (32 query / 2 KV heads, D 64, l = d = l' = 16,
16 blocks, window 128), random bf16 caches at full length, one layer:

    python benchmarks/bench_nsa_kernels.py --quick   # 32K, trees of 16 and 64, batch 1 and 8 (< 5 min)
    python benchmarks/bench_nsa_kernels.py           # 8K to 128K, trees of 4 to 64, batch 1 to 64: ~600
                                                     # compilations; run it in pieces with the flags below
    python benchmarks/bench_nsa_kernels.py --contexts 131072 --batches 1,8 --trees 64
    python benchmarks/bench_nsa_kernels.py --smoke   # 512 tokens, kernels in interpret mode: checks the script

Kernels per (context, batch): nsa-decode (pallas_kernels.nsa_decode: one query per sequence, the 1x baseline;
tree_nodes 1), and per tree size: v0 and v1 (pallas_kernels.nsa_verify: each node's selection computed in the
pass; the selected blocks read by the Pallas kernels of pallas_kernels.nsa_tree_select, impl "pallas" (V1 also
"pallas-row-loop": a program runs all row blocks of its union split), and by XLA gathers, impl "xla") and dense-tree (the Pallas verification kernel over the
whole context for the tree's rows, which reads what an ancestor-masked dense pass reads). Tree queries are
q_root + noise * eps (ssv-nsa.md 4.5) with eps from --noise, so that the nodes' block sets overlap as nearby
queries' do; each record states the overlap it measured (mean Jaccard of a node's blocks with the root's) and
the union size |U| (blocks per KV head, mean over the batch), from which the ideal ratio T n / |U| follows.

Per record: kernel, tree_nodes, context, batch, time_ms (median), bytes (K/V rows the schedule reads: selected
or union blocks, compressed rows, window), gb_per_s, copy_gb_per_s (benchmarks.suite_scale.measure_bandwidth),
union_blocks, overlap. Results: benchmarks/results/nsa-kernels-<date>.json (and $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from benchmarks.suite_scale import measure_bandwidth, median_seconds  # noqa: E402
from models.config import NSA_1B_LAYOUT  # noqa: E402
from models.nsa_cache import NSALayerCache, compressed_rows  # noqa: E402
from models.nsa_selection import num_select_blocks  # noqa: E402
from pallas_kernels import verify_attention  # noqa: E402
from pallas_kernels.nsa_decode import nsa_decode  # noqa: E402
from pallas_kernels.nsa_tree_select import V1Launch  # noqa: E402
from pallas_kernels.nsa_verify import nsa_tree_verify, union_schedule  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 2, 64
LAYOUT = NSA_1B_LAYOUT
RESULTS = Path(__file__).parent / "results"


def binary_tree(nodes: int) -> np.ndarray:
    """parents of a complete binary tree in breadth-first order (a draft tree of branching 2)."""
    return np.array([-1] + [(i - 1) // 2 for i in range(1, nodes)], np.int32)


def caches(batch: int, context: int, key):
    kk, kv, kc, kd = jax.random.split(key, 4)
    raw = lambda k, rows: jax.random.normal(k, (batch, rows, KV_HEADS, DIM), jnp.bfloat16)
    rows = compressed_rows(LAYOUT, context)
    return NSALayerCache(raw(kk, context), raw(kv, context), raw(kc, rows), raw(kd, rows))


def tree_inputs(batch: int, nodes: int, noise: float, key):
    kr, kn, kt, kg = jax.random.split(key, 4)
    root = jax.random.normal(kr, (batch, 1, HEADS, DIM), jnp.float32)
    q = (root + noise * jax.random.normal(kn, (batch, nodes, HEADS, DIM))).astype(jnp.bfloat16)
    tree_kv = jax.random.normal(kt, (2, batch, nodes, KV_HEADS, DIM), jnp.bfloat16)
    gates = jax.nn.sigmoid(jax.random.normal(kg, (batch, nodes, HEADS, 3)))
    return q, tree_kv[0], tree_kv[1], gates


def selected_bytes(blocks: int) -> int:
    return 2 * blocks * LAYOUT.select_block * DIM * 2  # K and V, bf16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode (CPU)")
    parser.add_argument("--noise", type=float, default=0.3, help="tree query noise relative to the root query")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated, e.g. 32768,131072")
    parser.add_argument("--batches", type=_ints, default=None)
    parser.add_argument("--trees", type=_ints, default=None, help="tree sizes (nodes, at most 64)")
    args = parser.parse_args(argv)
    contexts = [32768] if args.quick else [8192, 32768, 65536, 131072]
    batches = [1, 8] if args.quick else [1, 4, 8, 16, 64]
    trees = [16, 64] if args.quick else [4, 8, 16, 32, 64]
    if args.smoke:
        contexts, batches, trees = [512], [1], [4]
    contexts, batches, trees = args.contexts or contexts, args.batches or batches, args.trees or trees
    interpret = args.smoke
    kernels = "interpret" if interpret else "pallas"
    bandwidth = measure_bandwidth(2**20) if args.smoke else measure_bandwidth()
    records = []
    key = jax.random.PRNGKey(0)
    for context in contexts:
        for batch in batches:
            cache = caches(batch, context, key)
            length = jnp.full((batch,), context - 64 - 1, jnp.int32)  # room for the tree's rows
            cmp_read = 2 * (context // LAYOUT.compress_stride) * KV_HEADS * DIM * 2
            window_read = 2 * LAYOUT.window * KV_HEADS * DIM * 2
            q1 = jax.random.normal(key, (batch, HEADS, DIM), jnp.bfloat16)
            gates1 = jax.nn.sigmoid(jax.random.normal(key, (batch, HEADS, 3)))
            decode = jax.jit(functools.partial(nsa_decode, layout=LAYOUT, interpret=interpret))
            seconds = median_seconds(lambda c: decode(q1, c.k, c.v, c.k_cmp, c.v_cmp, length, gates1), cache)
            nbytes = batch * (cmp_read + KV_HEADS * selected_bytes(LAYOUT.top_n) + window_read)
            records.append(dict(kernel="nsa-decode", tree_nodes=1, context=context, batch=batch,
                                time_ms=seconds * 1e3, bytes=nbytes, gb_per_s=nbytes / seconds / 1e9,
                                copy_gb_per_s=bandwidth["copy_bandwidth_gbps"], union_blocks=LAYOUT.top_n,
                                overlap=1.0))
            for nodes in trees:
                q, tree_k, tree_v, gates = tree_inputs(batch, nodes, args.noise, key)
                parents = jnp.asarray(binary_tree(nodes))
                union, overlap = None, None
                variants = [("v0", "pallas"), ("v0", "xla"), ("v1", "pallas"), ("v1", "pallas-row-loop"), ("v1", "xla")]
                for schedule, impl in variants:
                    verify = jax.jit(jax.vmap(functools.partial(
                        nsa_tree_verify, layout=LAYOUT, schedule=schedule, return_blocks=True,
                        kernels=None if impl == "xla" else kernels,
                        v1_launch=V1Launch(row_loop=impl == "pallas-row-loop")), in_axes=(0, 0, 0, 0, 0, 0, None)))
                    run = lambda c: verify(q, c, tree_k, tree_v, gates, length, parents)
                    seconds = median_seconds(run, cache)
                    if union is None:
                        blocks = run(cache)[1]  # [B, T, H_kv, n]
                        counts = jax.vmap(lambda b: union_schedule(b, num_select_blocks(LAYOUT, context))[1])(blocks)
                        union = float(jnp.mean(counts))
                        overlap = jaccard_with_root(np.asarray(blocks))
                    read_blocks = nodes * LAYOUT.top_n if schedule == "v0" else union
                    nbytes = int(batch * (cmp_read + window_read + KV_HEADS * selected_bytes(read_blocks)))
                    records.append(dict(kernel=schedule, impl=impl, tree_nodes=nodes, context=context, batch=batch,
                                        time_ms=seconds * 1e3, bytes=nbytes, gb_per_s=nbytes / seconds / 1e9,
                                        copy_gb_per_s=bandwidth["copy_bandwidth_gbps"], union_blocks=union,
                                        overlap=overlap, ideal_ratio=nodes * LAYOUT.top_n / union))
                dense = jax.jit(lambda c: verify_attention(q, c.k, c.v, length, interpret=interpret)[0])
                seconds = median_seconds(dense, cache)
                nbytes = batch * 2 * context * KV_HEADS * DIM * 2
                records.append(dict(kernel="dense-tree", tree_nodes=nodes, context=context, batch=batch,
                                    time_ms=seconds * 1e3, bytes=nbytes, gb_per_s=nbytes / seconds / 1e9,
                                    copy_gb_per_s=bandwidth["copy_bandwidth_gbps"], union_blocks=None,
                                    overlap=None))
                print(records[-6:], flush=True)
    doc = run_metadata(layout=LAYOUT.__dict__, shapes=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM),
                       noise=args.noise, bandwidth=bandwidth, records=records)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(doc, f"nsa-kernels-{stamp}.json", None if args.smoke else RESULTS)
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def jaccard_with_root(blocks: np.ndarray) -> float:
    """Mean Jaccard similarity of each non-root node's block set with the root's, over batch and KV heads."""
    scores = []
    for b in range(blocks.shape[0]):
        for h in range(blocks.shape[2]):
            root = {x for x in blocks[b, 0, h] if x >= 0}
            for node in range(1, blocks.shape[1]):
                other = {x for x in blocks[b, node, h] if x >= 0}
                scores.append(len(root & other) / len(root | other))
    return float(np.mean(scores)) if scores else 1.0


if __name__ == "__main__":
    raise SystemExit(main())
