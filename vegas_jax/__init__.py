"""vegas-jax: lossless long-context self-speculative decoding (Vegas) in JAX.

    import vegas_jax
    engine = vegas_jax.load()                                   # embedded SmolLM2; or a .gguf / HF / Orbax path
    result = engine.generate(["Why is the sky blue?"], vegas_jax.GenerationOptions(method="vegas"))
    print(result.requests[0].text, result.metrics["tau"])

GenerationOptions' fields are the CLI's flags. (`vegas_jax.generate` is the CLI module, so the library entry
points are `load` and the Engine's `generate` / `stream`.)
"""

from __future__ import annotations

from vegas_jax.engine import Engine, GenerationOptions, GenerationResult, InputError, NonFiniteLogitsError

__all__ = ["Engine", "GenerationOptions", "GenerationResult", "InputError", "NonFiniteLogitsError", "load"]


def load(model: str | None = None, dtype: str = "auto", mesh=None) -> Engine:
    """An Engine for a checkpoint (None: the embedded SmolLM2). dtype: auto (bf16 on GPU, float32 on CPU),
    bfloat16 or float32. mesh: a `jax.sharding.Mesh` with axes `data` (splits the batch) and `model` (splits heads
    and MLP units), either optional; the parameters are loaded straight into their shards and every generate /
    stream / serve call runs on it. None: one device."""
    import jax
    import jax.numpy as jnp

    from vegas_jax.loading import load_model
    from vegas_jax.sharding import adopt_mesh

    if dtype == "auto":
        dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise InputError(f"dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return Engine(load_model(model, getattr(jnp, dtype), None if mesh is None else adopt_mesh(mesh)))

