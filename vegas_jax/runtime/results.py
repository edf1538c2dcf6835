"""What a run hands back: the result types of `Engine.generate` / `stream` / `serve`, and how they are read off a
decode state (one gather of its per-request rows to the host, then tokens, text, status and metrics)."""

from __future__ import annotations

import dataclasses

import numpy as np

from vegas_jax.decode import iteration as loop
from vegas_jax.decode import stops
from vegas_jax.decode.logprobs import TokenLogprob, host_list
from vegas_jax.runtime.metrics import pooled_metrics, rank_rates, request_metrics
from vegas_jax.runtime.options import GenerationOptions
from vegas_jax.sharding import Placement


@dataclasses.dataclass
class RequestResult:
    prompt_tokens: int
    tokens: list[int]  # up to and including the token that completed a stop (string or id)
    text: str  # the tokens' text, cut at a stop string (GenerationOptions.stop, include_stop)
    metrics: dict
    # "ok"; "failed": its logits became non-finite, it stopped there alone (tokens: those emitted before);
    # "interrupted": decoding was stopped (`stop`) before it finished (tokens so far; none if still queued).
    status: str
    reason: str | None  # why it failed or stopped; None when ok
    logprobs: list[TokenLogprob] | None = None  # one per token, with GenerationOptions.logprobs


class StreamedTokens(list):
    """One request's new token ids in a chunk of `Engine.stream`; with GenerationOptions.logprobs, `logprobs` has
    their TokenLogprobs (else None)."""

    def __init__(self, tokens, logprobs: list[TokenLogprob] | None = None):
        super().__init__(tokens)
        self.logprobs = logprobs


@dataclasses.dataclass
class GenerationResult:
    options: GenerationOptions
    requests: list[RequestResult]
    metrics: dict


def token_rows(state: loop.DecodeState, config: loop.DecodeConfig) -> dict:
    """The state's arrays that a request's tokens are read from (device arrays; fetch them)."""
    rows = {"output": state.output, "num_generated": state.num_generated}
    if config.logprobs is not None:
        lp = state.logprobs
        rows.update(logprob=lp.chosen, top_ids=lp.top_ids, top_values=lp.top_values)
    return rows


def host_rows(state: loop.DecodeState, config: loop.DecodeConfig) -> dict[str, np.ndarray]:
    """Host copies of a state's per-request results (one gather for all of them)."""
    return config.placement.fetch({
        **token_rows(state, config),
        "done": state.done,
        "nonfinite": state.nonfinite,
        "iterations": state.metrics.iterations,
        "drafted": state.metrics.drafted,
        "accepted": state.metrics.accepted,
        **({} if state.metrics.rank_offered is None else
           {"rank_offered": state.metrics.rank_offered, "rank_accepted": state.metrics.rank_accepted}),
    })


def streamed_tokens(rows: dict, i: int, start: int, end: int, k: int | None) -> StreamedTokens:
    """Request i's tokens [start, end) from host rows (`token_rows`), with their logprobs when asked for."""
    tokens = rows["output"][i, start:end].tolist()
    if k is None:
        return StreamedTokens(tokens)
    window = slice(start, end)
    return StreamedTokens(tokens, host_list(rows["logprob"][i, window], rows["top_ids"][i, window],
                                            rows["top_values"][i, window], tokens, k))


def request_status(rows: dict, i: int) -> tuple[str, str | None]:
    """Request i's status and reason (RequestResult)."""
    generated = int(rows["num_generated"][i])
    if rows["nonfinite"][i]:
        return "failed", (f"non-finite logits after {generated} generated tokens: this request stopped there "
                          f"(check the checkpoint and the dtype)")
    if not rows["done"][i]:
        return "interrupted", f"stopped after {generated} generated tokens, before it finished"
    return "ok", None


def generation_result(tokenizer, options: GenerationOptions, ids: list[list[int]], rows: dict, timings: dict,
                      placement: Placement, extra_metrics: dict | None = None) -> GenerationResult:
    """The result of a run from the host rows of its requests (in prompt order) and its timings."""
    num_generated, gamma = rows["num_generated"], options.effective_gamma
    # The loop's counts have at least one column (loop.init_state): keep those of real draft positions.
    iterations, drafted, accepted = rows["iterations"], rows["drafted"][:, :gamma], rows["accepted"][:, :gamma]
    requests = []
    for i, prompt in enumerate(ids):
        tokens = streamed_tokens(rows, i, 0, int(num_generated[i]), options.logprobs)
        status, reason = request_status(rows, i)
        requests.append(
            RequestResult(
                prompt_tokens=len(prompt),
                tokens=list(tokens),
                text=stops.cut_text(tokenizer.decode(tokens), options.stop, options.include_stop),
                metrics=request_metrics(len(tokens), iterations[i], drafted[i], accepted[i]),
                status=status,
                reason=reason,
                logprobs=tokens.logprobs,
            )
        )
    decode_tokens = int(np.maximum(num_generated - 1, 0).sum())  # the first token comes from prefill
    metrics = dict(timings)
    metrics["decode_tokens"] = decode_tokens
    # None, not NaN (which JSON has no word for): a decode of no measured time has no rate.
    metrics["decode_tokens_per_s"] = decode_tokens / timings["decode_s"] if timings["decode_s"] > 0 else None
    metrics["mesh"] = {"data": placement.data_shards, "model": placement.model_shards}
    metrics.update(pooled_metrics(iterations, drafted, accepted, gamma))
    # A tree's rank acceptance rates (loop.Metrics), pooled: what --tree-rates shapes trees with.
    metrics["acceptance_by_rank"] = (rank_rates(rows["rank_offered"], rows["rank_accepted"])
                                     if "rank_offered" in rows else None)
    metrics["draft_weights"] = options.draft_weights if gamma else None
    metrics["draft_activations"] = options.draft_activations if gamma else None
    metrics["draft_tree"] = options.drafting.draft_tree
    metrics["drafter"] = options.drafting.drafter if options.drafting.draft_tree else None
    metrics.update(extra_metrics or {})
    for status in ("failed", "interrupted"):
        metrics[f"{status}_requests"] = [i for i, r in enumerate(requests) if r.status == status]
    return GenerationResult(options, requests, metrics)
