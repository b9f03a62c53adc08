"""The self-selecting dispatcher: probe once per device, tune once per key, remember on disk, fall back on faults.

Key = (device, M bucket, N, K, out_dtype); the device fingerprint (GPU, driver, CUDA, library versions, env) names
the cache file. After a key is decided, a call costs one dict lookup and the chosen backend's run.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from . import api
from .backends import default_backends
from .backends.base import Backend, Config
from .bench import DoBench, for_device
from .cache import DecisionCache
from .config import Settings, default_cache_dir, read_settings
from .errors import BackendError, InvalidInputError, NoUsableBackendError
from .fingerprint import device_fingerprint
from .isolate import probe_isolated
from .probe import Verdict, describe_exception, probe_backend, reset_cuda_error
from .problem import Operands, Problem, m_bucket
from .tuner import Trial, tune, verify_only

__all__ = ["Dispatcher", "BackendRecord", "Choice", "key_str"]

log = logging.getLogger("fp4dispatch")


class Choice(NamedTuple):
    backend: Backend
    config: Config
    fallbacks: tuple = ()  # ((backend, config), ...) verified on this key, best first
    key: tuple | None = None  # None for a forced backend: no fallback, errors surface


@dataclass
class BackendRecord:
    """One backend's standing on a device: status, reason, and what it won or lost per key."""

    name: str
    status: str
    reason: str
    wins: list[str] = field(default_factory=list)
    losses: dict[str, str] = field(default_factory=dict)


@dataclass
class _DeviceState:
    cache: DecisionCache
    health: dict[str, Verdict]


def key_str(key: tuple) -> str:
    _, bucket, n, k, dt = key
    return f"m{bucket}-n{n}-k{k}-{str(dt).replace('torch.', '')}"


class Dispatcher:
    """Chooses, per device and shape, the fastest backend proven correct there.

    Args:
        backends: ordered backends (priority order); default: every built-in backend.
        cache_dir: decision cache directory; default ``FP4DISPATCH_CACHE_DIR`` or platformdirs' user cache dir.
        do_bench: ``fn -> milliseconds``; default on CUDA the median GPU time of CUDA-graph replays
            (``FP4DISPATCH_TIMER=eager``: eager launches, ``triton.testing.do_bench``), a timer loop on CPU.
        settings: environment knobs (default: read from ``FP4DISPATCH_*`` now).
        guard: guard mode (default ``FP4DISPATCH_GUARD``).
    """

    def __init__(self, backends: list[Backend] | None = None, *, cache_dir: str | Path | None = None,
                 do_bench: DoBench | None = None, settings: Settings | None = None, guard: bool | None = None):
        self.settings = settings or read_settings()
        self.backends: list[Backend] = list(backends) if backends is not None else default_backends()
        self._by_name = {b.name: b for b in self.backends}
        self.cache_dir = Path(cache_dir) if cache_dir is not None else (self.settings.cache_dir or default_cache_dir())
        self._do_bench = do_bench
        self._forced = self.settings.forced_backend
        self._choices: dict[tuple, Choice] = {}
        self._named: dict[tuple, Choice] = {}
        self._states: dict[torch.device, _DeviceState] = {}
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        # guard mode (fp4dispatch.guard): checks outputs for non-finite values without a host sync per call
        self.guard = None
        if guard if guard is not None else self.settings.guard:
            from .guard import Guard

            self.guard = Guard(every=self.settings.guard_every)

    # -- the call ------------------------------------------------------------------------------------------------
    def fp4_mm(self, a, b, a_scale, b_scale, alpha=None, *, out_dtype=torch.bfloat16, out=None,
               scale_layout="swizzled", backend=None) -> torch.Tensor:
        """Same contract as :func:`fp4dispatch.fp4_mm`, through this dispatcher."""
        return api.run_fp4_mm(self, a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend)

    def choose(self, problem: Problem, backend: str | None = None) -> Choice:
        """The backend and config for ``problem``: one dict lookup once the key is decided."""
        if backend is not None or self._forced is not None:
            return self._named_choice(backend or self._forced, problem)
        m, n, k, dt, dev = problem
        key = (dev, m_bucket(m), n, k, dt)
        c = self._choices.get(key)
        return c if c is not None else self._decide(key, problem)

    def execute(self, choice: Choice, problem: Problem, ops: Operands) -> torch.Tensor:
        try:
            choice.backend.run(problem, ops, choice.config)
        except Exception as e:  # noqa: BLE001 - a runtime fault falls back; the caller still gets a right result
            if choice.key is None:
                raise BackendError(f"fp4_mm: backend {choice.backend.name!r} failed on {problem}: "
                                   f"{describe_exception(e)}") from e
            return self.execute(self._runtime_fault(choice, problem, e), problem, ops)
        if self.guard is not None and choice.key is not None:
            return self.guard.after_run(self, choice, problem, ops)
        return ops.out

    # -- decisions -----------------------------------------------------------------------------------------------
    def _decide(self, key: tuple, problem: Problem) -> Choice:
        with self._lock:
            c = self._choices.get(key)
            if c is not None:
                return c
            if problem.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return self._capture_fallback(key, problem)
            st = self._state(problem.device)
            ks = key_str(key)
            entry = st.cache.decisions.get(ks)
            c = self._choice_from_entry(entry, st, key) if entry else None
            if c is None:
                c = self._tune_key(key, problem, st)
            self._choices[key] = c
            return c

    def _healthy(self, st: _DeviceState, name: str) -> bool:
        v = st.health.get(name)
        return v is not None and v.status == "ok"

    def _choice_from_entry(self, entry: dict, st: _DeviceState, key: tuple) -> Choice | None:
        banned = st.cache.shape_blacklist.get(key_str(key), {})
        ranked = []
        for t in [entry] + list(entry.get("ranking", [])):
            name = t.get("backend")
            if t.get("time_us") is None or name in banned or name not in self._by_name:
                continue
            if not self._healthy(st, name) or any(r[0].name == name for r in ranked):
                continue
            ranked.append((self._by_name[name], dict(t.get("config") or {})))
        if not ranked or ranked[0][0].name != entry.get("backend"):
            return None  # the cached winner is gone or banned: decide again
        return Choice(ranked[0][0], ranked[0][1], tuple(ranked[1:]), key)

    def _tune_key(self, key: tuple, problem: Problem, st: _DeviceState) -> Choice:
        ks = key_str(key)
        banned = st.cache.shape_blacklist.get(ks, {})
        reasons: dict[str, str] = {}
        candidates = []
        for b in self.backends:
            v = st.health[b.name]
            if v.status != "ok":
                reasons[b.name] = f"{v.status}: {v.reason}"
            elif b.name in banned:
                reasons[b.name] = banned[b.name]
            # a decision serves the whole M bucket: a backend must accept the bucket's largest M too
            elif (why := b.unsupported(problem) or b.unsupported(problem.with_m(key[1]))) is not None:
                reasons[b.name] = f"unsupported: {why}"
            else:
                candidates.append(b)
        if not candidates:
            raise self._no_backend(problem, reasons)
        if self.settings.tune:
            trials = tune(problem, candidates, self._do_bench or for_device(problem.device, self.settings.timer))
        else:
            trials = verify_only(problem, candidates)
        best: dict[str, Trial] = {}
        for t in trials:  # sorted: the first trial of a backend is its best config
            best.setdefault(t.backend, t)
        bad = {n: t.reason for n, t in best.items() if not t.ok}
        if bad:
            st.cache.update("shape_blacklist", {ks: bad}, merge_nested=True)
            reasons.update(bad)
        ok = [t for t in best.values() if t.ok]
        if not ok:
            raise self._no_backend(problem, reasons)
        entry = {**ok[0].to_json(), "ranking": [t.to_json() for t in trials], "tuned_at_m": problem.m,
                 "mode": "tuned" if self.settings.tune else "priority"}
        st.cache.update("decisions", {ks: entry})
        ranked = tuple((self._by_name[t.backend], t.config) for t in ok)
        log.info("fp4dispatch: %s on %s -> %s", ks, problem.device, ok[0].backend)
        return Choice(ranked[0][0], ranked[0][1], ranked[1:], key)

    def _runtime_fault(self, choice: Choice, problem: Problem, e: Exception) -> Choice:
        reset_cuda_error(problem.device)
        key, name = choice.key, choice.backend.name
        reason = f"failed at runtime: {describe_exception(e)} (at M={problem.m})"
        with self._lock:
            if name not in self._warned:
                self._warned.add(name)
                log.warning("fp4dispatch: backend %s raised on %s (%s); blacklisted for this shape, using the next "
                            "best", name, problem, describe_exception(e))
            st = self._state(problem.device)
            ks = key_str(key)
            st.cache.update("shape_blacklist", {ks: {name: reason}}, merge_nested=True)
            if not choice.fallbacks:
                self._choices.pop(key, None)
                raise self._no_backend(problem, {name: reason})
            nb, ncfg = choice.fallbacks[0]
            new = Choice(nb, ncfg, choice.fallbacks[1:], key)
            self._choices[key] = new
            entry = dict(st.cache.decisions.get(ks) or {})
            entry.update(backend=nb.name, config=ncfg, replaced=f"{name}: {reason}")
            entry["ranking"] = [t for t in entry.get("ranking", []) if t.get("backend") != name]
            entry["time_us"] = next((t["time_us"] for t in entry["ranking"] if t.get("backend") == nb.name), None)
            st.cache.update("decisions", {ks: entry})
            return new

    def _capture_fallback(self, key: tuple, problem: Problem) -> Choice:
        """During CUDA-graph capture nothing may probe or tune: reuse the nearest decided bucket, else the first
        backend in priority order whose health is known to be ok."""
        near = [(abs(k[1].bit_length() - key[1].bit_length()), c) for k, c in self._choices.items()
                if k[0] == key[0] and k[2:] == key[2:]]
        if near:
            c = min(near, key=lambda x: x[0])[1]
        else:
            st = self._states.get(problem.device)
            pick = next((b for b in self.backends if st and self._healthy(st, b.name)
                         and b.unsupported(problem) is None), None)
            if pick is None:
                raise NoUsableBackendError(f"fp4_mm: {problem} has no decision and none can be made during CUDA "
                                           "graph capture; warm the shape up before capture (fp4dispatch.warmup)")
            c = Choice(pick, pick.configs(problem)[0], (), key)
        msg = f"capture:{key_str(key)}"
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("fp4dispatch: %s was not warmed up before CUDA graph capture; using %s untuned",
                        key_str(key), c.backend.name)
        return c

    def _named_choice(self, name: str, problem: Problem) -> Choice:
        nk = (name, problem.device, m_bucket(problem.m), problem.n, problem.k, problem.out_dtype)
        c = self._named.get(nk)
        if c is not None:
            return c
        b = self._by_name.get(name)
        if b is None:
            raise InvalidInputError(f"fp4_mm: backend must be one of {sorted(self._by_name)}; got {name!r}")
        with self._lock:
            v = self._state(problem.device).health[name]
        if v.status != "ok":
            raise BackendError(f"fp4_mm: backend {name!r} was requested but is {v.status} on {problem.device}: "
                               f"{v.reason}")
        why = b.unsupported(problem)
        if why is not None:
            raise BackendError(f"fp4_mm: backend {name!r} was requested but does not support {problem}: {why}")
        c = self._named[nk] = Choice(b, b.configs(problem)[0], (), None)
        return c

    def _no_backend(self, problem: Problem, reasons: dict[str, str]) -> NoUsableBackendError:
        lines = "\n".join(f"  {n}: {r}" for n, r in reasons.items())
        return NoUsableBackendError(
            f"fp4_mm: no usable backend for {problem} on {problem.device}:\n{lines}\n"
            "Install a backend's library, unset FP4DISPATCH_DISABLE, or clear the cache (python -m fp4dispatch.tune "
            "clear) if a library was fixed.", reasons)

    # -- probing -------------------------------------------------------------------------------------------------
    def _state(self, device: torch.device) -> _DeviceState:
        st = self._states.get(device)
        if st is not None:
            return st
        cache = DecisionCache(self.cache_dir, device_fingerprint(device))
        st = _DeviceState(cache, {})
        fresh = {}
        isolated = []  # probed in worker processes, all at once: each may take up to the probe timeout
        # safe backends first, native ones last: a crash must not take the safe verdicts with it
        for b in sorted(self.backends, key=lambda b: bool(b.risky)):
            if b.name in self.settings.disabled:
                st.health[b.name] = Verdict("unavailable", "disabled by FP4DISPATCH_DISABLE")
                continue
            cached = cache.health.get(b.name)
            if isinstance(cached, dict):
                st.health[b.name] = Verdict.from_json(cached)
            elif self.settings.isolate and b.risky and b.unavailable(device) is None:
                isolated.append(b)
            else:
                st.health[b.name] = fresh[b.name] = probe_backend(b, device)
        if isolated:
            with ThreadPoolExecutor(max_workers=len(isolated)) as pool:
                verdicts = pool.map(lambda b: probe_isolated(b, device, self.settings.probe_timeout_s), isolated)
                for b, v in zip(isolated, verdicts):
                    st.health[b.name] = v
                    if not v.transient:  # a timeout may be a one-off JIT compile: probe again next process
                        fresh[b.name] = v
        for name, v in st.health.items():
            if name in fresh or v.transient:
                log.info("fp4dispatch: probe %s on %s: %s %s", name, device, v.status, v.reason)
        if fresh:
            cache.update("health", {n: v.to_json() for n, v in fresh.items()})
        self._states[device] = st
        return st

    # -- public helpers ------------------------------------------------------------------------------------------
    def warmup(self, shapes, *, out_dtype: torch.dtype = torch.bfloat16, device=None) -> dict[tuple, Choice]:
        """Decide every (M, N, K) in ``shapes`` now (before CUDA-graph capture or serving)."""
        dev = _resolve_device(device)
        out = {}
        for m, n, k in shapes:
            p = Problem(int(m), int(n), int(k), out_dtype, dev)
            out[(m, n, k)] = self.choose(p)
        return out

    def report(self, device=None) -> list[BackendRecord]:
        """One record per backend: status, reason and its wins/losses per decided key on ``device``."""
        dev = _resolve_device(device)
        with self._lock:
            st = self._state(dev)
        recs = []
        for b in self.backends:
            v = st.health[b.name]
            rec = BackendRecord(b.name, v.status, v.reason)
            for ks, e in st.cache.decisions.items():
                if e.get("backend") == b.name:
                    rec.wins.append(ks)
                    continue
                for t in e.get("ranking", []):
                    if t.get("backend") == b.name and t.get("time_us") is not None:
                        rec.losses.setdefault(ks, f"slower: {t['time_us']} us vs {e.get('time_us')} us "
                                                  f"({e.get('backend')})")
            for ks, banned in st.cache.shape_blacklist.items():
                if b.name in banned:
                    rec.losses[ks] = banned[b.name]
            recs.append(rec)
        return recs

    def entry_for(self, problem: Problem) -> dict | None:
        """The cached decision record (winner, time, ranking) of ``problem``'s key, deciding it if needed."""
        self.choose(problem)
        key = (problem.device, m_bucket(problem.m), problem.n, problem.k, problem.out_dtype)
        return self.cache_for(problem.device).decisions.get(key_str(key))

    def adopt_decisions(self, entries: dict[str, dict], device=None, *, persist: bool = False) -> None:
        """Take decision records made elsewhere (another rank, a profile) as this device's own; ``persist`` also
        writes them to the disk cache. In-memory choices of those keys are re-derived on next use."""
        dev = _resolve_device(device)
        with self._lock:
            st = self._state(dev)
            if persist:
                st.cache.update("decisions", entries)
            else:
                st.cache.decisions.update(entries)
            for key in [k for k in self._choices if k[0] == dev and key_str(k) in entries]:
                del self._choices[key]

    def cache_for(self, device=None) -> DecisionCache:
        with self._lock:
            return self._state(_resolve_device(device)).cache


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d
