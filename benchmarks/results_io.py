"""Where benchmark results go: the JSON document to each folder asked for, plus $OUT when the device tool sets it;
and a document saved after every record, so a run stopped by a time limit keeps what it measured."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import jax

from vegas_jax import inputs


def save_results(doc: dict, name: str, *folders: Path | None) -> None:
    """Writes doc to name in each folder (None: none) and $OUT, each file replaced whole (a temporary file, then
    os.replace): a run killed while writing leaves the previous version, never half a document."""
    named = [Path(f) for f in folders if f] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    text = json.dumps(doc, indent=1, default=float)
    for folder in dict.fromkeys(p.resolve() for p in named):  # each folder once
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{name}.{os.getpid()}.partial"
        partial.write_text(text)
        os.replace(partial, folder / name)


def check_writable(flag: str, folder: Path | str | None) -> None:
    """Before measuring: the folder a script's `flag` (--out, --results) names, and $OUT when set, are made if
    missing and take a test write (removed); else one `error:` line naming the flag (or $OUT) and exit 2, rather
    than a run whose results are lost when save_results meets the folder. None: only $OUT."""
    named = [(flag, folder)] if folder else []
    if os.environ.get("OUT"):
        named.append(("$OUT", os.environ["OUT"]))
    for name, path in named:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            inputs.probe_writable(Path(path) / f".results-write-probe-{os.getpid()}")
        except OSError as e:
            print(f"error: {name} {path}: cannot write results there ({e.strerror or e})", file=sys.stderr)
            raise SystemExit(2) from None


class RecordLog:
    """A results document of `meta` and a list of records under `key`, saved whole after every record with
    "complete": false, and with "complete": true once finish() says the run did all it set out to."""

    def __init__(self, meta: dict, name: str, *folders: Path | None, key: str = "records"):
        self.meta, self.name, self.folders, self.key = meta, name, folders, key
        self.records: list[dict] = []

    def add(self, record: dict) -> None:
        self.records.append(record)
        self._save(complete=False)

    def finish(self, complete: bool = True) -> None:
        self._save(complete)

    def _save(self, complete: bool) -> None:
        save_results({**self.meta, self.key: self.records, "complete": complete}, self.name, *self.folders)


def current_layer_loop() -> str:
    """The decoder's layer loop an engine started now would run: "scanned" or "unrolled" (VEGAS_SCAN_LAYERS)."""
    from vegas_jax.attention.backend import default_scan_layers

    return "scanned" if default_scan_layers() else "unrolled"


def run_metadata(**extra) -> dict:
    """What every results document starts with: device, jax version, UTC date, the command and the decoder's layer
    loop (VEGAS_SCAN_LAYERS: scanned or unrolled, so that the two are told apart in a comparison), then `extra`."""
    return {
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "layer_loop": current_layer_loop(),
        **extra,
    }
