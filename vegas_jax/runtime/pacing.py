"""How many loop iterations each decode call of a run may take, and the decode calls themselves: the host can react
(to `stop`, to stream tokens, to admit requests) only between calls."""

from __future__ import annotations

import time

import numpy as np

from vegas_jax import inputs
from vegas_jax.inputs import InputError
from vegas_jax.runtime.options import INT32_MAX


class Pacer:
    """The step limit of each decode call of a run: `steps` iterations past the loop's count (None: no limit).
    With `seconds`, the count adapts after every call so that calls last about that long at the last call's pace:
    the host then waits about that long whatever the model, batch and context. Each call may at most double the
    count, so that one fast call (most sequences finished, say) does not make the next overshoot."""

    def __init__(self, steps: int | None, seconds: float | None):
        if steps is not None and (inputs.integer(steps, "steps_per_call") < 1):
            raise InputError("{steps_per_call} must be None or >= 1, got {}", steps)
        if seconds is not None and not inputs.real(seconds, "seconds_per_call") > 0:
            raise InputError("{seconds_per_call} must be None or > 0, got {}", seconds)
        self.steps = 1 if steps is None and seconds is not None else steps
        self.seconds = seconds

    def limit(self, step: int) -> int:
        return INT32_MAX if self.steps is None else min(step + self.steps, INT32_MAX)

    def update(self, iterations: int, elapsed: float) -> None:
        if self.seconds is not None and iterations > 0 and elapsed > 0:
            self.steps = max(1, min(2 * self.steps, int(iterations * self.seconds / elapsed)))


class DecodeCalls:
    """The host's side of every decode call, for `Engine.stream` and `Engine.serve` alike: each call's step limit
    (the Pacer's, and adaptive γ's warm-up, `control`: an adaptive_gamma.RunControl), the compiled loop run up to it,
    and the call's iterations and seconds (agreed by every process of a mesh, so that all pace alike) fed back to
    both."""

    def __init__(self, decode, params, draft_params, placement, pacer: Pacer, control):
        self.decode, self.params, self.draft_params = decode, params, draft_params
        self.placement, self.pacer, self.control = placement, pacer, control

    def __call__(self, state, step: int, finished_limit: int):
        """(the state after one decode call from loop step `step`, its iterations, its seconds). The loop returns
        early once `finished_limit` rows are done."""
        start = time.perf_counter()
        state, limit = self.control.before_call(state, step, self.pacer.limit(step))
        state = self.decode(self.params, self.draft_params, state, np.int32(limit), np.int32(finished_limit))
        iterations = int(self.placement.fetch(state.step)) - step  # waits for the call
        elapsed = self.placement.agreed(time.perf_counter() - start)
        self.pacer.update(iterations, elapsed)
        self.control.after_call(iterations, elapsed)
        return state, iterations, elapsed
