"""On-disk decision cache: one JSON file per device fingerprint, safe for many processes.

File ``<cache_dir>/decisions-<fingerprint hash>.json``::

    {"schema_version": 1,
     "fingerprint": {...},                               # what the hash was made of
     "health":    {"<backend>": {"status": "unavailable", "reason": "..."}},
     "decisions": {"<key>": {"backend": "...", "config": {...}, "time_us": 12.3, "ranking": [...], ...}},
     "shape_blacklist": {"<key>": {"<backend>": "incorrect: all zeros at M=300"}}}

Writes re-read the file under a ``filelock`` lock, merge, write a temp file and ``os.replace`` it, so concurrent
processes never lose each other's entries and readers never see half a file. JSON only: a cache dir may be shared.
A corrupt, truncated, foreign or future-schema file is reported once and rebuilt; it never raises.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path

from filelock import FileLock

from .fingerprint import fingerprint_hash

__all__ = ["DecisionCache", "SCHEMA_VERSION", "SECTIONS", "write_json_atomic"]

SCHEMA_VERSION = 1
log = logging.getLogger("fp4dispatch")
SECTIONS = ("health", "decisions", "shape_blacklist")


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to a temp file beside ``path``, then ``os.replace`` it: readers see the old file or
    the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _empty(fp: dict) -> dict:
    return {"schema_version": SCHEMA_VERSION, "fingerprint": fp, **{s: {} for s in SECTIONS}}


class DecisionCache:
    """Decisions and health verdicts of one device fingerprint, mirrored in memory."""

    def __init__(self, cache_dir: Path, fingerprint: dict):
        self.dir = Path(cache_dir)
        self.fingerprint = fingerprint
        self.hash = fingerprint_hash(fingerprint)
        self.path = self.dir / f"decisions-{self.hash}.json"
        self._lock_path = self.dir / f"decisions-{self.hash}.json.lock"
        self._warned = False
        self._mutex = threading.Lock()
        self.data = self._read()

    # -- reading ---------------------------------------------------------------------------------------------
    def _warn_once(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("fp4dispatch: ignoring cache file %s (%s); it will be rebuilt", self.path, why)

    def _read(self) -> dict:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return _empty(self.fingerprint)
        except OSError as e:
            self._warn_once(f"unreadable: {e}")
            return _empty(self.fingerprint)
        try:
            data = json.loads(text)
        except ValueError as e:
            self._warn_once(f"corrupt or truncated JSON: {e}")
            return _empty(self.fingerprint)
        if not isinstance(data, dict):
            self._warn_once("not a JSON object")
            return _empty(self.fingerprint)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            self._warn_once(f"schema_version {version!r}, this fp4dispatch reads {SCHEMA_VERSION}")
            return _empty(self.fingerprint)
        if data.get("fingerprint") != self.fingerprint:
            self._warn_once("foreign file: its fingerprint is not this device's")
            return _empty(self.fingerprint)
        for s in SECTIONS:
            if not isinstance(data.get(s), dict):
                self._warn_once(f"section {s!r} missing or malformed")
                return _empty(self.fingerprint)
        return data

    def reload(self) -> None:
        with self._mutex:
            self.data = self._read()

    # -- writing ---------------------------------------------------------------------------------------------
    def update(self, section: str, entries: dict, *, merge_nested: bool = False) -> None:
        """Merge ``entries`` into ``section`` on disk (read-merge-write under the file lock) and in memory."""
        with self._mutex:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with FileLock(str(self._lock_path), timeout=60):
                    data = self._read()
                    for k, v in entries.items():
                        if merge_nested and isinstance(data[section].get(k), dict):
                            data[section][k].update(v)
                        else:
                            data[section][k] = v
                    write_json_atomic(self.path, data)
                    self.data = data
            except OSError as e:  # a read-only or full cache dir must not break the GEMM
                log.warning("fp4dispatch: could not write the cache %s (%s); decisions stay in memory", self.path, e)
                for k, v in entries.items():
                    if merge_nested and isinstance(self.data[section].get(k), dict):
                        self.data[section][k].update(v)
                    else:
                        self.data[section][k] = v

    def clear(self) -> None:
        with self._mutex:
            with FileLock(str(self._lock_path), timeout=60):
                if self.path.exists():
                    self.path.unlink()
            self.data = _empty(self.fingerprint)

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def health(self) -> dict:
        return self.data["health"]

    @property
    def decisions(self) -> dict:
        return self.data["decisions"]

    @property
    def shape_blacklist(self) -> dict:
        return self.data["shape_blacklist"]
