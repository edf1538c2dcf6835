"""Logits processing (temperature, top-k, top-p, min-p), sampling, and speculative acceptance, all on device.

Sampling parameters are per-request arrays, so a batch may mix greedy and sampled requests without recompiling.
A greedy row's distribution is the one-hot of its argmax; speculative sampling over one-hot distributions is
exactly greedy verification, so one acceptance rule serves both. When every request is greedy (`SamplingMode.
greedy`), the loop skips probabilities altogether and compares argmaxes.

The order is Hugging Face transformers' (and, but for min-p, vLLM's): the history-dependent penalties
(vegas_jax.decode.penalties) on the raw logits first, then temperature, top-k, top-p and min-p. Min-p keeps the tokens
whose probability after temperature is at least min_p times the most likely token's; top-k and top-p always keep
that token and renormalising keeps ratios, so filtering min-p on the tempered logits before or after top-k / top-p
keeps the same set (transformers applies it after them; vLLM before top-p, which differs when both are given).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.logical_axes import BATCH, axes_field


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """Static: which processing steps the compiled loop contains."""

    greedy: bool  # every request has temperature 0
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # some request has a repetition, presence or frequency penalty (greedy ones too)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: jax.Array = axes_field(BATCH)  # [B] float32; 0 means greedy
    top_k: jax.Array = axes_field(BATCH)  # [B] int32; 0 means off
    top_p: jax.Array = axes_field(BATCH)  # [B] float32; 1 means off
    min_p: jax.Array = axes_field(BATCH)  # [B] float32; 0 means off
    repetition_penalty: jax.Array = axes_field(BATCH)  # [B] float32; 1 means off (vegas_jax.decode.penalties)
    presence_penalty: jax.Array = axes_field(BATCH)  # [B] float32; 0 means off
    frequency_penalty: jax.Array = axes_field(BATCH)  # [B] float32; 0 means off

    @classmethod
    def create(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0) -> "SamplingParams":
        full = lambda value, dtype=jnp.float32: jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))
        return cls(full(temperature), full(top_k, jnp.int32), full(top_p), full(min_p), full(repetition_penalty),
                   full(presence_penalty), full(frequency_penalty))

    def mode(self) -> SamplingMode:
        """Host-side: the static mode these (concrete) parameters need."""
        greedy = bool(jnp.all(self.temperature == 0))
        return SamplingMode(
            greedy=greedy,
            top_k=not greedy and bool(jnp.any(self.top_k > 0)),
            top_p=not greedy and bool(jnp.any(self.top_p < 1)),
            min_p=not greedy and bool(jnp.any(self.min_p > 0)),
            penalties=bool(jnp.any(self.repetition_penalty != 1) | jnp.any(self.presence_penalty != 0)
                           | jnp.any(self.frequency_penalty != 0)),
        )


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def probabilities(logits: jax.Array, params: SamplingParams, mode: SamplingMode) -> jax.Array:
    """The distribution each row samples from, float32 [B, ..., V] (logits [B, ..., V], already penalised)."""
    logits = logits.astype(jnp.float32)
    nd = logits.ndim
    temperature = _per_row(params.temperature, nd - 1)
    greedy_row = temperature == 0
    scaled = logits / jnp.where(greedy_row, 1.0, temperature)[..., None]
    if mode.top_k or mode.top_p:
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        if mode.top_k:
            k = _per_row(params.top_k, nd - 1)
            kth = jnp.take_along_axis(ordered, jnp.clip(k - 1, 0, ordered.shape[-1] - 1)[..., None], axis=-1)
            scaled = jnp.where((k[..., None] > 0) & (scaled < kth), -jnp.inf, scaled)
            ordered = jnp.where((k[..., None] > 0) & (ordered < kth), -jnp.inf, ordered)
        if mode.top_p:
            # Keep the smallest prefix of the sorted distribution whose mass reaches top_p (at least one token).
            p = _per_row(params.top_p, nd - 1)
            sorted_probs = jax.nn.softmax(ordered, axis=-1)
            mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
            keep = mass_before < p[..., None]
            cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
            scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    if mode.min_p:
        # p >= min_p * p_max, in logits: scaled >= max + log(min_p) (min_p 0: log 0 = -inf keeps everything).
        floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(_per_row(params.min_p, nd - 1))[..., None]
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy_row[..., None], one_hot, probs)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per row from probs [..., V] (need not be normalised); key is a single PRNG key."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def sample_rows(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """Per-request keys [B] and probs [B, V] -> tokens [B]."""
    return jax.vmap(sample)(keys, probs)


def accept_greedy(draft_tokens: jax.Array, target_logits: jax.Array, num_drafts: jax.Array):
    """Greedy verification: the longest prefix of drafts equal to the target argmax, then the target's token.

    draft_tokens [B, γ], target_logits [B, γ+1, V], num_drafts [B] (drafts that count; the rest are ignored).
    Returns (accepted [B], next_token [B]).
    """
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    return _accept_prefix(draft_tokens == target[:, :-1], num_drafts, lambda n: _take_row(target, n))


def accept_speculative(
    keys: jax.Array,  # [B] per-request keys for this iteration
    draft_tokens: jax.Array,  # [B, γ]
    draft_probs: jax.Array,  # [B, γ, V], the distributions the drafts were sampled from
    target_probs: jax.Array,  # [B, γ+1, V]
    num_drafts: jax.Array,  # [B]
):
    """Speculative sampling (Leviathan et al.): accept d_i with probability min(1, p(d_i)/q(d_i)); at the first
    rejection draw from norm(max(0, p - q)); if every counted draft is accepted, draw the bonus from p's next row.
    The emitted tokens are then distributed exactly as sampling from p alone."""
    gamma = draft_tokens.shape[1]
    accept_keys, residual_keys = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k))(keys), 1, 0)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(accept_keys)
    p_draft = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]

    def next_token(accepted):
        p_row = _take_row(target_probs, accepted)
        q_row = _take_row(draft_probs, jnp.minimum(accepted, gamma - 1))
        rejected = (accepted < num_drafts)[:, None]
        residual = jnp.where(rejected, jnp.maximum(p_row - q_row, 0.0), p_row)
        return sample_rows(residual_keys, residual)

    return _accept_prefix(u * q_draft < p_draft, num_drafts, next_token)


def _take_row(x: jax.Array, row: jax.Array) -> jax.Array:
    idx = row.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def _accept_prefix(ok: jax.Array, num_drafts: jax.Array, next_token):
    counted = jnp.arange(ok.shape[1])[None, :] < num_drafts[:, None]
    accepted = jnp.sum(jnp.cumprod(ok & counted, axis=1), axis=1).astype(jnp.int32)
    return accepted, next_token(accepted)
