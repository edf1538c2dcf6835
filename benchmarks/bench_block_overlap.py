"""Block overlap between a query and its neighbours on real text (the SSV paper's figures 2 and 4), measured on
SmolLM2 through its NSA view (--attention nsa-view: top-16 blocks of 16 tokens, sink and own block forced):

    python benchmarks/bench_block_overlap.py --tokens 8192                 # the GPU run
    python benchmarks/bench_block_overlap.py --tokens 2048 --chunk 512     # a CPU run

The text (Python standard-library source, benchmarks.prompts) is prefilled in chunks with the view's attention
reporting every query's selected blocks per layer and KV head. For each distance δ in 1..--max-distance, over
queries t that select from more blocks than they keep (t >= top_n * block, so the overlap is not forced):
overlap(δ) = |S_t ∩ S_{t+δ}| / top_n (the shared fraction a union schedule saves) and Jaccard |∩| / |∪|, mean
over queries, KV heads and layers, and per layer. JSON benchmarks/results/block-overlap-<date>.json, and with
matplotlib (pip install -e '.[bench]') a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import stdlib_corpus  # noqa: E402
from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from models.decoder import forward  # noqa: E402
from models.nsa_cache import NSACache  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.attention.nsa import NSAAttention  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def selected_blocks(params, config, tokens: np.ndarray, chunk: int) -> np.ndarray:
    """[layers, H_kv, N, top_n] every query's selected blocks (NO_BLOCK pads) over tokens [N]."""
    cache = NSACache.create(config, 1, -(-len(tokens) // 128) * 128, params["embed"].dtype)
    attention = NSAAttention(config.nsa, config.attention, return_blocks=True)
    step = jax.jit(lambda cache, tokens, positions: forward(
        params, tokens, positions, cache, attention, config=config,
        logit_rows=jnp.zeros((1, 1), jnp.int32))[1:])
    pieces = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        positions = jnp.arange(start, start + len(piece), dtype=jnp.int32)[None]
        cache, aux = step(cache, jnp.asarray(piece, jnp.int32)[None], positions)
        pieces.append(np.stack([np.asarray(a[0]) for a in aux]))  # [layers, H_kv, S, n]
    return np.concatenate(pieces, axis=2)


def overlap_by_distance(blocks: np.ndarray, first: int, max_distance: int) -> dict:
    layers, heads, length, top_n = blocks.shape
    shared = np.zeros((layers, max_distance))
    jaccard = np.zeros((layers, max_distance))
    queries = np.arange(first, length - max_distance)
    for layer in range(layers):
        for head in range(heads):
            sets = [set(row[row >= 0]) for row in blocks[layer, head]]
            for d in range(1, max_distance + 1):
                common = np.array([len(sets[t] & sets[t + d]) for t in queries])
                union = np.array([len(sets[t] | sets[t + d]) for t in queries])
                shared[layer, d - 1] += np.mean(common / top_n) / heads
                jaccard[layer, d - 1] += np.mean(common / union) / heads
    return {"distance": list(range(1, max_distance + 1)), "shared_fraction": shared.mean(axis=0).tolist(),
            "jaccard": jaccard.mean(axis=0).tolist(), "shared_fraction_per_layer": shared.tolist(),
            "queries": len(queries)}


def plot(doc: dict, path: Path) -> None:
    import matplotlib  # the optional [bench] dependency, needed only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    o = doc["overlap"]
    ax.plot(o["distance"], o["shared_fraction"], label="shared blocks / top-n")
    ax.plot(o["distance"], o["jaccard"], label="Jaccard")
    ax.set_xlabel("distance between queries (tokens)")
    ax.set_ylabel("block overlap")
    ax.set_ylim(0, 1)
    ax.set_title(f"SmolLM2 NSA view, {doc['tokens']} tokens of real text")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--max-distance", type=int, default=64)
    args = parser.parse_args(argv)
    loaded = load_model(None)
    config = with_attention(loaded.config, "nsa-view")
    tokens = np.array(loaded.tokenizer.encode(stdlib_corpus()[:6 * args.tokens], add_special_tokens=False))
    if len(tokens) < args.tokens:
        raise SystemExit(f"--tokens {args.tokens}: the text gives only {len(tokens)} tokens")
    tokens = tokens[:args.tokens]
    blocks = selected_blocks(loaded.params, config, tokens, args.chunk)
    layout = config.nsa
    doc = run_metadata(tokens=args.tokens, layout=dataclasses.asdict(layout), dtype=str(loaded.params["embed"].dtype),
                       overlap=overlap_by_distance(blocks, layout.top_n * layout.select_block, args.max_distance))
    print(json.dumps({k: doc["overlap"][k][:8] for k in ("shared_fraction", "jaccard")}))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    name = f"block-overlap-{stamp}"
    save_results(doc, name + ".json", RESULTS)
    try:
        plot(doc, RESULTS / (name + ".png"))
    except ImportError:
        print("matplotlib is not installed: no figure (pip install -e '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
