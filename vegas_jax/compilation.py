"""How the engine compiles its loops: XLA options chosen for decoding, applied per compilation (not through the
process-wide XLA_FLAGS, which belong to the user)."""

from __future__ import annotations

import warnings
from typing import Callable

import jax

# A decode step's GEMMs are skinny (batch rows by the model width). On the H200 XLA's Triton GEMM emitter tiles
# them worse than cuBLAS: with cuBLAS a Vegas iteration of SmolLM2 at batch 64 spends 0.95 ms less GPU time
# (14.6 vs 15.5 ms, benchmarks/results/profile-2026-11-30-{default,cublas}.json).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options() -> dict | None:
    return GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None


def compile_jitted(fn: Callable, *args, donate: tuple = ()):
    """fn jitted and compiled ahead of time for these argument shapes, with the decode compiler options (without
    them, and a warning, on an XLA that does not know one of them)."""
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    options = compiler_options()
    try:
        return lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as exc:
        if not options or "No such compile option" not in str(exc):
            raise
        warnings.warn(f"compiling without the decode compiler options {options}: {exc}", RuntimeWarning,
                      stacklevel=2)
        return lowered.compile()
