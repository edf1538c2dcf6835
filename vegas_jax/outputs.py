"""Where the CLIs write is tried before the work that fills it: a test write, then its removal. A folder that takes
no file (read-only, /proc, /sys, another user's) is then one error line before the run, not a run's output lost
after it."""

from __future__ import annotations

from pathlib import Path


def probe(path: Path) -> None:
    """Writes an empty file at `path` (a name of the caller's own, beside what it will write) and removes it;
    OSError when it cannot be written."""
    try:
        path.write_bytes(b"")
    finally:
        path.unlink(missing_ok=True)
