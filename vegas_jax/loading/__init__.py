"""One entry point for every checkpoint format: `load_model(path or None)`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from models.config import UnsupportedModelError
from models.draft_weights import DraftWeightsError
from models.quantized import PRECISIONS
from vegas_jax.inputs import InputError
from vegas_jax.loading.bundle import LoadedModel
from vegas_jax.loading.checkpoint_files import CheckpointError

# Orbax appends whole TensorStore specs to its messages: a cause is cut to its first line and this many characters.
CAUSE_CHARS = 400


def load_model(model: str | Path | None, dtype=jnp.bfloat16, mesh=None, draft_weights: str | None = None) -> LoadedModel:
    """None: the embedded SmolLM2 GGUF; a .gguf file; a vegas-jax Orbax folder; a Hugging Face folder. mesh: the
    (data, model) mesh to lay the parameters out on (vegas_jax.sharding.adopt_mesh), None for one device.
    draft_weights: int8 or int4 makes the draft passes' quantized weights now (from a GGUF's own blocks where it
    has them; models.draft_weights), bf16 or None leaves them to be made on first use. InputError naming
    draft_weights when the model's shapes on this mesh admit no such draft.

    Raises CheckpointError or UnsupportedModelError naming the file at fault: any other failure while reading
    (a corrupt file deep inside a reader library, say) becomes a CheckpointError naming the checkpoint and the
    innermost cause, the reader's exception being its __cause__."""
    if draft_weights is not None and draft_weights not in PRECISIONS:
        raise InputError("{draft_weights} must be one of {}, got {!r}", ", ".join(PRECISIONS), draft_weights)
    try:
        loaded = _load(model, dtype, mesh, draft_weights)
        if draft_weights is not None:
            loaded.draft_params(draft_weights)
        return loaded
    except DraftWeightsError as e:
        raise InputError("{draft_weights} {}: {}", draft_weights, e) from None
    except (CheckpointError, UnsupportedModelError, InputError):  # InputError: a mesh that cannot hold the model
        raise
    except Exception as e:
        raise CheckpointError(f"{model or 'the embedded model'}: cannot read the checkpoint: {cause(e)}") from e


def where_and_why(model: str | Path | None, error: Exception) -> str:
    """`PATH: cause` for an error of load_model(model), PATH being the file at fault where the message names one
    inside the folder (loaders' messages start with the file they name), else the checkpoint."""
    message = str(error)
    if model is not None and message.startswith((str(Path(model)), str(Path(model).absolute()))):
        return message
    return f"{model or '(the embedded SmolLM2)'}: {message}"


def cause(error: BaseException) -> str:
    """The first line of the innermost exception that `error` was raised from, with its type."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:CAUSE_CHARS] if lines else ''}"


def _load(model: str | Path | None, dtype, mesh, draft_weights) -> LoadedModel:
    # Each branch imports only its own loader: importing Orbax alone costs a noticeable fraction of a second.
    if model is None:
        from vegas_jax.loading.gguf import embedded_smollm2_path, load_gguf

        return load_gguf(embedded_smollm2_path(), dtype, mesh, draft_weights)
    path = Path(model)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix.lower() == ".gguf":
        from vegas_jax.loading.gguf import load_gguf

        return load_gguf(path, dtype, mesh, draft_weights)
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


__all__ = ["CheckpointError", "LoadedModel", "load_model", "where_and_why"]
