import os
import shutil
import tempfile

import numpy as np
import pytest


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run, shared by the xdist workers and every subprocess a
    test starts (they inherit the environment): most of the suite's time is XLA compiling decode loops, and many
    tests compile the same program (the same tiny model, method and shapes) in another test, worker or process. A
    fresh folder each run, so a run never reads programs compiled by an earlier JAX or XLA. Set before any test
    module imports JAX, which reads these variables once."""
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # an xdist worker (its controller made the folder), or a folder the caller chose
    config._test_compilation_cache = tempfile.mkdtemp(prefix="vegas-tests-xla-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=config._test_compilation_cache,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def pytest_unconfigure(config):
    folder = getattr(config, "_test_compilation_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


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
