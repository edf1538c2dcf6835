"""History-dependent logits processing: the repetition, presence and frequency penalties, on device.

Semantics (on the raw logits, before temperature and the filters, as both libraries do):
- repetition (Hugging Face transformers' `RepetitionPenaltyLogitsProcessor`, also vLLM's): every token that occurs
  in the prompt or in the output so far has its logit divided by the penalty if positive, multiplied by it if not.
  Occurrence, not count: a token seen ten times is penalised once. 1 is off; the penalty must be > 0.
- presence and frequency (OpenAI's and vLLM's): logit - frequency * count - presence * (count > 0), where count is
  how often the token occurs in the output so far: the prompt does not count. 0 is off; both lie in [-2, 2]
  (negative values favour repetition).
Repetition is applied first, then frequency and presence, as vLLM does.

A speculative iteration scores γ + 1 positions at once, and position i's prefix ends with the drafts before it. So
row i of the verification logits (and draft step i) is penalised with the counts of the tokens emitted so far
(`History`, kept in the loop state, updated by the emitted tokens only) plus drafts 0..i-1: the distribution plain
decoding would use after that prefix. The drafts change the counts of at most γ tokens per row, so the rows are
penalised with the emitted counts everywhere and then, at the drafted tokens' columns only, recomputed with each
row's own counts and scattered back: a [B, rows, γ] gather and scatter rather than a [B, rows, V] array of counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.logical_axes import BATCH, axes_field
from vegas_jax.decode.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class History:
    """Per request and token: how often it was emitted, and whether the prompt has it."""

    counts: jax.Array = axes_field(BATCH, None)  # [B, V] int32: occurrences in the output so far
    in_prompt: jax.Array = axes_field(BATCH, None)  # [B, V] bool

    @classmethod
    def of_prompts(cls, in_prompt: jax.Array) -> "History":
        return cls(jnp.zeros(in_prompt.shape, jnp.int32), in_prompt)

    def add(self, tokens: jax.Array, counted: jax.Array) -> "History":
        """The counts after emitting tokens[b, j] where counted[b, j] (tokens [B, W])."""
        rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
        return dataclasses.replace(self, counts=self.counts.at[rows, tokens].add(counted.astype(jnp.int32)))


def prompt_mask(prompts: list[list[int]], vocab_size: int) -> np.ndarray:
    """Host-side [B, V] bool: which tokens each prompt contains."""
    mask = np.zeros((len(prompts), vocab_size), bool)
    for row, prompt in enumerate(prompts):
        mask[row, prompt] = True
    return mask


def _penalise(logits, count, in_prompt, params: SamplingParams):
    """The definition, elementwise on broadcastable arrays whose leading axis is the batch."""
    per_row = lambda x: x.reshape(x.shape + (1,) * (logits.ndim - 1))
    repetition = per_row(params.repetition_penalty)
    seen = in_prompt | (count > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - per_row(params.frequency_penalty) * count - per_row(params.presence_penalty) * (count > 0)


def apply(logits: jax.Array, history: History, params: SamplingParams, drafts: jax.Array,
          preceding: jax.Array) -> jax.Array:
    """Penalised logits [B, R, V] (float32). Row r's prefix is the emitted tokens (`history`) followed by drafts
    [B, G] 0..preceding[r]-1 ([R] int32); drafts past that do not count for it."""
    logits = logits.astype(jnp.float32)
    out = _penalise(logits, history.counts[:, None, :], history.in_prompt[:, None, :], params)
    if drafts.shape[1] == 0:
        return out
    # Row r's count of the token drafts[b, k]: its emitted count plus its occurrences among the drafts before r.
    # Right for every k, also k >= preceding[r] (then the draft is just some token), so no column is masked.
    same = drafts[:, :, None] == drafts[:, None, :]  # [B, k, m]
    before = jnp.arange(drafts.shape[1])[None, :] < preceding[:, None]  # [R, m]
    extra = jnp.einsum("bkm,rm->brk", same.astype(jnp.int32), before.astype(jnp.int32))
    rows = logits.shape[1]
    columns = jnp.broadcast_to(drafts[:, None, :], (drafts.shape[0], rows, drafts.shape[1]))  # [B, R, G]
    count = jnp.take_along_axis(history.counts, drafts, axis=1)[:, None, :] + extra
    in_prompt = jnp.take_along_axis(history.in_prompt, drafts, axis=1)[:, None, :]
    fixed = _penalise(jnp.take_along_axis(logits, columns, axis=-1), count, in_prompt, params)
    # Equal tokens among the drafts write equal values (same column, same row, same count).
    b = jnp.arange(drafts.shape[0])[:, None, None]
    r = jnp.arange(rows)[None, :, None]
    return out.at[b, r, columns].set(fixed)
