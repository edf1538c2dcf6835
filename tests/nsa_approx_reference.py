"""A float64 numpy transcription of the approximate modes' modified targets (vegas_jax.precision's docstring), one
query row at a time with plain loops over the oracle's NSA rules (tests/nsa_reference.py), sharing no code with the
package: refresh layer R(l) = l - l % r; the selection of (l, t, h) is the oracle's top-(c n) selection of layer
R(l)'s query at the span anchor a(t) = t - t % S; every other branch is the query's own."""

from __future__ import annotations

import dataclasses

import numpy as np

from nsa_reference import _softmax_attend, rope, selected_blocks


def rows_with_blocks(q, k, v, gates, layout, kind, rows, blocks_of):
    """Outputs [len(rows), H_q, D] of queries at positions `rows` (q [T, H_q, D], k, v [T, H_kv, D]) attending
    the blocks blocks_of(t, h) (negative entries: none) instead of their own selection."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_q, num_kv = q.shape[1], k.shape[1]
    group = num_q // num_kv
    l, d, sel, w = layout.compress_block, layout.compress_stride, layout.select_block, layout.window
    out = np.zeros((len(rows), num_q, q.shape[2]))
    for n, t in enumerate(rows):
        for h in range(num_kv):
            heads = list(range(h * group, (h + 1) * group))
            _, probs, _ = selected_blocks(q[t, heads], k[:t + 1, h], t, layout)
            chosen = sorted({r for j in blocks_of(t, h) if j >= 0 for r in range(j * sel, min((j + 1) * sel, t + 1))})
            window = list(range(max(0, t - w + 1), t + 1))
            v_cmp = np.array([v[i * d:i * d + l, h].mean(axis=0) for i in range(probs.shape[1])])
            for g, head in enumerate(heads):
                if kind == "nsa-view":
                    union = sorted(set(chosen) | set(window))
                    out[n, head] = _softmax_attend(q[t, head], k[union, h], v[union, h])[0]
                    continue
                o_cmp = probs[g] @ v_cmp if probs.shape[1] else np.zeros(q.shape[2])
                o_slc = _softmax_attend(q[t, head], k[chosen, h], v[chosen, h])[0]
                o_win = _softmax_attend(q[t, head], k[window, h], v[window, h])[0]
                gc, gs, gw = np.asarray(gates[t, head], np.float64)
                out[n, head] = gc * o_cmp + gs * o_slc + gw * o_win
    return out


def anchor_selection(q, k, layout, span, widen, t, h, group):
    """The top-(widen n) selection of the span anchor of position t, KV head h."""
    a = t - t % span
    wide = dataclasses.replace(layout, top_n=layout.top_n * widen)
    return selected_blocks(q[a, h * group:(h + 1) * group], k[:a + 1, h], a, wide)[0]


def model_logits(weights: dict, hf: dict, layout, tokens, span: int, widen: int, refresh_every: int) -> np.ndarray:
    """Logits [T, V] float64 of fla-org's LlamaNSAForCausalLM (safetensors `weights`, config.json `hf`) as the
    modified target of mode (span, widen, refresh_every)."""
    w = {name: np.asarray(x, np.float64) for name, x in weights.items()}
    eps, heads, kv = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    dim = hf.get("head_dim") or hf["hidden_size"] // heads
    norm = lambda x, scale: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale
    x = w["model.embed_tokens.weight"][tokens]
    t = np.arange(len(tokens))
    selections = {}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(len(t), heads, dim), t, hf["rope_theta"])
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(len(t), kv, dim), t, hf["rope_theta"])
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(len(t), kv, dim)
        gates = 1 / (1 + np.exp(-(h @ w[p + "self_attn.g_proj.weight"].T).reshape(len(t), heads, 3)))
        if i % refresh_every == 0:
            selections[i] = {(r, g): anchor_selection(q, k, layout, span, widen, r, g, heads // kv)
                             for r in t for g in range(kv)}
        chosen = selections[i - i % refresh_every]
        attn = rows_with_blocks(q, k, v, gates, layout, "nsa", list(t), lambda r, g: chosen[(r, g)])
        x = x + attn.reshape(len(t), heads * dim) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T
