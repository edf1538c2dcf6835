import os

import numpy as np
import pytest


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
