"""The SSV planner's profile (vegas_jax.ssv.planner): kernel time tables measured on this device, composed into the
whole-pass times the planner fits, saved as a vegas-ssv-profile JSON.

    python benchmarks/profile_ssv.py --model smollm2-view --distances benchmarks/results/approx-modes-<date>.json
    python benchmarks/profile_ssv.py --model nsa-1b --contexts 8192,32768     # NSA-1B shapes, random weights
    python benchmarks/profile_ssv.py --quick                                  # fewer shapes (< 5 min)
    python benchmarks/profile_ssv.py --smoke                                  # tiny shapes, interpret mode (CPU)
    python benchmarks/profile_ssv.py --merge A.json B.json                    # runs split to fit a time limit

Every time is GPU time, the summed durations of the kernels a table's program launches (profiler traces; off the
GPU, wall time): a lone jitted call's wall time adds its dispatch, about 0.1 ms, which the loop's kernels do not pay
(timed that way, the profile of 2026-12-02 put a plain step at 3.3x its measured time). Tables, per (batch,
context) of the grid:
- linear: one whole-model pass over `rows` new tokens per sequence with the attention left out (an attention that
  reads no cache), i.e. weights, MLP, norms and the LM head;
- attention of one layer, the mean over 4 distinct layer caches run in sequence (one cache would sit in L2 at
  small shapes): plain decoding of the exact target (pallas_kernels.nsa_decode), a refresh layer (the mean over
  a span: its anchor derives a selection, the other steps read it) and a reuse layer of each approximate mode
  (vegas_jax.attention.nsa_approx, the reuse layer through the fused kernel), and exact tree verification of each
  tree shape (pallas_kernels.nsa_verify with the loop's schedule, nsa_tree.TREE_SCHEDULE, selected blocks through
  its Pallas kernels; the commit of the accepted path is not timed);
- checks: the fused reuse kernel against its jnp twin on each (mode, batch, context), before it is timed;
- drafts: the n-gram drafter's device work per tree shape, modelled as a match of the last two tokens against
  every position and the continuations of the best `branching` matches gathered (the drafter lives with the
  loop; this is its cost's order, not its code); the self drafter's pass, composed per level with children as
  the linear part at the level's width plus each layer's sink-and-window draft attention; the draft head's
  proposal (vegas_jax.decode.drafters.HeadDrafter: random head weights, whose values cost nothing), whose cache holds
  a row for every position of the context (prefill writes the prompt's), so its attention grows with the context.
- the same tree verification under each approximate mode for the --mode-trees shapes (the refresh layers' nodes
  taking their anchors' blocks, the reuse layers' injected, whose own selection XLA then drops as unused).
A pass's time is then linear + the sum over layers of their attention (refresh or reuse), and each passes record
says so ("source": "composed"). JSON: benchmarks/results/ssv-profile-<model>-<date>.json (and $OUT).

A dense model (`--model smollm2`: the planner's profile for dense models, whose drafter auto chooses between the
head's and n-gram lookup's trees and plain decoding): its passes are measured whole, a plain step and each tree's
verification through the decoder as the loop runs it (cache donated, so updated in place), and the drafts are the
n-gram drafter's and the head's as above; no approximate modes.
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

from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from benchmarks.suite_scale import gpu_seconds  # noqa: E402
from models.attention import NewTokens  # noqa: E402
from models.config import NSA_1B_LAYOUT, ModelConfig, NSALayout  # noqa: E402
from models.decoder import forward, init_params  # noqa: E402
from models.kv_cache import KVCache  # noqa: E402
from models.nsa_cache import NSACache, NSALayerCache, compressed_rows  # noqa: E402
from pallas_kernels.nsa_verify import ancestor_mask, nsa_tree_verify  # noqa: E402
from vegas_jax.attention.nsa import NSAAttention  # noqa: E402
from vegas_jax.attention.nsa_approx import ApproxLayerCache, ApproxNSAAttention, tree_reselect  # noqa: E402
from vegas_jax.attention.nsa_tree import TREE_SCHEDULE, SinkWindowDraft  # noqa: E402
from vegas_jax.attention.tree import TreeAttention  # noqa: E402
from vegas_jax.attention.verify import VerifyAttention  # noqa: E402
from vegas_jax.decode.drafters import window_slots  # noqa: E402
from vegas_jax.loading import draft_head_checkpoint  # noqa: E402
from vegas_jax.train_draft_head import Settings  # noqa: E402
from vegas_jax.decode.tree_shapes import tree_nodes  # noqa: E402
from vegas_jax.ssv.planner import PROFILE_FORMAT, PROFILE_VERSION  # noqa: E402
from vegas_jax.ssv.precision import ApproxMode  # noqa: E402
from vegas_jax.sharding import Placement  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CACHE_COPIES = 4
NSA_1B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                     num_heads=32, num_kv_heads=2, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=131072, tie_word_embeddings=True, attention="nsa", nsa=NSA_1B_LAYOUT)
TINY = dataclasses.replace(NSA_1B, vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                           head_dim=16, nsa=NSALayout(16, 16, 16, 2, 16, forced_initial=0, forced_local=1))
TINY_DENSE = dataclasses.replace(TINY, attention="dense", nsa=None)
DEFAULT_TREES = "1x1,2x1,3x1,4x1,6x1,2x2,3x2,4x2,5x2,2x3,3x3,2x4"
DEFAULT_MODES = "s2w1r1,s4w1r1,s4w2r1,s8w1r1,s1w1r2,s4w1r2,s1w1r3"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoAttention:
    """Attention left out (the linear table): zero output, the cache untouched."""

    def __call__(self, layer, new, positions, cache):
        num_q = new.heads.shape[2] - 2 * new.num_kv_heads
        return jnp.zeros(new.heads.shape[:2] + (num_q, new.heads.shape[3]), new.heads.dtype), cache, None


def load(name: str, dtype):
    if name in ("smollm2", "smollm2-view"):
        from vegas_jax.attention.family import with_attention
        from vegas_jax.loading import load_model

        loaded = load_model(None, dtype)
        return (loaded.config if name == "smollm2" else with_attention(loaded.config, "nsa-view")), loaded.params
    config = {"nsa-1b": NSA_1B, "tiny": TINY, "tiny-dense": TINY_DENSE}[name]
    return config, init_params(config, dtype)


def ms(fn, x, reps) -> float:
    return gpu_seconds(fn, x, reps) * 1e3


def linear_ms(config, params, batch: int, rows: int, dtype, reps: int) -> float:
    cache = NSACache.create(config, batch, 64, dtype)
    tokens = jnp.zeros((batch, rows), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (batch, rows))
    run = jax.jit(functools.partial(forward, config=config))
    return ms(lambda p: run(p, tokens, positions, cache, NoAttention())[0], params, reps)


def layer_caches(config, batch: int, context: int, dtype, key) -> tuple[NSALayerCache, ...]:
    """CACHE_COPIES random layer caches of capacity context + 64 (room for a tree's rows), separate arrays (slices
    of one stacked array would be copied out, and the copies timed with the kernels)."""
    capacity = context + 64
    rows = compressed_rows(config.nsa, capacity)
    shape = lambda n: (batch, n, config.num_kv_heads, config.head_dim)
    return tuple(NSALayerCache(*(jax.random.normal(k, shape(n), dtype)
                                 for k, n in zip(jax.random.split(copy, 4), (capacity,) * 2 + (rows,) * 2)))
                 for copy in jax.random.split(key, CACHE_COPIES))


def new_tokens(config, batch: int, rows: int, dtype, key):
    heads = jax.random.normal(key, (batch, rows, config.num_heads + 2 * config.num_kv_heads, config.head_dim), dtype)
    ones = jnp.ones((batch, rows, config.head_dim), jnp.float32)
    gates = jax.nn.sigmoid(jax.random.normal(key, (batch, rows, config.num_heads, 3))) if config.attention == "nsa" \
        else None
    return NewTokens(heads, ones, 0 * ones, config.num_kv_heads, gates)


def per_layer(call, caches, reps) -> float:
    """Mean ms of call(layer cache) over the distinct caches, run in sequence in one program."""
    def all_copies(copies):
        return sum(jnp.sum(call(cache).astype(jnp.float32)) for cache in copies)
    return ms(jax.jit(all_copies), caches, reps) / CACHE_COPIES


def full_tree_parents(depth: int, branching: int) -> np.ndarray:
    """parents of the full DEPTHxBRANCHING tree in breadth-first order, the root (the last committed token)
    first: nodes + 1 rows."""
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(branching):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.array(parents, np.int32)


# Largest |kernel - jnp twin| / max |twin| accepted on the device (bf16 rounds probabilities and outputs).
FUSED_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def check_fused(attention, new, position, cache, mode, batch, context) -> dict:
    """The fused reuse kernel as the device compiles it against its jnp twin on the profile's shapes; a
    mismatch stops the profile (timings of a wrong kernel mean nothing)."""
    kernel = attention(1, new, position, cache)[0].astype(jnp.float32)
    twin = dataclasses.replace(attention, placement=Placement())(1, new, position, cache)[0].astype(jnp.float32)
    error = float(jnp.max(jnp.abs(kernel - twin)) / jnp.max(jnp.abs(twin)))
    dtype = str(cache.nsa.k.dtype)
    if not error <= FUSED_TOLERANCE[dtype]:
        raise SystemExit(f"error: the fused reuse kernel differs from its jnp twin by {error:.3g} (relative) for "
                         f"mode {mode.name()}, batch {batch}, context {context}")
    return dict(mode=mode.name(), batch=batch, context=context, relative_error=error, dtype=dtype)


def approx_tree_ms(config, mode: ApproxMode, caches, q, k, v, gates, length, parents, backend, reps):
    """(refresh, reuse) ms of one layer's tree verification of mode's target (nsa_tree_verify with
    tree_reselect): a refresh layer's nodes take their anchors' blocks (the stored one for anchors before the
    tree), a reuse layer's are injected (its own selection unused, so not derived in the compiled pass)."""
    wide = mode.selection_layout(config.nsa)
    batch, rows = q.shape[:2]
    stored = jnp.broadcast_to(jnp.arange(wide.top_n, dtype=jnp.int32), (batch, config.num_kv_heads, wide.top_n))
    injected = jnp.broadcast_to(stored[:, None], (batch, rows, config.num_kv_heads, wide.top_n))

    def one(role):
        def verify(q, c, k, v, g, n, extra):
            reselect = tree_reselect(mode, stored=extra) if role == "refresh" else tree_reselect(mode, injected=extra)
            return nsa_tree_verify(q, c, k, v, g, n, parents, layout=wide, kind=config.attention,
                                   schedule=TREE_SCHEDULE, kernels=backend, batch=batch, reselect=reselect)
        batched = jax.vmap(verify, in_axes=(0, 0, 0, 0, None if gates is None else 0, 0, 0))
        extra = stored if role == "refresh" else injected
        return per_layer(lambda c: batched(q, c, k, v, gates, length, extra), caches, reps)

    return one("refresh"), one("reuse") if mode.refresh_every > 1 else one("refresh")


def self_draft_ms(config, params, caches, linear, batch: int, context: int, parents: np.ndarray, dtype, key, reps: int):
    """ms of the self drafter's pass over a tree (vegas_jax.decode.drafters.SelfDrafter): one model pass per level with
    children, over that level's nodes, each layer attending the sink block, NSA's window and the node's path
    (vegas_jax.attention.nsa_tree.SinkWindowDraft); composed as the linear part at the level's width plus the
    layers' draft attention. `linear` caches linear-part times by rows (filled here as needed)."""
    ancestors = np.asarray(ancestor_mask(jnp.asarray(parents)))
    depths = ancestors.sum(axis=1) - 1
    has_children = np.isin(np.arange(len(parents)), parents)
    base = jnp.full((batch,), context - 1, jnp.int32)
    total = 0.0
    for depth in range(int(depths.max())):
        nodes = np.flatnonzero((depths == depth) & has_children)
        if nodes.size not in linear:
            linear[nodes.size] = linear_ms(config, params, batch, nodes.size, dtype, reps)
        draft = SinkWindowDraft(base[:, None] + jnp.asarray(nodes)[None], base, jnp.asarray(ancestors[nodes]),
                                config.nsa.select_block, config.nsa.window)
        level = new_tokens(config, batch, nodes.size, dtype, key)
        positions = jnp.broadcast_to(base[:, None] + depth, (batch, nodes.size))
        attention = per_layer(lambda c: draft(0, level, positions, c)[0], caches, reps)
        total += linear[nodes.size] + config.num_layers * attention
    return total


# A head trained at vegas_jax.train_draft_head's defaults attends to this many positions (its trained span).
DEFAULT_HEAD_WINDOW = draft_head_checkpoint.span(Settings.context_tokens, Settings.prompt_tokens, Settings.new_tokens)
HEAD_SPARE_SLOTS = 64  # the head cache's rows past the context: its tree's scratch rows (and generated rows)


def head_draft_ms(config, params, batch: int, context: int, parents: np.ndarray, reps: int, window: int) -> float:
    """ms of the head drafter's proposal over a tree: one head pass over the verified rows (depth + 1), then one
    per level with children, each with the target's LM head over its nodes (as HeadDrafter.propose runs them),
    every pass attending over the last `window` slots of the head's cache and the tree's scratch slots, gathered
    as HeadDrafter gathers them (window 0: the whole context)."""
    from models import draft_head

    ancestors = np.asarray(ancestor_mask(jnp.asarray(parents)))
    depths = ancestors.sum(axis=1) - 1
    levels = [np.flatnonzero((depths == d) & np.isin(np.arange(len(parents)), parents))
              for d in range(int(depths.max()))]
    dtype = params["embed"].dtype
    head = jax.tree.map(lambda x: x.astype(dtype), draft_head.init_params(config))
    hidden = jnp.zeros((batch, int(depths.max()) + 1, config.hidden_size), dtype)

    slots = context + HEAD_SPARE_SLOTS
    scratch = slots - len(parents) + jnp.arange(len(parents))
    if window and window < context:  # the window's slots, then the tree's scratch slots
        read = jnp.concatenate([window_slots(jnp.full((batch,), context - 1), window, context),
                                jnp.broadcast_to(scratch, (batch, len(parents)))], axis=1)
    else:
        read = None
    width = slots if read is None else read.shape[1]

    @jax.jit
    def propose(head):
        k, v = draft_head.empty_cache(config, batch, slots, dtype)
        visible = jnp.ones((batch, 1, width), bool)
        rows = jnp.broadcast_to(jnp.arange(hidden.shape[1]), hidden.shape[:2])
        out, k, v = draft_head.features(head, params, config, hidden, rows, rows, k, v, rows, visible, read)
        logits = [draft_head.logits(params, config, out[:, -1:])]
        for nodes in levels[1:]:
            at = jnp.broadcast_to(jnp.asarray(nodes), (batch, len(nodes)))
            out, k, v = draft_head.features(head, params, config, out[:, :1].repeat(len(nodes), 1), at, at, k, v,
                                            slots - len(parents) + at, visible, read)
            logits.append(draft_head.logits(params, config, out))
        return [jax.lax.top_k(x, 4)[1] for x in logits]

    return ms(propose, head, reps)


def ngram_draft_ms(batch: int, context: int, depth: int, branching: int, reps: int) -> float:
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, context), 0, 50000)

    @jax.jit
    def draft(t):
        last = t[:, -2:]
        hit = (t[:, :-depth - 2] == last[:, :1]) & (t[:, 1:-depth - 1] == last[:, 1:])
        score = jnp.where(hit, jnp.arange(context - depth - 2), -1)
        _, starts = jax.lax.top_k(score, branching)
        return jnp.take_along_axis(t, (starts[..., None] + 2 + jnp.arange(depth)).reshape(batch, -1), axis=1)

    return ms(draft, tokens, reps)


def dense_pass_ms(config, params, batch: int, context: int, parents: np.ndarray | None, placement, dtype,
                  reps: int) -> float:
    """ms of one whole pass of a dense model as its loop verifies: a plain step's one row (parents None) or a
    tree's nodes (VerifyAttention, TreeAttention; kernels where the placement has them) over a cache holding
    `context` positions, written in place (donated) as the loop's is: measured whole, not composed."""
    cache = KVCache.create(config, batch, context + HEAD_SPARE_SLOTS, dtype)
    base = jnp.full((batch,), context - 1, jnp.int32)
    if parents is None:
        rows, attention, positions = 1, VerifyAttention(placement=placement), base[:, None]
    else:
        ancestors = ancestor_mask(jnp.asarray(parents))
        rows = len(parents)
        attention = TreeAttention(rows=base[:, None] + jnp.arange(rows)[None], base=base, ancestors=ancestors,
                                  placement=placement)
        positions = base[:, None] + (ancestors.sum(axis=1) - 1)[None]
    tokens = jnp.zeros((batch, rows), jnp.int32)
    run = jax.jit(functools.partial(forward, config=config), donate_argnums=(3,))
    carried = {"cache": cache}

    def call(p):
        logits, carried["cache"], _ = run(p, tokens, positions, carried["cache"], attention)
        return logits

    return ms(call, params, reps)


def dense_tables(config, params, batches, contexts, trees, placement, dtype, args, record, passes, drafts) -> None:
    """A dense model's profile: its exact passes, measured whole (plain steps and each tree's verification),
    and the drafts of the drafters whose trees need no KV selection (n-gram lookup, the draft head)."""
    for batch in batches:
        for context in contexts:
            record(passes, mode="exact", rows=1, batch=batch, context=context, source="measured",
                   ms=dense_pass_ms(config, params, batch, context, None, placement, dtype, args.reps))
            for depth, branching in trees:
                parents = full_tree_parents(depth, branching)
                record(passes, mode="exact", rows=len(parents), batch=batch, context=context, source="measured",
                       ms=dense_pass_ms(config, params, batch, context, parents, placement, dtype, args.reps))
                record(drafts, drafter="ngram", nodes=len(parents) - 1, batch=batch, context=context,
                       ms=ngram_draft_ms(batch, context, depth, branching, args.reps))
                record(drafts, drafter="head", nodes=len(parents) - 1, batch=batch, context=context,
                       window=args.head_window, ms=head_draft_ms(config, params, batch, context, parents, args.reps,
                                                                 args.head_window))


def read_distances(path: str | None) -> dict:
    """Each mode's distance from the exact target, from a benchmarks/measure_approx_modes.py JSON."""
    if path is None:
        return {}
    measured = json.loads(Path(path).read_text())
    return {m["mode"]: {"top1_disagreement": 1 - m["top1_agreement"], "greedy_agreement": m["greedy_agreement"]}
            for m in measured["modes"]}


def merge(paths: list[str], distances: str | None) -> int:
    """One profile of several runs' tables (the same model, device and dtype), the distances of the last run that
    has them or of `distances`."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    for key in ("model", "device", "dtype", "timing"):  # profiles before 2026-12-02 have no timing: wall time
        values = {d.get(key, "wall time") for d in docs}
        if len(values) > 1:
            raise SystemExit(f"error: --merge: the profiles differ in {key}: {sorted(values)}")
    merged = {**docs[-1], "merged_from": paths, "date": run_metadata()["date"],
              "complete": all(d.get("complete", True) for d in docs)}
    for table in ("kernels", "passes", "drafts"):
        merged[table] = [row for d in docs for row in d[table]]
    merged["distances"] = read_distances(distances) or next((d["distances"] for d in reversed(docs)
                                                             if d["distances"]), {})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(merged, f"ssv-profile-{merged['model']}-merged-{stamp}.json", RESULTS)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-view", choices=("smollm2-view", "smollm2", "nsa-1b", "tiny",
                                                                     "tiny-dense"),
                        help="smollm2: the dense model (its passes and the head's and n-gram drafts, for the "
                             "planner on dense models)")
    parser.add_argument("--contexts", default="4096,8192,16384")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--trees", default=DEFAULT_TREES, help="DEPTHxBRANCHING shapes verified")
    parser.add_argument("--modes", default=DEFAULT_MODES, help="approximate modes (ApproxMode labels)")
    parser.add_argument("--mode-trees", default="4x1,3x2,4x2",
                        help="the tree shapes (among --trees) verified under each approximate mode too")
    parser.add_argument("--distances", default=None,
                        help="a benchmarks/measure_approx_modes.py JSON: each mode's distance from the exact target")
    parser.add_argument("--head-window", type=int, default=DEFAULT_HEAD_WINDOW,
                        help="positions a draft head's row attends to (its checkpoint's training span; the "
                             "default is the span of vegas_jax.train_draft_head's defaults), 0: the whole context")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--merge", nargs="+", default=None, metavar="PROFILE",
                        help="write one profile of these profiles' tables together (runs split to fit a time limit)")
    parser.add_argument("--quick", action="store_true", help="contexts 4096,8192, batches 1,8, trees 2x1,4x1,3x2")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, interpret mode (CPU)")
    args = parser.parse_args(argv)
    if args.head_window < 0:
        parser.error(f"--head-window: positions (0: the whole context), got {args.head_window}")
    if args.merge:
        return merge(args.merge, args.distances)
    if args.quick:
        args.contexts, args.batches, args.trees, args.mode_trees = "4096,8192", "1,8", "2x1,4x1,3x2", "4x1,3x2"
    if args.smoke:
        args.model, args.contexts, args.batches, args.trees, args.modes, args.mode_trees, args.reps = (
            "tiny-dense" if args.model in ("smollm2", "tiny-dense") else "tiny",  # a dense model: the dense path
            "256", "2", "2x2", "s2w1r2", "2x2", 1)  # one cell; s2w1r2 both shares spans and reuses
        args.head_window = 64  # the head's drafts gather a window shorter than the context
    backend = "interpret" if args.smoke else "pallas"
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    config, params = load(args.model, dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    trees = [tuple(int(x) for x in spec.split("x")) for spec in args.trees.split(",")]
    modes = [ApproxMode.from_name(m) for m in args.modes.split(",")]
    mode_trees = {tuple(int(x) for x in spec.split("x")) for spec in args.mode_trees.split(",")}
    placement, layers, key = Placement(backend=backend), config.num_layers, jax.random.PRNGKey(0)
    kernels, passes, drafts, checks = [], [], [], []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    meta = run_metadata(format=PROFILE_FORMAT, version=PROFILE_VERSION, model=args.model, config=config.to_dict(),
                        dtype=str(jnp.dtype(dtype)), smoke=args.smoke,
                        timing="gpu kernel time" if jax.default_backend() == "gpu" else "wall time")

    def save(complete: bool):
        """The profile so far, rewritten whole: a run stopped by a time limit keeps the cells it measured."""
        doc = {**meta, "kernels": kernels, "passes": passes, "drafts": drafts,
               "distances": read_distances(args.distances), "fused_kernel_checks": checks, "complete": complete}
        save_results(doc, f"ssv-profile-{args.model}-{stamp}.json", None if args.smoke else RESULTS)

    def record(table, **fields):
        table.append(fields)
        print(json.dumps(fields), flush=True)
        save(complete=False)

    if config.attention == "dense":
        dense_tables(config, params, batches, contexts, trees, placement, dtype, args, record, passes, drafts)
        save(complete=True)
        return 0
    for batch in batches:
        linear = {rows: linear_ms(config, params, batch, rows, dtype, args.reps)
                  for rows in [1] + [tree_nodes(*t) + 1 for t in trees]}
        for rows, t in linear.items():
            record(kernels, kernel="linear", rows=rows, batch=batch, context=0, ms=t)
        for context in contexts:
            caches = layer_caches(config, batch, context, dtype, key)
            position = jnp.full((batch, 1), context - 1, jnp.int32)
            one = new_tokens(config, batch, 1, dtype, key)
            exact = NSAAttention(config.nsa, config.attention, placement)
            t_exact = per_layer(lambda c: exact(0, one, position, c)[0], caches, args.reps)
            record(kernels, kernel="nsa-decode", rows=1, batch=batch, context=context, ms=t_exact)
            record(passes, mode="exact", rows=1, batch=batch, context=context, ms=linear[1] + layers * t_exact,
                   source="composed")
            for mode in modes:
                attention = ApproxNSAAttention(config.nsa, mode, config.attention, placement)
                width = mode.selection_layout(config.nsa).top_n
                num_spans = -(-caches[0].k.shape[1] // mode.share_span) if mode.share_span > 1 else 1
                stored = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32),
                                          (batch, num_spans, config.num_kv_heads, width))  # each span's selection
                carried = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, config.num_kv_heads, 1, width))
                # A refresh layer derives a selection at a span's anchor only; the other S - 1 steps of the span
                # read the stored one.
                at = position - 1 - (context - 2) % mode.share_span  # an anchor
                refresh_at = lambda p: per_layer(lambda c: attention(0, one, p, ApproxLayerCache(c, stored))[0],
                                                 caches, args.reps)
                at_anchor = refresh_at(at)
                following = refresh_at(at + 1) if mode.share_span > 1 else at_anchor
                refresh = (at_anchor + (mode.share_span - 1) * following) / mode.share_span
                reuse_attention = dataclasses.replace(attention, carried=carried)
                checks.append(check_fused(reuse_attention, one, at, ApproxLayerCache(caches[0], stored),
                                          mode, batch, context))
                reuse = per_layer(lambda c: reuse_attention(1, one, at, ApproxLayerCache(c, stored))[0], caches,
                                  args.reps) if mode.refresh_every > 1 else refresh
                record(kernels, kernel="refresh-decode", mode=mode.name(), rows=1, batch=batch, context=context,
                       ms=refresh, at_anchor_ms=at_anchor, following_ms=following)
                record(kernels, kernel="reuse-decode", mode=mode.name(), rows=1, batch=batch, context=context,
                       ms=reuse)
                refreshing = sum(mode.refreshes(layer) for layer in range(layers))
                record(passes, mode=mode.name(), rows=1, batch=batch, context=context,
                       ms=linear[1] + refreshing * refresh + (layers - refreshing) * reuse, source="composed")
            length = jnp.full((batch,), context - 1, jnp.int32)
            for depth, branching in trees:
                parents = jnp.asarray(full_tree_parents(depth, branching))
                rows = len(parents)
                tree = new_tokens(config, batch, rows, dtype, key)
                q, k, v = tree.rotated()
                gates_axis = None if tree.gates is None else 0
                verify = jax.vmap(functools.partial(nsa_tree_verify, layout=config.nsa, kind=config.attention,
                                                    schedule=TREE_SCHEDULE, kernels=backend),
                                  in_axes=(0, 0, 0, 0, gates_axis, 0, None))
                t_tree = per_layer(lambda c: verify(q, c, k, v, tree.gates, length, parents), caches, args.reps)
                record(kernels, kernel="tree", schedule=TREE_SCHEDULE, rows=rows, batch=batch, context=context,
                       ms=t_tree)
                record(passes, mode="exact", rows=rows, batch=batch, context=context,
                       ms=linear[rows] + layers * t_tree, source="composed")
                record(drafts, drafter="ngram", nodes=rows - 1, batch=batch, context=context,
                       ms=ngram_draft_ms(batch, context, depth, branching, args.reps))
                record(drafts, drafter="head", nodes=rows - 1, batch=batch, context=context,
                       window=args.head_window, ms=head_draft_ms(config, params, batch, context,
                                                                 np.asarray(parents), args.reps, args.head_window))
                record(drafts, drafter="self", nodes=rows - 1, batch=batch, context=context,
                       ms=self_draft_ms(config, params, caches, linear, batch, context, np.asarray(parents), dtype,
                                        key, args.reps), source="composed")
                if (depth, branching) not in mode_trees:
                    continue
                for mode in modes:
                    refresh, reuse = approx_tree_ms(config, mode, caches, q, k, v, tree.gates, length, parents,
                                                    backend, args.reps)
                    record(kernels, kernel="tree-refresh", schedule=TREE_SCHEDULE, mode=mode.name(), rows=rows,
                           batch=batch, context=context, ms=refresh)
                    record(kernels, kernel="tree-reuse", schedule=TREE_SCHEDULE, mode=mode.name(), rows=rows,
                           batch=batch, context=context, ms=reuse)
                    refreshing = sum(mode.refreshes(layer) for layer in range(layers))
                    record(passes, mode=mode.name(), rows=rows, batch=batch, context=context,
                           ms=linear[rows] + refreshing * refresh + (layers - refreshing) * reuse, source="composed")
    save(complete=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
