import collections
import json
import os
import shutil
import tempfile
import time

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TESTS_COMPILE_LOG=<file>: one JSON line per test (setup, call and teardown together) with its wall
    seconds, the seconds XLA spent compiling in this process, how many programs it compiled, and how many the
    persistent cache gave instead; what tells a compile-bound test from a compute-bound one across the suite (the
    subprocesses some tests start are not counted). Off by default. (Not a VEGAS_ name: the CLI refuses any
    VEGAS_ variable that is no flag's, and the CLI subprocesses of some tests inherit the environment.)"""
    path = os.environ.get("TESTS_COMPILE_LOG")
    if not path:
        yield
        return
    counts = _compile_counts()
    counts.clear()
    start = time.perf_counter()
    yield
    record = {"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 2),
              "compile_s": round(counts["compile_s"], 2), "compiled": counts["compiled"],
              "cache_hits": counts["cache_hits"], "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(path, "a") as log:
        log.write(json.dumps(record) + "\n")


_COUNTS = None


def _compile_counts() -> collections.Counter:
    """This process's compile counters, fed by JAX's monitoring events (registered on first use, after
    pytest_configure set the cache variables, so importing JAX here changes nothing)."""
    global _COUNTS
    if _COUNTS is None:
        import jax

        _COUNTS = collections.Counter()

        def duration(event, seconds, **_):
            if event == "/jax/core/compile/backend_compile_duration":
                _COUNTS["compile_s"] += seconds
                _COUNTS["compiled"] += 1

        def event(name, **_):
            if name == "/jax/compilation_cache/cache_hits":
                _COUNTS["cache_hits"] += 1

        jax.monitoring.register_event_duration_secs_listener(duration)
        jax.monitoring.register_event_listener(event)
    return _COUNTS
