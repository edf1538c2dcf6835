"""The cache a prefill left, kept for the next run over the same prompts (`Engine.start(reuse_prefill=...)`).

Prefill fills the cache with the keys and values of every prompt token but the last, and what it writes depends
only on the prompts, the model and how the run lays the cache out: not on the decoding method, γ, the sparse
ratio or the sampling mode, all of which act from the bootstrap step on. Runs that compare such settings over the
same prompts (a benchmark's repeats, a tuning sweep) can therefore start from one prefill: the kept cache is
copied into the run's own, and the run goes on exactly as after its own prefill (tested token for token and
buffer for buffer against fresh prefills, every method). At SmolLM2's size, batch 64 x 7.9K, a prefill takes about
a second on the H200 and the copy a few milliseconds.

One cache is kept (the last prompts'): it holds a cache's bytes besides the run's own, which the run's memory
plan counts (vegas_jax.runtime.memory, `kept_prefill`)."""

from __future__ import annotations

import functools
import hashlib
import threading

import jax
import jax.numpy as jnp
import numpy as np


class PrefillReuse:
    """Holds the cache of the last prefill run through it, under what determined it (`key`)."""

    def __init__(self):
        self._lock = threading.Lock()  # runs may start in threads (benchmarks compile side by side)
        self._key = None
        self._cache = None

    @staticmethod
    def key(ids, cache, **layout) -> tuple:
        """What a prefill's cache depends on: the prompts' token ids, the cache's arrays (structure, shapes, dtypes,
        shardings) and `layout` (hashable: the model, placement, attention mode, prefill chunk)."""
        digest = hashlib.sha256()
        for prompt in ids:
            digest.update(np.asarray(prompt, np.int64).tobytes() + b"|")
        arrays = tuple((x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(cache))
        return digest.hexdigest(), str(jax.tree.structure(cache)), arrays, tuple(sorted(layout.items()))

    def fill(self, key, cache):
        """`cache` (donated) holding the kept prefill's contents, or None when none is kept under this key."""
        with self._lock:
            if key != self._key:
                return None
            return _copy_into(cache, self._cache)

    def keep(self, key, cache) -> None:
        """Keeps a copy of a just-prefilled cache (the run decodes into its own, which it donates)."""
        copied = jax.tree.map(jnp.copy, cache)
        with self._lock:
            self._key, self._cache = key, copied

    def clear(self) -> None:
        with self._lock:
            self._key = self._cache = None


@functools.partial(jax.jit, donate_argnums=0)
def _copy_into(destination, source):
    # A copy, written over the donated destination: the kept arrays stay the store's own (an output that merely
    # forwarded them would be donated, and deleted, by the run's decode loop).
    return jax.tree.map(lambda d, s: jnp.copy(s).astype(d.dtype), destination, source)
