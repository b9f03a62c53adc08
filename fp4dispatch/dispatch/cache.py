"""On-disk decision cache: one JSON file per device fingerprint, safe for many processes and users.

File ``<cache_dir>/decisions-<fingerprint hash>.json``::

    {"schema_version": 1, "fingerprint": {...}, "health": {...}, "decisions": {...}, "shape_blacklist": {...},
     "verified": {...}, "faults": {...}}                 (sections: fp4dispatch/dispatch/records.py)

Rules (docs/tuning.md, "The cache"):
  * Reading never raises: an unreadable, corrupt, foreign, future-schema or oversized file is ignored with one
    warning and rebuilt; an entry that does not parse is dropped with one warning (records.py checks each).
  * A write merges into the file under a ``filelock`` lock (read, merge, temp file, ``os.replace``), so concurrent
    processes lose nothing and readers never see half a file. The lock is waited for briefly: if another process
    holds it longer, the update stays in memory (it is used at once) and is written with the next update or at exit;
    a call never stalls on a peer.
  * Bounded: at most ``MAX_KEYS`` keys per section (the least recently written go first: a section keeps its keys in
    the order they were last written) and ``MAX_RANKING`` trials per decision are kept; a file larger than
    ``MAX_FILE_BYTES`` is not read, and none is written (``_fitted``).
  * Files are created with the mode the umask gives (0644 under umask 022): with a group-writable umask (002) and a
    shared directory, several users share one cache. Temp files left by a killed writer are removed on open (when
    the lock is free) and by ``clear``.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from .fingerprint import fingerprint_hash
from .records import SECTIONS, clean_section

__all__ = ["DecisionCache", "SCHEMA_VERSION", "SECTIONS", "write_json_atomic", "remove_leftovers", "nested_merge"]

SCHEMA_VERSION = 1
log = logging.getLogger("fp4dispatch")
MAX_KEYS = 4096
MAX_RANKING = 16
MAX_FILE_BYTES = 64 << 20  # a file at every key bound, with 16 long trials a decision, is about 30 MiB
LOCK_TIMEOUT_S = 1.0
EXIT_LOCK_TIMEOUT_S = 10.0  # at exit, what is still pending waits this long in all for the lock (no call is waiting)


@functools.cache
def _umask() -> int:
    # the only way to read the umask is to set it: do it once (another thread creating a file in between gets 022)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomic(path: Path, data: dict | str) -> None:
    """Write ``data`` as JSON (or ``data`` itself, JSON text already) to a temp file beside ``path``, then
    ``os.replace`` it: readers see the old file or the new one, never half of one. The file gets the umask's mode
    (``mkstemp`` alone would make it 0600). Keys stay in the order given (a cache section's order is its keys' age:
    ``_bounded`` drops the first)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data, indent=1))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def remove_leftovers(directory: Path, name: str = "decisions-*.json") -> list[Path]:
    """Remove the temp files that writers of ``name`` (a glob) left when killed mid-write; returns them. Call it
    only while holding the file's lock (or for ``clear``): a live writer's temp file exists only under the lock."""
    gone = []
    for p in Path(directory).glob(f".{name}.*.tmp"):
        try:
            p.unlink()
            gone.append(p)
        except OSError:
            pass
    return gone


def _empty(fp: dict) -> dict:
    return {"schema_version": SCHEMA_VERSION, "fingerprint": fp, **{s: {} for s in SECTIONS}}


def _merge(section: dict, entries: dict, merge) -> None:
    """Each entry into ``section``, moved to its end: a section's keys stay in the order they were last written."""
    for k, v in entries.items():
        old = section.pop(k, None)
        section[k] = merge(old, v) if merge is not None and old is not None else v


def nested_merge(old, new):
    """Merge for two-level sections: the new entry's items over the old entry's."""
    return {**old, **new} if isinstance(old, dict) and isinstance(new, dict) else new


def _fitted(data: dict, path: Path) -> str:
    """``data`` bounded, as the JSON text written, within ``MAX_FILE_BYTES`` (what a reader takes: a file over it
    is ignored and rebuilt, every decision lost). Where the key bounds do not keep it there (long configs, many
    proven M), the older half of every section goes, again until it fits."""
    text = json.dumps(_bounded(data), indent=1)  # ASCII (ensure_ascii): characters are bytes
    if len(text) > MAX_FILE_BYTES:
        log.warning("fp4dispatch: the cache %s would pass %d bytes, more than a reader takes; the older half of "
                    "every section was dropped", path, MAX_FILE_BYTES)
    while len(text) > MAX_FILE_BYTES:
        for s in SECTIONS:
            data[s] = dict(list(data[s].items())[len(data[s]) // 2:])
        text = json.dumps(data, indent=1)
    return text


def _bounded(data: dict) -> dict:
    for s in SECTIONS:
        sec = data[s]
        if len(sec) > MAX_KEYS:  # the least recently written keys go first: they come first (_merge)
            data[s] = dict(list(sec.items())[-MAX_KEYS:])
    for e in data["decisions"].values():
        if len(e.get("ranking", ())) > MAX_RANKING:
            e["ranking"] = e["ranking"][:MAX_RANKING]
    return data


# held (not weakly): a cache whose dispatcher is gone, as a CLI command's, still has its updates written at exit
_pending_caches: "set[DecisionCache]" = set()


@atexit.register
def _flush_at_exit() -> None:
    deadline = time.monotonic() + EXIT_LOCK_TIMEOUT_S
    for cache in list(_pending_caches):
        cache._warned.add("lock")  # its "written later" would be wrong now: the warning below says what is lost
        if not cache.flush(timeout=max(deadline - time.monotonic(), 0.0)) and cache.pending_summary():
            log.warning("fp4dispatch: at exit, the cache lock %s was still held by another process (waited up to "
                        "%.1f s); not written to %s, so a later process decides or proves these again: %s",
                        cache._lock_path, EXIT_LOCK_TIMEOUT_S, cache.path, cache.pending_summary())


class DecisionCache:
    """The sections of one device fingerprint, mirrored in memory."""

    def __init__(self, cache_dir: Path, fingerprint: dict):
        self.dir = Path(cache_dir)
        self.fingerprint = fingerprint
        self.hash = fingerprint_hash(fingerprint)
        self.path = self.dir / f"decisions-{self.hash}.json"
        self._lock_path = self.dir / f"decisions-{self.hash}.json.lock"
        self._warned: set[str] = set()
        self._mutex = threading.RLock()
        self._pending: list[tuple[str, dict, object]] = []
        self.write_error: str | None = None  # why the last write failed; None once one succeeds
        self.data = self._read()
        self._clean_leftovers()

    # -- reading ---------------------------------------------------------------------------------------------
    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    def _ignore(self, why: str) -> dict:
        self._warn_once("file", "fp4dispatch: ignoring cache file %s (%s); it will be rebuilt", self.path, why)
        return _empty(self.fingerprint)

    def _read(self) -> dict:
        if self.dir.exists() and not self.dir.is_dir():  # nothing to ignore or rebuild: it cannot be written either
            self._warn_once("file", "fp4dispatch: the cache directory %s is not a directory; decisions stay in memory. "
                            "Point FP4DISPATCH_CACHE_DIR (or --cache-dir) at a directory", self.dir)
            return _empty(self.fingerprint)
        try:
            size = self.path.stat().st_size
            if size > MAX_FILE_BYTES:
                return self._ignore(f"{size} bytes, over the {MAX_FILE_BYTES}-byte bound")
            data = json.loads(self.path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            return _empty(self.fingerprint)
        except OSError as e:
            return self._ignore(f"unreadable: {e}")
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            return self._ignore(f"corrupt or truncated: {type(e).__name__}: {str(e)[:100]}")
        if not isinstance(data, dict):
            return self._ignore("not a JSON object")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:  # true and 1.0 equal 1 too
            return self._ignore(f"schema_version {version!r}, this fp4dispatch reads {SCHEMA_VERSION}")
        if data.get("fingerprint") != self.fingerprint:
            return self._ignore("foreign file: its fingerprint is not this device's")
        out, dropped = _empty(self.fingerprint), []
        for s in SECTIONS:
            sec = data.get(s, {})
            if not isinstance(sec, dict):
                return self._ignore(f"section {s!r} is not a JSON object")
            out[s], bad = clean_section(s, sec)
            dropped += bad
        if dropped:
            self._warn_once("entries", "fp4dispatch: dropped %d malformed entries of cache file %s (they are decided "
                            "again): %s", len(dropped), self.path, "; ".join(dropped[:3]))
        return out

    def reload(self) -> None:
        with self._mutex:
            self.data = self._read()
            for section, entries, merge in self._pending:
                _merge(self.data[section], entries, merge)

    def _clean_leftovers(self) -> None:
        if not self.dir.is_dir():
            return
        try:
            with FileLock(str(self._lock_path), timeout=0):
                remove_leftovers(self.dir, self.path.name)
        except (Timeout, OSError):
            pass  # a writer is busy (its temp file is live) or the directory is not ours to write

    # -- writing ---------------------------------------------------------------------------------------------
    def update(self, section: str, entries: dict, *, merge=None, merge_nested: bool = False,
               defer: bool = False) -> bool:
        """Merge ``entries`` into ``section`` in memory at once and on disk if the lock comes within
        ``LOCK_TIMEOUT_S`` (else with a later write). ``merge(old, new)`` combines an entry with the one already
        there (default: the new one replaces it). ``defer``: write it with the next update or at exit, not now
        (for what is only worth less work in a later process). Returns True when everything pending reached the
        disk."""
        if merge_nested:
            merge = nested_merge
        with self._mutex:
            _merge(self.data[section], entries, merge)
            self._pending.append((section, entries, merge))
            if defer:
                _pending_caches.add(self)
                return False
            return self.flush()

    def flush(self, timeout: float = LOCK_TIMEOUT_S) -> bool:
        """Write every pending update now (read, merge, write under the lock); False if they stay pending."""
        with self._mutex:
            if not self._pending:
                return True
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with FileLock(str(self._lock_path), timeout=timeout):
                    data = self._read()
                    for section, entries, merge in self._pending:
                        _merge(data[section], entries, merge)
                    write_json_atomic(self.path, _fitted(data, self.path))
            except Timeout:
                _pending_caches.add(self)
                self._warn_once("lock", "fp4dispatch: the cache lock %s is held by another process; decisions are "
                                "used from memory and written later", self._lock_path)
                return False
            except OSError as e:  # a read-only, full or missing cache dir must not break the GEMM
                self.write_error = f"{type(e).__name__}: {e}"
                self._pending.clear()
                self._warn_once("write", "fp4dispatch: could not write the cache %s (%s); decisions stay in memory",
                                self.path, e)
                return False
            self._pending.clear()
            _pending_caches.discard(self)
            self.write_error = None
            self.data = data
            return True

    def renew_lock(self) -> None:
        """In a fork child: a parent thread may have held the mutex at the fork; it would never be released here."""
        self._mutex = threading.RLock()

    def pending_summary(self, most: int = 3) -> str:
        """The updates not written yet, per section: ``decisions: m16-n64-k64-float32, ... (+2 more)``; "" if none."""
        with self._mutex:
            keys: dict[str, dict] = {}
            for section, entries, _ in self._pending:
                keys.setdefault(section, {}).update(dict.fromkeys(map(str, entries)))
        return "; ".join(f"{s}: {', '.join(list(ks)[:most])}" + (f" (+{len(ks) - most} more)" if len(ks) > most else "")
                         for s, ks in keys.items())

    def clear(self) -> list[Path]:
        """Remove this fingerprint's file, its writers' leftovers and its lock file; returns the files of data
        removed (not the lock)."""
        with self._mutex:
            removed = []
            self._pending.clear()
            if self.dir.is_dir():
                with FileLock(str(self._lock_path), timeout=10):
                    if self.path.exists():
                        self.path.unlink()
                        removed.append(self.path)
                    removed += remove_leftovers(self.dir, self.path.name)
                # removed, not listed: its own reading of the file made it, and it holds no data
                self._lock_path.unlink(missing_ok=True)
            self.data = _empty(self.fingerprint)
            return removed

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

    @property
    def verified(self) -> dict:
        return self.data["verified"]

    @property
    def faults(self) -> dict:
        return self.data["faults"]
