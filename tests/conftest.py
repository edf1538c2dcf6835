import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

# The suite compiles the same programs many times over (an engine per test, xdist workers, scenario subprocesses):
# JAX's persistent cache, named in the environment that the workers and subprocesses inherit, compiles each once
# per run (lossless_tiny and continuous_batching took 146 s with it against 176 s without, on 2 cores). A fresh
# folder each run, removed at its end by the process that made it: nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="vegas-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"seed {seed} (replay with KERNEL_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def pytest_collection_modifyitems(items):
    """Slow (real-model) tests first, in their order: under `--dist loadscope` the module that takes longest then
    starts at once on one worker while the other works through the rest, instead of starting halfway and running
    on alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
