"""Which implementation computes attention and selection: Pallas kernels on a GPU, the same kernels in interpret
mode (CPU tests of the kernel path), or plain jnp (the reference, and the CPU default).

The choice is a static string carried, with the mesh, by `vegas_jax.sharding.Placement`, so it is part of what a
loop compiles for; `VEGAS_KERNELS` (auto | pallas | interpret | reference) overrides the default.
`VEGAS_SCAN_LAYERS` (auto | 1 | 0) likewise chooses the decoder's scanned or unrolled layers.
"""

from __future__ import annotations

import os

import jax

from vegas_jax.inputs import InputError

BACKENDS = ("pallas", "interpret", "reference")
# Pallas lowers to Triton on NVIDIA GPUs of compute capability 8.0 (Ampere) and newer (jax#26799).
MIN_COMPUTE_CAPABILITY = (8, 0)


def default_backend() -> str:
    """The backend `VEGAS_KERNELS` names, or the platform's; InputError naming the variable for a value that is
    not a backend or a backend this platform cannot run (pallas without a capable GPU)."""
    choice = os.environ.get("VEGAS_KERNELS", "auto")
    if choice not in ("auto", *BACKENDS):
        raise InputError("VEGAS_KERNELS must be auto or one of {}, got {!r}", ", ".join(BACKENDS), choice)
    problem = _pallas_problem()
    if choice == "auto":
        return "reference" if problem else "pallas"
    if choice == "pallas" and problem:
        raise InputError("VEGAS_KERNELS=pallas: {}; use interpret (the kernels in interpret mode, slow) or reference",
                         problem)
    return choice


def _pallas_problem() -> str | None:
    """Why this platform cannot run the Pallas GPU kernels, or None."""
    if jax.default_backend() != "gpu":
        return f"the Pallas kernels need a GPU, and JAX runs on {jax.default_backend()}"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if capability.replace(".", "").isdigit() and tuple(map(int, capability.split("."))) < MIN_COMPUTE_CAPABILITY:
        return f"the Pallas kernels need compute capability 8.0 or newer, GPU 0 has {capability}"
    return None  # a newer NVIDIA GPU, or one that names no such number (ROCm's gfx names): left to the kernels


def default_scan_layers() -> bool:
    """Whether the decoder's layers run as one scanned body (models.decoder.forward): `VEGAS_SCAN_LAYERS` 1
    (scanned), 0 (unrolled) or auto (the default: scanned except on a GPU).

    The scanned body compiles 3-6x faster, which is most of a CPU run's start; on a GPU the unrolled layers decode
    faster (H100s, random weights, docs/design.md: a SmolLM2 Vegas iteration at batch 32 x 7936 by 8 to 53 %, the
    host setting how much, a plain step by 4 to 5 %, Llama-3.1-8B shapes at batch 1 x 32K by 1.5 to 5 %), and
    decoding is what a GPU run is for."""
    choice = os.environ.get("VEGAS_SCAN_LAYERS", "auto")
    if choice not in ("auto", "0", "1"):
        raise InputError("VEGAS_SCAN_LAYERS must be auto, 0 (unrolled layers) or 1 (scanned), got {!r}", choice)
    if choice == "auto":
        return jax.default_backend() != "gpu"
    return choice == "1"
