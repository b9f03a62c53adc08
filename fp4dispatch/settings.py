"""Every ``FP4DISPATCH_*`` environment knob, read in one place, lazily (at dispatcher creation).

| variable                 | meaning                                                                  | default |
|--------------------------|--------------------------------------------------------------------------|---------|
| FP4DISPATCH_BACKEND      | force one backend by name for the ops it computes (error if unhealthy)   | unset   |
| FP4DISPATCH_DISABLE      | comma list of backend names never to use                                 | unset   |
| FP4DISPATCH_CACHE_DIR    | decision cache directory, ~ expanded (else platformdirs' user cache dir) | unset   |
| FP4DISPATCH_TUNE         | 0: healthy backends in priority order, verified but not timed            | 1       |
| FP4DISPATCH_TIMER        | CUDA timing while tuning: graph (GPU time of graph replays) or eager     | graph   |
| FP4DISPATCH_SEARCH       | fast: screen every candidate, time the best few in full; full: time all  | fast    |
| FP4DISPATCH_LOG          | log level of the ``fp4dispatch`` logger (DEBUG, INFO, WARNING, ...)      | unset   |
| FP4DISPATCH_ISOLATE      | 1: probe risky (native) backends in worker processes                     | 0       |
| FP4DISPATCH_PROBE_TIMEOUT| seconds a probe worker may take                                          | 30      |
| FP4DISPATCH_GUARD        | 1: guard mode (device-side non-finite check, see fp4dispatch.dispatch.guard)      | 0       |
| FP4DISPATCH_GUARD_EVERY  | calls between two guard checks (each is one host sync)                   | 64      |
| FP4DISPATCH_COMPILE_WORKERS | compile processes (0: threads only; at most the cores) | (cores-2)/ranks, 1-14 |
| FP4DISPATCH_BACKGROUND_COMPILE | 0: a new key's shape's other M buckets are not compiled ahead (Humming) | 1 |
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidInputError

__all__ = ["Settings", "read_settings", "default_cache_dir", "RELEVANT_ENV", "apply_log_level", "fingerprint_env"]

# Env variables of other libraries that can change which kernel runs or what it computes: part of the fingerprint.
RELEVANT_ENV = (
    "FLASHINFER_CUDA_ARCH_LIST",
    "FLASHINFER_DISABLE_JIT",
    "TORCH_CUDA_ARCH_LIST",
    "TRITON_INTERPRET",
    "FP4DISPATCH_TIMER",
    "FP4DISPATCH_DISABLE",
)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _bad(name: str, raw: str, accepted: str, default) -> InvalidInputError:
    return InvalidInputError(f"{name}={raw!r} is not valid; accepted: {accepted}. Unset it for the default "
                             f"{default!r}")


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    raise _bad(name, raw, "/".join(_TRUE) + " or " + "/".join(_FALSE), "1" if default else "0")


def _positive(name: str, default, kind, accepted: str):
    """``kind(value)`` of the variable, which must be > 0 and finite; ``default`` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = kind(raw)
    except ValueError:
        v = -1
    if not 0 < v < float("inf"):
        raise _bad(name, raw, accepted, default)
    return v


def apply_log_level() -> None:
    """The ``fp4dispatch`` logger at ``FP4DISPATCH_LOG``'s level, if set."""
    raw = os.environ.get("FP4DISPATCH_LOG", "").strip()
    if raw:
        if raw.upper() not in _LEVELS:
            raise _bad("FP4DISPATCH_LOG", raw, ", ".join(_LEVELS) + " (any case)", "WARNING")
        logging.getLogger("fp4dispatch").setLevel(raw.upper())


@dataclass(frozen=True)
class Settings:
    forced_backend: str | None = None
    disabled: frozenset[str] = field(default_factory=frozenset)
    cache_dir: Path | None = None
    tune: bool = True
    isolate: bool = False
    probe_timeout_s: float = 30.0
    guard: bool = False
    guard_every: int = 64
    timer: str = "graph"
    search: str = "fast"
    compile_workers: int | None = None  # None: compile_processes.worker_count()
    background_compile: bool = True  # a key tuned on its first call compiles its shape's other buckets ahead

    def __post_init__(self):
        """Each field checked when built: a Settings made in code has not been through the variables' checks (a
        negative probe timeout timed every probe out at once; a string one raised TypeError from inside a call)."""
        def count(v, least: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= least

        timeout = self.probe_timeout_s
        for name, ok, want in (
                ("forced_backend", self.forced_backend is None or isinstance(self.forced_backend, str),
                 "None or a backend name"),
                ("disabled", isinstance(self.disabled, frozenset) and all(isinstance(n, str) for n in self.disabled),
                 "a frozenset of backend names"),
                ("cache_dir", self.cache_dir is None or isinstance(self.cache_dir, (str, os.PathLike)),
                 "None or a path"),
                ("probe_timeout_s", isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                 and 0 < timeout < float("inf"), "a positive finite number of seconds"),
                ("guard_every", count(self.guard_every, 1), "a positive int (calls between guard checks)"),
                ("timer", self.timer in ("graph", "eager"), "'graph' or 'eager'"),
                ("search", self.search in ("fast", "full"), "'fast' or 'full'"),
                ("compile_workers", self.compile_workers is None or count(self.compile_workers, 0),
                 "None or an int >= 0"),
                *((f, isinstance(getattr(self, f), bool), "True or False")
                  for f in ("tune", "isolate", "guard", "background_compile"))):
            if not ok:
                raise InvalidInputError(f"Settings: {name} must be {want}; got {getattr(self, name)!r}. Build it with "
                                        "dataclasses.replace(read_settings(), ...) and values of those kinds")


def _env_cache_dir() -> Path | None:
    """FP4DISPATCH_CACHE_DIR as a path, ``~`` expanded; unset, empty or blank: None (a directory named by spaces, or
    one named "~" in the working directory, is never what was meant)."""
    raw = os.environ.get("FP4DISPATCH_CACHE_DIR", "").strip()
    return Path(raw).expanduser() if raw else None


def default_cache_dir() -> Path:
    env = _env_cache_dir()
    if env is not None:
        return env
    import platformdirs

    return Path(platformdirs.user_cache_dir("fp4dispatch"))


def read_settings() -> Settings:
    """Read the environment now."""
    apply_log_level()
    disabled = _disabled()
    return Settings(
        forced_backend=os.environ.get("FP4DISPATCH_BACKEND", "").strip() or None,
        disabled=disabled,
        cache_dir=_env_cache_dir(),
        tune=_flag("FP4DISPATCH_TUNE", True),
        isolate=_flag("FP4DISPATCH_ISOLATE", False),
        probe_timeout_s=_positive("FP4DISPATCH_PROBE_TIMEOUT", 30.0, float, "a positive number of seconds"),
        guard=_flag("FP4DISPATCH_GUARD", False),
        guard_every=_positive("FP4DISPATCH_GUARD_EVERY", 64, int, "a positive integer (calls between guard checks)"),
        timer=_choice("FP4DISPATCH_TIMER", ("graph", "eager"), "graph"),
        search=_choice("FP4DISPATCH_SEARCH", ("fast", "full"), "fast"),
        compile_workers=_count("FP4DISPATCH_COMPILE_WORKERS"),
        background_compile=_flag("FP4DISPATCH_BACKGROUND_COMPILE", True),
    )


def _disabled() -> frozenset[str]:
    return frozenset(x.strip() for x in os.environ.get("FP4DISPATCH_DISABLE", "").split(",") if x.strip())


def fingerprint_env() -> dict[str, str]:
    """The ``RELEVANT_ENV`` variables set now, fp4dispatch's own as ``read_settings`` reads them (the timer in lower
    case, the disabled names sorted, either left out at its default), so that equivalent spellings (``EAGER``,
    ``b, a``, an explicit ``graph``) name the same cache file. InvalidInputError for a timer that is not valid."""
    env = {k: os.environ[k] for k in RELEVANT_ENV if k in os.environ and not k.startswith("FP4DISPATCH_")}
    timer, disabled = _choice("FP4DISPATCH_TIMER", ("graph", "eager"), "graph"), _disabled()
    if timer != "graph":
        env["FP4DISPATCH_TIMER"] = timer
    if disabled:
        env["FP4DISPATCH_DISABLE"] = ",".join(sorted(disabled))
    return env


def _count(name: str) -> int | None:
    """A count of processes from 0 to the machine's cores from the variable, or None when unset: each process
    imports torch, so a count past the cores only costs memory (a huge one would start processes until none can)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    most = os.cpu_count() or 1
    if not raw.isdigit() or int(raw) > most:
        raise _bad(name, raw, f"a whole number from 0 (0: none) to {most} (this machine's cores)",
                   "unset: a share of every core but two, 1 to 14")
    return int(raw)


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = os.environ.get(name, "").strip().lower() or default
    if raw not in choices:
        raise _bad(name, raw, " or ".join(choices), default)
    return raw
