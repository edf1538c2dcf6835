"""How far the training-free NSA view of SmolLM2 (--attention nsa-view) is from dense SmolLM2: perplexity of
held-out real text (Python standard-library source, benchmarks.prompts) through the engine's scoring path, and
greedy agreement (tokens equal before the first difference, and in all) over --new-tokens generated tokens.

    python benchmarks/measure_nsa_view.py --prompt-tokens 7936 --new-tokens 256     # the GPU run (8K in all)
    python benchmarks/measure_nsa_view.py --prompt-tokens 1024 --new-tokens 64      # a CPU run

The view differs from dense only past what its blocks cover (16 blocks of 16 plus a 128-token window), so
prompts must be longer than that for the distance to mean anything. JSON: benchmarks/results/nsa-view-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import stdlib_corpus  # noqa: E402
from benchmarks.results_io import run_metadata, save_results  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.runtime.engine import Engine, GenerationOptions  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.runtime.scoring import perplexity  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--texts", type=int, default=4, help="held-out texts scored (and prompts generated from)")
    args = parser.parse_args(argv)
    loaded = load_model(None)
    if args.prompt_tokens + args.new_tokens > loaded.config.max_position_embeddings:
        parser.error(f"--prompt-tokens {args.prompt_tokens} plus --new-tokens {args.new_tokens} is more than the "
                     f"model's context of {loaded.config.max_position_embeddings}")
    dense = Engine(loaded)
    view = Engine(dataclasses.replace(loaded, config=with_attention(loaded.config, "nsa-view")))
    span = args.prompt_tokens + args.new_tokens
    # About 3 characters per token in source code: twice that much text is enough, and tokenizing the whole
    # standard library is not.
    corpus = dense.tokenizer.encode(stdlib_corpus()[:6 * span * args.texts], add_special_tokens=False)
    texts = [corpus[i * span:(i + 1) * span] for i in range(args.texts)]
    prompts = [t[:args.prompt_tokens] for t in texts]
    continuations = [t[args.prompt_tokens:] for t in texts]
    ppl = {name: perplexity(engine.score(prompts, continuations, batch_size=1))
           for name, engine in (("dense", dense), ("nsa-view", view))}
    options = GenerationOptions(max_new_tokens=args.new_tokens)
    runs = {name: [r.tokens for r in engine.generate(prompts, options).requests]
            for name, engine in (("dense", dense), ("nsa-view", view))}
    agreement = []
    for a, b in zip(runs["dense"], runs["nsa-view"]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreement.append({"tokens": len(a), "equal_prefix": first,
                          "equal": sum(x == y for x, y in zip(a, b)) / max(len(a), 1)})
    doc = run_metadata(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, texts=args.texts,
                       dtype=str(loaded.params["embed"].dtype),
                       layout=dataclasses.asdict(view.config.nsa), perplexity=ppl, greedy_agreement=agreement)
    print(doc)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    save_results(doc, f"nsa-view-{stamp}.json", RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
