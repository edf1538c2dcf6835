"""vegas-jax: lossless long-context self-speculative decoding (Vegas) in JAX.

    import vegas_jax
    engine = vegas_jax.load()                                   # embedded SmolLM2; or a .gguf / HF / Orbax path
    result = vegas_jax.generate(engine, ["Why is the sky blue?"], method="vegas", max_new_tokens=64)
    print(result.requests[0].text, result.metrics["tau"])

The keyword arguments of `generate` are the fields of `GenerationOptions`, named like the CLI's flags.
"""

from __future__ import annotations

from vegas_jax.engine import Engine, GenerationOptions, GenerationResult, InputError, NonFiniteLogitsError

__all__ = ["Engine", "GenerationOptions", "GenerationResult", "InputError", "NonFiniteLogitsError", "generate", "load"]


def load(model: str | None = None, dtype: str = "auto") -> Engine:
    """An Engine for a checkpoint (None: the embedded SmolLM2). dtype: auto (bf16 on GPU, float32 on CPU),
    bfloat16 or float32."""
    import jax
    import jax.numpy as jnp

    from vegas_jax.loading import load_model

    if dtype == "auto":
        dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise InputError(f"dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return Engine(load_model(model, getattr(jnp, dtype)))


def generate(engine: Engine, prompts, *, chat_template: bool | None = None, **options) -> GenerationResult:
    """Prompts are strings (chat template applied when the model has one) or lists of token ids."""
    return engine.generate(prompts, GenerationOptions(**options), chat_template=chat_template)
