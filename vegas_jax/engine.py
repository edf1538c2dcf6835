"""The library API: an `Engine` holds a loaded model and turns prompts into tokens, text and metrics.

Compiled shapes: prefill once per (batch, chunk size, cache capacity) and at most once more for the tail chunks
(prefill_spans); the bootstrap step and the decode loop once per (batch, cache capacity, method configuration,
sampling mode, output buffer width: max_new_tokens rounded up to OUTPUT_BUCKET). The cache capacity is
`max_model_len` plus γ+1 rows (for the drafts), rounded up to a multiple of 128; left unset, `max_model_len` is the
prompt plus `max_new_tokens` rounded up to a multiple of 1024, so prompts of similar length share one compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import param_axes
from models.kv_cache import KVCache
from models.logical_axes import Axes, axes_of
from vegas_jax import loop, memory, sampling
from vegas_jax.attention.backend import default_backend
from vegas_jax.attention.verify import SCORE_MODES
from vegas_jax.compilation import compile_jitted
from vegas_jax.errors import InputError, NonFiniteLogitsError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.metrics import pooled_metrics, request_metrics
from vegas_jax.selection import POLICIES, Budget, make_policy
from vegas_jax.sharding import Placement, check_model_fits, on_all_shards, round_up_to_shards

METHODS = ("ar",) + POLICIES
CAPACITY_ALIGN = 128
AUTO_LENGTH_BUCKET = 1024
OUTPUT_BUCKET = 256  # output buffers are this many tokens wide or a multiple: max_new_tokens rarely recompiles
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
INT32_MAX = 2**31 - 1
# Drafts per iteration: beyond a few dozen every verification pass mostly checks tokens that are rejected anyway,
# and the draft probabilities ([batch, γ, vocabulary] float32 when sampling) grow with γ.
MAX_GAMMA = 64


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    method: str = "ar"
    gamma: int = 6
    sparse_ratio: float = 0.07
    min_sparse_tokens: int = 256
    score_mode: str = "logit"
    max_model_len: int | None = None
    prefill_chunk: int = 2048

    def validate(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "--max-new-tokens", f"must be >= 1, got {self.max_new_tokens}"),
            # Below ~1e-37 logits / temperature overflows float32; anything that small is greedy in effect.
            (self.temperature == 0 or 1e-6 <= self.temperature < math.inf, "--temperature",
             f"must be 0 (greedy) or a finite number >= 1e-6, got {self.temperature}"),
            (0 <= self.top_k <= INT32_MAX, "--top-k", f"must be in [0, 2**31 - 1], got {self.top_k}"),
            (0 < self.top_p <= 1, "--top-p", f"must be in (0, 1], got {self.top_p}"),
            # Greedy decoding takes the argmax whatever the filters keep: a filter given with it would be ignored.
            (self.temperature > 0 or self.top_k == 0, "--top-k",
             f"{self.top_k} has no effect with --temperature 0 (greedy); give a temperature to sample"),
            (self.temperature > 0 or self.top_p == 1, "--top-p",
             f"{self.top_p} has no effect with --temperature 0 (greedy); give a temperature to sample"),
            (-INT32_MAX - 1 <= self.seed <= INT32_MAX, "--seed", f"must fit in 32 bits, got {self.seed}"),
            (self.method in METHODS, "--method", f"must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (0 <= self.gamma <= MAX_GAMMA, "--gamma", f"must be in [0, {MAX_GAMMA}], got {self.gamma}"),
            (0 < self.sparse_ratio <= 1, "--sparse-ratio", f"must be in (0, 1], got {self.sparse_ratio}"),
            (self.min_sparse_tokens >= 1, "--min-sparse-tokens", f"must be >= 1, got {self.min_sparse_tokens}"),
            (self.score_mode in SCORE_MODES, "--score-mode", f"must be one of {SCORE_MODES}, got {self.score_mode!r}"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len", f"must be >= 2, got {self.max_model_len}"),
            (self.prefill_chunk >= 1, "--prefill-chunk", f"must be >= 1, got {self.prefill_chunk}"),
        ]
        for ok, flag, message in checks:
            if not ok:
                raise InputError(f"{flag} {message}")

    @property
    def effective_gamma(self) -> int:
        return 0 if self.method == "ar" else self.gamma


@dataclasses.dataclass
class RequestResult:
    prompt_tokens: int
    tokens: list[int]
    text: str
    metrics: dict


@dataclasses.dataclass
class GenerationResult:
    options: GenerationOptions
    requests: list[RequestResult]
    metrics: dict


@dataclasses.dataclass
class Started:
    prompt_ids: list[list[int]]
    config: loop.DecodeConfig
    # After prefill and the bootstrap step; on a mesh with a data axis the batch is padded to a multiple of its
    # size with rows that never generate (rows len(prompt_ids) on).
    state: loop.DecodeState
    decode: Callable  # compiled loop.decode(params, state, step_limit, finished_limit) over global arrays
    timings: dict


def _largest_chunk(budget_bytes: int, bytes_per_chunk_token: int) -> int:
    """Largest multiple of 16 (at least 16) of chunk tokens that fit the budget."""
    return max(16, budget_bytes // bytes_per_chunk_token // 16 * 16)


def prefill_chunk_for_memory(batch: int, num_heads: int, capacity: int) -> int:
    """The largest prefill chunk whose float32 score arrays (the jnp path's) fit PREFILL_SCORE_BYTES."""
    return _largest_chunk(PREFILL_SCORE_BYTES, 3 * 4 * batch * num_heads * capacity)


def prefill_chunk_for_activations(batch: int, intermediate_size: int) -> int:
    """The largest prefill chunk whose MLP activations fit PREFILL_ACTIVATION_BYTES."""
    return _largest_chunk(PREFILL_ACTIVATION_BYTES, 2 * 4 * batch * intermediate_size)


def prefill_spans(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(start, size) of the prefill steps covering positions [0, num_tokens): chunks of `chunk` while a whole one
    fits; the rest in chunks of PREFILL_TAIL_CHUNK where they fill at most half a chunk, else in one more padded
    chunk. At most two sizes, each compiled once for any length."""
    whole = num_tokens // chunk * chunk
    tail = PREFILL_TAIL_CHUNK if _round_up(num_tokens - whole, PREFILL_TAIL_CHUNK) <= chunk // 2 else chunk
    return [(start, chunk) for start in range(0, whole, chunk)] + [
        (start, tail) for start in range(whole, num_tokens, tail)
    ]


def check_serving(slots: int, refill: int | None) -> int:
    """The refill group size for continuous batching (default slots // 8, at least 1); InputError if either
    number is out of range. Each return to the host costs 2-6 ms at 64 slots of 7.9K tokens (a sixth to a half of
    an iteration) and a finished slot idles until its group is complete: groups of 1, 4 and 8 measured within 4 %
    of each other there, 8 ahead (benchmarks/results/e2e-2026-11-30-serve{2,3}-*.json)."""
    if slots < 1:
        raise InputError(f"--slots must be >= 1, got {slots}")
    refill = max(1, slots // 8) if refill is None else refill
    if not 1 <= refill <= slots:
        raise InputError(f"--refill must be in [1, --slots {slots}], got {refill}")
    return refill


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class Engine:
    """A loaded model on its devices (one, or the mesh it was loaded onto: `vegas_jax.load(..., mesh=...)`)."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self.config = model.config
        self.tokenizer = model.tokenizer
        self._compiled: dict = {}

    @property
    def placement(self) -> Placement:
        """The attention backend (VEGAS_KERNELS, read at each call) and the model's mesh."""
        return Placement(default_backend(), self.model.mesh)

    # ---- prompts -------------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[str | Sequence[int]], chat_template: bool | None = None) -> list[list[int]]:
        """Strings are tokenized (through the chat template when the model has one, unless told otherwise);
        lists of ids are taken as they are."""
        if not prompts:
            raise InputError("--prompt: no prompt given")
        use_template = self.tokenizer.chat_template is not None if chat_template is None else chat_template
        if use_template and self.tokenizer.chat_template is None:
            raise InputError("--chat-template: the model has no chat template")
        encoded = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise InputError(f"--prompt: prompt {i} is empty")
                if use_template:
                    ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
                else:
                    ids = self.tokenizer.encode(prompt)
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise InputError(f"--prompt: prompt {i} has no tokens")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InputError(f"--prompt: prompt {i} has token ids outside the vocabulary: {bad[:5]}")
            encoded.append(list(ids))
        return encoded

    # ---- planning ------------------------------------------------------------------------------------------
    def check_input(self, prompt_ids: list[list[int]], options: GenerationOptions, *, slots: int | None = None,
                    refill: int | None = None) -> None:
        """InputError if these prompts cannot run with these options on this model and its devices: every check
        `generate` and `serve` (with `slots`, `refill`) make before they compile (or allocate) anything."""
        self.plan(prompt_ids, options, slots=slots, refill=refill)

    def plan(self, prompt_ids: list[list[int]], options: GenerationOptions, *, slots: int | None = None,
             refill: int | None = None) -> dict:
        """What a run of these prompts (with `slots`: served through that many) would compile and allocate, without
        doing either: the mesh, the compiled shapes and the bytes per device (vegas_jax.memory). InputError if it
        does not fit."""
        config, capacity = self._plan(prompt_ids, options)
        batch = self._batch_rows(len(prompt_ids) if slots is None else min(slots, len(prompt_ids)))
        p = self.placement
        estimate = memory.estimate(self.config, self.model.params, p, batch=batch, capacity=capacity,
                                   gamma=config.gamma, k_max=config.policy.budget.k_max if config.policy else 0,
                                   policy=options.method, output_width=config.max_new_tokens,
                                   sampling=not config.sampling.greedy,
                                   prefill_chunk=self._prefill_chunk(batch, max(map(len, prompt_ids)), capacity,
                                                                     options, p),
                                   refill=None if slots is None else self._batch_rows(check_serving(slots, refill)))
        memory.check_fits(estimate, p)
        return {
            "placement": p.describe(),
            "mesh": {"data": p.data_shards, "model": p.model_shards},
            "backend": p.backend,
            "batch_rows": batch,
            "cache_capacity": capacity,
            "output_width": config.max_new_tokens,
            "gamma": config.gamma,
            "draft_kv_budget": config.policy.budget.k_max if config.policy else 0,
            "bytes_per_device": estimate,
        }

    def _max_model_len(self, prompt_lens: list[int], options: GenerationOptions) -> int:
        model_max = self.config.max_position_embeddings
        longest = max(prompt_lens)
        if options.max_model_len is not None:
            if options.max_model_len > model_max:
                raise InputError(f"--max-model-len {options.max_model_len} exceeds the model's context of {model_max}")
            limit = options.max_model_len
            if longest > limit:
                raise InputError(f"--max-model-len: a prompt of {longest} tokens is longer than {limit}")
        else:
            limit = min(model_max, _round_up(longest + options.max_new_tokens, AUTO_LENGTH_BUCKET))
            if longest > limit:
                raise InputError(f"--prompt: a prompt of {longest} tokens is longer than the model's context of {limit}")
        if longest + options.max_new_tokens > limit:
            raise InputError(
                f"--max-new-tokens {options.max_new_tokens}: with a prompt of {longest} tokens it exceeds the "
                f"context of {limit} tokens (--max-model-len)"
            )
        return limit

    def _decode_config(self, options: GenerationOptions, mode: sampling.SamplingMode, max_model_len: int):
        gamma = options.effective_gamma
        placement = self.placement
        policy = None
        if gamma:
            budget = Budget.for_length(options.sparse_ratio, options.min_sparse_tokens, max_model_len)
            policy = make_policy(options.method, budget, gamma, placement)
        width = _round_up(options.max_new_tokens, OUTPUT_BUCKET)
        return loop.DecodeConfig(self.config, gamma, policy, options.score_mode, mode, width, placement)

    def _plan(self, ids: list[list[int]], options: GenerationOptions) -> tuple[loop.DecodeConfig, int]:
        """The loop configuration and cache capacity for these prompts; InputError if they do not fit."""
        options.validate()
        if options.seed + len(ids) - 1 > INT32_MAX:
            raise InputError(f"--seed {options.seed}: request i uses seed + i, which passes 2**31 - 1 for {len(ids)} "
                             f"requests")
        max_model_len = self._max_model_len([len(p) for p in ids], options)
        mode = sampling.SamplingParams.create(1, options.temperature, options.top_k, options.top_p).mode()
        config = self._decode_config(options, mode, max_model_len)
        check_model_fits(self.config, config.placement)
        # The kernels run on each shard's heads: the verification kernel's limit is per KV head's query heads,
        # which a model axis does not change (it splits query and KV heads alike).
        gamma, group = options.effective_gamma, self.config.num_heads // self.config.num_kv_heads
        most = config.verify_attention().scored_tokens_limit(group)
        if most is not None and gamma + 1 > most:
            raise InputError(f"--gamma {gamma}: the verification kernel scores at most {most} tokens per sequence "
                             f"for this model's heads (γ + 1 <= {most})")
        return config, _round_up(max_model_len + options.effective_gamma + 1, CAPACITY_ALIGN)

    def _batch_rows(self, requests: int) -> int:
        """Rows a batch of this many requests takes: a multiple of the mesh's data axis (padding never generates)."""
        return round_up_to_shards(requests, self.placement)

    def _prefill_chunk(self, batch: int, longest: int, capacity: int, options: GenerationOptions,
                       placement: Placement) -> int:
        """The prefill chunk for a batch of this many rows: the memory bounds count one shard's rows and heads."""
        rows, model = batch // placement.data_shards, placement.model_shards
        chunk = min(
            options.prefill_chunk,
            _round_up(longest - 1, 16) or 16,
            prefill_chunk_for_activations(rows, self.config.intermediate_size // model),
        )
        if not placement.uses_kernels:
            chunk = min(chunk, prefill_chunk_for_memory(rows, self.config.num_heads // model, capacity))
        return chunk

    # ---- compilation ---------------------------------------------------------------------------------------
    def _compile(self, name: str, fn: Callable, *args, in_axes: tuple, out_axes, layout: Placement,
                 donate: tuple = (), **static):
        """fn(*args, **static) compiled once per shapes and static values, as one program per shard of the
        layout's mesh, its arguments and result laid out by their logical axes."""
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), args)
        key = (name, layout, tuple(sorted(static.items())), str(jax.tree.structure(args)),
               tuple(jax.tree.leaves(shapes)))
        if key not in self._compiled:
            program = layout.program(functools.partial(fn, **static), in_axes, out_axes)
            self._compiled[key] = compile_jitted(program, *args, donate=donate)
        return self._compiled[key]

    def _put(self, host, axes: Axes, placement: Placement):
        return placement.put(np.asarray(host), axes)

    # ---- generation ----------------------------------------------------------------------------------------
    def _initial_state(self, ids, options, config, capacity, first_request: int, *, rows: int | None = None,
                       finished: bool = False) -> loop.DecodeState:
        """The state of these requests before prefill, created straight into its shards; request i (counted from
        first_request) is seeded with options.seed + i, whatever batch it runs in. Rows past the requests (up to
        `rows`) are padding that never generates."""
        batch = len(ids) if rows is None else rows
        padded = list(ids) + [ids[-1]] * (batch - len(ids))
        host = (
            np.asarray([len(p) for p in padded], np.int32),
            np.asarray([p[-1] for p in padded], np.int32),
            np.where(np.arange(batch) < len(ids), options.max_new_tokens, 0).astype(np.int32),
            (np.arange(batch) + first_request + options.seed).astype(np.int32),
            np.asarray(list(self.tokenizer.eos_ids) or [-1], np.int32),
            np.float32(options.temperature), np.int32(options.top_k), np.float32(options.top_p), np.bool_(finished),
        )
        create = functools.partial(_new_state, config=config, capacity=capacity,
                                   dtype=self.model.params["embed"].dtype)
        key = ("init", config, capacity, jax.tree.map(np.shape, host))
        if key not in self._compiled:
            self._compiled[key] = config.placement.creator(create, *host)
        return self._compiled[key](*host)

    def _prefill(self, ids, options, config, capacity, timings, *, first_request=0, rows=None, progress=None):
        """Prefill of all but each prompt's last token in chunks (prefill_spans: two compilations at most for any
        length), then the bootstrap step: the state a decode loop starts from. Adds to timings' compile_s and
        prefill_s."""
        placement, params = config.placement, self.model.params
        batch = len(ids) if rows is None else rows
        lens = [len(p) for p in ids]
        chunk = self._prefill_chunk(batch, max(lens), capacity, options, placement)
        timings["prefill_chunk"] = chunk
        spans = prefill_spans(max(lens) - 1, chunk)
        width = spans[-1][0] + spans[-1][1] if spans else 0
        tokens = np.zeros((batch, width), np.int32)
        for i, p in enumerate(ids):
            tokens[i, : len(p) - 1] = p[:-1]
        state = self._initial_state(ids, options, config, capacity, first_request, rows=batch)
        t0 = time.perf_counter()
        p_axes, cache_axes, state_axes = param_axes(params), axes_of(state.cache), axes_of(state)
        prefill = {}
        for size in sorted({size for _, size in spans}):
            steps = (self._put(np.zeros((batch, size), np.int32), loop.PREFILL_TOKENS_AXES, placement),) * 2
            prefill[size] = self._compile(
                "prefill", loop.prefill_chunk, params, state.cache, *steps, donate=(1,), layout=placement,
                in_axes=(p_axes, cache_axes, loop.PREFILL_TOKENS_AXES, loop.PREFILL_TOKENS_AXES),
                out_axes=cache_axes, model=self.config, placement=placement,
            )
        bootstrap = self._compile("bootstrap", loop.bootstrap, params, state, donate=(1,), layout=placement,
                                  in_axes=(p_axes, state_axes), out_axes=state_axes, config=config)
        timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - t0

        t0 = time.perf_counter()
        cache = state.cache
        for step, (start, size) in enumerate(spans):
            positions = np.broadcast_to(np.arange(start, start + size, dtype=np.int32), (batch, size))
            cache = prefill[size](params, cache, self._put(tokens[:, start : start + size], loop.PREFILL_TOKENS_AXES,
                                                           placement),
                                  self._put(positions, loop.PREFILL_TOKENS_AXES, placement))
            if progress:
                progress("prefill", step + 1, len(spans))
        state = bootstrap(params, dataclasses.replace(state, cache=cache))
        jax.block_until_ready(state.output)
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        return state

    def _compile_decode(self, config, state, timings) -> Callable:
        """The compiled decode loop: decode(params, state, step_limit, finished_limit), the limits int32 scalars."""
        t0 = time.perf_counter()
        state_axes = axes_of(state)
        args = (self.model.params, state, np.int32(0), np.int32(0))
        decode = self._compile("decode", loop.decode, *args, donate=(1,), layout=config.placement,
                               in_axes=(param_axes(self.model.params), state_axes, Axes(), Axes()),
                               out_axes=state_axes, config=config)
        timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - t0
        return decode

    def start(self, prompts, options: GenerationOptions, *, chat_template: bool | None = None, progress=None) -> Started:
        """Validates, compiles, prefills and runs the bootstrap step: the state the decode loop starts from (also
        for tools, such as benchmarks, that time parts of an iteration themselves)."""
        ids = self.encode_prompts(prompts, chat_template)
        self.check_input(ids, options)
        config, capacity = self._plan(ids, options)
        timings = {}
        state = self._prefill(ids, options, config, capacity, timings, rows=self._batch_rows(len(ids)),
                              progress=progress)
        decode = self._compile_decode(config, state, timings)
        self._raise_if_nonfinite(self._fetch(config, state.nonfinite)[: len(ids)])
        return Started(ids, config, state, decode, timings)

    @staticmethod
    def _fetch(config: loop.DecodeConfig, tree):
        return config.placement.fetch(tree)

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: GenerationOptions = GenerationOptions(),
        *,
        chat_template: bool | None = None,
        steps_per_call: int | None = 16,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> Iterator[list[list[int]] | GenerationResult]:
        """Yields the bootstrap step's token of each request, then, after every `steps_per_call` loop iterations,
        the new tokens of each request; last, the GenerationResult. `steps_per_call=None` runs the whole decode in
        one device call."""
        if steps_per_call is not None and steps_per_call < 1:
            raise InputError(f"steps_per_call must be None or >= 1, got {steps_per_call}")
        started = self.start(prompts, options, chat_template=chat_template, progress=progress)
        state, timings, params, config = started.state, started.timings, self.model.params, started.config
        batch, rows = len(started.prompt_ids), state.committed.shape[0]
        first, seen = self._fetch(config, (state.output[:, :1], state.num_generated))
        yield [list(first[i]) if int(seen[i]) else [] for i in range(batch)]

        t0 = time.perf_counter()
        limit = INT32_MAX
        step = 0
        while True:
            step = step + steps_per_call if steps_per_call else limit
            state = started.decode(params, state, np.int32(min(step, limit)), np.int32(rows))
            num_generated, done, step = self._fetch(config, (state.num_generated, state.done, state.step))
            if steps_per_call:
                output = self._fetch(config, state.output)
                yield [list(output[i, seen[i] : num_generated[i]]) for i in range(batch)]
                if progress:
                    progress("decode", int(num_generated[:batch].sum()), batch * options.max_new_tokens)
            seen = num_generated
            if bool(np.all(done)) or not steps_per_call:
                break
        jax.block_until_ready(state.output)
        timings["decode_s"] = time.perf_counter() - t0
        host = {k: v[:batch] for k, v in self._host_rows(config, state).items()}
        self._raise_if_nonfinite(host["nonfinite"])
        if not steps_per_call:
            yield [list(host["output"][i, 1 : num_generated[i]]) for i in range(batch)]
        yield self._result(options, started.prompt_ids, host, timings, config.placement)

    def generate(self, prompts, options: GenerationOptions = GenerationOptions(), **kwargs) -> GenerationResult:
        *_, result = self.stream(prompts, options, **kwargs)
        return result

    def serve(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: GenerationOptions = GenerationOptions(),
        *,
        slots: int,
        refill: int | None = None,
        chat_template: bool | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> GenerationResult:
        """Continuous batching: at most `slots` requests decode together. The loop returns to the host as soon as
        `refill` (`check_serving`) of them have finished or the queue holds fewer than that; as
        many queued requests as there are free slots are then prefilled and bootstrapped in groups of `refill`
        and admitted into the running batch (`loop.admit`), and decoding resumes. Results come in prompt order
        and, request for request, equal `generate`'s on all the prompts at once (each request's seed and random
        draws do not depend on the batch it ran in). On a mesh the slots are split over its data axis (`slots`
        must be a multiple of its size) and a group is prefilled on all data shards, padded to a multiple of it.

        Timings: prefill_s covers every group's prefill and bootstrap, decode_s only the decode loop. Decode
        calls that start with every slot busy and requests still queued are "steady": their tokens/s
        (steady_decode_tokens_per_s) leaves out the drain at the end, where slots empty out. metrics.decode_calls
        has each call's busy slots, queue length, iterations, tokens and seconds.
        """
        refill = check_serving(slots, refill)
        data = self.placement.data_shards
        if slots % data:
            raise InputError(f"--slots {slots}: must be a multiple of the mesh's data axis (--mesh data={data})")
        ids = self.encode_prompts(prompts, chat_template)
        self.check_input(ids, options, slots=slots, refill=refill)
        config, capacity = self._plan(ids, options)
        placement = config.placement
        slots = min(slots, self._batch_rows(len(ids)))
        refill = min(refill, slots)
        group_rows = self._batch_rows(refill)
        params, timings = self.model.params, {}

        # An empty batch: every slot finished, so the first admissions fill it.
        state = self._initial_state([[0]], options, config, capacity, 0, rows=slots, finished=True)
        decode = self._compile_decode(config, state, timings)

        queue = list(range(len(ids)))[::-1]  # popped from the end: request 0 first
        slot_request: list[int | None] = [None] * slots
        finished: dict[int, dict] = {}
        calls = []  # per decode call: busy slots at its start, iterations, tokens, seconds
        while True:
            free = [i for i, r in enumerate(slot_request) if r is None]
            while queue and free:
                group = [queue.pop() for _ in range(min(refill, len(queue), len(free)))]
                targets, free = free[: len(group)], free[len(group) :]
                # Fixed-size groups (one compilation): padding repeats the last request and is dropped on admission.
                padded = group + [group[-1]] * (refill - len(group))
                joining = self._prefill([ids[r] for r in padded], options, config, capacity, timings,
                                        first_request=group[0], rows=group_rows)
                into = self._put(np.asarray(targets + [slots] * (group_rows - len(group)), np.int32), Axes(None),
                                 placement)
                t0 = time.perf_counter()
                running_axes = axes_of(state)
                admit = self._compile("admit", loop.admit, state, joining, into, donate=(0,), layout=placement,
                                      in_axes=(running_axes, on_all_shards(axes_of(joining)), Axes(None)),
                                      out_axes=running_axes, config=config)
                timings["compile_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                state = admit(state, joining, into)
                jax.block_until_ready(state.done)
                timings["prefill_s"] += time.perf_counter() - t0
                for slot, r in zip(targets, group):
                    slot_request[slot] = r
            occupied = [i for i, r in enumerate(slot_request) if r is not None]
            if not occupied:
                break
            finished_limit = slots - len(occupied) + min(refill, len(queue)) if queue else slots
            before, step = self._fetch(config, (state.num_generated, state.step))
            t0 = time.perf_counter()
            state = decode(params, state, np.int32(INT32_MAX), np.int32(finished_limit))
            jax.block_until_ready(state.done)
            elapsed = time.perf_counter() - t0
            rows = self._host_rows(config, state)
            calls.append({
                "busy_slots": len(occupied),
                "queued": len(queue),
                "iterations": int(self._fetch(config, state.step)) - int(step),
                "tokens": int((rows["num_generated"] - before)[occupied].sum()),
                "seconds": elapsed,
            })
            for slot in occupied:
                if rows["done"][slot]:
                    finished[slot_request[slot]] = {k: v[slot] for k, v in rows.items()}
                    slot_request[slot] = None
            if progress:
                progress("requests", len(finished), len(ids))

        timings["decode_s"] = sum(c["seconds"] for c in calls)
        steady = [c for c in calls if c["busy_slots"] == slots and c["queued"]]
        steady_s = sum(c["seconds"] for c in steady)
        steady_tokens = sum(c["tokens"] for c in steady)
        rows = {k: np.stack([finished[r][k] for r in range(len(ids))]) for k in finished[0]}
        self._raise_if_nonfinite(rows["nonfinite"])
        result = self._result(options, ids, rows, timings, placement)
        result.metrics.update(
            slots=slots,
            refill=refill,
            decode_calls=calls,
            loop_iterations=sum(c["iterations"] for c in calls),
            steady_decode_s=steady_s,
            steady_decode_tokens=steady_tokens,
            steady_decode_tokens_per_s=steady_tokens / steady_s if steady_s > 0 else None,
        )
        return result

    def _host_rows(self, config: loop.DecodeConfig, state) -> dict[str, np.ndarray]:
        """Host copies of a state's per-request results (one gather for all of them)."""
        return self._fetch(config, {
            "output": state.output,
            "num_generated": state.num_generated,
            "done": state.done,
            "nonfinite": state.nonfinite,
            "iterations": state.metrics.iterations,
            "drafted": state.metrics.drafted,
            "accepted": state.metrics.accepted,
        })

    def _raise_if_nonfinite(self, nonfinite) -> None:
        bad = np.flatnonzero(np.asarray(nonfinite))
        if bad.size:
            raise NonFiniteLogitsError(
                f"non-finite logits in request(s) {bad.tolist()}: generation stopped (check the checkpoint and --dtype)"
            )

    def _result(self, options, ids, rows: dict, timings, placement: Placement) -> GenerationResult:
        output, num_generated, gamma = rows["output"], rows["num_generated"], options.effective_gamma
        # The loop's counts have at least one column (loop.init_state): keep those of real draft positions.
        iterations, drafted, accepted = rows["iterations"], rows["drafted"][:, :gamma], rows["accepted"][:, :gamma]
        requests = []
        for i, prompt in enumerate(ids):
            tokens = output[i, : num_generated[i]].tolist()
            requests.append(
                RequestResult(
                    prompt_tokens=len(prompt),
                    tokens=tokens,
                    text=self.tokenizer.decode(tokens),
                    metrics=request_metrics(len(tokens), iterations[i], drafted[i], accepted[i]),
                )
            )
        decode_tokens = int(np.maximum(num_generated - 1, 0).sum())  # the first token comes from prefill
        metrics = dict(timings)
        metrics["decode_tokens"] = decode_tokens
        metrics["decode_tokens_per_s"] = decode_tokens / timings["decode_s"] if timings["decode_s"] > 0 else math.nan
        metrics["mesh"] = {"data": placement.data_shards, "model": placement.model_shards}
        metrics.update(pooled_metrics(iterations, drafted, accepted, options.effective_gamma))
        return GenerationResult(options, requests, metrics)


def _new_state(lengths, last, max_new, seeds, stop_ids, temperature, top_k, top_p, finished, *, config, capacity,
               dtype) -> loop.DecodeState:
    """The decode state of a batch before prefill (Engine._initial_state), from host arrays."""
    batch = lengths.shape[0]
    state = loop.init_state(
        config,
        KVCache.create(config.model, batch, capacity, dtype),
        lengths, last, max_new, jax.vmap(jax.random.key)(seeds),
        sampling.SamplingParams.create(batch, temperature, top_k, top_p),
        stop_ids,
    )
    return dataclasses.replace(state, done=jnp.full_like(state.done, finished))
