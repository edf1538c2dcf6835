"""What every loader reads first: a checkpoint's JSON files, and the error that names the file at fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
