"""A batch's start (`Engine.start`, and each admission group of `Engine.serve`): its decode state created straight
into its shards, prefill of all but each prompt's last token in chunks (vegas_jax.runtime.prefill_chunks), then the
bootstrap step. The state returned is the one a decode loop starts from. With the draft head as drafter, each chunk
also writes the head's K/V rows of its positions (loop.prefill_chunk_with_head), so the head drafts over the whole
prompt."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import draft_head
from models.decoder import param_axes
from models.logical_axes import axes_of
from vegas_jax.decode import iteration as loop
from vegas_jax.decode import penalties
from vegas_jax.decode import sampling
from vegas_jax.runtime.compilation import Programs
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.runtime.options import GenerationOptions
from vegas_jax.runtime.prefill_chunks import prefill_chunk, prefill_spans
from vegas_jax.runtime.prefill_reuse import PrefillReuse


def initial_state(model: LoadedModel, programs: Programs, ids, options: GenerationOptions, config: loop.DecodeConfig,
                  capacity: int, stop_table: np.ndarray, first_request: int, *, rows: int | None = None,
                  finished: bool = False) -> loop.DecodeState:
    """The state of these requests before prefill, created straight into its shards; request i (counted from
    first_request) is seeded with options.seed + i, whatever batch it runs in. Rows past the requests (up to
    `rows`) are padding that never generates."""
    batch = len(ids) if rows is None else rows
    padded = list(ids) + [ids[-1]] * (batch - len(ids))
    in_prompt = penalties.prompt_mask(padded, model.config.vocab_size) if config.sampling.penalties else None
    prompt_tokens = None
    if config.tree is not None and config.drafter == "ngram":  # the drafter looks tokens up in the prompts
        prompt_tokens = np.zeros((batch, capacity), np.int32)
        for i, p in enumerate(padded):
            prompt_tokens[i, : len(p)] = p
    host = (
        np.asarray([len(p) for p in padded], np.int32),
        np.asarray([p[-1] for p in padded], np.int32),
        np.where(np.arange(batch) < len(ids), options.max_new_tokens, 0).astype(np.int32),
        (np.arange(batch) + first_request + options.seed).astype(np.int32),
        stop_table, in_prompt, prompt_tokens,
        tuple(np.float32(v) for v in options.sampling_values), np.bool_(finished),
    )
    create = functools.partial(_new_state, config=config, capacity=capacity, dtype=model.params["embed"].dtype)
    key = ("init", config, capacity, jax.tree.map(np.shape, host))
    return programs.kept(key, lambda: config.placement.creator(create, *host))(*host)


def prefill(model: LoadedModel, programs: Programs, ids, options: GenerationOptions, config: loop.DecodeConfig,
            capacity: int, stop_table: np.ndarray, timings: dict, *, first_request: int = 0, rows: int | None = None,
            progress=None, fill_cache=None, reuse_prefill: PrefillReuse | None = None,
            head=None) -> loop.DecodeState:
    """Prefill in chunks (prefill_spans: two compilations at most for any length), then the bootstrap step. Adds
    to timings' compile_s and prefill_s. With `fill_cache` (`Engine.start`'s), that function makes the cache
    instead of prefill (the head's rows, with `head`, stay empty: only the cost of decoding counts there); with
    `reuse_prefill`, the cache it keeps for these prompts and this layout, if any (timings' prefill_reused), and
    otherwise it keeps this prefill's. `head`: the draft head's params when the config's drafter is the head,
    whose memory prefill fills beside the cache (and `reuse_prefill` keeps with it)."""
    placement, params = config.placement, model.params
    batch = len(ids) if rows is None else rows
    lens = [len(p) for p in ids]
    chunk = prefill_chunk(model.config, batch, max(lens), capacity, options.prefill_chunk, placement)
    timings["prefill_chunk"] = chunk
    state = initial_state(model, programs, ids, options, config, capacity, stop_table, first_request, rows=batch)
    # What prefill fills: the cache, and with the head its memory (kept and reused together).
    filled = (state.cache, state.drafter_state) if head is not None else state.cache
    reuse_key = kept = None
    if reuse_prefill is not None and fill_cache is None:
        reuse_key = PrefillReuse.key(ids, filled, model=id(model), placement=placement, mode=config.mode,
                                     chunk=chunk, first_request=first_request, head=id(head))
        kept = reuse_prefill.fill(reuse_key, filled)
        if kept is not None:
            filled = kept
    timings["prefill_reused"] = kept is not None
    spans = [] if fill_cache or kept is not None else prefill_spans(max(lens) - 1, chunk)
    width = spans[-1][0] + spans[-1][1] if spans else 0
    tokens, following = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
    for i, p in enumerate(ids if spans else ()):  # no spans: nothing to prefill (fill_cache, a kept prefill)
        # following: the token after each prefilled row, which the head's row reads
        tokens[i, : len(p) - 1], following[i, : len(p) - 1] = p[:-1], p[1:]
    t0 = time.perf_counter()
    p_axes, cache_axes, state_axes = param_axes(params), axes_of(state.cache), axes_of(state)
    compiled = {}
    for size in sorted({size for _, size in spans}):
        steps = (placement.put(np.zeros((batch, size), np.int32), loop.PREFILL_TOKENS_AXES),) * 2
        if head is None:
            compiled[size] = programs.compile(
                "prefill", loop.prefill_chunk, params, state.cache, *steps, donate=(1,), layout=placement,
                in_axes=(p_axes, cache_axes, loop.PREFILL_TOKENS_AXES, loop.PREFILL_TOKENS_AXES),
                out_axes=cache_axes, model=model.config, placement=placement, mode=config.mode,
            )
        else:
            memory_axes = axes_of(state.drafter_state)
            compiled[size] = programs.compile(
                "prefill-head", loop.prefill_chunk_with_head, params, head, state.cache, state.drafter_state, *steps,
                steps[0], donate=(2, 3), layout=placement,
                in_axes=(p_axes, draft_head.param_axes(head), cache_axes, memory_axes,
                         *(loop.PREFILL_TOKENS_AXES,) * 3),
                out_axes=(cache_axes, memory_axes), model=model.config, placement=placement, mode=config.mode,
            )
    bootstrap = programs.compile("bootstrap", loop.bootstrap, params, state, donate=(1,), layout=placement,
                                 in_axes=(p_axes, state_axes), out_axes=state_axes, config=config)
    timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - t0

    t0 = time.perf_counter()
    if fill_cache:
        filled = (fill_cache(state.cache), state.drafter_state) if head is not None else fill_cache(state.cache)
    for step, (start, size) in enumerate(spans):
        positions = placement.put(np.broadcast_to(np.arange(start, start + size, dtype=np.int32), (batch, size)),
                                  loop.PREFILL_TOKENS_AXES)
        chunk_tokens = placement.put(tokens[:, start : start + size], loop.PREFILL_TOKENS_AXES)
        if head is None:
            filled = compiled[size](params, filled, chunk_tokens, positions)
        else:
            next_tokens = placement.put(following[:, start : start + size], loop.PREFILL_TOKENS_AXES)
            filled = compiled[size](params, head, *filled, chunk_tokens, next_tokens, positions)
        if progress:
            progress("prefill", step + 1, len(spans))
    if reuse_key is not None and kept is None:
        reuse_prefill.keep(reuse_key, filled)
    cache, memory = filled if head is not None else (filled, state.drafter_state)
    state = bootstrap(params, dataclasses.replace(state, cache=cache, drafter_state=memory))
    jax.block_until_ready(state.output)
    timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
    return state


def _new_state(lengths, last, max_new, seeds, stop_table, in_prompt, prompt_tokens, sampling_values, finished, *,
               config, capacity, dtype) -> loop.DecodeState:
    """The decode state of a batch before prefill (initial_state), from host arrays."""
    batch = lengths.shape[0]
    state = loop.init_state(
        config,
        config.family.create_cache(config.model, batch, capacity, dtype),
        lengths, last, max_new, jax.vmap(jax.random.key)(seeds),
        sampling.SamplingParams.create(batch, *sampling_values),
        stop_table,
        None if in_prompt is None else penalties.History.of_prompts(in_prompt),
        prompt_tokens,
    )
    return dataclasses.replace(state, done=jnp.full_like(state.done, finished))
