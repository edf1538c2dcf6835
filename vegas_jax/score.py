"""`python -m vegas_jax.score`: log-probabilities and perplexity of given continuations (`Engine.score`).

The input is a JSON Lines file, one pair a line: {"prompt": ..., "continuation": ...}, each a string or a list of
token ids (strings are tokenized without the chat template, as lm-eval-harness does). It prints one line per pair
(tokens, sum of log-probabilities, whether every token was the model's most likely one) and the perplexity over all
continuation tokens; --output-json writes the same with each token's log-probability.

Exit status: 0; 2 for bad input, one `error:` line naming the flag, file or line; 130 when interrupted (SIGINT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from vegas_jax.cli.arguments import (DTYPES, INTERRUPTED, OneLineErrors, flag, load_checkpoint, mesh_of,
                                     read_text, resolve_dtype)
from vegas_jax.cli.outputs import check_json_path, write_json
from vegas_jax.inputs import InputError
from vegas_jax.runtime.scoring import perplexity


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="python -m vegas_jax.score", description=__doc__.splitlines()[0])
    p.add_argument("--model",
                   help="GGUF file, Hugging Face folder, or vegas-jax Orbax folder (default: embedded SmolLM2)")
    p.add_argument("--pairs", type=Path, required=True,
                   help='JSON Lines file: {"prompt": ..., "continuation": ...} per line (strings or token-id lists)')
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per pass")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per pass step (fewer bound memory)")
    p.add_argument("--mesh", default=None, help="data=D,model=M as for vegas_jax.generate; default: one device")
    p.add_argument("--output-json", type=Path, help="write every pair's scores and the perplexity to this file")
    return p


def read_pairs(path: Path) -> tuple[list, list]:
    """(prompts, continuations) from a JSON Lines file; InputError naming the file and line."""
    lines = read_text(path, "--pairs").splitlines()
    prompts, continuations = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            pair = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError("--pairs {} line {}: not JSON ({})", path, number, e.msg) from None
        if not isinstance(pair, dict) or set(pair) != {"prompt", "continuation"}:
            raise InputError('--pairs {} line {}: expected an object with exactly "prompt" and "continuation"', path,
                             number)
        prompts.append(pair["prompt"])
        continuations.append(pair["continuation"])
    if not prompts:
        raise InputError("--pairs {}: no pairs in the file", path)
    return prompts, continuations


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code
    try:
        prompts, continuations = read_pairs(args.pairs)
        if args.output_json:
            check_json_path(args.output_json)
        dtype_name, dtype = resolve_dtype(args.dtype)
        from vegas_jax.runtime.engine import Engine

        engine = Engine(load_checkpoint(args.model, dtype, mesh_of(args), "bf16"))  # scoring reads no drafts
        t0 = time.perf_counter()
        scored = engine.score(prompts, continuations, batch_size=args.batch_size, prefill_chunk=args.prefill_chunk)
        seconds = time.perf_counter() - t0
        for i, s in enumerate(scored):
            print(f"pair {i}: {len(s.tokens)} tokens  sum logprob {s.sum_logprob:.4f}  greedy {s.greedy}")
        total, tokens = perplexity(scored), sum(len(s.tokens) for s in scored)
        print(f"perplexity {total:.4f} over {tokens} tokens of {len(scored)} continuations ({dtype_name}, "
              f"{seconds:.2f}s)")
        if args.output_json:
            write_json(args.output_json, {"model": args.model or "embedded:SmolLM2-135M-Instruct",
                                           "dtype": dtype_name, "pairs": [dataclasses.asdict(s) for s in scored],
                                           "perplexity": total, "tokens": tokens, "seconds": seconds})
    except InputError as e:
        # The library names pairs by their index among the file's pairs (blank lines skipped), counted from 0.
        print(f"error: {e.render(_pair_flag)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        return INTERRUPTED
    return 0


def _pair_flag(name: str) -> str:
    return "--pairs" if name in ("prompts", "continuations") else flag(name)


if __name__ == "__main__":
    sys.exit(main())
