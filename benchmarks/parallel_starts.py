"""How many decoding loops a benchmark may compile side by side on this device.

The suite and the GPU lossless check compile a batch's configurations ahead, several threads at once (XLA compiles
without Python's lock: on the H200 a SmolLM2 configuration at 64 x 7.9K compiled in 8.8 s alone and about 4 s each
four to eight at a time). Each thread's `Engine.start` holds its own KV cache, decode state and step buffers until
it returns, so the number of threads is what the device's free memory holds, not a constant: six at once, right
on the H200's 141 GB, ran an H100 (80 GB) out of memory (a 5.71 GiB bootstrap buffer, 2026-12-06).
"""
from __future__ import annotations

import jax

# What one start allocates, over its plan (vegas_jax.runtime.memory): XLA's own temporaries while compiling and
# the bootstrap step's buffers beside the plan's; two starts' plans per start, as the lossless check always used.
HEADROOM = 2


def parallel_starts(jobs, prompts, most: int, stats: dict | None = None) -> int:
    """How many of these (engine, options) may start at once: the device's free memory (`stats`, default the first
    device's memory_stats) over HEADROOM times the largest plan's bytes a start allocates (its total less the
    params and draft weights every start shares), at most `most`; 1 where the device reports no limit or a plan
    fails (the configuration's own run reports why)."""
    stats = (jax.devices()[0].memory_stats() or {}) if stats is None else stats
    limit = stats.get("bytes_limit")
    if not limit:
        return 1
    try:
        plans = [engine.plan(prompts, options)["bytes_per_device"] for engine, options in jobs]
    except Exception:  # noqa: BLE001 (a configuration that cannot run is reported when its case runs)
        return 1
    per_start = max(p["total"] - p["params"] - p["draft_weights"] for p in plans)
    free = limit - stats.get("bytes_in_use", 0)
    return max(1, min(most, int(free // (HEADROOM * max(per_start, 1)))))
