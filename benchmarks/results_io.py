"""Where benchmark results go: the JSON document to each folder asked for, plus $OUT when the device tool sets it."""

from __future__ import annotations

import json
import os
from pathlib import Path


def save_results(doc: dict, name: str, *folders: Path | None) -> None:
    destinations = [f for f in folders if f] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for folder in destinations:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(doc, indent=1, default=float))
