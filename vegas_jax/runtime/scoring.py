"""Scoring given continuations (`Engine.score`): each continuation token's log-probability under the model after the
prompt and the continuation tokens before it, their sum, and whether every token was the model's most likely one
(lm-eval-harness's `loglikelihood` returns the sum and that flag). Perplexity over a set of continuations is
exp(-(sum of their log-probabilities) / (their token count)).

One prefill-style pass per batch: each prompt + continuation goes through the model in chunks (as prefill does,
writing the cache), and every chunk's logits are reduced on device at once to the log-probability of each position's
next token, so no [batch, length, vocabulary] array is ever whole. Pairs are sorted by length and batched, so
similar lengths share a batch; the batch rows, the chunk and the cache capacity are fixed for the whole call (one or
two compilations). Log-probabilities are log_softmax of the raw logits, as `GenerationOptions.logprobs` gives them.

Strings are tokenized as lm-eval-harness does: the prompt alone, then prompt + continuation, whose tokens past the
prompt's count are the continuation (so a token that spans the boundary is scored as the model would see it).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import forward, param_axes
from models.kv_cache import KVCache
from models.logical_axes import BATCH, Axes, axes_of
from vegas_jax import inputs
from vegas_jax.attention.family import family_of
from vegas_jax.runtime.compilation import Programs
from vegas_jax.inputs import InputError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.runtime.options import round_up
from vegas_jax.runtime.research_options import CAPACITY_ALIGN
from vegas_jax.sharding import Placement, round_up_to_shards

# Each chunk's logits, their log-softmax and a temporary of XLA's: the chunk shrinks so that these stay under this
# many bytes (float32 [rows, chunk, vocabulary], three of them) whatever the batch and vocabulary.
SCORE_LOGIT_BYTES = 2**31
TOKEN_AXES = Axes(BATCH, None)  # every [rows, chunk] array of a scoring step


@dataclasses.dataclass
class Scored:
    prompt_tokens: int
    tokens: list[int]  # the continuation's token ids
    logprobs: list[float]  # log p(tokens[j] | prompt, tokens[:j])
    sum_logprob: float
    greedy: bool  # every token was the argmax at its position

    @property
    def perplexity(self) -> float:
        return math.exp(-self.sum_logprob / len(self.tokens))


def perplexity(scored: list[Scored]) -> float:
    """Over all the continuations' tokens together."""
    return math.exp(-sum(s.sum_logprob for s in scored) / sum(len(s.tokens) for s in scored))


def score_chunk(params, cache: KVCache, tokens, positions, targets, *, model, placement: Placement):
    """One chunk [B, C] through the model, writing its K/V: (cache, log p(targets) [B, C], targets are the argmax
    [B, C]); a target of -1 is not scored (its values are meaningless)."""
    attention = family_of(model).full_attention(model, placement)
    logits, cache, _ = forward(params, tokens, positions, cache, attention, config=model,
                               tensor_parallel=placement.tensor_parallel, scan_layers=placement.scan_layers)
    logp = jax.nn.log_softmax(logits, axis=-1)
    index = jnp.maximum(targets, 0)[..., None]
    chosen = jnp.take_along_axis(logp, index, axis=-1)[..., 0]
    top = jnp.argmax(logits, axis=-1) == targets
    return cache, chosen, top


def _ids(tokenizer, prompt, continuation, index: int) -> tuple[list[int], list[int]]:
    """(prompt ids, continuation ids) of one checked pair (`inputs.prompt_batch`); strings as lm-eval-harness
    splits them."""
    for item, name in ((prompt, "prompts"), (continuation, "continuations")):
        if isinstance(item, list) and isinstance(item[0], dict):
            raise InputError("{" + name + "}: pair {} is a conversation; score strings or token ids", index)
    if isinstance(prompt, str) and isinstance(continuation, str):
        head = tokenizer.encode(prompt)
        whole = tokenizer.encode(prompt + continuation)
        prompt, continuation = whole[: len(head)], whole[len(head):]
    else:
        if isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)
        if isinstance(continuation, str):
            continuation = tokenizer.encode(continuation, add_special_tokens=False)
    if not prompt:
        raise InputError("{prompts}: pair {} has no prompt tokens (the first token has no probability to score)",
                         index)
    if not continuation:
        raise InputError("{continuations}: pair {} has no continuation tokens", index)
    return prompt, continuation


def score(model: LoadedModel, placement: Placement, programs: Programs, prompts, continuations, *,
          batch_size: int = 8, prefill_chunk: int = 2048, progress=None) -> tuple[list[Scored], dict]:
    """(one Scored per pair, in order; timings) under `model` on `placement`, its scoring chunk compiled into
    `programs` (an engine's). Prompts and continuations are batches as `Engine.generate` takes them (a bare string
    is one); InputError naming the argument for bad pairs or sizes."""
    config = model.config
    prompts = inputs.prompt_batch(prompts, config.vocab_size)
    continuations = inputs.prompt_batch(continuations, config.vocab_size, name="continuations")
    if len(prompts) != len(continuations):
        raise InputError("{prompts} and {continuations}: {} and {} given; one continuation per prompt",
                         len(prompts), len(continuations))
    batch_size = inputs.integer(batch_size, "batch_size")
    prefill_chunk = inputs.integer(prefill_chunk, "prefill_chunk")
    if batch_size < 1 or prefill_chunk < 1:
        raise InputError("{batch_size} and {prefill_chunk} must be >= 1, got {} and {}", batch_size, prefill_chunk)
    pairs = [_ids(model.tokenizer, p, c, i) for i, (p, c) in enumerate(zip(prompts, continuations))]
    lengths = [len(p) + len(c) for p, c in pairs]
    context = config.max_position_embeddings
    if max(lengths) > context:
        i = int(np.argmax(lengths))
        raise InputError("{continuations}: pair {} has {} tokens, more than the model's context of {}", i,
                         lengths[i], context)

    rows = round_up_to_shards(min(batch_size, len(pairs)), placement)
    capacity = round_up(max(lengths), CAPACITY_ALIGN)
    local_rows = rows // placement.data_shards
    budget = SCORE_LOGIT_BYTES // (3 * 4 * local_rows * config.vocab_size)
    chunk = max(16, min(prefill_chunk, budget, round_up(max(lengths) - 1, 16)) // 16 * 16)
    timings = {"compile_s": 0.0, "score_s": 0.0}
    params = model.params
    family = family_of(config)
    cache = placement.creator(lambda: family.create_cache(config, rows, capacity, params["embed"].dtype))()
    order = sorted(range(len(pairs)), key=lambda i: -lengths[i])
    results: dict[int, Scored] = {}
    for first in range(0, len(order), rows):
        group = order[first : first + rows]
        padded = group + [group[-1]] * (rows - len(group))
        width = max(lengths[i] for i in group) - 1  # the last token is only ever a target
        spans = [(start, chunk) for start in range(0, width, chunk)]  # one compiled size; the last one padded
        end = spans[-1][0] + chunk
        tokens = np.zeros((rows, end), np.int32)
        targets = np.full((rows, end), -1, np.int32)
        for row, i in enumerate(padded):
            prompt, continuation = pairs[i]
            sequence = prompt + continuation
            tokens[row, : len(sequence) - 1] = sequence[:-1]
            targets[row, len(prompt) - 1 : len(sequence) - 1] = continuation
        chosen = np.zeros((rows, end), np.float32)
        top = np.zeros((rows, end), bool)
        for start, size in spans:
            t0 = time.perf_counter()
            example = placement.put(np.zeros((rows, size), np.int32), TOKEN_AXES)
            step = programs.compile(
                "score", score_chunk, params, cache, example, example, example, donate=(1,), layout=placement,
                in_axes=(param_axes(params), axes_of(cache), TOKEN_AXES, TOKEN_AXES, TOKEN_AXES),
                out_axes=(axes_of(cache), TOKEN_AXES, TOKEN_AXES), model=config, placement=placement,
            )
            timings["compile_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            positions = np.broadcast_to(np.arange(start, start + size, dtype=np.int32), (rows, size))
            window = slice(start, start + size)
            cache, values, is_top = step(params, cache, placement.put(tokens[:, window], TOKEN_AXES),
                                         placement.put(positions, TOKEN_AXES),
                                         placement.put(targets[:, window], TOKEN_AXES))
            chosen[:, window], top[:, window] = placement.fetch((values, is_top))
            timings["score_s"] += time.perf_counter() - t0
        for row, i in enumerate(group):
            prompt, continuation = pairs[i]
            scored = slice(len(prompt) - 1, len(prompt) + len(continuation) - 1)
            values = chosen[row, scored].astype(np.float64)
            results[i] = Scored(len(prompt), continuation, values.tolist(), float(values.sum()),
                                bool(top[row, scored].all()))
        if progress:
            progress("score", len(results), len(pairs))
    return [results[i] for i in range(len(pairs))], timings
