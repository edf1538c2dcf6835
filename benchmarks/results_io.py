"""Where benchmark results go: the JSON document to each folder asked for, plus $OUT when the device tool sets it."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import jax


def save_results(doc: dict, name: str, *folders: Path | None) -> None:
    destinations = [f for f in folders if f] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for folder in destinations:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(doc, indent=1, default=float))


def run_metadata(**extra) -> dict:
    """What every results document starts with: device, jax version, UTC date and the command, then `extra`."""
    return {
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        **extra,
    }
