"""What a run compiles and allocates, decided before either happens: the loop's static configuration, the cache
capacity and the bytes per device (vegas_jax.runtime.memory), or an InputError naming what does not fit.

Compiled shapes: the bootstrap step and the decode loop once per (batch, cache capacity, method configuration,
sampling mode, output buffer width: max_new_tokens rounded up to OUTPUT_BUCKET). The cache capacity is
`max_model_len` plus the verification's rows (γ + 1; a draft tree: its nodes + 1), rounded up to CAPACITY_ALIGN;
left unset, `max_model_len` is the prompt plus `max_new_tokens` rounded up to AUTO_LENGTH_BUCKET, so prompts of
similar length share one compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np

from models import draft_weights
from models.config import ModelConfig
from vegas_jax.decode import draft_kernel
from vegas_jax import inputs
from vegas_jax.decode import iteration as loop
from vegas_jax.runtime import memory
from vegas_jax.decode import sampling
from vegas_jax.ssv import choice as ssv
from vegas_jax.inputs import InputError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.runtime.options import INT32_MAX, GenerationOptions, round_up
from vegas_jax.runtime.research_options import CAPACITY_ALIGN
from vegas_jax.ssv.planner import DrafterAcceptance
from vegas_jax.runtime.prefill_chunks import prefill_chunk
from vegas_jax.decode.selection import Budget, make_policy
from vegas_jax.decode.drafters import head_slots
from vegas_jax.runtime.serving import check_serving
from vegas_jax.sharding import Placement, check_model_fits, round_up_to_shards

AUTO_LENGTH_BUCKET = 1024
OUTPUT_BUCKET = 256  # output buffers are this many tokens wide or a multiple: max_new_tokens rarely recompiles


@dataclasses.dataclass(frozen=True)
class RunPlan:
    options: GenerationOptions  # the caller's, checked (GenerationOptions.check)
    choice: ssv.Choice  # the run's draft tree and target: the caller's, or the SSV planner's (vegas_jax.ssv.choice)
    config: loop.DecodeConfig
    capacity: int  # cache rows per sequence
    summary: dict  # Engine.plan's report

    @property
    def decoding(self) -> GenerationOptions:
        """What the run decodes with: the caller's options with SSV's choice applied."""
        return self.choice.applied_to(self.options)


def resolve(model: LoadedModel, placement: Placement, prompt_ids: list[list[int]], options: GenerationOptions, *,
            acceptance: DrafterAcceptance, stop_table_of: Callable[[GenerationOptions], np.ndarray],
            slots: int | None = None, refill: int | None = None, kept_prefill: bool = False,
            drafters: tuple[str, ...] = ("self", "ngram"), head_window: int = 0, head_bytes: int = 0) -> RunPlan:
    """The plan of a run of these prompts (with `slots`: served through that many, `refill` at a time) once its
    options are checked, SSV's choice made and the run known to fit its devices; InputError otherwise. Each run
    resolves its plan once, and nothing downstream checks or changes its options again. `stop_table_of`: the
    options' vegas_jax.decode.stops table, asked for once the options are checked (its stop ids within the
    vocabulary). `drafters`: those the engine can run (the SSV planner's choices with drafter auto); `head_window`:
    its draft head's attention window (vegas_jax.decode.iteration.DecodeConfig.head_window), `head_bytes` its
    params' bytes (with its draft vocabulary's readout)."""
    model_config, prompt_lens = model.config, [len(p) for p in prompt_ids]
    asked = GenerationOptions.check(options)
    choice = ssv.choose(asked, model_config, prompt_lens, acceptance, drafters)
    options = choice.applied_to(asked)
    if choice.plan is not None:
        options.validate()  # the planner's tree against the other options (penalties take no tree)
    config, capacity = loop_config(model_config, placement, prompt_lens, options)
    if config.drafts_with_head:
        config = dataclasses.replace(config, head_window=head_window)
    stop_table = stop_table_of(options)
    batch = round_up_to_shards(len(prompt_ids) if slots is None else min(slots, len(prompt_ids)), placement)
    precision = config.draft_weights
    draft = draft_shapes(model, precision)
    if config.draft_activations == "int8":
        try:
            draft_kernel.check_int8_activations(draft)
        except ValueError as e:
            raise InputError("{draft_activations} int8: {}", e) from None
    chunk = prefill_chunk(model_config, batch, max(prompt_lens), capacity, options.prefill_chunk, placement)
    refill_rows = None if slots is None else round_up_to_shards(check_serving(slots, refill), placement)
    estimate = memory.estimate(model_config, model.params, placement, batch=batch, capacity=capacity, draft=draft,
                               gamma=config.verify_rows - 1,
                               k_max=config.policy.budget.k_max if config.policy else 0,
                               policy=options.method, quest_page=options.quest.page,
                               output_width=config.max_new_tokens,
                               sampling=not config.sampling.greedy, penalties=config.sampling.penalties,
                               logprobs=config.logprobs, stop_table=stop_table.shape, prefill_chunk=chunk,
                               refill=refill_rows, approx_mode=config.mode, kept_prefill=kept_prefill,
                               head_slots=head_slots(capacity, config.tree) if config.drafts_with_head else 0,
                               head_bytes=head_bytes if config.drafts_with_head else 0)
    memory.check_fits(estimate, placement)
    return RunPlan(asked, choice, config, capacity, {
        "ssv_plan": None if choice.plan is None else choice.plan.report(),
        "placement": placement.describe(),
        "mesh": {"data": placement.data_shards, "model": placement.model_shards},
        "backend": placement.backend,
        # VEGAS_SCAN_LAYERS's loop; attentions that differ by layer (last-layer scores, NSA's approximate modes)
        # run their layers unrolled whatever it says (models.decoder.layer_specific).
        "layer_loop": "scanned" if placement.scan_layers else "unrolled",
        "batch_rows": batch,
        "cache_capacity": capacity,
        "output_width": config.max_new_tokens,
        "gamma": options.gamma if options.auto_gamma else config.gamma,
        "gamma_max": config.gamma if options.auto_gamma else None,
        "draft_tree": options.drafting.draft_tree,
        # Its shape (a NODES[dDEPTH] tree is built from rates): node i's parent, the root's -1.
        "draft_tree_parents": None if options.tree is None else list(options.tree.parents),
        "drafter": options.drafting.drafter if options.drafting.draft_tree else None,
        "draft_kv_budget": config.policy.budget.k_max if config.policy else 0,
        "stop_table_states": stop_table.shape[0],
        "draft_weights": precision,
        "draft_weights_source": draft_source(model, precision),
        "bytes_per_device": estimate,
    })


def loop_config(model: ModelConfig, placement: Placement, prompt_lens: list[int],
                options: GenerationOptions) -> tuple[loop.DecodeConfig, int]:
    """The loop configuration and cache capacity for prompts of these lengths (of options checked and resolved:
    `resolve`); InputError if they do not fit."""
    if model.attention != "dense" and options.method != "ar":
        raise InputError("{method} {}: an {} model decodes with {method} ar only (sparse drafts and their "
                         "selection policies attend densely)", options.method, model.attention)
    if model.attention == "dense" and options.drafting.draft_tree is not None and options.drafting.drafter == "self" \
            and options.method == "ar":
        raise InputError("{draft_tree} {}: a dense model's self drafter drafts with a KV selection: give {method} "
                         "(e.g. vegas), or {drafter} ngram", options.drafting.draft_tree)
    if options.seed + len(prompt_lens) - 1 > INT32_MAX:
        raise InputError("{seed} {}: request i uses seed + i, which passes 2**31 - 1 for {} requests",
                         options.seed, len(prompt_lens))
    vocab = model.vocab_size
    for token in options.stop_token_ids:
        if token >= vocab:
            raise InputError("{stop_token_ids}: {} is outside the vocabulary [0, {})", token, vocab)
    if options.logprobs is not None and options.logprobs > vocab:
        raise InputError("{logprobs} {}: more alternatives than the vocabulary's {} tokens", options.logprobs,
                         vocab)
    length = max_model_len(model, prompt_lens, options)
    config = decode_config(model, placement, options, length)
    check_model_fits(model, config.placement)
    # The kernels run on each shard's heads: the verification kernel's limit is per KV head's query heads,
    # which a model axis does not change (it splits query and KV heads alike).
    gamma, group = options.effective_gamma, model.num_heads // model.num_kv_heads
    most = None if config.tree else config.verify_attention().scored_tokens_limit(group)
    if most is not None and gamma + 1 > most:
        raise InputError("{gamma} {}: the verification kernel scores at most {} tokens per sequence for this "
                         "model's heads (γ + 1 <= {})", gamma, most, most)
    return config, round_up(length + config.verify_rows, CAPACITY_ALIGN)


def max_model_len(model: ModelConfig, prompt_lens: list[int], options: GenerationOptions) -> int:
    """The context the run's cache holds: options.max_model_len, or the longest prompt plus max_new_tokens rounded
    up to AUTO_LENGTH_BUCKET (at most the model's); InputError when a prompt and its new tokens do not fit."""
    model_max = model.max_position_embeddings
    longest = max(prompt_lens)
    too_long = inputs.item("prompts", prompt_lens.index(longest)) + " has {} tokens, more than "
    if options.max_model_len is not None:
        if options.max_model_len > model_max:
            raise InputError("{max_model_len} {} exceeds the model's context of {}", options.max_model_len,
                             model_max)
        limit = options.max_model_len
        if longest > limit:
            raise InputError(too_long + "{max_model_len} {}", longest, limit)
    else:
        limit = min(model_max, round_up(longest + options.max_new_tokens, AUTO_LENGTH_BUCKET))
        if longest > limit:
            raise InputError(too_long + "the model's context of {}", longest, limit)
    if longest + options.max_new_tokens > limit:
        raise InputError(
            "{max_new_tokens} {}: with a prompt of {} tokens it exceeds the context of {} tokens ({max_model_len})",
            options.max_new_tokens, longest, limit,
        )
    return limit


def decode_config(model: ModelConfig, placement: Placement, options: GenerationOptions,
                  max_model_len: int) -> loop.DecodeConfig:
    gamma, selection = options.effective_gamma, options.selection
    policy = None
    if gamma and options.method != "ar":  # a sparse draft's selection (a dense model's chain or self drafter)
        budget = Budget.for_length(selection.sparse_ratio, selection.min_sparse_tokens, max_model_len)
        policy = make_policy(options.method, budget, gamma, placement, **options.policy_knobs)
    mode = sampling.SamplingParams.create(1, *options.sampling_values).mode()
    width = round_up(options.max_new_tokens, OUTPUT_BUCKET)
    return loop.DecodeConfig(model, gamma, policy, selection.score_mode, mode, width, placement, options.logprobs,
                             draft_weights=options.draft_weights if gamma else "bf16",
                             draft_activations=options.draft_activations if gamma else "bf16",
                             adaptive_gamma=options.auto_gamma, tree=options.tree, drafter=options.drafting.drafter,
                             mode=ssv.approx_mode_of(options))


def draft_shapes(model: LoadedModel, precision: str):
    """The draft tree of `precision` as it is or would be made (shapes only until then); None for bf16.
    InputError naming draft_weights when this model's shapes on its mesh admit no such draft."""
    if precision == "bf16":
        return None
    if precision in model.drafts:
        return model.drafts[precision]
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    try:
        return jax.eval_shape(functools.partial(draft_weights.quantize_params, config=model.config,
                                                precision=precision), shapes)
    except draft_weights.DraftWeightsError as e:
        raise InputError("{draft_weights} {}: {}", precision, e) from None


def draft_source(model: LoadedModel, precision: str) -> str:
    if precision == "bf16":
        return "the model's own weights"
    return model.draft_sources.get(precision, "made at the first run that reads them")
