"""Speculative-decoding metrics, per request and pooled.

τ (tokens per iteration) = 1 + accepted drafts / verification passes, the acceptance length of vLLM and
llama.cpp, from 1 to γ+1. Acceptance rate = accepted / drafted. Acceptance by position i = the fraction of passes
whose draft i (1-based) was accepted among passes that drafted it. Pooled numbers sum counts over requests rather
than averaging per-request ratios, so long requests weigh by their iterations (report both). The accepted-depth
histogram counts passes by how many drafts they accepted (0 to γ; with a draft tree, the depth of the accepted
path): a pass accepted at least i drafts iff it accepted draft i, so it follows from the counts by position.
"""

from __future__ import annotations

import numpy as np


def _ratio(num, den) -> float | None:
    return float(num) / float(den) if den else None


def request_metrics(generated: int, iterations: int, drafted: np.ndarray, accepted: np.ndarray) -> dict:
    return {
        "generated_tokens": int(generated),
        "iterations": int(iterations),
        "tau": _ratio(iterations + accepted.sum(), iterations),
        "acceptance_rate": _ratio(accepted.sum(), drafted.sum()),
        "acceptance_by_position": [_ratio(a, d) for a, d in zip(accepted, drafted)],
    }


def pooled_metrics(iterations: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, gamma: int) -> dict:
    """iterations [B], drafted/accepted [B, γ]."""
    total_iterations = int(iterations.sum())
    per_request_tau = [_ratio(i + a.sum(), i) for i, a in zip(iterations, accepted) if i]
    return {
        "gamma": gamma,
        "iterations": total_iterations,
        "tau": _ratio(total_iterations + accepted.sum(), total_iterations),
        "tau_mean_over_requests": float(np.mean(per_request_tau)) if per_request_tau else None,
        "acceptance_rate": _ratio(accepted.sum(), drafted.sum()),
        "drafts_counted": int(drafted.sum()),  # the rate's counts, to pool over runs
        "drafts_accepted": int(accepted.sum()),
        "acceptance_by_position": [_ratio(a, d) for a, d in zip(accepted.sum(0), drafted.sum(0))],
        "accepted_depth_histogram": accepted_histogram(total_iterations, accepted.sum(0)),
    }


def rank_rates(offered: np.ndarray, accepted: np.ndarray) -> list[float | None]:
    """A tree's acceptance rate by rank, pooled over requests (offered/accepted [B, most children], loop.Metrics):
    a node's chance that its child of that rank is the accepted one, given the node was (--tree-rates)."""
    return [_ratio(a, o) for a, o in zip(accepted.sum(0), offered.sum(0))]


def accepted_histogram(iterations: int, accepted_by_position: np.ndarray) -> list[int]:
    """[passes that accepted exactly 0, 1, ..., γ drafts] from the passes and the accepted counts by position."""
    at_least = np.concatenate([[iterations], np.asarray(accepted_by_position, np.int64)])
    return (at_least - np.concatenate([at_least[1:], [0]])).astype(int).tolist()
