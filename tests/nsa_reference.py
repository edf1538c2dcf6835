"""An independent float64 numpy NSA: the oracle of the NSA tests. Written from the NSA rules as ssv-nsa.md states
them (fla-org / XunhaoLai), one query row at a time with plain loops, sharing no code with the package.

Rows are queries at positions t over keys 0..t (q, k after RoPE): compressed keys are means of complete
compressed blocks; block scores are the compressed probabilities summed over a KV group, spread onto selection
blocks by XunhaoLai's transform; the forced blocks come first, then the best scores (ties: lower block);
selected, window and compressed branches are softmaxes mixed by the gates ("nsa"), or selected and window rows in
one softmax ("nsa-view").
"""

from __future__ import annotations

import numpy as np


def _softmax_attend(q, k, v):
    """q [D] over k, v [N, D]; zero with no key."""
    if len(k) == 0:
        return np.zeros(v.shape[-1]), np.zeros(0)
    logits = k @ q / np.sqrt(q.shape[-1])
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return p @ v, p


def selected_blocks(q_group, k_head, t, layout):
    """The selection blocks of the query heads q_group [G, D] of one KV head at position t (keys k_head [t+1, D]),
    forced blocks first, and the group's compressed probabilities per head [G, num complete blocks]."""
    l, d, sel = layout.compress_block, layout.compress_stride, layout.select_block
    complete = [i for i in range(t + 1) if i * d + l - 1 <= t]
    k_cmp = np.array([k_head[i * d:i * d + l].mean(axis=0) for i in complete]).reshape(len(complete), k_head.shape[-1])
    probs = np.array([_softmax_attend(qh, k_cmp, k_cmp)[1] for qh in q_group])  # [G, C]
    cmp_score = probs.sum(axis=0) if len(complete) else np.zeros(0)
    a, r = l // d, sel // d
    own = t // sel
    scores = {}
    for j in range(own + 1):
        total = 0.0
        for u in range(a):
            for w in range(r):
                i = j * r + u + w - (a - 1)
                if 0 <= i < len(cmp_score):
                    total += cmp_score[i]
        scores[j] = total
    forced = lambda j: j < layout.forced_initial or own - layout.forced_local < j <= own
    ranked = sorted(scores, key=lambda j: (not forced(j), -scores[j], j))
    return ranked[:layout.top_n], probs, k_cmp


def nsa_rows(q, k, v, gates, layout, kind, rows, blocks_of=None):
    """Outputs [len(rows), H_q, D] float64 of queries q [T, H_q, D] at positions `rows` over k, v [T, H_kv, D];
    gates [T, H_q, 3] (compressed, selected, window) for kind "nsa". blocks_of(t, h), if given, names the blocks
    (negative entries: none) the query at t attends through KV head h instead of its own selection."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_q, num_kv = q.shape[1], k.shape[1]
    group = num_q // num_kv
    l, d, sel, w = layout.compress_block, layout.compress_stride, layout.select_block, layout.window
    out = np.zeros((len(rows), num_q, q.shape[2]))
    for n, t in enumerate(rows):
        for h in range(num_kv):
            heads = range(h * group, (h + 1) * group)
            blocks, probs, _ = selected_blocks(q[t, list(heads)], k[:t + 1, h], t, layout)
            if blocks_of is not None:
                blocks = blocks_of(t, h)
            chosen = sorted({r for j in blocks if j >= 0 for r in range(j * sel, min((j + 1) * sel, t + 1))})
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


def rope(x, positions, theta):
    """Rotate-half RoPE (HF) of x [T, H, D] at positions [T], float64."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = np.asarray(positions, np.float64)[:, None] * inv
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def model_logits(weights: dict, hf: dict, layout, tokens, layer_blocks=None) -> np.ndarray:
    """Logits [T, V] float64 of fla-org's LlamaNSAForCausalLM over `tokens`, from its safetensors weights
    (torch [out, in] linears, g_proj viewed as [..., H_q, 3]) and config.json `hf`. layer_blocks(i, q, k), if
    given, returns layer i's blocks_of for nsa_rows (its rotated q [T, H_q, D] and k [T, H_kv, D] at hand)."""
    w = {name: np.asarray(x, np.float64) for name, x in weights.items()}
    eps, heads, kv = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    dim = hf.get("head_dim") or hf["hidden_size"] // heads
    norm = lambda x, scale: x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale
    x = w["model.embed_tokens.weight"][tokens]
    t = np.arange(len(tokens))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(len(t), heads, dim), t, hf["rope_theta"])
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(len(t), kv, dim), t, hf["rope_theta"])
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(len(t), kv, dim)
        gates = 1 / (1 + np.exp(-(h @ w[p + "self_attn.g_proj.weight"].T).reshape(len(t), heads, 3)))
        blocks_of = layer_blocks(i, q, k) if layer_blocks else None
        attn = nsa_rows(q, k, v, gates, layout, "nsa", list(t), blocks_of).reshape(len(t), heads * dim)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T
