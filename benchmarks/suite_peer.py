"""The peer: Hugging Face transformers' greedy `generate` (PyTorch) on the same GGUF, held-out prompts, batch and
length as the suite's plain decoding, set up as fairly as transformers allows: bf16, its static cache, SDPA
attention, and prompts of exactly equal length, so no padding and an all-ones attention mask.

Decode time is the time of generate(N new tokens) minus generate(1 new token) (its prefill), each repeat after a
warm-up, every request forced to N tokens (min_new_tokens), so the token count is exact. torch and transformers
are imported only here: the JAX stages never need them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from benchmarks.suite_presets import PEER_MODEL_S, Preset, hf_step_s

PEER_METHOD = "hf-transformers-static"


@functools.cache
def _model(path: str):
    import torch
    import transformers

    gguf = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    return model.cuda().eval()


def _versions() -> dict:
    import torch
    import transformers

    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "device": torch.cuda.get_device_name()}


def peer_run(model_path: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    import torch

    from benchmarks.bench_hf_generate import timed_generate

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the peer takes prompts of one length (no padding)")
    model = _model(model_path)
    ids = torch.tensor(prompts, dtype=torch.long).cuda()
    mask = torch.ones_like(ids)
    rates, prefills = [], []
    with torch.inference_mode():
        timed_generate(model, ids, mask, 8, "static")  # warm-up: allocations, the static cache
        for _ in range(repeats):
            prefill = timed_generate(model, ids, mask, 1, "static")
            total = timed_generate(model, ids, mask, new_tokens, "static")
            rates.append(len(prompts) * (new_tokens - 1) / (total - prefill))
            prefills.append(prefill)
    return {
        "repeats": repeats,
        "decode_tokens_per_s": float(np.median(rates)),
        "decode_tokens_per_s_min": min(rates),
        "decode_tokens_per_s_max": max(rates),
        "decode_tokens_per_s_runs": rates,
        "prefill_s": float(np.median(prefills)),
        "new_tokens": new_tokens,
        "dtype": "bfloat16",
        "attention": "sdpa",
        "cache": "static",
        **_versions(),
    }


def run_peer(session, preset: Preset) -> None:
    for batch, length in preset.peer:
        fields = {"stage": "peer", "method": PEER_METHOD, "batch": batch, "prompt_tokens": length,
                  "split": "heldout", "temperature": 0.0}
        if not session.missing(fields):
            continue
        estimate = (PEER_MODEL_S if _model.cache_info().currsize == 0 else 0.0) + (preset.repeats + 1) * (
            preset.new_tokens * hf_step_s(batch, length) + 2 * batch * length / 100e3)
        prompts = session.prompts("heldout", batch, length)
        session.measure({**fields, "prompts_sha256": prompts.provenance["prompts_sha256"]}, estimate,
                        lambda: peer_run(session.model_path, prompts.prompts, preset.new_tokens, preset.repeats))
