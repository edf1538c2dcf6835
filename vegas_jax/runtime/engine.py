"""The library API: an `Engine` holds a loaded model and turns prompts into tokens, text and metrics.

A run: prompts to ids (vegas_jax.runtime.prompt_encoding), what it compiles and allocates, or why it does not fit
(vegas_jax.runtime.run_plan), the batch's start (vegas_jax.runtime.prefill: prefill once per (batch, chunk size, cache capacity)
and at most once more for the tail chunks), then the compiled decode loop, driven from here: `stream` calls it
and hands out tokens as they come, `serve` admits queued requests into finished rows between its calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from models import draft_head, draft_weights
from models.decoder import param_axes
from models.kv_cache import KVCache
from models.logical_axes import Axes, axes_of
from vegas_jax.decode import loop as decode_loop
from vegas_jax.decode import draft_kernel
from vegas_jax.decode import iteration as loop
from vegas_jax.loading import draft_head_checkpoint
from vegas_jax.runtime import prefill
from vegas_jax.runtime import run_plan
from vegas_jax.runtime import scoring
from vegas_jax.ssv import choice as ssv
from vegas_jax.decode import stops
from vegas_jax.decode.adaptive_gamma import CostBook, with_control
from vegas_jax.attention.backend import default_backend, default_scan_layers
from vegas_jax.runtime.compilation import Programs, matmul_precision
from vegas_jax.inputs import InputError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.ssv.planner import DrafterAcceptance
from vegas_jax.runtime.prefill_reuse import PrefillReuse
from vegas_jax.runtime.options import GenerationOptions
from vegas_jax.runtime.pacing import DecodeCalls, Pacer
from vegas_jax.runtime.prompt_encoding import encode_prompts
from vegas_jax.runtime.results import (GenerationResult, RequestResult, StreamedTokens, generation_result, host_rows,
                               streamed_tokens, token_rows)
from vegas_jax.runtime.serving import SlotTable, check_serving
from vegas_jax.sharding import Placement, on_all_shards, round_up_to_shards

__all__ = ["Engine", "GenerationOptions", "GenerationResult", "InputError", "RequestResult", "Started",
           "StreamedTokens"]


@dataclasses.dataclass
class Started:
    prompt_ids: list[list[int]]
    config: loop.DecodeConfig
    # After prefill and the bootstrap step; on a mesh with a data axis the batch is padded to a multiple of its
    # size with rows that never generate (rows len(prompt_ids) on).
    state: loop.DecodeState
    # compiled decode_loop.decode(params, draft_params, state, step_limit, finished_limit) over global arrays
    decode: Callable
    timings: dict
    draft_params: Any = None  # what the drafts read besides the parameters (None: nothing; int8 / int4 copies)
    options: Any = None  # the options the run decodes with (run_plan.RunPlan.decoding: the SSV choice applied)
    ssv_plan: dict | None = None  # the SSV planner's choice (vegas_jax.ssv.planner.Plan.report), None: the default plan


class Engine:
    """A loaded model on its devices (one, or the mesh it was loaded onto: `vegas_jax.load(..., mesh=...)`)."""

    def __init__(self, model: LoadedModel, draft_head=None, draft_vocab=0):
        self.model = model
        self.config = model.config
        self.tokenizer = model.tokenizer
        # Its programs' dots at the precision its dtype implies (float32: float32, not TF32), set for them alone.
        self.programs = Programs(matmul_precision(model.params["embed"].dtype))
        self._stop_tables: dict = {}
        self._gamma_book = CostBook()  # adaptive γ's measured costs, kept for later runs of the same loop
        self._acceptance = DrafterAcceptance()  # the SSV planner's running acceptances, over this engine's runs
        self.draft_head = None  # the params `drafter` head drafts with (use_draft_head)
        self.draft_head_window = 0  # the positions each of its rows sees (0: all)
        if draft_head is not None:
            self.use_draft_head(draft_head, vocabulary=draft_vocab)
        elif not isinstance(draft_vocab, int) or draft_vocab:
            raise InputError("{draft_vocab}: a draft vocabulary is the draft head's; give draft_head too")

    def use_draft_head(self, head, window: int | None = None, vocabulary=0) -> None:
        """Drafts with this trained draft head where the options say `drafter` head: its params (a dict in the
        layout of models.draft_head.param_shapes) or a checkpoint folder of vegas_jax.train_draft_head. Whole on
        every device of the mesh (it is one layer). Each of its rows attends to the last `window` positions; None:
        as many as its training showed it (a checkpoint's training span, draft_head_checkpoint.trained_span), or
        all for params; 0: all. `vocabulary`, the tokens its drafts are chosen from (a draft vocabulary,
        models.draft_head.vocabulary_readout): 0 all the model's; N the N most frequent in the head's training
        sequences (a checkpoint folder's token counts); or a sequence of token ids."""
        dtype = self.model.params["embed"].dtype
        if window is not None and window < 0:
            raise InputError("{window} must be >= 0 (0: every position), got {}", window)
        folder = None
        if isinstance(head, dict):
            head = jax.tree.map(lambda x: np.asarray(x, dtype), head)
            trained = 0
        else:
            folder, head = head, draft_head_checkpoint.load_head(head, self.config, dtype)
            trained = draft_head_checkpoint.trained_span(folder)
        tokens = self._draft_vocabulary(vocabulary, folder)
        self.draft_head_window = trained if window is None else window
        whole = lambda x: self.placement.put(np.asarray(x), Axes(*(None,) * np.ndim(x)))  # noqa: E731
        self.draft_head = jax.tree.map(whole, head)
        if tokens is not None:
            # The LM head is whole on every device (models.decoder.param_axes), so its rows are too.
            readout = jax.jit(lambda params, ids: draft_head.vocabulary_readout(params, self.config, ids),
                              out_shardings=self.placement.sharding(Axes()))
            self.draft_head[draft_head.READOUT] = readout(self.model.params, whole(tokens))

    def _draft_vocabulary(self, vocabulary, folder) -> np.ndarray | None:
        """The token ids [K] of a draft vocabulary (use_draft_head's `vocabulary`); None for the whole."""
        size = self.config.vocab_size
        if isinstance(vocabulary, (int, np.integer)) and not isinstance(vocabulary, bool):
            if not 0 <= vocabulary <= size:
                raise InputError("{draft_vocab} must be in [0, {}] (0: the whole vocabulary), got {}", size,
                                 vocabulary)
            if vocabulary in (0, size):
                return None
            counts = None if folder is None else draft_head_checkpoint.token_counts(folder)
            if counts is None:
                where = ("a head given as params" if folder is None
                         else f"{folder} (no {draft_head_checkpoint.TOKEN_COUNTS})")
                raise InputError("{draft_vocab} {}: {} has no token counts to choose the most frequent tokens by; "
                                 "give the token ids", vocabulary, where)
            if counts.shape != (size,):
                raise InputError("{draft_vocab}: {} counts {} token ids, the model has {}", str(folder),
                                 counts.shape[0], size)
            return draft_head_checkpoint.ranked_tokens(counts, vocabulary)
        tokens = np.asarray(vocabulary)
        if (tokens.ndim != 1 or not tokens.size or not np.issubdtype(tokens.dtype, np.integer)
                or tokens.min() < 0 or tokens.max() >= size or np.unique(tokens).size != tokens.size):
            raise InputError("{draft_vocab}: token ids must be distinct integers in [0, {}), at least one; got {}",
                             size, np.array2string(tokens, threshold=8))
        return tokens.astype(np.int32)

    @property
    def placement(self) -> Placement:
        """The attention backend (VEGAS_KERNELS, read at each call), the model's mesh and the layer loop
        (VEGAS_SCAN_LAYERS, likewise)."""
        return Placement(default_backend(), self.model.mesh, default_scan_layers())

    # ---- prompts -------------------------------------------------------------------------------------------
    def encode_prompts(self, prompts, chat_template: bool | None = None) -> list[list[int]]:
        """The token ids of a batch of prompts (vegas_jax.runtime.prompt_encoding): strings through the tokenizer, or the
        chat template as one user message when the model has one unless told otherwise; conversations through
        the chat template; token ids checked and kept."""
        return encode_prompts(self.tokenizer, self.config.vocab_size, prompts, chat_template)

    # ---- planning ------------------------------------------------------------------------------------------
    def check_input(self, prompts, options: GenerationOptions, *, chat_template: bool | None = None,
                    slots: int | None = None, refill: int | None = None) -> None:
        """InputError if these prompts cannot run with these options on this model and its devices: every check
        `generate` and `serve` (with `slots`, `refill`) make before they compile (or allocate) anything."""
        self.plan(self.encode_prompts(prompts, chat_template), options, slots=slots, refill=refill)

    def plan(self, prompt_ids: list[list[int]], options: GenerationOptions, *, slots: int | None = None,
             refill: int | None = None) -> dict:
        """What a run of these prompts (with `slots`: served through that many) would compile and allocate, without
        doing either: the mesh, the compiled shapes and the bytes per device (vegas_jax.runtime.memory). InputError if it
        does not fit."""
        return self._fitted_plan(prompt_ids, options, slots=slots, refill=refill).summary

    def _fitted_plan(self, prompt_ids, options, *, slots=None, refill=None,
                     kept_prefill: bool = False) -> run_plan.RunPlan:
        drafters = ("self", "ngram") + (("head",) if self.draft_head is not None else ())
        plan = run_plan.resolve(self.model, self.placement, prompt_ids, options, acceptance=self._acceptance,
                                stop_table_of=self._stop_table, slots=slots, refill=refill,
                                kept_prefill=kept_prefill, drafters=drafters, head_window=self.draft_head_window,
                                head_bytes=sum(x.nbytes for x in jax.tree.leaves(self.draft_head or {})))
        if plan.config.drafts_with_head:
            # a head-drafted run without a head is refused by a plan too
            readout = self._head().get(draft_head.READOUT)
            width = plan.config.tree.children.shape[1]
            if readout is not None and readout["tokens"].shape[0] < width:
                raise InputError("{draft_vocab}: {} tokens, fewer than the {} children a node of the draft tree "
                                 "draws", readout["tokens"].shape[0], width)
        return plan

    def _head(self):
        """The draft head's params; InputError naming drafter when this engine has none."""
        if self.draft_head is None:
            raise InputError("{drafter} head: this engine has no draft head; load one with "
                             "Engine.use_draft_head(FOLDER) (--draft-head FOLDER)")
        return self.draft_head

    # ---- draft weights -------------------------------------------------------------------------------------
    def _draft_params(self, config: loop.DecodeConfig, rows: int):
        """What the config's drafts read over `rows` batch rows: the draft head's params (drafter head), or the
        quantized weights' codes in the layout of the kernel that multiplies them
        (vegas_jax.decode.draft_kernel.code_layout)."""
        if config.drafts_with_head:
            return self._head()
        precision = config.draft_weights
        try:
            return self.model.draft_params(precision, draft_kernel.code_layout(config.placement,
                                                                               config.draft_activations, rows))
        except draft_weights.DraftWeightsError as e:
            raise InputError("{draft_weights} {}: {}", precision, e) from None

    def _stop_table(self, options: GenerationOptions) -> np.ndarray:
        """vegas_jax.decode.stops.table for these options and the tokenizer's EOS ids (kept: building one for stop strings
        walks every token's bytes)."""
        key = (tuple(self.tokenizer.eos_ids), options.stop_token_ids, options.stop)
        if key not in self._stop_tables:
            strings = options.stop
            pieces = stops.token_bytes(self.tokenizer) if strings else None
            self._stop_tables[key] = stops.table(self.config.vocab_size, (*self.tokenizer.eos_ids,
                                                                          *options.stop_token_ids), strings, pieces)
        return self._stop_tables[key]

    def _batch_rows(self, requests: int) -> int:
        """Rows a batch of this many requests takes: a multiple of the mesh's data axis (padding never generates)."""
        return round_up_to_shards(requests, self.placement)

    # ---- generation ----------------------------------------------------------------------------------------
    def _prefill(self, ids, options, config, capacity, timings, **kwargs) -> loop.DecodeState:
        """vegas_jax.runtime.prefill.prefill with this engine's model, compiled programs and stop table (and the
        draft head, which prefill runs over the prompts, when it drafts)."""
        head = self._head() if config.drafts_with_head else None
        return prefill.prefill(self.model, self.programs, ids, options, config, capacity, self._stop_table(options),
                               timings, head=head, **kwargs)

    def _compile_decode(self, config, state, draft_params, timings) -> Callable:
        """The compiled decode loop: decode(params, draft_params, state, step_limit, finished_limit), the limits
        int32 scalars."""
        t0 = time.perf_counter()
        state_axes = axes_of(state)
        if draft_params is None:
            draft_axes = None
        elif config.drafts_with_head:
            draft_axes = draft_head.param_axes(draft_params)
        else:
            draft_axes = draft_weights.draft_axes(draft_params)
        args = (self.model.params, draft_params, state, np.int32(0), np.int32(0))
        decode = self.programs.compile(
            "decode", decode_loop.decode, *args, donate=(2,), layout=config.placement,
            in_axes=(param_axes(self.model.params), draft_axes, state_axes, Axes(), Axes()),
            out_axes=state_axes, config=config)
        timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - t0
        return decode

    def start(self, prompts, options: GenerationOptions, *, chat_template: bool | None = None, progress=None,
              fill_cache: Callable[[KVCache], KVCache] | None = None,
              reuse_prefill: PrefillReuse | None = None) -> Started:
        """Validates, compiles, prefills and runs the bootstrap step: the state the decode loop starts from (also
        for tools, such as benchmarks, that time parts of an iteration themselves). A request whose logits are
        not finite already is done there (`DecodeState.nonfinite`).

        `fill_cache`, for timing at shapes too large to prefill often (an 8B model at 128K): a function from the
        allocated, zeroed cache to the cache to decode from, run instead of prefill. Its rows stand for the
        prompts' keys and values, so the tokens that follow mean nothing; only their cost does. The cache it is
        given is its own: where it writes over that cache's buffers (donates them), no second cache is allocated.

        `reuse_prefill` (a `PrefillReuse`, vegas_jax.runtime.prefill_reuse): runs over the same prompts, whatever their
        method and settings, start from the cache the first one's prefill left (copied; timings' prefill_reused
        says whether this run did), and decode exactly as after their own prefill. Its kept cache is counted in
        the memory plan."""
        ids = self.encode_prompts(prompts, chat_template)
        plan = self._fitted_plan(ids, options,  # refuses what cannot fit first
                                 kept_prefill=reuse_prefill is not None and fill_cache is None)
        options, config, capacity = plan.decoding, plan.config, plan.capacity
        timings = {}
        rows = self._batch_rows(len(ids))
        draft_params = self._draft_params(config, rows)
        state = self._prefill(ids, options, config, capacity, timings, rows=rows,
                              progress=progress, fill_cache=fill_cache, reuse_prefill=reuse_prefill)
        if options.adaptive_gamma.costs is not None:  # a caller of `decode` runs adaptive γ on them from the start
            state = with_control(state, config.placement, -1, options.adaptive_gamma.costs)
        decode = self._compile_decode(config, state, draft_params, timings)
        return Started(ids, config, state, decode, timings, draft_params, options, plan.summary["ssv_plan"])

    def stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: GenerationOptions = GenerationOptions(),
        *,
        chat_template: bool | None = None,
        steps_per_call: int | None = 16,
        progress: Callable[[str, int, int], None] | None = None,
        seconds_per_call: float | None = None,
        stop: Callable[[], bool] | None = None,
        reuse_prefill: PrefillReuse | None = None,
    ) -> Iterator[list[StreamedTokens] | GenerationResult]:
        """Yields the bootstrap step's token of each request, then, after every `steps_per_call` loop iterations,
        the new tokens of each request (a StreamedTokens each: a list of ids, with their logprobs when the options
        ask for them); last, the GenerationResult. `steps_per_call=None` runs the whole decode in
        one device call. With `seconds_per_call`, the iterations per call adapt so that each call lasts about that
        long (`pacing.Pacer`; steps_per_call is the first call's). `stop` is asked before every call: once it returns
        True, decoding ends and the requests not finished are reported "interrupted" with their tokens so far.
        A request whose logits become non-finite stops alone ("failed"); the others go on. `reuse_prefill`: as
        `start`'s (runs comparing methods or settings over the same prompts prefill once; metrics'
        prefill_reused)."""
        pacer = Pacer(steps_per_call, seconds_per_call)
        started = self.start(prompts, options, chat_template=chat_template, progress=progress,
                             reuse_prefill=reuse_prefill)
        state, timings, params, config = started.state, started.timings, self.model.params, started.config
        options = started.options
        draft_params = started.draft_params
        batch, rows, k = len(started.prompt_ids), state.committed.shape[0], options.logprobs
        adaptive = self._gamma_book.for_run(config, options.adaptive_gamma.costs, rows, state.cache.capacity)
        placement = config.placement
        host = placement.fetch(token_rows(state, config))
        seen = host["num_generated"]
        yield [streamed_tokens(host, i, 0, int(seen[i]), k) for i in range(batch)]

        t0 = time.perf_counter()
        calls = DecodeCalls(started.decode, params, draft_params, placement, pacer, adaptive)
        num_generated, done, step = seen, *placement.fetch((state.done, state.step))
        while not bool(np.all(done)) and not placement.agreed(stop is not None and bool(stop())):
            state, iterations, _ = calls(state, int(step), rows)
            step = int(step) + iterations
            num_generated, done = placement.fetch((state.num_generated, state.done))
            if pacer.steps is not None:
                host = placement.fetch(token_rows(state, config))
                yield [streamed_tokens(host, i, int(seen[i]), int(num_generated[i]), k) for i in range(batch)]
                if progress:
                    progress("decode", int(num_generated[:batch].sum()), batch * options.max_new_tokens)
            seen = num_generated
        jax.block_until_ready(state.output)
        timings["decode_s"] = time.perf_counter() - t0
        host = {key: v[:batch] for key, v in host_rows(state, config).items()}
        if pacer.steps is None:
            yield [streamed_tokens(host, i, 1, int(num_generated[i]), k) for i in range(batch)]
        result = generation_result(self.tokenizer, options, started.prompt_ids, host, timings, placement,
                                   adaptive.report(state))
        if self.config.attention != "dense" or started.ssv_plan is not None:
            result.metrics.update(ssv.report(options, started.ssv_plan, timings["decode_s"],
                                             result.metrics["decode_tokens"], batch))
        # Every tree run tells the planner how its drafter fares (a later planned run may choose it).
        ssv.observe(self._acceptance, options, result.metrics["accepted_depth_histogram"])
        yield result

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
        steps_per_call: int | None = None,
        seconds_per_call: float | None = None,
        stop: Callable[[], bool] | None = None,
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

        `steps_per_call`, `seconds_per_call` and `stop` are `stream`'s: calls also return after that many
        iterations, and `stop` is asked before every admission and call (queued requests that never started are
        "interrupted" with no tokens). A failed request (non-finite logits) frees its slot like a finished one.
        """
        refill = check_serving(slots, refill)
        pacer = Pacer(steps_per_call, seconds_per_call)
        data = self.placement.data_shards
        if slots % data:
            raise InputError("{slots} {}: must be a multiple of the mesh's data axis ({mesh} data={})", slots, data)
        ids = self.encode_prompts(prompts, chat_template)
        plan = self._fitted_plan(ids, options, slots=slots, refill=refill)
        options, config, capacity = plan.decoding, plan.config, plan.capacity
        placement = config.placement
        slots = min(slots, self._batch_rows(len(ids)))
        table = SlotTable(slots, len(ids), min(refill, slots))
        group_rows = self._batch_rows(table.refill)
        params, timings = self.model.params, {}

        # An empty batch: every slot finished, so the first admissions fill it.
        state = prefill.initial_state(self.model, self.programs, [[0]], options, config, capacity,
                                      self._stop_table(options), 0, rows=slots, finished=True)
        draft_params = self._draft_params(config, slots)
        decode = self._compile_decode(config, state, draft_params, timings)
        adaptive = self._gamma_book.for_run(config, options.adaptive_gamma.costs, slots, capacity)
        calls = DecodeCalls(decode, params, draft_params, placement, pacer, adaptive)

        while not placement.agreed(stop is not None and bool(stop())):
            for group, targets in table.groups():
                # Fixed-size groups (one compilation): padding repeats the last request and is dropped on admission.
                padded = group + [group[-1]] * (table.refill - len(group))
                joining = self._prefill([ids[r] for r in padded], options, config, capacity, timings,
                                        first_request=group[0], rows=group_rows)
                into = placement.put(np.asarray(targets + [slots] * (group_rows - len(group)), np.int32), Axes(None))
                t0 = time.perf_counter()
                running_axes = axes_of(state)
                admit = self.programs.compile(
                    "admit", loop.admit, state, joining, into, donate=(0,), layout=placement,
                    in_axes=(running_axes, on_all_shards(axes_of(joining)), Axes(None)),
                    out_axes=running_axes, config=config)
                timings["compile_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                state = admit(state, joining, into)
                jax.block_until_ready(state.done)
                timings["prefill_s"] += time.perf_counter() - t0
            if not table.occupied():
                break
            before, step = placement.fetch((state.num_generated, state.step))
            state, iterations, elapsed = calls(state, int(step), table.finished_limit())
            table.after_call(host_rows(state, config), before, iterations, elapsed)
            if progress:
                progress("requests", len(table.finished), len(ids))

        timings["decode_s"] = sum(c["seconds"] for c in table.calls)
        rows = table.rows_in_order(host_rows(state, config))
        result = generation_result(self.tokenizer, options, ids, rows, timings, placement, adaptive.report(state))
        result.metrics.update(table.metrics())
        return result

    def score(self, prompts, continuations, *, batch_size: int = 8, prefill_chunk: int = 2048,
              progress: Callable[[str, int, int], None] | None = None) -> list[scoring.Scored]:
        """Each continuation's tokens' log-probabilities after its prompt, their sum and whether each was the most
        likely token (vegas_jax.runtime.scoring): pairs of strings or token-id sequences, `batch_size` pairs per pass, in
        chunks of at most `prefill_chunk` tokens. `scoring.perplexity(result)` is the perplexity over all of them."""
        scored, _ = scoring.score(self.model, self.placement, self.programs, prompts, continuations,
                                  batch_size=batch_size, prefill_chunk=prefill_chunk, progress=progress)
        return scored

