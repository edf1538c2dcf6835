"""How far each approximate mode's modified target (vegas_jax.ssv.precision.ApproxMode) is from the exact target, on
the SmolLM2 NSA view (real weights): plain decoding of each target (vegas_jax.attention.nsa_approx), no trees.

- top1_agreement: over held-out real text (Python standard-library source, benchmarks.prompts, after the first
  --prompt-tokens tokens of each text), how often the mode's next-token argmax equals the exact target's, both
  teacher-forced over the same text in one pass;
- perplexity of that text under each, and their difference;
- greedy agreement over --new-tokens generated tokens from each text's first --prompt-tokens tokens: the equal
  prefix and the fraction of positions equal.

    python benchmarks/measure_approx_modes.py                                             # the GPU run
    python benchmarks/measure_approx_modes.py --prompt-tokens 1024 --new-tokens 48 --texts 1 --modes s8w1r1,s1w1r2
                                                                                          # a short CPU run
    python benchmarks/measure_approx_modes.py --smoke --out /tmp/approx                   # tiny random model (CPU)

The view differs from dense only past what its blocks cover (16 blocks of 16 plus a 128-token window), so the
modes differ from the exact target only past that too. JSON: benchmarks/results/approx-modes-<date>.json (--out,
and $OUT), rewritten after every mode ("complete": false until the last); benchmarks/profile_ssv.py --distances
reads it. Prints a line per text scored and per mode measured.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import stdlib_corpus  # noqa: E402
from benchmarks.random_model import TINY, TINY_NSA_LAYOUT, random_model  # noqa: E402
from benchmarks.results_io import RecordLog, check_writable, run_metadata  # noqa: E402
from vegas_jax.attention.family import with_attention  # noqa: E402
from vegas_jax.attention.nsa_approx import greedy_decode, prefill_logits  # noqa: E402
from vegas_jax.loading import load_model  # noqa: E402
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODES = "s2w1r1,s4w1r1,s4w2r1,s8w1r1,s1w1r2,s4w1r2,s1w1r3"


def scored(logits: np.ndarray, tokens: np.ndarray, start: int):
    """(argmax [N], log p of the next token [N]) of rows start..T-2 of logits [T, V] over tokens [T]."""
    rows = logits[start:-1]
    logp = rows - jax.nn.logsumexp(jnp.asarray(rows), axis=-1, keepdims=True)
    return rows.argmax(-1), np.take_along_axis(np.asarray(logp), tokens[start + 1:, None], axis=1)[:, 0]


def held_out_texts(loaded, count: int, span: int, smoke: bool) -> list[np.ndarray]:
    """count texts of span tokens each: consecutive slices of the standard library's source (random tokens with
    --smoke, whose model has no tokenizer)."""
    if smoke:
        rng = np.random.default_rng(0)
        return [rng.integers(0, loaded.config.vocab_size, span).astype(np.int32) for _ in range(count)]
    # About 3 characters per token in source code: twice that much text is enough.
    corpus = loaded.tokenizer.encode(stdlib_corpus()[:6 * span * count], add_special_tokens=False)
    return [np.asarray(corpus[i * span:(i + 1) * span], np.int32) for i in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--texts", type=int, default=4, help="held-out texts (each scored and generated from)")
    parser.add_argument("--modes", default=DEFAULT_MODES, help="ApproxMode labels")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on random tokens: checks the script")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    check_writable("--out", args.out)
    gpu = jax.default_backend() == "gpu"
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.texts, args.modes = 96, 6, 1, "s2w1r2"
        loaded = random_model(TINY, jnp.float32)
        config = with_attention(TINY, "nsa-view", TINY_NSA_LAYOUT)
    else:
        loaded = load_model(None, jnp.bfloat16 if gpu else jnp.float32)
        config = with_attention(loaded.config, "nsa-view")
    modes = [ApproxMode.from_name(m) for m in args.modes.split(",")]
    span = args.prompt_tokens + args.new_tokens
    texts = held_out_texts(loaded, args.texts, span, args.smoke)
    prompts = np.stack([t[:args.prompt_tokens] for t in texts])

    def measure(mode):
        top1, logp, generated = [], [], None
        for i, text in enumerate(texts):
            logits = np.asarray(prefill_logits(loaded.params, config, text[None], mode)[0], np.float32)
            argmax, lp = scored(logits, text, args.prompt_tokens - 1)
            top1.append(argmax)
            logp.append(lp)
            print(f"{mode.name()}: text {i + 1}/{len(texts)} scored, perplexity {math.exp(-lp.mean()):.3f}", flush=True)
        generated = greedy_decode(loaded.params, config, prompts, args.new_tokens, mode,
                                  backend="pallas" if gpu else "reference")[0]
        return np.concatenate(top1), np.concatenate(logp), generated

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    model = "tiny random nsa-view" if args.smoke else "smollm2-135m nsa-view"
    meta = run_metadata(model=model, dtype=str(loaded.params["embed"].dtype), prompt_tokens=args.prompt_tokens,
                        new_tokens=args.new_tokens, texts=args.texts, backend=jax.default_backend(),
                        layout=config.nsa.__dict__)
    log = RecordLog(meta, f"approx-modes-{'smoke-' if args.smoke else '' if gpu else 'cpu-'}{stamp}.json", args.out,
                    key="modes")
    exact_top1, exact_logp, exact_tokens = measure(EXACT_MODE)
    exact_ppl = math.exp(-exact_logp.mean())
    for mode in modes:
        top1, logp, tokens = measure(mode)
        equal_prefix = [int(np.argmax(np.append(a != b, True))) for a, b in zip(exact_tokens, tokens)]
        ppl = math.exp(-logp.mean())
        log.add(dict(mode=mode.name(), share_span=mode.share_span, widen=mode.widen,
                     refresh_every=mode.refresh_every, top1_agreement=float((top1 == exact_top1).mean()),
                     scored_tokens=int(top1.size), perplexity=ppl, perplexity_exact=exact_ppl,
                     perplexity_difference=ppl - exact_ppl, greedy_agreement=float((tokens == exact_tokens).mean()),
                     greedy_equal_prefix=equal_prefix, new_tokens=args.new_tokens))
        print(log.records[-1], flush=True)
    log.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
