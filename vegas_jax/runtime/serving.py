"""Continuous batching's host side (`Engine.serve`): the refill group size, and the table of which request each
slot decodes, what is queued, what finished, and what each decode call did."""

from __future__ import annotations

import numpy as np

from vegas_jax import inputs
from vegas_jax.inputs import InputError


def check_serving(slots: int, refill: int | None) -> int:
    """The refill group size for continuous batching (default slots // 8, at least 1); InputError if either
    number is not an integer in range. Each return to the host costs 2-6 ms at 64 slots of 7.9K tokens (a sixth to
    a half of an iteration) and a finished slot idles until its group is complete: groups of 1, 4 and 8 measured
    within 4 % of each other there, 8 ahead (benchmarks/results/e2e-2026-11-30-serve{2,3}-*.json)."""
    slots = inputs.integer(slots, "slots")
    if slots < 1:
        raise InputError("{slots} must be >= 1, got {}", slots)
    refill = max(1, slots // 8) if refill is None else inputs.integer(refill, "refill")
    if not 1 <= refill <= slots:
        raise InputError("{refill} must be in [1, {slots} {}], got {}", slots, refill)
    return refill


class SlotTable:
    """Requests 0..n-1 through `slots` slots, in order: the queue, the request in each slot, the host rows of the
    finished ones, and a record of every decode call (busy slots at its start, queue length, iterations, tokens,
    seconds)."""

    def __init__(self, slots: int, requests: int, refill: int):
        self.slots, self.requests, self.refill = slots, requests, refill
        self.queue = list(range(requests))[::-1]  # popped from the end: request 0 first
        self.request: list[int | None] = [None] * slots
        self.finished: dict[int, dict] = {}
        self.calls: list[dict] = []

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.request) if r is None]

    def occupied(self) -> list[int]:
        return [i for i, r in enumerate(self.request) if r is not None]

    def groups(self):
        """Yields (requests, slots they go to) for the next admission groups, as many as the free slots take;
        each group is seated in its slots as it is taken off the queue."""
        free = self.free()
        while self.queue and free:
            group = [self.queue.pop() for _ in range(min(self.refill, len(self.queue), len(free)))]
            targets, free = free[: len(group)], free[len(group):]
            for slot, r in zip(targets, group):
                self.request[slot] = r
            yield group, targets

    def finished_limit(self) -> int:
        """The decode call returns once this many slots are finished: enough free slots for the next group, or
        (nothing queued) all of them."""
        if not self.queue:
            return self.slots
        return self.slots - len(self.occupied()) + min(self.refill, len(self.queue))

    def after_call(self, rows: dict, generated_before: np.ndarray, iterations: int, seconds: float) -> None:
        """A decode call that started with the current occupants: its record, and the slots it finished freed."""
        occupied = self.occupied()
        self.calls.append({
            "busy_slots": len(occupied),
            "queued": len(self.queue),
            "iterations": iterations,
            "tokens": int((rows["num_generated"] - generated_before)[occupied].sum()),
            "seconds": seconds,
        })
        for slot in occupied:
            if rows["done"][slot]:
                self.finished[self.request[slot]] = {k: v[slot] for k, v in rows.items()}
                self.request[slot] = None

    def rows_in_order(self, rows: dict) -> dict:
        """Every request's host rows in request order, from the finished ones and the slots' current `rows` (still
        decoding when the run was stopped); a request never started has no tokens and is not done."""
        finished = dict(self.finished)
        for slot, r in enumerate(self.request):
            if r is not None:
                finished[r] = {k: v[slot] for k, v in rows.items()}
        queued = {k: np.zeros_like(v[0]) for k, v in rows.items()}
        return {k: np.stack([finished.get(r, queued)[k] for r in range(self.requests)]) for k in rows}

    def metrics(self) -> dict:
        """The serving entries of the run's metrics; steady calls start with every slot busy and requests queued,
        so their tokens/s leaves out the drain at the end."""
        steady = [c for c in self.calls if c["busy_slots"] == self.slots and c["queued"]]
        steady_s = sum(c["seconds"] for c in steady)
        steady_tokens = sum(c["tokens"] for c in steady)
        return {
            "slots": self.slots,
            "refill": self.refill,
            "decode_calls": self.calls,
            "loop_iterations": sum(c["iterations"] for c in self.calls),
            "steady_decode_s": steady_s,
            "steady_decode_tokens": steady_tokens,
            "steady_decode_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,
        }
