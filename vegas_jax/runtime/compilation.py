"""How the engine compiles its loops: XLA options chosen for decoding, applied per compilation (not through the
process-wide XLA_FLAGS, which belong to the user); the precision of their dots, which the model's dtype decides
(`matmul_precision`), likewise per compilation; and, on request, JAX's persistent compilation cache, so that a new
process finds the loops an earlier one compiled."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import warnings
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from vegas_jax import inputs
from vegas_jax.inputs import InputError

# A decode step's GEMMs are skinny (batch rows by the model width). On the H200 XLA's Triton GEMM emitter tiles
# them worse than cuBLAS: with cuBLAS a Vegas iteration of SmolLM2 at batch 64 spends 0.95 ms less GPU time
# (14.6 vs 15.5 ms, benchmarks/results/profile-2026-11-30-{default,cublas}.json).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options() -> dict | None:
    return GPU_COMPILER_OPTIONS if jax.default_backend() == "gpu" else None


def matmul_precision(dtype) -> str | None:
    """The precision an engine's programs give their dots (XLA's and the Pallas kernels') for a model computing in
    `dtype`: "highest" for float32, None (JAX's default, or the user's) otherwise.

    JAX's default float32 dot runs in TF32 on NVIDIA GPUs (operands rounded to 10-bit mantissas), in XLA's GEMMs
    and in Triton's, so a float32 model would decide its tokens at about bf16's precision. Worse for speculation:
    a verification pass over γ + 1 rows and a plain step's one row then round differently, and near-ties flip
    (issue 49: greedy Vegas and Stream equal to plain decoding on 6 of 8 summaries at batch 8 x 7.9K on an H100,
    8 of 8 at "highest"). So a float32 model multiplies in float32, at the speed that costs. bf16 operands are
    multiplied exactly into float32 accumulators whatever the precision; their programs keep JAX's default."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else None


def tracing_precision(precision: str | None):
    """A context in which dots traced without a precision of their own take `precision` (None: leaves JAX's
    setting as it is). Thread-local and undone on leaving, so the user's own JAX code keeps the user's setting;
    the precision is part of what jit traces and caches, and ahead-of-time compilation fixes it in the program."""
    return jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()


def compile_jitted(fn: Callable, *args, donate: tuple = ()):
    """fn jitted and compiled ahead of time for these argument shapes, with the decode compiler options (without
    them, and a warning, on an XLA that does not know one of them). With several processes, every process leaves
    only once all have compiled (`_after_every_process_compiled`)."""
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    options = compiler_options()
    try:
        compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as exc:
        if not options or "No such compile option" not in str(exc):
            raise
        warnings.warn(f"compiling without the decode compiler options {options}: {exc}", RuntimeWarning,
                      stacklevel=2)
        compiled = lowered.compile()
    _after_every_process_compiled(getattr(fn, "__qualname__", "program"))
    return compiled


class Programs:
    """An engine's compiled programs, each compiled once per (name, layout, static values, argument shapes): the
    prefill chunks, bootstrap step, decode loop, admission and scoring chunk of every configuration it ran, and the
    creators of its states. Iterating gives the keys, whose first item is the program's name. Every program is
    traced with the dots' precision of the engine's model (`matmul_precision` of its dtype)."""

    def __init__(self, matmul_precision: str | None = None):
        self.matmul_precision = matmul_precision
        self._programs: dict = {}

    def tracing(self):
        """The context the programs are traced in: dots at this engine's precision (`tracing_precision`)."""
        return tracing_precision(self.matmul_precision)

    def __iter__(self):
        return iter(self._programs)

    def __len__(self) -> int:
        return len(self._programs)

    def compile(self, name: str, fn: Callable, *args, in_axes: tuple, out_axes, layout, donate: tuple = (),
                **static):
        """fn(*args, **static) compiled as one program per shard of the layout's mesh (`Placement.program`), its
        arguments and result laid out by their logical axes."""
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), args)
        key = (name, layout, tuple(sorted(static.items())), str(jax.tree.structure(args)),
               tuple(jax.tree.leaves(shapes)))
        if key not in self._programs:
            program = layout.program(functools.partial(fn, **static), in_axes, out_axes)
            with self.tracing():
                self._programs[key] = compile_jitted(program, *args, donate=donate)
        return self._programs[key]

    def kept(self, key: tuple, make: Callable[[], Callable]) -> Callable:
        """The program kept under `key`, made by `make()` the first time (a state's creator, say)."""
        if key not in self._programs:
            self._programs[key] = make()
        return self._programs[key]


def _after_every_process_compiled(name: str) -> None:
    """A barrier across processes. Compiling a loop takes seconds to minutes and its time differs between
    processes, while the program's first collective waits for every process; on CPUs that collective first builds
    a Gloo context, which gives up on a late peer after 30 s whatever the timeout flags say (jax#40831), and one
    process failing that way leaves the others waiting for ever. So the barrier is the coordination service's
    (`BARRIER_TIMEOUT_S`), not a collective."""
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp  # only here: importing it costs every run seconds

        global _barriers
        _barriers += 1
        ocp.multihost.get_barrier_sync_fn()(key=f"vegas_jax compiled {_barriers} {name}",
                                            timeout_ms=BARRIER_TIMEOUT_S * 1000)


BARRIER_TIMEOUT_S = 3600  # the slowest process's compilation of the largest loop, with a wide margin
_barriers = 0  # every process compiles the same programs in the same order, so the counts agree


# What JAX's persistent cache reports, counted since use_persistent_cache (jax.monitoring events).
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_cache_counts: collections.Counter = collections.Counter()
_cache_dir: Path | None = None


def use_persistent_cache(directory: str | os.PathLike, source: str = "{compile_cache_dir}") -> Path:
    """Compiled programs are written to and read from `directory` (made if missing), every program whatever its
    compile time or size: a CLI run that finds the decode loop there skips its compilation (tens of seconds on a
    GPU for a large model). InputError naming `source` (the flag, or the variable it came from) when the folder
    cannot be made or written. Process-wide (JAX's own configuration, fixed once JAX has compiled with it): a
    second call naming another folder is an error."""
    global _cache_dir
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        inputs.probe_writable(path / f".vegas-write-probe-{os.getpid()}")
    except (OSError, ValueError) as e:
        raise InputError(source + " {}: cannot be used as a cache folder: {}", str(directory),
                         getattr(e, "strerror", None) or e) from None
    if _cache_dir is not None:
        if path.resolve() != _cache_dir.resolve():
            raise InputError(source + " {}: this process already keeps its compiled programs in {}", str(directory),
                             str(_cache_dir))
        return _cache_dir
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size limit (0 is JAX's default)
    jax.monitoring.register_event_listener(_count_cache_event)
    _cache_dir = path
    return path


def _count_cache_event(event: str, **_) -> None:
    if event in _CACHE_EVENTS:
        _cache_counts[_CACHE_EVENTS[event]] += 1


def persistent_cache_report() -> dict | None:
    """{dir, hits, misses} of the persistent cache since use_persistent_cache (None when not in use): a hit is a
    program read from the folder instead of compiled."""
    if _cache_dir is None:
        return None
    return {"dir": str(_cache_dir), "hits": _cache_counts["hits"], "misses": _cache_counts["misses"]}
