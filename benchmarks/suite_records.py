"""The benchmark suite's results: one JSON record per line, appended and flushed as each measurement ends, so that
a run stopped by a time limit keeps everything it measured and the next run skips it.

A record's key is what was measured (KEY_FIELDS); two records with the same key are the same measurement, and the
later one wins when they are read back (a re-measurement replaces, never averages). A key field a record lacks
takes its KEY_DEFAULTS value: the records made before task families existed are the summarise family's. A line cut short by a kill
is ignored when the log is read (and reported), never half-parsed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterable

from benchmarks.task_families import DEFAULT_FAMILY

KEY_FIELDS = ("stage", "model", "method", "batch", "prompt_tokens", "context", "split", "gamma", "sparse_ratio",
              "knobs", "temperature", "requests", "family")
KEY_DEFAULTS = {"family": DEFAULT_FAMILY}


def value_of(record: dict, field: str):
    """A record's field, or its KEY_DEFAULTS value when the record lacks it."""
    value = record.get(field)
    return KEY_DEFAULTS.get(field) if value is None else value


def _canonical(value):
    # Ratios arrive as 0.07 from a preset and 0.07000000000000001 from arithmetic: keys compare them rounded.
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in sorted(value.items())}
    return value


def record_key(record: dict) -> str:
    """What a record measured, as one string: equal for records of the same measurement."""
    return json.dumps([_canonical(value_of(record, field)) for field in KEY_FIELDS])


def key_fields_differing(a: dict, b: dict) -> list[str]:
    """The key fields on which two records differ (none: record_key(a) == record_key(b))."""
    return [f for f in KEY_FIELDS if _canonical(value_of(a, f)) != _canonical(value_of(b, f))]


def find(records: Iterable[dict], **fields) -> list[dict]:
    """The records whose fields equal these (compared as keys compare them, defaults included)."""
    want = {k: _canonical(v) for k, v in fields.items()}
    return [r for r in records if all(_canonical(value_of(r, k)) == v for k, v in want.items())]


class RecordLog:
    """Records in a JSON Lines file, read at creation; `append` writes one and copies the log to `mirror` (the
    device tool's $OUT, so that what a call measured comes back even if a later one is cut short). `keep`: a second
    log outside the working tree (on the device machine, which keeps its home folder between calls while warm, but
    whose copy of the working tree each call replaces): records there that the log lacks are added to the log at
    creation, and every record is appended to both, so a call whose files did not come back loses nothing while
    the machine stays warm."""

    def __init__(self, path: Path, mirror: Path | None = None, keep: Path | None = None):
        self.path, self.mirror = Path(path), Path(mirror) if mirror else None
        self.keep = Path(keep).expanduser() if keep else None
        self._by_key: dict[str, dict] = {}
        self.skipped_lines = 0
        for record in self._read(self.path):
            self._by_key[record_key(record)] = record
        if self.keep:
            recovered = [r for r in self._read(self.keep) if record_key(r) not in self._by_key]
            for record in recovered:
                self._write(self.path, record)
                self._by_key[record_key(record)] = record
            if recovered:
                print(f"{self.path}: added {len(recovered)} record(s) found only in {self.keep}", file=sys.stderr)
        if self.skipped_lines:
            print(f"{self.path}: ignored {self.skipped_lines} unreadable line(s)", file=sys.stderr)

    def _read(self, path: Path) -> list[dict]:
        records = []
        if path.exists():
            for line in path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    self.skipped_lines += 1  # a line cut short when a run was killed mid-write
        return records

    @staticmethod
    def _write(path: Path, record: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(_line(record))
            f.flush()
            os.fsync(f.fileno())

    @property
    def records(self) -> list[dict]:
        return list(self._by_key.values())

    def get(self, key: str) -> dict | None:
        return self._by_key.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def find(self, **fields) -> list[dict]:
        """Records whose fields equal these (compared as keys compare them)."""
        return find(self._by_key.values(), **fields)

    def drop(self, stale) -> int:
        """Removes the records for which stale(record) holds from the log and from `keep` (rewritten whole, then
        moved into place), and from the mirror's copy; returns how many the log held."""
        dropped = [key for key, record in self._by_key.items() if stale(record)]
        for key in dropped:
            del self._by_key[key]
        for path in (self.path, self.keep):
            if path is not None and path.exists():
                kept = [r for r in self._read(path) if not stale(r)]
                temporary = path.with_name(path.name + ".partial")
                temporary.write_text("".join(map(_line, kept)))
                temporary.replace(path)
        self._mirror()
        return len(dropped)

    def append(self, record: dict) -> None:
        self._write(self.path, record)
        if self.keep:
            self._write(self.keep, record)
        self._by_key[record_key(record)] = record
        self._mirror()

    def _mirror(self) -> None:
        if self.mirror and self.path.exists():
            self.mirror.mkdir(parents=True, exist_ok=True)
            temporary = self.mirror / (self.path.name + ".partial")
            shutil.copyfile(self.path, temporary)
            temporary.replace(self.mirror / self.path.name)


def _line(record: dict) -> str:
    """A record as the log stores it: one line of JSON (numpy scalars as floats)."""
    return json.dumps(record, default=float) + "\n"


def read_logs(paths: list[Path]) -> list[dict]:
    """Every record of several logs, each with `log`: its file's name without the suffix (suite-paper)."""
    return [{**r, "log": Path(path).stem} for path in paths for r in RecordLog(path).records]


def latest_per_key(records: list[dict]) -> list[dict]:
    """One record per key: the latest measured (two presets' logs can hold the same measurement, and which file
    is read last says nothing about which has the later code)."""
    merged: dict[str, dict] = {}
    for r in records:
        key = record_key(r)
        if key not in merged or r.get("date", "") >= merged[key].get("date", ""):
            merged[key] = r
    return list(merged.values())
