"""How the engine compiles its loops: XLA options chosen for decoding, applied per compilation (not through the
process-wide XLA_FLAGS, which belong to the user)."""

from __future__ import annotations

from typing import Callable

import jax

# A decode step's GEMMs are skinny (batch rows by the model width). On the H200 XLA's Triton GEMM emitter tiles
# them worse than cuBLAS: with cuBLAS a Vegas iteration of SmolLM2 at batch 64 spends 0.95 ms less GPU time
# (14.6 vs 15.5 ms, benchmarks/results/profile-2026-11-30-{default,cublas}.json).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options() -> dict | None:
    return GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None


def compile_jitted(fn: Callable, *args, donate: tuple = ()):
    """fn jitted and compiled ahead of time for these argument shapes, with the decode compiler options."""
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile(compiler_options=compiler_options())
