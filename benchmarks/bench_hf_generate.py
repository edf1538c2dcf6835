"""Baseline: HF transformers `generate` (PyTorch, greedy) on the same GGUF, prompts and GPU as bench_decode.py.

    python benchmarks/bench_hf_generate.py --model PATH.gguf --batches 1,32 --prompt-tokens 4096 --max-new-tokens 256

Decode time = time of generate(N new tokens) - time of generate(1 new token) (the prefill), both after a warm-up;
every request is forced to N tokens (min_new_tokens) so the count is exact. Writes JSON to --out and $OUT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import long_prompts, stdlib_corpus  # noqa: E402
from benchmarks.results_io import check_writable, save_results  # noqa: E402
from vegas_jax.loading.gguf import load_gguf  # noqa: E402  (its tokenizer builds the same prompts)


def timed_generate(model, input_ids, attention_mask, new_tokens: int, cache: str) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, cache_implementation=cache, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-tokens", default="4096")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--cache", default="static", help="transformers cache_implementation (static | dynamic)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_writable("--out", args.out)

    tokenizer = load_gguf(args.model).tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(args.model.parent), gguf_file=args.model.name, dtype=torch.bfloat16
    ).cuda().eval()
    corpus = stdlib_corpus()
    records = []
    for prompt_tokens in [int(x) for x in args.prompt_tokens.split(",")]:
        for batch in [int(x) for x in args.batches.split(",")]:
            prompts = long_prompts(tokenizer, batch, prompt_tokens, corpus)
            width = max(map(len, prompts))
            ids = torch.zeros((batch, width), dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for i, pr in enumerate(prompts):  # left padding, as generate expects for decoder-only models
                ids[i, width - len(pr):] = torch.tensor(pr)
                mask[i, width - len(pr):] = 1
            ids, mask = ids.cuda(), mask.cuda()
            with torch.inference_mode():
                timed_generate(model, ids, mask, 8, args.cache)  # warm-up
                prefill = timed_generate(model, ids, mask, 1, args.cache)
                total = timed_generate(model, ids, mask, args.max_new_tokens, args.cache)
            decode_s = total - prefill
            rec = {
                "method": f"hf-transformers-{args.cache}",
                "batch": batch,
                "prompt_tokens": int(sum(map(len, prompts)) / batch),
                "max_new_tokens": args.max_new_tokens,
                "prefill_s": prefill,
                "decode_s": decode_s,
                "decode_tokens_per_s": batch * (args.max_new_tokens - 1) / decode_s,
            }
            records.append(rec)
            print(json.dumps(rec), flush=True)
    doc = {
        "device": torch.cuda.get_device_name(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "records": records,
    }
    name = f"hf-generate-{datetime.date.today().isoformat()}.json"
    save_results(doc, name, args.out)
    for r in records:
        print(f"{r['method']:24} batch {r['batch']:3d} prompt {r['prompt_tokens']:5d}  {r['decode_tokens_per_s']:9.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
