"""What every checkpoint loader returns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.config import ModelConfig

if TYPE_CHECKING:
    from vegas_jax.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or inconsistent; the message names the file at fault."""


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; any problem is a CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: does not hold a JSON object")
    return data


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # nested dict of jax arrays, layout of models.decoder.param_shapes(config)
    tokenizer: "Tokenizer"
    source: str  # path (or "embedded:SmolLM2-135M-Instruct") it was loaded from
    format: str  # "gguf" | "hf" | "orbax"
