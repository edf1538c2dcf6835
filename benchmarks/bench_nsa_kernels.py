"""NSA verification and decoding on the GPU at NSA-1B shapes (32 query / 2 KV heads, D 64, l = d = l' = 16,
16 blocks, window 128; `--shapes smollm2-view`: SmolLM2's NSA view, 9 query / 3 KV heads, the sink block forced,
no gates), random bf16 caches at full length, one layer:

    python benchmarks/bench_nsa_kernels.py --quick   # 32K, trees of 16 and 64, batch 1 and 8 (< 5 min)
    python benchmarks/bench_nsa_kernels.py           # 8K to 128K, trees of 4 to 64, batch 1 to 64: ~600
                                                     # compilations; run it in pieces with the flags below
    python benchmarks/bench_nsa_kernels.py --contexts 131072 --batches 1,8 --trees 64
    python benchmarks/bench_nsa_kernels.py --quick --shapes smollm2-view   # the loop's SSV target's shapes
    python benchmarks/bench_nsa_kernels.py --smoke   # 512 tokens, kernels in interpret mode: checks the script
    python benchmarks/bench_nsa_kernels.py --plot A.json B.json --figure F.png   # one figure of several pieces

Kernels per (context, batch): nsa-decode (pallas_kernels.nsa_decode: one query per sequence, the 1x baseline;
tree_nodes 1), and per tree size: v0 and v1 (pallas_kernels.nsa_verify: each node's selection computed in the
pass; the selected blocks read by the Pallas kernels of pallas_kernels.nsa_tree_select, impl "pallas" (V1 also
"pallas-row-loop": a program runs all row blocks of its union split), and by XLA gathers, impl "xla") and
dense-tree (the tree's rows in pallas_kernels.tree_attention over the whole context, ancestor-masked; its own
sweep against the jnp path is benchmarks/bench_tree_attention.py), and v0-selected and v1-selected: the selected
branch's kernels alone (pallas_kernels.nsa_verify.selected_branch, V1 with its union schedule, also at 4 union
splits and in row blocks of 32: impls "pallas-4-splits", "pallas-32-rows" and "pallas-32-rows-4-splits") on the
blocks the pass chose, the part the schedules differ in and what the SSV paper's kernel speedup compares; and
top-n: the selection alone, the top 16 of random block scores for 1 (decode) and each tree size's queries per KV
head, impl "xla" (lax.top_k, XLA's TopK kernel), "pallas" (pallas_kernels.top_n, which the kernel paths use) and
"pallas-packed" (top_n with its launch until 2026-12-04: up to 64 rows a 4-warp program, rows whole) and
"pallas-one-stage" (the default launch without chunks: rows whole, no second stage).
Tree queries are q_root + noise * eps (ssv-nsa.md 4.5) with eps from --noise, so that the nodes' block sets
overlap as nearby queries' do; each record states the overlap it measured (mean Jaccard of a node's blocks with
the root's) and the union size |U| (blocks per KV head, mean over the batch), from which the ideal ratio T n / |U|
follows.

Every kernel's output is checked first (nsa-decode against nsa_decode_reference, each tree variant against XLA's
V0, bf16 tolerance 0.05); a kernel that fails to run or to match goes to `failures` with its error and the run
goes on, exiting 1 at the end. Per record: kernel, tree_nodes, context, batch, time_ms (on the GPU the kernels'
summed time per call, `timer` "gpu kernel time", against a copy bandwidth timed the same way; a lone call's wall
time, wall_ms, adds about 0.1 ms of dispatch, which hid every one-layer kernel here until 2026-12-03), kernels
(launched per call) and top_kernels (the longest, mean µs each), max_abs_error, bytes (K/V rows the schedule
reads: selected or union blocks, compressed rows, window), gb_per_s, copy_gb_per_s
(benchmarks.suite_scale.measure_bandwidth), union_blocks, overlap. Results:
benchmarks/results/nsa-kernels-<date>.json (and $OUT), saved after every record
(`"complete": false` until the run ends, so a run cut short by a call's limit keeps what it measured), and with
matplotlib (pip install -e '.[bench]') a PNG beside it: V0's time over V1's (the fastest Pallas impl of each;
the whole pass, and the selected branch alone) against tree size, per context and batch, beside the ideal ratio
T n / |U| and the 3x target.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_io import RecordLog, run_metadata  # noqa: E402
from benchmarks import suite_scale  # noqa: E402
from benchmarks.suite_scale import KERNEL_TIME, WALL_TIME, gpu_seconds, kernel_profile, measure_bandwidth  # noqa: E402
from models.config import NSA_1B_LAYOUT, NSA_VIEW_LAYOUT, NSALayout  # noqa: E402
from models.nsa_cache import NSALayerCache, compressed_rows  # noqa: E402
from models.nsa_selection import num_select_blocks  # noqa: E402
from pallas_kernels.nsa_decode import nsa_decode, nsa_decode_reference  # noqa: E402
from pallas_kernels.nsa_tree_select import V1Launch  # noqa: E402
from pallas_kernels.nsa_verify import (  # noqa: E402
    ancestor_mask, nsa_tree_verify, selected_branch, union_schedule)
from pallas_kernels._common import next_power_of_2  # noqa: E402
from pallas_kernels.top_n import MAX_TILE, TopNLaunch, top_n  # noqa: E402
from pallas_kernels.tree_attention import tree_attention  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """One layer's attention shapes: query and KV heads, head dim, the NSA layout and the attention kind."""

    heads: int
    kv_heads: int
    dim: int
    layout: NSALayout
    kind: str


# NSA-1B's (issue 20's targets are at these), and SmolLM2's NSA view (9 query / 3 KV heads: G 3, no gates, the
# compressed branch only scoring blocks), whose V0 / V1 balance differs: 42 nodes' rows fill one V1 row block.
SHAPES = {"nsa-1b": Shapes(32, 2, 64, NSA_1B_LAYOUT, "nsa"), "smollm2-view": Shapes(9, 3, 64, NSA_VIEW_LAYOUT,
                                                                                     "nsa-view")}


def binary_tree(nodes: int) -> np.ndarray:
    """parents of a complete binary tree in breadth-first order (a draft tree of branching 2)."""
    return np.array([-1] + [(i - 1) // 2 for i in range(1, nodes)], np.int32)


def caches(shapes: Shapes, batch: int, context: int, key):
    kk, kv, kc, kd = jax.random.split(key, 4)
    raw = lambda k, rows: jax.random.normal(k, (batch, rows, shapes.kv_heads, shapes.dim), jnp.bfloat16)
    rows = compressed_rows(shapes.layout, context)
    return NSALayerCache(raw(kk, context), raw(kv, context), raw(kc, rows), raw(kd, rows))


def tree_inputs(shapes: Shapes, batch: int, nodes: int, noise: float, key):
    kr, kn, kt, kg = jax.random.split(key, 4)
    heads, dim = shapes.heads, shapes.dim
    root = jax.random.normal(kr, (batch, 1, heads, dim), jnp.float32)
    q = (root + noise * jax.random.normal(kn, (batch, nodes, heads, dim))).astype(jnp.bfloat16)
    tree_kv = jax.random.normal(kt, (2, batch, nodes, shapes.kv_heads, dim), jnp.bfloat16)
    gates = jax.nn.sigmoid(jax.random.normal(kg, (batch, nodes, heads, 3)))
    return q, tree_kv[0], tree_kv[1], gates


def selected_bytes(shapes: Shapes, blocks: int) -> int:
    return 2 * blocks * shapes.layout.select_block * shapes.dim * 2  # K and V, bf16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels in interpret mode (CPU)")
    parser.add_argument("--noise", type=float, default=0.3, help="tree query noise relative to the root query")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated, e.g. 32768,131072")
    parser.add_argument("--batches", type=_ints, default=None)
    parser.add_argument("--trees", type=_ints, default=None, help="tree sizes (nodes, at most 64)")
    parser.add_argument("--shapes", default="nsa-1b", choices=sorted(SHAPES),
                        help="one layer's heads and NSA layout (issue 20's targets: nsa-1b)")
    parser.add_argument("--plot", nargs="+", type=Path, default=None, metavar="RESULTS.json",
                        help="draw the figure of these saved runs (pieces of one grid) into --figure, and stop")
    parser.add_argument("--figure", type=Path, default=None, help="with --plot: the PNG to write")
    args = parser.parse_args(argv)
    if args.plot:
        if args.figure is None:
            parser.error("--plot needs --figure PATH.png")
        records = [r for path in args.plot for r in json.loads(path.read_text())["records"]]
        shapes = sorted({r.get("shapes", "nsa-1b") for r in records})  # records before `shapes`: NSA-1B's
        if len(shapes) > 1:  # the figure's points are keyed by context, batch and tree size alone
            print(f"error: --plot: one figure per shapes; these files mix {', '.join(shapes)}", file=sys.stderr)
            return 2
        plot(records, args.figure)
        return 0
    contexts = [32768] if args.quick else [8192, 32768, 65536, 131072]
    batches = [1, 8] if args.quick else [1, 4, 8, 16, 64]
    trees = [16, 64] if args.quick else [4, 8, 16, 32, 64]
    if args.smoke:
        contexts, batches, trees = [512], [1], [4]
    contexts, batches, trees = args.contexts or contexts, args.batches or batches, args.trees or trees
    interpret = args.smoke
    kernels = "interpret" if interpret else "pallas"
    shapes = SHAPES[args.shapes]
    heads, kv_heads, dim, layout, kind = shapes.heads, shapes.kv_heads, shapes.dim, shapes.layout, shapes.kind
    # Kernel time against kernel time: a lone call's wall time adds about 0.1 ms of dispatch, which is all of a
    # one-layer decode at batch 1 (records before 2026-12-03 were timed so; `timer` tells them apart).
    bandwidth = measure_bandwidth(2**20 if args.smoke else suite_scale.BANDWIDTH_BYTES, timer=gpu_seconds)
    failures = []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    name = f"nsa-kernels-{stamp}" + ("" if args.shapes == "nsa-1b" else f"-{args.shapes}")
    # `failures` is the document's own list: every save carries the failures so far.
    shape_doc = dict(name=args.shapes, heads=heads, kv_heads=kv_heads, head_dim=dim, kind=kind)
    log = RecordLog(run_metadata(layout=layout.__dict__, shapes=shape_doc,
                                 noise=args.noise, bandwidth=bandwidth, failures=failures),
                    name + ".json", None if args.smoke else RESULTS)
    records = log.records
    key = jax.random.PRNGKey(0)

    def timed(record: dict, fn, arg, want=None, tolerance=0.05):
        """record + time_ms, bytes' GB/s and (against want) max_abs_error; a kernel that fails to run or to match
        is recorded with its error and the run goes on (exit status 1 at the end)."""
        try:
            got = fn(arg)
            out = got[0] if isinstance(got, tuple) else got
            if want is not None:
                error = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
                record["max_abs_error"] = error
                if not error <= tolerance:
                    raise AssertionError(f"max abs error {error} against the XLA path")
            profile = kernel_profile(fn, arg)
            seconds = profile["gpu_s"]
            if not seconds > 0:
                raise RuntimeError(f"the profiler saw no kernel time ({seconds} s)")
        except Exception as e:  # noqa: BLE001: one kernel's failure must not cost the rest of the run
            failures.append(record | {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            print("FAILED", failures[-1], flush=True)
            return None
        record |= dict(shapes=args.shapes, time_ms=seconds * 1e3, wall_ms=profile["wall_s"] * 1e3,
                       timer=profile["clock"], kernels=profile["kernels"], top_kernels=profile["top_kernels"],
                       gb_per_s=record["bytes"] / seconds / 1e9, copy_gb_per_s=bandwidth["copy_bandwidth_gbps"])
        log.add(record)
        return got

    for context in contexts:
        for batch in batches:
            cache = caches(shapes, batch, context, key)
            length = jnp.full((batch,), context - 64 - 1, jnp.int32)  # room for the tree's rows
            # Compressed keys and values (the view reads only the keys, to score blocks).
            cmp_read = (2 if kind == "nsa" else 1) * (context // layout.compress_stride) * kv_heads * dim * 2
            window_read = 2 * layout.window * kv_heads * dim * 2
            q1 = jax.random.normal(key, (batch, heads, dim), jnp.bfloat16)
            gates1 = jax.nn.sigmoid(jax.random.normal(key, (batch, heads, 3)))
            gates1 = gates1 if kind == "nsa" else None  # the view has no gates
            decode = jax.jit(functools.partial(nsa_decode, layout=layout, kind=kind, interpret=interpret))
            want = nsa_decode_reference(q1, cache.k, cache.v, cache.k_cmp, cache.v_cmp, length, gates1,
                                        layout=layout, kind=kind)
            timed(dict(kernel="nsa-decode", tree_nodes=1, context=context, batch=batch,
                       bytes=batch * (cmp_read + kv_heads * selected_bytes(shapes, layout.top_n) + window_read),
                       union_blocks=layout.top_n, overlap=1.0),
                  lambda c: decode(q1, c.k, c.v, c.k_cmp, c.v_cmp, length, gates1), cache, want)
            # Selection alone: the top-n of each query's block scores, XLA's TopK kernel against pallas_kernels.top_n.
            num_blocks = num_select_blocks(layout, context)
            for nodes in [1, *trees]:
                scores = jax.random.normal(key, (batch, kv_heads, nodes, num_blocks), jnp.float32)
                want = None
                # "pallas-packed": top_n's launch until 2026-12-04, up to 64 rows (8,192 scores) to a 4-warp program.
                packed = TopNLaunch(chunk=MAX_TILE, block_rows=min(64, MAX_TILE // next_power_of_2(num_blocks)),
                                    num_warps=4)
                # "pallas-one-stage": the default's rows per program and warps, but rows whole (no chunks).
                whole = TopNLaunch.for_rows(batch * kv_heads * nodes, num_blocks, min_chunk=MAX_TILE)
                for impl, select in (("xla", jax.lax.top_k), ("pallas", functools.partial(top_n, interpret=interpret)),
                                     ("pallas-packed", functools.partial(top_n, launch=packed, interpret=interpret)),
                                     ("pallas-one-stage", functools.partial(top_n, launch=whole,
                                                                            interpret=interpret))):
                    got = timed(dict(kernel="top-n", impl=impl, tree_nodes=nodes, context=context, batch=batch,
                                     bytes=scores.size * 4, union_blocks=None, overlap=None),
                                jax.jit(lambda x, select=select: select(x, layout.top_n)), scores, want, tolerance=0.0)
                    if want is None and got is not None:
                        want = got[0]
            for nodes in trees:
                q, tree_k, tree_v, gates = tree_inputs(shapes, batch, nodes, args.noise, key)
                gates = gates if kind == "nsa" else None
                parents = jnp.asarray(binary_tree(nodes))
                union = overlap = want = None
                # XLA's V0 first: the others are checked against its output.
                variants = [("v0", "xla"), ("v0", "pallas"), ("v1", "xla"), ("v1", "pallas"),
                            ("v1", "pallas-row-loop")]
                for schedule, impl in variants:
                    verify = jax.jit(jax.vmap(functools.partial(
                        nsa_tree_verify, layout=layout, kind=kind, schedule=schedule, return_blocks=True,
                        kernels=None if impl == "xla" else kernels, batch=batch,
                        v1_launch=V1Launch(row_loop=impl == "pallas-row-loop")), in_axes=(0, 0, 0, 0, 0, 0, None)))
                    run = lambda c: verify(q, c, tree_k, tree_v, gates, length, parents)
                    if union is None:
                        want, blocks = run(cache)  # [B, T, H_q, D], [B, T, H_kv, n]
                        counts = jax.vmap(lambda b: union_schedule(b, num_select_blocks(layout, context))[1])(blocks)
                        union = float(jnp.mean(counts))
                        overlap = jaccard_with_root(np.asarray(blocks))
                    read_blocks = nodes * layout.top_n if schedule == "v0" else union
                    timed(dict(kernel=schedule, impl=impl, tree_nodes=nodes, context=context, batch=batch,
                               bytes=int(batch * (cmp_read + window_read
                                              + kv_heads * selected_bytes(shapes, read_blocks))),
                               union_blocks=union, overlap=overlap, ideal_ratio=nodes * layout.top_n / union),
                          run, cache, None if (schedule, impl) == ("v0", "xla") else want)
                # The selected branch alone, on the blocks the pass chose: the kernels the schedules differ in.
                # V1 also at 4 union splits (fewer partial outputs to write and merge) and in row blocks of 32
                # (2 nodes at G 16: fewer union blocks each, which the kernel skips, and less masked arithmetic).
                want = None
                for schedule, impl, launch in [("v0", "pallas", V1Launch()), ("v1", "pallas", V1Launch()),
                                               ("v1", "pallas-row-loop", V1Launch(row_loop=True)),
                                               ("v1", "pallas-4-splits", V1Launch(num_splits=4)),
                                               ("v1", "pallas-32-rows", V1Launch(block_rows=32)),
                                               ("v1", "pallas-32-rows-4-splits",
                                                V1Launch(block_rows=32, num_splits=4))]:
                    branch = jax.jit(jax.vmap(functools.partial(
                        selected_branch, layout=layout, schedule=schedule, interpret=interpret, v1_launch=launch)))
                    read_blocks = nodes * layout.top_n if schedule == "v0" else union
                    got = timed(dict(kernel=f"{schedule}-selected", impl=impl, tree_nodes=nodes, context=context,
                                     batch=batch, bytes=int(batch * kv_heads * selected_bytes(shapes, read_blocks)),
                                     union_blocks=union, overlap=overlap, ideal_ratio=nodes * layout.top_n / union),
                                lambda c: branch(q, c, blocks, length), cache, want)
                    if want is None and got is not None:
                        want = got[0]
                ancestors = ancestor_mask(parents)
                dense = jax.jit(lambda c: tree_attention(q, c.k, c.v, length, ancestors, interpret=interpret)[0])
                timed(dict(kernel="dense-tree", tree_nodes=nodes, context=context, batch=batch,
                           bytes=batch * 2 * context * kv_heads * dim * 2, union_blocks=None, overlap=None),
                      dense, cache)
                print(records[-11:], flush=True)
    log.finish()
    if not args.smoke:
        try:
            plot(records, RESULTS / (name + ".png"))
        except ImportError:
            print("matplotlib is not installed: no figure (pip install -e '.[bench]')", file=sys.stderr)
    return 1 if failures else 0


def fastest_pallas(records: list[dict], part: str = "") -> dict[tuple, dict]:
    """{(context, batch, tree_nodes, schedule): record} of V0 and V1, each at its fastest Pallas impl; part ""
    for the whole verification pass, "-selected" for the selected branch's kernels alone."""
    best = {}
    for r in records:
        if r["kernel"] in ("v0" + part, "v1" + part) and r["impl"] != "xla":
            k = (r["context"], r["batch"], r["tree_nodes"], r["kernel"].removesuffix(part))
            if k not in best or r["time_ms"] < best[k]["time_ms"]:
                best[k] = r
    return best


def v0_v1_pairs(records: list[dict], part: str = "") -> list[tuple[tuple, dict, dict]]:
    """[((context, batch, tree_nodes), V0 record, V1 record)] in that order, each schedule at its fastest Pallas
    impl (fastest_pallas; part as there), where both were measured."""
    best = fastest_pallas(records, part)
    return [((context, batch, nodes), best[context, batch, nodes, "v0"], v1)
            for (context, batch, nodes, kernel), v1 in sorted(best.items())
            if kernel == "v1" and (context, batch, nodes, "v0") in best]


def v0_over_v1(records: list[dict], part: str = "") -> dict:
    """{(context, batch): [(tree_nodes, V0 time / V1 time, ideal ratio)]} from v0_v1_pairs."""
    points = {}
    for (context, batch, nodes), v0, v1 in v0_v1_pairs(records, part):
        points.setdefault((context, batch), []).append((nodes, v0["time_ms"] / v1["time_ms"], v1["ideal_ratio"]))
    return points


def newest_on_one_clock(documents: list[dict]) -> list[dict]:
    """The records of several runs' documents, each with its run's `date`, keeping per (shapes, kernel, impl, tree
    size, context, batch) the newest measurement on the best clock: kernel time over a lone call's wall time.
    Records before `shapes` was recorded are NSA-1B's."""
    best: dict[tuple, dict] = {}
    for doc in documents:
        for r in doc["records"]:
            r = {"shapes": "nsa-1b", **r, "date": doc.get("date", "")}
            key = (r["shapes"], r["kernel"], r.get("impl"), r["tree_nodes"], r["context"], r["batch"])
            rank = (r.get("timer") == KERNEL_TIME, r["date"])
            if key not in best or rank >= (best[key].get("timer") == KERNEL_TIME, best[key]["date"]):
                best[key] = r
    return list(best.values())


def readme_section(records: list[dict]) -> str:
    """docs/nsa-ssv.md's tables of issue 20's kernel targets from `newest_on_one_clock` records: V0 against V1 (each at
    its fastest Pallas impl) per context, batch and tree size, for the whole verification pass and for the
    selected branch's kernels alone, plain NSA decoding per context and batch, and each target met, missed or not
    yet measured, all at NSA-1B's shapes; then the whole pass at SmolLM2's view's shapes, where measured."""
    view = [r for r in records if r.get("shapes") == "smollm2-view"]
    records = [r for r in records if r.get("shapes", "nsa-1b") == "nsa-1b"]
    clock = lambda r: (("kernel" if r.get("timer") == KERNEL_TIME else "wall (dispatch included)")  # noqa: E731
                       + f", {r.get('date', '')[:10] or '-'}")

    def v0_against_v1(part: str, measured: list[dict] = records):
        rows, at_target = [], {}
        for (context, batch, nodes), v0, v1 in v0_v1_pairs(measured, part):
            ratio = v0["time_ms"] / v1["time_ms"]
            if context == 32768 and nodes == 64 and 1 <= batch <= 8:
                at_target[batch] = ratio
            rows.append(f"| {context // 1024}K | {batch} | {nodes} | {v0['time_ms']:.3f} | {v1['time_ms']:.3f} | "
                        f"{ratio:.2f}x | {v1['ideal_ratio']:.1f}x | {v0['bytes'] / 1e6:.1f} / "
                        f"{v1['bytes'] / 1e6:.1f} | {clock(v1)} |")
        status = ("not yet measured" if not at_target else
                  f"**{'met' if min(at_target.values()) >= 3 else 'missed'}**: "
                  + ", ".join(f"batch {b} {r:.2f}x" for b, r in sorted(at_target.items())))
        return rows, status

    pass_rows, pass_status = v0_against_v1("")
    view_rows, _ = v0_against_v1("", view)
    branch_rows, branch_status = v0_against_v1("-selected")
    decode = sorted((r for r in records if r["kernel"] == "nsa-decode"), key=lambda r: (r["context"], r["batch"]))
    fraction = lambda r: r["gb_per_s"] / r["copy_gb_per_s"]  # noqa: E731
    decode_rows = [f"| {r['context'] // 1024}K | {r['batch']} | {r['time_ms']:.3f} | {r['bytes'] / 1e6:.1f} | "
                   f"{r['gb_per_s']:,.0f} | {100 * fraction(r):.1f} % | {clock(r)} |"
                   for r in decode]
    selection = {}
    for r in records:
        if r["kernel"] == "top-n":
            selection.setdefault((r["context"], r["batch"], r["tree_nodes"]), {})[r["impl"]] = r
    ms = lambda by, impl: f"{by[impl]['time_ms']:.3f}" if impl in by else "-"  # noqa: E731
    selection_rows = [f"| {c // 1024}K | {b} | {t} | {ms(by, 'xla')} | {ms(by, 'pallas-packed')} | "
                      f"{ms(by, 'pallas-one-stage')} | {ms(by, 'pallas')} | "
                      f"{by['xla']['time_ms'] / by['pallas']['time_ms']:.1f}x | {clock(by['pallas'])} |"
                      for (c, b, t), by in sorted(selection.items()) if {"xla", "pallas"} <= set(by)]
    best = max(decode, key=fraction, default=None)
    decode_status = ("not yet measured" if best is None else
                     f"**{'met' if fraction(best) >= 0.7 else 'missed'}**: at best {100 * fraction(best):.1f} % "
                     f"({best['context'] // 1024}K x {best['batch']})")
    header = ("| context | batch | tree nodes | V0 ms | V1 ms | V0 / V1 | ideal T n / \\|U\\| | MB read V0 / V1 "
              "| clock, date |\n|---|---|---|---|---|---|---|---|---|")
    return "\n".join([
        f"- V1 >= 3x V0 at 64 nodes, 32K, batch 1-8, the whole verification pass: {pass_status}.",
        f"- The same for the selected branch's kernels alone (V1 with its union schedule): {branch_status}.",
        f"- Plain NSA decoding >= 70 % of copy bandwidth: {decode_status}.",
        "",
        "The whole verification pass (compressed scores, top-n, selected branch, window, gates):",
        "",
        header,
        *pass_rows,
        "",
        "The selected branch alone, on the blocks the pass chose (the work the two schedules differ in):",
        "",
        header,
        *branch_rows,
        "",
        "| context | batch | NSA decode ms | MB read | GB/s | of copy bandwidth | clock, date |",
        "|---|---|---|---|---|---|---|",
        *decode_rows,
        *(["", "Selection alone, the top 16 blocks of each query (per KV head; 1 query: a decode step):", "",
           "| context | batch | queries | lax.top_k ms | top_n packed (until 2026-12-04) ms | top_n rows whole ms "
           "| pallas_kernels.top_n ms | speedup over lax.top_k | clock, date |",
           "|---|---|---|---|---|---|---|---|---|", *selection_rows] if selection_rows else []),
        *(["", "The whole verification pass at SmolLM2's NSA view's shapes (9 query / 3 KV heads of 64, the loop's "
           "SSV target; no gates):", "", header, *view_rows] if view_rows else []),
    ])


def plot(records: list[dict], path: Path) -> None:
    import matplotlib  # the optional [bench] dependency, needed only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One clock per figure: kernel time where the records have it (older records were timed by wall clock).
    clock = KERNEL_TIME if any(r.get("timer") == KERNEL_TIME for r in records) else WALL_TIME
    on_clock = [r for r in records if r.get("timer", WALL_TIME) == clock]
    points, branch = v0_over_v1(on_clock), v0_over_v1(on_clock, "-selected")
    contexts = sorted({c for c, _ in points})
    if not contexts:
        return
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for (c, batch), rows in points.items():
            if c == context:
                nodes, ratio, ideal = zip(*rows)
                line, = ax.plot(nodes, ratio, marker="o", label=f"batch {batch}")
                ax.plot(nodes, ideal, linestyle=":", marker="x", color=line.get_color())
                if (c, batch) in branch:
                    nodes, ratio, _ = zip(*branch[c, batch])
                    ax.plot(nodes, ratio, linestyle="-.", marker="s", color=line.get_color())
        ax.axhline(3, color="grey", linestyle="--", label="target 3x")
        for style, marker, what in (("-", "o", "whole pass"), ("-.", "s", "selected branch alone"),
                                    (":", "x", "ideal T n / |U|")):
            ax.plot([], [], color="black", linestyle=style, marker=marker, label=what)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tree nodes")
        ax.set_ylabel(f"V0 time / V1 time ({clock})")
        ax.set_title(f"NSA-1B shapes, context {context // 1024}K")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
