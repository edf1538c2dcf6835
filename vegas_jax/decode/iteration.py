"""The decode loop's state and phases: chunked prefill, a bootstrap step, then the iterations of one jitted
`lax.while_loop` (vegas_jax.decode.loop), each of which drafts γ tokens with sparse attention, verifies them in
one full-attention pass, accepts a prefix, and selects the next draft's KV. With γ = 0 the iteration is exactly
plain autoregressive decoding (no drafts, no selection).

Every verified position's logits are processed as plain decoding would process them after that position's own
prefix: penalties (vegas_jax.decode.penalties) count the drafts before the row on top of the emitted tokens, in the draft
steps and in verification alike, so greedy output stays plain greedy output and speculative sampling stays exact.
Stops (vegas_jax.decode.stops: ids and strings) are found on each emitted token, also inside a run of accepted drafts.

Drafts may read weight-only quantized copies of the linear weights (`draft_params`, models.draft_weights);
verification always reads the model's own, so the output does not depend on them. With adaptive γ
(vegas_jax.decode.adaptive_gamma) each iteration drafts g <= γ tokens, g chosen in the loop, and g = 0 is a plain step.

Lengths: `committed[b]` tokens of sequence b have verified K/V at positions [0, committed). `last_token[b]`, the
newest emitted token, has no K/V yet; the next verification writes it at position `committed`. Draft K/V are
written at their true positions and overwritten by that verification, so only verified K/V is ever kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.decoder import forward
from models.kv_cache import KVCache
from models.logical_axes import BATCH, Axes, axes_field, axes_of
from models.quantized import overlay
from vegas_jax.decode import adaptive_gamma
from vegas_jax.decode import penalties
from vegas_jax.decode import sampling
from vegas_jax.decode.logprobs import Logprobs
from vegas_jax.attention.family import family_of
from vegas_jax.decode.draft_kernel import with_kernel
from vegas_jax.decode.drafters import HeadMemory, Verified, make_drafter, prefill_rows
from vegas_jax.ssv.precision import EXACT_MODE, ApproxMode
from vegas_jax.decode.selection import Policy, SelectContext, Selection
from vegas_jax.sharding import Placement
from vegas_jax.decode.tree_shapes import TreeShape


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Everything static about a compiled loop (hashable)."""

    model: ModelConfig
    gamma: int
    policy: Policy | None  # None: plain decoding (γ must be 0)
    score_mode: str
    sampling: sampling.SamplingMode
    max_new_tokens: int  # width of the output buffer (each request's own limit is DecodeState.max_new)
    placement: Placement = Placement()  # attention backend and mesh
    logprobs: int | None = None  # log-probabilities of the emitted tokens and this many alternatives; None: off
    draft_weights: str = "bf16"  # what the drafts read: bf16 (the model's weights) | int8 | int4 (draft_params)
    draft_activations: str = "bf16"  # what their quantized products multiply: bf16 | int8 (vegas_jax.decode.draft_kernel)
    adaptive_gamma: bool = False  # gamma is γ_max; each iteration drafts as many as adaptive_gamma chooses
    # A draft tree (vegas_jax.decode.tree_iteration) in place of the chain of γ drafts; γ is then its depth.
    tree: TreeShape | None = None
    # With a tree (vegas_jax.decode.drafters): self (the model's cheaper draft: a dense model's reads the policy) |
    # ngram | head (a trained draft head, models.draft_head: the loop's draft_params are its params).
    drafter: str = "self"
    # The approximate NSA mode whose modified target every pass runs (vegas_jax.ssv.precision; exact: the model).
    mode: ApproxMode = EXACT_MODE
    # With the head drafter: its rows see the last this many positions (the span it was trained over); 0: all.
    head_window: int = 0

    def __post_init__(self):
        if self.tree is None:
            if (self.policy is None) != (self.gamma == 0):
                raise ValueError("a selection policy is needed exactly when gamma > 0")
        else:
            if self.gamma != self.tree.depth:
                raise ValueError(f"with a draft tree gamma is its depth {self.tree.depth}, got {self.gamma}")
            if (self.policy is not None) != (self.drafter == "self" and self.model.attention == "dense"):
                raise ValueError("a dense model's self drafter reads a selection policy's KV; the ngram drafter "
                                 "and an NSA model's self drafter none")
            if self.adaptive_gamma or self.sampling.penalties:
                raise ValueError("draft trees take neither adaptive gamma nor penalties")
        if self.policy is None and (self.adaptive_gamma or self.draft_weights != "bf16"):
            raise ValueError("adaptive gamma and quantized draft weights need sparse drafts")

    @property
    def verify_rows(self) -> int:
        """Tokens per sequence of a verification pass (the cache's spare rows past the longest sequence)."""
        return self.tree.rows if self.tree is not None else self.gamma + 1

    @property
    def drafts_with_head(self) -> bool:
        """A tree drafted by the trained draft head (its params are the loop's draft params, and prefill fills its
        memory)."""
        return self.tree is not None and self.drafter == "head"

    def plain(self) -> "DecodeConfig":
        """This loop's plain decoding step (adaptive γ's g = 0)."""
        return dataclasses.replace(self, gamma=0, policy=None, draft_weights="bf16", adaptive_gamma=False)

    @property
    def family(self):
        """The model's attention family running this loop's mode (vegas_jax.attention.family)."""
        return family_of(self.model, self.mode)

    def verify_attention(self, active: jax.Array | None = None, last_draft: jax.Array | None = None):
        request = self.policy.score_request(self.score_mode) if self.policy else None
        return self.family.full_attention(self.model, self.placement, request, active, last_draft)

    def forward(self, params, tokens, positions, cache, attention, logit_rows=None, with_hidden=False):
        """The model on this program's shard (models.decoder.forward with the mesh's tensor parallelism)."""
        return forward(params, tokens, positions, cache, attention, config=self.model, logit_rows=logit_rows,
                       tensor_parallel=self.placement.tensor_parallel, with_hidden=with_hidden,
                       scan_layers=self.placement.scan_layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Metrics:
    iterations: jax.Array = axes_field(BATCH)  # [B] verification passes (the bootstrap step not counted)
    drafted: jax.Array = axes_field(BATCH, None)  # [B, max(γ, 1)] drafts that counted, by position
    accepted: jax.Array = axes_field(BATCH, None)  # [B, max(γ, 1)] drafts accepted, by position
    # A tree's, by a node's rank among its siblings (0: the drafter's first choice) [B, most children]: the accepted
    # nodes that had a counted child of that rank, and such children accepted, so that a rank's acceptance rate
    # (its chance, given its parent was accepted) is their ratio: the --tree-rates that shape trees. None on chains.
    rank_offered: jax.Array | None = axes_field(BATCH, None, default=None)
    rank_accepted: jax.Array | None = axes_field(BATCH, None, default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Every array declares its logical axes (models.logical_axes): the mesh programs shard the state by them and
    `admit` replaces a request's rows by them, whatever fields the state (or a policy's state) has."""

    cache: KVCache
    committed: jax.Array = axes_field(BATCH)  # [B] int32
    last_token: jax.Array = axes_field(BATCH)  # [B] int32
    output: jax.Array = axes_field(BATCH, None)  # [B, N] int32 generated tokens
    num_generated: jax.Array = axes_field(BATCH)  # [B] int32
    max_new: jax.Array = axes_field(BATCH)  # [B] int32 per-request token limit (<= N)
    done: jax.Array = axes_field(BATCH)  # [B] bool
    nonfinite: jax.Array = axes_field(BATCH)  # [B] bool: stopped because logits were not finite
    keys: jax.Array = axes_field(BATCH)  # [B] per-request PRNG keys
    sampling: sampling.SamplingParams
    history: penalties.History | None  # emitted-token counts and prompt tokens; None without penalties
    stop_table: jax.Array = axes_field(None, None)  # [S, V] int32 (vegas_jax.decode.stops.table)
    stop_state: jax.Array = axes_field(BATCH)  # [B] int32: the stop automaton's state after the emitted text
    logprobs: Logprobs | None  # None without logprobs
    selection: Selection
    policy_state: Any  # Policy.init_state
    metrics: Metrics
    step: jax.Array = axes_field()  # scalar int32: iterations run
    gamma_control: adaptive_gamma.GammaControl | None = None  # with adaptive γ
    drafter_state: Any = ()  # a tree's drafter's memory (vegas_jax.decode.drafters: the ngram drafter's tokens so
    # far, the head drafter's K/V and pending rows)


def init_state(
    config: DecodeConfig,
    cache: KVCache,
    prompt_lengths: jax.Array,
    last_prompt_token: jax.Array,
    max_new: jax.Array,
    keys: jax.Array,
    sampling_params: sampling.SamplingParams,
    stop_table: jax.Array,
    history: penalties.History | None,
    prompt_tokens: jax.Array | None = None,
) -> DecodeState:
    """State after prefill of all but each prompt's last token (which the bootstrap step verifies). prompt_tokens
    [B, capacity] (each prompt from column 0): the ngram drafter's, None for the others."""
    drafter = make_drafter(config.drafter)
    batch = prompt_lengths.shape[0]
    policy, mc = config.policy, config.model
    if policy is not None:
        selection = policy.empty_selection(mc.num_layers, batch)
        policy_state = policy.init_state(mc, batch, cache.capacity, cache.k[0].dtype)
    else:
        # Never read. One column wide, not zero: no state array may have a zero-sized axis, since XLA's CPU
        # partitioner crashes on zero-sized shards (and the state crosses shard_map on a mesh).
        unused = jnp.zeros((mc.num_layers, batch, 1), jnp.int32)
        selection = Selection(unused, jnp.zeros((mc.num_layers, batch), jnp.int32), jnp.zeros((batch,), jnp.int32))
        policy_state = ()
    # Counts by draft position; with γ = 0 one column that stays zero (not zero columns, as above).
    gamma_counts = lambda: jnp.zeros((batch, max(config.gamma, 1)), jnp.int32)
    return DecodeState(
        cache=cache,
        committed=(prompt_lengths - 1).astype(jnp.int32),
        last_token=last_prompt_token.astype(jnp.int32),
        output=jnp.zeros((batch, config.max_new_tokens), jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        max_new=max_new.astype(jnp.int32),
        done=jnp.zeros((batch,), bool),
        nonfinite=jnp.zeros((batch,), bool),
        keys=keys,
        sampling=sampling_params,
        history=history,
        stop_table=stop_table.astype(jnp.int32),
        stop_state=jnp.zeros((batch,), jnp.int32),
        logprobs=None if config.logprobs is None else Logprobs.create(batch, config.max_new_tokens, config.logprobs),
        selection=selection,
        policy_state=policy_state,
        metrics=Metrics(jnp.zeros((batch,), jnp.int32), gamma_counts(), gamma_counts(),
                        *([None] * 2 if config.tree is None else
                          [jnp.zeros((batch, config.tree.children.shape[1]), jnp.int32)] * 2)),
        step=jnp.zeros((), jnp.int32),
        gamma_control=adaptive_gamma.GammaControl.create(config.gamma) if config.adaptive_gamma else None,
        drafter_state=(drafter.init_state(config, prompt_lengths, prompt_tokens, cache.capacity,
                                          _activations_dtype(cache))
                       if config.tree is not None else ()),
    )


def _activations_dtype(cache):
    """The dtype the model computes in: its cache's K/V's (whatever else the cache of its family holds)."""
    return next(x.dtype for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating))


def prefill_chunk(params, cache: KVCache, tokens, positions, *, model: ModelConfig, placement: Placement,
                  mode: ApproxMode = EXACT_MODE) -> KVCache:
    """Writes K/V of one chunk of prompt tokens [B, C] at the same positions in every sequence; logits are not
    needed. Causal attention through verification attention without scores: on the kernel backend its kernel
    tiles the chunk's query rows and reads each sequence's keys only up to the chunk."""
    rows = jnp.zeros((tokens.shape[0], 1), jnp.int32)
    attention = family_of(model, mode).full_attention(model, placement)
    _, cache, _ = forward(params, tokens, positions, cache, attention, config=model, logit_rows=rows,
                          tensor_parallel=placement.tensor_parallel, scan_layers=placement.scan_layers)
    return cache


def prefill_chunk_with_head(params, head, cache: KVCache, memory: HeadMemory, tokens, following, positions, *,
                            model: ModelConfig, placement: Placement,
                            mode: ApproxMode = EXACT_MODE) -> tuple[KVCache, HeadMemory]:
    """prefill_chunk for the head drafter: the chunk's last hidden states also feed the draft head (`head`, its
    params), whose K/V rows for these positions go into its memory (vegas_jax.decode.drafters.prefill_rows), each
    row reading the token after it, following [B, C]. Only the chunk's hidden states are ever live."""
    rows = jnp.zeros((tokens.shape[0], 1), jnp.int32)
    attention = family_of(model, mode).full_attention(model, placement)
    _, cache, _, hidden = forward(params, tokens, positions, cache, attention, config=model, logit_rows=rows,
                                  tensor_parallel=placement.tensor_parallel, with_hidden=True)
    return cache, prefill_rows(head, params, memory, hidden, following, positions, model)


PREFILL_TOKENS_AXES = Axes(BATCH, None)  # prefill_chunk's tokens and positions [B, C]


def _walk_stops(table: jax.Array, start: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The stop automaton over tokens [B, W] from states [B]: (a stop ends at token j [B, W], the state after
    token j [B, W])."""
    if table.shape[0] == 1:  # stop ids only: one state
        return (table[0][tokens] & 1).astype(bool), jnp.zeros_like(tokens)

    def step(current, token):
        entry = table[current, token]
        return entry >> 1, (entry >> 1, entry & 1)

    _, (states, ends) = jax.lax.scan(step, start, tokens.T)
    return ends.T.astype(bool), states.T


def _emit(state: DecodeState, candidates: jax.Array, count: jax.Array, active: jax.Array, logits: jax.Array,
          config: DecodeConfig) -> tuple[DecodeState, jax.Array]:
    """Appends candidates[b, :count[b]] to the output, cut after the first token that ends a stop, with what follows
    from them: the stop automaton's state, the emitted-token counts (with penalties) and the log-probabilities
    (with logprobs; candidate j's from the raw logits' row j, [B, W, V]). Returns (the state, hit_stop)."""
    width = candidates.shape[1]
    idx = jnp.arange(width)[None, :]
    ends, stop_states = _walk_stops(state.stop_table, state.stop_state, candidates)
    is_stop = ends & (idx < count[:, None])
    first_stop = jnp.argmax(is_stop, axis=1)
    hit_stop = jnp.any(is_stop, axis=1)
    count = jnp.where(hit_stop, first_stop + 1, count) * active
    emitted = idx < count[:, None]
    slots = jnp.where(emitted, state.num_generated[:, None] + idx, state.output.shape[1])
    rows = jnp.arange(candidates.shape[0])[:, None]
    last = jnp.take_along_axis(stop_states, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    state = dataclasses.replace(
        state,
        output=state.output.at[rows, slots].set(candidates, mode="drop"),
        num_generated=state.num_generated + count,
        stop_state=jnp.where(count > 0, last, state.stop_state),
    )
    if config.sampling.penalties:
        state = dataclasses.replace(state, history=state.history.add(candidates, emitted))
    if config.logprobs is not None:
        state = dataclasses.replace(state, logprobs=state.logprobs.write(logits[:, :width], candidates, slots,
                                                                          config.logprobs))
    return state, hit_stop & active


def _processed(logits: jax.Array, state: DecodeState, drafts: jax.Array, preceding: jax.Array,
               config: DecodeConfig) -> jax.Array:
    """The logits [B, R, V] sampling reads: penalised (when some request has a penalty) with each row's own
    history, the emitted tokens and drafts[:, :preceding[r]] (vegas_jax.decode.penalties.apply)."""
    if not config.sampling.penalties:
        return logits
    return penalties.apply(logits, state.history, state.sampling, drafts, preceding)


def _check_finite(logits: jax.Array, rows_used: jax.Array) -> jax.Array:
    """[B]: all logits of the rows that will be used are finite."""
    row_ok = jnp.all(jnp.isfinite(logits), axis=-1)  # [B, R]
    used = jnp.arange(logits.shape[1])[None, :] < rows_used[:, None]
    return jnp.all(row_ok | ~used, axis=1)


def step_keys(keys: jax.Array, step: jax.Array, count: int) -> jax.Array:
    """[count, B] keys, a pure function of each request's seed and its own step ([B] or scalar; 0: bootstrap,
    i + 1: the request's iteration i). Counting steps per request rather than per loop makes a request's random
    draws independent of when it joined a running batch (`admit`)."""
    step = jnp.broadcast_to(step, keys.shape)
    step_keys = jax.vmap(jax.random.fold_in)(keys, step)
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, count))(step_keys), 1, 0)


def request_step(state: DecodeState) -> jax.Array:
    """[B] each request's step for `step_keys`: its iterations so far plus one (an unfinished request emits in
    every iteration, so the count advances by one per iteration it takes part in)."""
    return state.metrics.iterations + 1


def bootstrap(params, state: DecodeState, *, config: DecodeConfig) -> DecodeState:
    """Verifies each prompt's last token: its K/V, the first generated token, and (Vegas) the first selection from
    that row's scores over the whole prompt."""
    positions, root = state.committed[:, None], state.last_token[:, None]
    drafter = make_drafter(config.drafter) if config.tree is not None else None
    logits, cache, scores, *hidden = config.forward(params, state.last_token[:, None], positions, state.cache,
                                                    config.verify_attention(),
                                                    with_hidden=drafter is not None and drafter.reads_hidden)
    finite = _check_finite(logits, jnp.ones_like(state.committed))
    (key,) = step_keys(state.keys, 0, 1)
    processed = _processed(logits, state, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((1,), jnp.int32),
                           config)[:, 0]
    if config.sampling.greedy:
        token = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    else:
        token = sampling.sample_rows(key, sampling.probabilities(processed, state.sampling, config.sampling))
    active = finite & (state.max_new > 0)
    state, hit_stop = _emit(state, token[:, None], jnp.ones_like(token), active, logits, config)
    committed = state.committed + 1
    state = dataclasses.replace(
        state,
        cache=cache,
        committed=committed,
        last_token=token,
        done=hit_stop | (state.num_generated >= state.max_new) | ~finite,
        nonfinite=~finite,
    )
    if drafter is not None:  # the drafter's first verified row: the prompt's last token, followed by `token`
        verified = Verified(positions[:, 0], active.astype(jnp.int32), root, token[:, None],
                            hidden[0] if hidden else None)
        state = dataclasses.replace(state, drafter_state=drafter.record(state.drafter_state, verified))
    if config.policy is None:
        return state
    scores = config.placement.mean_over_model(scores)
    ctx = SelectContext(scores, committed, committed, jnp.zeros_like(committed), cache, first=True)
    selection, policy_state = config.policy.select(ctx, state.selection, state.policy_state)
    return dataclasses.replace(state, selection=selection, policy_state=policy_state)


def draft(params, draft_params, state: DecodeState, keys: jax.Array, config: DecodeConfig, num_drafts: jax.Array,
          steps: int | None = None):
    """`steps` (default γ; adaptive γ: its g <= γ) sequential single-token forwards with sparse attention,
    reading `draft_params` (quantized weights) over `params` where given. Returns (cache, drafts [B, γ], draft
    probs [B, γ, V] or None, finite [B]: every counted draft step had finite logits); positions from `steps` on
    hold zeros."""
    gamma, batch = config.gamma, state.committed.shape[0]
    if (draft_params is None) != (config.draft_weights == "bf16"):
        raise ValueError(f"draft weights {config.draft_weights} need their copies (draft_params) and bf16 none")
    weights = params if draft_params is None else overlay(
        params, with_kernel(draft_params, config.placement, config.draft_activations))
    # A finished sequence's drafts are discarded: with no selected rows its draft attention reads only the few
    # recent ones, which makes the iterations where the batch waits for its slowest sequences cheaper.
    selection = state.selection
    selection = dataclasses.replace(selection, counts=jnp.where(state.done[None, :], 0, selection.counts))
    attention = config.policy.draft_attention(selection, state.policy_state)
    greedy = config.sampling.greedy
    probs = None if greedy else jnp.zeros((batch, gamma, config.model.vocab_size), jnp.float32)

    def step(j, carry):
        cache, token, drafts, probs, finite = carry
        logits, cache, _ = config.forward(weights, token[:, None], (state.committed + j)[:, None], cache, attention)
        finite = finite & (jnp.all(jnp.isfinite(logits[:, 0]), axis=-1) | (j >= num_drafts))
        logits = _processed(logits, state, drafts, j[None], config)[:, 0]  # draft j follows drafts 0..j-1
        if greedy:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            p = sampling.probabilities(logits, state.sampling, config.sampling)
            token = sampling.sample_rows(keys[j], p)
            probs = probs.at[:, j].set(p)
        return cache, token, drafts.at[:, j].set(token), probs, finite

    init = (state.cache, state.last_token, jnp.zeros((batch, gamma), jnp.int32), probs, jnp.ones((batch,), bool))
    cache, _, drafts, probs, finite = jax.lax.fori_loop(0, gamma if steps is None else steps, step, init)
    return cache, drafts, probs, finite


def verify(params, state: DecodeState, cache: KVCache, drafts: jax.Array, config: DecodeConfig,
           steps: int | None = None):
    """The full-attention pass over each sequence's newest token and its drafts [B, γ]: (logits [B, γ+1, V], cache,
    per-layer selection scores averaged over every head). steps: the drafts made (None: all γ; adaptive γ's g may
    be fewer than its pass holds); the scores take row g as the last draft's."""
    gamma = drafts.shape[1]
    tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    positions = state.committed[:, None] + jnp.arange(gamma + 1)[None, :]
    last_draft = None if steps in (None, gamma) else jnp.full(state.committed.shape, steps, jnp.int32)
    attention = config.verify_attention(~state.done, last_draft)
    logits, cache, scores = config.forward(params, tokens, positions, cache, attention)
    # One collective for every layer's scores (each shard has averaged its own heads).
    return logits, cache, config.placement.mean_over_model(scores)


def accept(state: DecodeState, logits, drafts, draft_probs, num_drafts, keys, config: DecodeConfig):
    """(accepted drafts [B], the token after them [B]) from the verification logits [B, γ+1, V] (raw; row i processed
    after the drafts before it): greedy verification, speculative sampling, or with γ = 0 a plain draw from the
    target."""
    logits = _processed(logits, state, drafts, jnp.arange(drafts.shape[1] + 1), config)
    if config.sampling.greedy:
        return sampling.accept_greedy(drafts, logits, num_drafts)
    target_probs = sampling.probabilities(logits, state.sampling, config.sampling)
    if config.gamma:
        return sampling.accept_speculative(keys[config.gamma], drafts, draft_probs, target_probs, num_drafts)
    return jnp.zeros_like(num_drafts), sampling.sample_rows(keys[0], target_probs[:, 0])


def select(state: DecodeState, verified: DecodeState, scores, accepted, config: DecodeConfig) -> DecodeState:
    """`verified` (the state after this iteration's acceptance) with the next draft's KV selection, from the
    verification of `state`."""
    ctx = SelectContext(scores, verified.committed, state.committed + 1, accepted, verified.cache, first=False)
    selection, policy_state = config.policy.select(ctx, state.selection, state.policy_state)
    return dataclasses.replace(verified, selection=selection, policy_state=policy_state)


def counted_drafts(state: DecodeState, most_drafts) -> jax.Array:
    """[B] the drafts of this iteration that count: never past the tokens still owed (the bonus token always
    comes on top of the accepted drafts), nor past `most_drafts` (adaptive γ's g: positions from g on hold no
    drafts, and verification treats them as rejected)."""
    return jnp.clip(state.max_new - state.num_generated - 1, 0, most_drafts)


def chain_iteration(params, draft_params, state: DecodeState, config: DecodeConfig, most_drafts: int,
                    width: int | None = None) -> DecodeState:
    """One draft -> verify -> accept -> select round for every unfinished sequence, with at most `most_drafts`
    drafts (γ, or adaptive γ's g; 0 and no draft params: a plain step), verified in a pass of `width` drafts
    (default γ; adaptive γ: the narrowest compiled pass that holds g)."""
    if not isinstance(most_drafts, int):  # a traced count would make the GPU wait on the host at every draft step
        raise TypeError(f"the drafts of an iteration are known when it is compiled, got {most_drafts!r}")
    gamma = config.gamma
    active = ~state.done
    num_drafts = counted_drafts(state, most_drafts)
    keys = step_keys(state.keys, request_step(state), gamma + 2)
    if gamma:
        cache, drafts, draft_probs, draft_finite = draft(params, draft_params, state, keys, config, num_drafts,
                                                         most_drafts)
        if width is not None:  # positions from g on hold no drafts: the pass verifies the first `width`
            drafts = drafts[:, :width]
            draft_probs = None if draft_probs is None else draft_probs[:, :width]
    else:
        cache, drafts, draft_probs = state.cache, jnp.zeros((state.committed.shape[0], 0), jnp.int32), None
        draft_finite = jnp.ones_like(active)

    logits, cache, scores = verify(params, state, cache, drafts, config, most_drafts)
    finite = draft_finite & _check_finite(logits, num_drafts + 1)
    accepted, next_token = accept(state, logits, drafts, draft_probs, num_drafts, keys, config)
    return conclude(state, config, cache=cache, drafts=drafts, accepted=accepted, next_token=next_token,
                    finite=finite, num_drafts=num_drafts, logits=logits, scores=scores, last_row=accepted)


def conclude(state: DecodeState, config: DecodeConfig, *, cache, drafts, accepted, next_token, finite, num_drafts,
             logits, scores, last_row, rank_counts=None, **fields) -> DecodeState:
    """The end of an iteration, over a chain or a tree: emits drafts[:, :accepted] ([B, γ], by position) and
    next_token, cut after a stop (logits [B, γ+1, V]: candidate j's distribution in row j), commits them, counts
    them, and selects the next draft's KV from the verification scores with the last accepted token in row
    `last_row`. rank_counts: a tree's (offered, accepted) [B, most children] by rank (Metrics). `fields`: more of
    the state that the iteration changed."""
    active = ~state.done
    emit_ok = active & finite
    width = drafts.shape[1] + 1
    candidates = jnp.concatenate([drafts, next_token[:, None]], axis=1)
    candidates = jnp.where(jnp.arange(width)[None, :] == accepted[:, None], next_token[:, None], candidates)
    emitted, hit_stop = _emit(state, candidates, accepted + 1, emit_ok, logits, config)
    committed = jnp.where(emit_ok, state.committed + accepted + 1, state.committed)

    positions_idx = jnp.arange(state.metrics.drafted.shape[1])[None, :]
    counted = emit_ok[:, None]
    metrics = dataclasses.replace(
        state.metrics,
        iterations=state.metrics.iterations + emit_ok,
        drafted=state.metrics.drafted + (counted & (positions_idx < num_drafts[:, None])),
        accepted=state.metrics.accepted + (counted & (positions_idx < accepted[:, None])),
    )
    if rank_counts is not None:  # a tree's (offered, accepted) by rank, this iteration's
        offered_now, accepted_now = rank_counts
        metrics = dataclasses.replace(metrics, rank_offered=metrics.rank_offered + counted * offered_now,
                                      rank_accepted=metrics.rank_accepted + counted * accepted_now)
    verified = dataclasses.replace(
        emitted,
        cache=cache,
        committed=committed,
        last_token=jnp.where(emit_ok, next_token, state.last_token),
        done=state.done | hit_stop | (emitted.num_generated >= state.max_new) | (active & ~finite),
        nonfinite=state.nonfinite | (active & ~finite),
        metrics=metrics,
        step=state.step + 1,
        **fields,
    )
    if config.policy is None:
        return verified
    return select(state, verified, scores, last_row, config)


def admit(running: DecodeState, joining: DecodeState, slots: jax.Array, *, config: DecodeConfig) -> DecodeState:
    """Continuous batching: the requests of `joining` (prefilled and bootstrapped with the same configuration and
    cache capacity) replace the finished ones in rows `slots` of a running batch; a slot past the batch drops its
    row (padding). Every array with a batch axis takes the joining rows; the others (the loop's step count, the
    stop table) stay the running batch's.

    On a mesh this program holds its data shard's rows of `running` and all of `joining`'s: each shard writes the
    joining rows whose slots fall in its range, so admitted requests land on their shard."""
    local_batch = running.committed.shape[0]
    local_slots = slots - config.placement.first_row(local_batch)
    local_slots = jnp.where((local_slots >= 0) & (local_slots < local_batch), local_slots, local_batch)
    return replace_rows(running, joining, local_slots)


def replace_rows(running, joining, slots: jax.Array):
    """`running` (a pytree of dataclasses whose arrays declare their logical axes) with rows `slots` of every
    array's batch axis replaced by `joining`'s rows; slots past the batch drop their row."""

    def take(axes: Axes, old: jax.Array, new: jax.Array) -> jax.Array:
        if BATCH not in axes:
            return old
        index = (slice(None),) * axes.index(BATCH) + (slots,)
        return old.at[index].set(new, mode="drop")

    return jax.tree.map(take, axes_of(running), running, joining)
