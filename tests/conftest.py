import os

import numpy as np
import pytest


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    print(f"seed {seed} (replay with KERNEL_TEST_SEED={seed})")
    return np.random.default_rng(seed)
