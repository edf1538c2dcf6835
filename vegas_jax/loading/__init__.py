"""One entry point for every checkpoint format: `load_model(path or None)`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from vegas_jax.loading.bundle import CheckpointError, LoadedModel


def load_model(model: str | Path | None, dtype=jnp.bfloat16, mesh=None) -> LoadedModel:
    """None: the embedded SmolLM2 GGUF; a .gguf file; a vegas-jax Orbax folder; a Hugging Face folder. mesh: the
    (data, model) mesh to lay the parameters out on (vegas_jax.sharding.adopt_mesh), None for one device."""
    # Each branch imports only its own loader: importing Orbax alone costs a noticeable fraction of a second.
    if model is None:
        from vegas_jax.loading.gguf import embedded_smollm2_path, load_gguf

        return load_gguf(embedded_smollm2_path(), dtype, mesh)
    path = Path(model)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix.lower() == ".gguf":
        from vegas_jax.loading.gguf import load_gguf

        return load_gguf(path, dtype, mesh)
    if path.is_dir():
        if (path / "vegas_config.json").is_file():  # orbax_ckpt.CONFIG_FILE, named here to leave Orbax unimported
            from vegas_jax.loading.orbax_ckpt import load_orbax

            return load_orbax(path, dtype, mesh)
        if (path / "config.json").is_file():
            from vegas_jax.loading.hf import load_hf

            return load_hf(path, dtype, mesh)
    raise CheckpointError(
        f"{path}: not a GGUF file (*.gguf), a Hugging Face folder (config.json) "
        f"or a vegas-jax Orbax checkpoint (vegas_config.json)"
    )


__all__ = ["CheckpointError", "LoadedModel", "load_model"]
