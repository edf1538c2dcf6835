"""Where the CLIs write is tried before the work that fills it: a test write, then its removal. A folder that takes
no file (read-only, /proc, /sys, another user's) is then one error line before the run, not a run's output lost
after it. And a stdout whose reader leaves early costs neither the run's files nor a traceback (Stdout). --output-json
is written whole or not at all (write_json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vegas_jax import inputs
from vegas_jax.inputs import InputError


class Stdout:
    """sys.stdout for a CLI's run, through which all it prints goes. When the reader goes away (`... | head -1`)
    the write or flush that meets the closed pipe raises BrokenPipeError: this takes it, that once, points the
    descriptor at /dev/null so that later writes (and Python's flush at exit) go nowhere, and records it
    (`reader_gone`). The run goes on: its files are written and its stderr lines printed, and no traceback."""

    def __init__(self, stream):
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())  # what is still buffered is flushed there, not raised again
        finally:
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def check_json_path(path: Path) -> None:
    """Before any work: the file can be written where it is asked for (its folder is made if missing), tried with
    the temporary file `write_json` starts with."""
    if path.is_dir():
        raise InputError("--output-json {}: is a directory", path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError("--output-json {}: cannot make its folder: {}", path, e.strerror) from None
    try:
        inputs.probe_writable(_temporary(path))
    except OSError as e:
        raise InputError("--output-json {}: cannot be written: {}", path, e.strerror) from None


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_json(path: Path, doc: dict) -> None:
    """Written to a temporary file beside `path`, then renamed over it: an interrupted or failed write never
    leaves a half-written file at `path`."""
    temporary = _temporary(path)
    try:
        temporary.write_text(json.dumps(doc, indent=1))
        os.replace(temporary, path)
    except OSError as e:
        raise InputError("--output-json {}: cannot be written: {}", path, e.strerror) from None
    finally:
        temporary.unlink(missing_ok=True)
