"""What every checkpoint loader returns."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig

if TYPE_CHECKING:
    from vegas_jax.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or inconsistent; the message names the file at fault."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # nested dict of jax arrays, layout of models.decoder.param_shapes(config)
    tokenizer: "Tokenizer"
    source: str  # path (or "embedded:SmolLM2-135M-Instruct") it was loaded from
    format: str  # "gguf" | "hf" | "orbax"
