"""Log-probabilities of the emitted tokens, from the logits the loop already has: the verification pass's slab (row j
scores the token emitted at position j of the iteration) and the bootstrap step's row. No extra forward pass.

They are the model's own distribution, log_softmax of the raw logits: before penalties, temperature and filters
(vLLM's default, `raw_logprobs`), so they are what `Engine.score` gives for the same tokens and what a plain
forward pass over the final sequence gives, whatever the sampling settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.logical_axes import BATCH, axes_field


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its log-probability and the `k` most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Per request, aligned with the output buffer."""

    chosen: jax.Array = axes_field(BATCH, None)  # [B, N] float32
    top_ids: jax.Array = axes_field(BATCH, None, None)  # [B, N, max(K, 1)] int32
    top_values: jax.Array = axes_field(BATCH, None, None)  # [B, N, max(K, 1)] float32

    @classmethod
    def create(cls, batch: int, width: int, k: int) -> "Logprobs":
        k = max(k, 1)  # with none asked for, one column that is never written: no array has a zero-sized axis
        return cls(jnp.zeros((batch, width), jnp.float32), jnp.zeros((batch, width, k), jnp.int32),
                   jnp.zeros((batch, width, k), jnp.float32))

    def write(self, logits: jax.Array, tokens: jax.Array, slots: jax.Array, k: int) -> "Logprobs":
        """logits [B, W, V] (raw), the token scored by each row [B, W], and its output slot [B, W] (past the buffer:
        not written)."""
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        rows = jnp.arange(tokens.shape[0])[:, None]
        chosen = self.chosen.at[rows, slots].set(jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0], mode="drop")
        if k == 0:
            return dataclasses.replace(self, chosen=chosen)
        values, ids = jax.lax.top_k(logp, k)
        return Logprobs(chosen, self.top_ids.at[rows, slots].set(ids.astype(jnp.int32), mode="drop"),
                        self.top_values.at[rows, slots].set(values, mode="drop"))


def host_list(chosen, top_ids, top_values, tokens: list[int], k: int) -> list[TokenLogprob]:
    """One request's TokenLogprobs from host copies of its rows of the buffers."""
    return [TokenLogprob(int(t), float(chosen[j]), [(int(i), float(v)) for i, v in zip(top_ids[j, :k],
                                                                                       top_values[j, :k])])
            for j, t in enumerate(tokens)]
