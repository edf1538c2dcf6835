"""How prefill is cut into chunks: the chunk size a batch can afford (memory bounds of the jnp path and of the MLP's
activations, one shard's rows and heads) and the spans that cover a prompt with at most two compiled sizes."""

from __future__ import annotations

from models.config import ModelConfig
from vegas_jax.runtime.options import round_up
from vegas_jax.sharding import Placement

# Without kernels, prefill attends each chunk to the whole cache through float32 score arrays [B, H_q, chunk, T]
# (about three live at once): the chunk shrinks so that these stay under this many bytes whatever the batch and
# context. The kernel keeps its scores on chip.
PREFILL_SCORE_BYTES = 2**33
# Prefill runs a chunk of every sequence at once, and the MLP's gate and up activations are its largest arrays (2 x
# intermediate values per token, counted as float32): the chunk shrinks so that they stay under this many bytes.
PREFILL_ACTIVATION_BYTES = 2**33
# Prefill runs full chunks, then, where the rest of the longest prompt fills at most half a chunk, chunks of this
# many tokens: a prompt just past a multiple of a large chunk does not pay for a chunk of padding. On the H200 a
# 512-token chunk took about half a 2048-token one's time at batch 1 and a quarter at batch 64 (7.9K-token
# prompts, benchmarks/results/prefill-2026-11-30-s12*.json), so the small chunks never cost more than the big one.
PREFILL_TAIL_CHUNK = 512


def _largest_chunk(budget_bytes: int, bytes_per_chunk_token: int) -> int:
    """Largest multiple of 16 (at least 16) of chunk tokens that fit the budget."""
    return max(16, budget_bytes // bytes_per_chunk_token // 16 * 16)


def prefill_chunk_for_memory(batch: int, num_heads: int, capacity: int) -> int:
    """The largest prefill chunk whose float32 score arrays (the jnp path's) fit PREFILL_SCORE_BYTES."""
    return _largest_chunk(PREFILL_SCORE_BYTES, 3 * 4 * batch * num_heads * capacity)


def prefill_chunk_for_activations(batch: int, intermediate_size: int) -> int:
    """The largest prefill chunk whose MLP activations fit PREFILL_ACTIVATION_BYTES."""
    return _largest_chunk(PREFILL_ACTIVATION_BYTES, 2 * 4 * batch * intermediate_size)


def prefill_chunk(model: ModelConfig, batch: int, longest: int, capacity: int, requested: int,
                  placement: Placement) -> int:
    """The prefill chunk for a batch of this many rows whose longest prompt has `longest` tokens: at most
    `requested` (GenerationOptions.prefill_chunk), the memory bounds counting one shard's rows and heads."""
    rows, shards = batch // placement.data_shards, placement.model_shards
    chunk = min(requested, round_up(longest - 1, 16) or 16,
                prefill_chunk_for_activations(rows, model.intermediate_size // shards))
    if not placement.uses_kernels or model.attention != "dense":  # NSA prefills through jnp
        chunk = min(chunk, prefill_chunk_for_memory(rows, model.num_heads // shards, capacity))
    return chunk


def prefill_spans(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, size) of the prefill steps covering positions [0, num_tokens): chunks of `chunk` while a whole one
    fits; the rest in chunks of PREFILL_TAIL_CHUNK where they fill at most half a chunk, else in one more padded
    chunk. At most two sizes, each compiled once for any length."""
    whole = num_tokens // chunk * chunk
    tail = PREFILL_TAIL_CHUNK if round_up(num_tokens - whole, PREFILL_TAIL_CHUNK) <= chunk // 2 else chunk
    return [(start, chunk) for start in range(0, whole, chunk)] + [
        (start, tail) for start in range(whole, num_tokens, tail)
    ]
