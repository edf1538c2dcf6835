"""Which implementation computes attention and selection: Pallas kernels on a GPU, the same kernels in interpret
mode (CPU tests of the kernel path), or plain jnp (the reference, and the CPU default).

The choice is a static string carried, with the mesh, by `vegas_jax.sharding.Placement`, so it is part of what a
loop compiles for; `VEGAS_KERNELS` (auto | pallas | interpret | reference) overrides the default.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("pallas", "interpret", "reference")


def default_backend() -> str:
    choice = os.environ.get("VEGAS_KERNELS", "auto")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if choice not in BACKENDS:
        raise ValueError(f"VEGAS_KERNELS must be auto or one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice
