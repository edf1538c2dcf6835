"""Bytes per device before anything is allocated: parameters, the KV cache, and the decode loop's largest buffers,
each counted for one shard of the mesh, against what one device holds.

The estimate counts what the engine keeps live at its peak: the parameters, the draft passes' quantized weights
(models.draft_weights; none for bf16 drafts) and the decode state (cache, selection, policy state, output, with
penalties the token counts, with logprobs their buffers, the stop table) for the whole run, and on top of them the
largest of the transient arrays of one step (verification logits, their penalised copy and log-softmax when asked
for, and, when sampling, the draft and target distributions; the layers' selection scores;
prefill's MLP activations and, without kernels, its score arrays; under continuous batching a joining group's
state, which admission gathers onto every data shard). With the draft head as drafter, its params (and its draft
vocabulary's rows of the LM head) count as draft weights, and its K/V over the whole
context (one layer's, whole on every device: the head is not split over the model axis) is part of each
request's cache, and its score arrays are part of prefill's and of each step's buffers. XLA's own temporaries are
not counted, so the bound is what must fit, not everything that will be used; MARGIN leaves room for them.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from models import draft_weights
from models.config import ModelConfig
from vegas_jax.decode.drafters import head_prefill_piece
from models.decoder import param_axes
from models.logical_axes import HEADS, MLP
from models.nsa_cache import compressed_rows
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode
from models.quantized import nbytes
from vegas_jax.inputs import InputError
from vegas_jax.sharding import Placement

# Fraction of a device's memory the estimate may take: the rest is for XLA's temporaries and fragmentation.
MARGIN = 0.9
_GIB = 2**30


def _per_device(pairs, placement: Placement) -> int:
    """Bytes per device of (array, its Axes) pairs: the parameters split only over the model axis."""
    total = 0
    for array, axes in pairs:
        split = placement.model_shards if (HEADS in axes or MLP in axes) else 1
        total += nbytes(array) // split
    return total


def _params_per_device(params, placement: Placement) -> int:
    return _per_device(zip(jax.tree.leaves(params), jax.tree.leaves(param_axes(params))), placement)


def draft_per_device(draft, placement: Placement) -> int:
    """Bytes per device of a draft tree (arrays or ShapeDtypeStructs); 0 for None (bf16 drafts)."""
    return 0 if draft is None else _per_device(draft_weights.leaves_with_axes(draft), placement)


def estimate(config: ModelConfig, params, placement: Placement, *, batch: int, capacity: int, gamma: int,
             k_max: int, policy: str, output_width: int, sampling: bool, prefill_chunk: int,
             refill: int | None, penalties: bool = False, logprobs: int | None = None,
             stop_table: tuple[int, int] = (1, 1), draft=None, quest_page: int = 16,
             approx_mode: ApproxMode = EXACT_MODE, kept_prefill: bool = False, head_slots: int = 0,
             head_bytes: int = 0) -> dict:
    """Bytes per device, by part; `total` is what must fit. draft: the draft tree (or its shapes), None for
    bf16 drafts. kept_prefill: a copy of the cache is held besides (vegas_jax.runtime.prefill_reuse).
    head_slots: the draft head's K/V rows per request (vegas_jax.decode.drafters.HeadMemory; 0: no head);
    head_bytes: its params with its draft vocabulary's readout, whole on every device (counted as draft weights)."""
    dtype = np.dtype(params["embed"].dtype).itemsize
    rows = batch // placement.data_shards
    kv_heads = config.num_kv_heads // placement.model_shards
    heads = config.num_heads // placement.model_shards
    layers, vocab = config.num_layers, config.vocab_size
    # One sequence's K and V rows, and an NSA layer's compressed rows besides (models.nsa_cache).
    rows_kept = capacity + (compressed_rows(config.nsa, capacity) if config.nsa is not None else 0)
    cache_row = 2 * layers * rows_kept * kv_heads * config.head_dim * dtype
    cache_row += 2 * head_slots * config.num_kv_heads * config.head_dim * dtype
    if not approx_mode.is_exact:  # its stored span selections (vegas_jax.attention.nsa_approx.ApproxNSACache)
        spans = -(-capacity // approx_mode.share_span) if approx_mode.share_span > 1 else 1
        cache_row += layers * spans * kv_heads * approx_mode.selection_layout(config.nsa).top_n * 4

    # Per request beyond its cache: the output, and with logprobs each token's value and alternatives (id, value).
    request_row = output_width * 4 * (1 if logprobs is None else 2 + 2 * max(logprobs, 1))
    if penalties:
        request_row += vocab * (4 + 1)  # emitted-token counts and the prompt's tokens
    state = rows * (cache_row + request_row) + int(np.prod(stop_table)) * 4
    if gamma:
        state += layers * rows * k_max * 4  # selected positions
    if policy == "quest":
        state += 2 * layers * rows * (capacity // quest_page) * kv_heads * config.head_dim * dtype  # page min / max

    verify_rows = gamma + 1
    slab = rows * verify_rows * vocab * 4
    logits = slab * (1 + penalties + (logprobs is not None))  # raw, penalised, log-softmax
    if sampling:
        # target and draft distributions, and the sorted copy top-k / top-p filtering makes
        logits += rows * (2 * verify_rows + gamma) * vocab * 4
    scores = layers * rows * capacity * 4 * (verify_rows if policy == "last" else 1) if gamma else 0
    prefill = 2 * 4 * rows * prefill_chunk * config.intermediate_size // placement.model_shards
    if not placement.uses_kernels:
        prefill += 3 * 4 * rows * heads * prefill_chunk * capacity
    if head_slots:  # the head's float32 scores over its cache: a level of drafts, a piece of a prefill chunk
        head_scores = 3 * 4 * rows * config.num_heads * head_slots
        scores += head_scores * verify_rows
        prefill += (head_scores * head_prefill_piece(rows, prefill_chunk, config.num_heads, head_slots)
                    + rows * prefill_chunk * config.hidden_size * dtype)  # and the chunk's hidden states
    joining = refill * (cache_row + request_row) if refill else 0
    parts = {
        "params": _params_per_device(params, placement),
        "draft_weights": draft_per_device(draft, placement) + head_bytes,
        "kv_cache": rows * cache_row,
        "decode_state": state,
        "largest_step_buffers": max(logits + scores, prefill),
        "joining_group": joining,
        "kept_prefill": rows * cache_row if kept_prefill else 0,
    }
    parts["total"] = (parts["params"] + parts["draft_weights"] + parts["decode_state"] + parts["largest_step_buffers"]
                      + joining + parts["kept_prefill"])
    return parts


def device_bytes(placement: Placement) -> tuple[int, str]:
    """(bytes one device can hold, where that number comes from)."""
    device = (jax.local_devices() if placement.mesh is None else
              [d for d in placement.mesh.devices.flat if d.process_index == jax.process_index()])[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    # CPU devices share the host's memory.
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, len(jax.local_devices())), "host memory / local devices"


def check_fits(parts: dict, placement: Placement) -> None:
    """InputError naming the flags that shrink the plan when it does not fit one device."""
    limit, source = device_bytes(placement)
    if parts["total"] > MARGIN * limit:
        gib = lambda key: f"{parts[key] / _GIB:.2f}"
        raise InputError(
            "{max_model_len} / {slots} / {mesh}: this run needs {} GiB per device (params {}, draft weights {}, KV "
            "cache {}, decode state {}, step buffers {}{}) but a device has {:.2f} GiB ({}, {} % usable): shorten "
            "the context, run fewer sequences at once, or spread them over more devices",
            gib("total"), gib("params"), gib("draft_weights"), gib("kv_cache"), gib("decode_state"),
            gib("largest_step_buffers"),
            f", a kept prefill {gib('kept_prefill')}" if parts.get("kept_prefill") else "",
            limit / _GIB, source, math.floor(MARGIN * 100),
        )
