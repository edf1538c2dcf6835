"""A float64 numpy transcription of the approximate modes' modified targets (vegas_jax.ssv.precision's docstring), one
query row at a time with plain loops over the oracle's NSA rules (tests/nsa_reference.py), sharing no code with the
package: refresh layer R(l) = l - l % r; the selection of (l, t, h) is the oracle's top-(c n) selection of layer
R(l)'s query at the span anchor a(t) = t - t % S; every other branch is the query's own."""

from __future__ import annotations

import dataclasses

import numpy as np

import nsa_reference
from nsa_reference import selected_blocks


def anchor_selection(q, k, layout, span, widen, t, h, group):
    """The top-(widen n) selection of the span anchor of position t, KV head h."""
    a = t - t % span
    wide = dataclasses.replace(layout, top_n=layout.top_n * widen)
    return selected_blocks(q[a, h * group:(h + 1) * group], k[:a + 1, h], a, wide)[0]


def model_logits(weights: dict, hf: dict, layout, tokens, span: int, widen: int, refresh_every: int) -> np.ndarray:
    """Logits [T, V] float64 of fla-org's LlamaNSAForCausalLM (safetensors `weights`, config.json `hf`) as the
    modified target of mode (span, widen, refresh_every): the oracle's model with each layer's blocks replaced."""
    group = hf["num_attention_heads"] // hf["num_key_value_heads"]
    selections = {}

    def layer_blocks(i, q, k):
        if i % refresh_every == 0:
            selections[i] = {(r, h): anchor_selection(q, k, layout, span, widen, r, h, group)
                             for r in range(len(tokens)) for h in range(k.shape[1])}
        chosen = selections[i - i % refresh_every]
        return lambda r, h: chosen[(r, h)]

    return nsa_reference.model_logits(weights, hf, layout, tokens, layer_blocks)
