"""vegas-jax: lossless long-context self-speculative decoding (Vegas) in JAX.

    import vegas_jax
    engine = vegas_jax.load()                                   # embedded SmolLM2; or a .gguf / HF / Orbax path
    result = engine.generate(["Why is the sky blue?"], vegas_jax.GenerationOptions(method="vegas"))
    print(result.requests[0].text, result.metrics["tau"])

GenerationOptions' fields are the CLI's flags (stops, penalties, min-p and logprobs among them). (`vegas_jax.generate`
and `vegas_jax.score` are the CLI modules, so the library entry points are `load` and the Engine's `generate` /
`stream` / `serve` / `score`.)
"""

from __future__ import annotations

import os

from vegas_jax.runtime.engine import Engine, GenerationOptions, GenerationResult, InputError

__all__ = ["Engine", "GenerationOptions", "GenerationResult", "InputError", "load"]


def load(model: str | None = None, dtype: str = "auto", mesh=None, draft_weights: str | None = None,
         draft_head: str | None = None, draft_vocab=0) -> Engine:
    """An Engine for a checkpoint (None: the embedded SmolLM2). dtype: auto (bf16 on GPU, float32 on CPU),
    bfloat16 or float32. mesh: a `jax.sharding.Mesh` with axes `data` (splits the batch) and `model` (splits heads
    and MLP units), either optional, or the CLI's --mesh string over all devices ("data=2,model=4"); the parameters
    are loaded straight into their shards and every generate / stream / serve call runs on it. None: one device. A checkpoint that cannot be read raises CheckpointError
    naming the file and the cause. draft_weights: int8 / int4 makes the quantized draft weights at load time
    (from a GGUF's own Q8_0 / Q4_0 / Q4_1 blocks where it has them); otherwise a run asking for them
    (`GenerationOptions.draft_weights`) quantizes the loaded weights on first use. draft_head: the folder of a
    trained draft head (vegas_jax.train_draft_head), which `drafter="head"` drafts with; draft_vocab: the tokens it
    drafts from (Engine.use_draft_head's `vocabulary`: 0 all, N the N most frequent in its training sequences)."""
    import jax
    import jax.numpy as jnp

    from vegas_jax.loading import load_model
    from vegas_jax.sharding import adopt_mesh

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InputError("{model} must be a path or None, got {!r} ({})", model, type(model).__name__)
    if dtype == "auto":
        dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if dtype not in ("bfloat16", "float32"):
        raise InputError("{dtype} must be auto, bfloat16 or float32, got {!r}", dtype)
    return Engine(load_model(model, getattr(jnp, dtype), None if mesh is None else adopt_mesh(mesh), draft_weights),
                  draft_head=draft_head, draft_vocab=draft_vocab)

