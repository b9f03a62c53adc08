"""The self-selecting dispatcher: probe each backend once per device (when a call first needs one of its ops), tune
once per key, prove the pick at every M it serves, remember on disk, fall back on faults.

Key = (device, M bucket, N, K, out_dtype, activation dtype, experts) (``Problem.key``); the device fingerprint (GPU,
driver, CUDA, library versions, env) names the cache file. Once a key is decided and the call's M proven, a call
costs one dict lookup, one set lookup and the chosen backend's run; a repeat of a canonical call, one check of its
tensors' metadata instead of validation and lookups (call_memo.py). The rules (docs/tuning.md):
  * a decision serves an M bucket, and is proven at each M before its first result there: one run on the
    dispatcher's own hostile inputs against the exact reference (fp4dispatch/dispatch/verify.py), remembered on disk;
    a backend wrong at some M (probing or proving) is banned from the key of that M's bucket;
  * a runtime exception in a user's call is redone on the next proven backend; it counts as the backend's fault
    only if another backend then computed that same call (otherwise the call is the likely cause and nothing is
    recorded). A faulted backend is benched for the key in this process; a new process tries it again, until it
    has faulted ``FAULT_LIMIT`` times, when it is banned from the key until ``tune clear``.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path

import torch

from ..backends import default_backends
from ..backends.base import OPS, Backend, Config, computes, config_json
from ..backends.reference import reference_mm
from ..devices import check_device, check_not_traced, resolve_device
from ..errors import (MEMORY_ADVICE, BackendError, DeviceMemoryError, InvalidInputError, NoUsableBackendError,
                      describe_exception)
from ..problem import Operands, Problem, m_bucket
from ..settings import Settings, default_cache_dir, read_settings
from ..validate import check_fp4_mm_args, check_w4a16_mm_args
from ..validate_grouped import check_fp4_grouped_mm_args, check_w4a16_grouped_mm_args
from .cache import DecisionCache
from .call_memo import CallMemo
from .choice import Choice, add_proven, ident
from .faults import FAULT_LIMIT, FaultRecovery
from .untuned import UntunedChoices
from .fingerprint import device_fingerprint
from .health import device_health, wrong_when_probed
from .key_tuning import KeyTuning
from .options import check_backends, check_options, check_timer
from .records import Verdict, key_str
from .report import BackendRecord, Report, build_report, check_ops, serving_entry
from .timer import DoBench
from .warmup import Warmup
from .verify import OUT_OF_MEMORY, check_run, make_case

__all__ = ["Dispatcher", "BackendRecord", "Choice", "key_str", "FAULT_LIMIT", "check_dispatcher"]

log = logging.getLogger("fp4dispatch")
MAX_VERIFIED_M = 256  # proven M remembered on disk per key; beyond that they are proven again in each process
_live: "weakref.WeakSet[Dispatcher]" = weakref.WeakSet()  # renewed in a fork child (Dispatcher._after_fork)


class Dispatcher(KeyTuning, FaultRecovery, UntunedChoices, Warmup):
    """Chooses, per device and shape, the fastest backend proven correct there.

    Args:
        backends: ordered backends (priority order), of distinct names; default: every built-in backend.
        cache_dir: decision cache directory; default ``FP4DISPATCH_CACHE_DIR`` or platformdirs' user cache dir.
        do_bench: ``fn -> milliseconds``; default on CUDA the median GPU time of CUDA-graph replays
            (``FP4DISPATCH_TIMER=eager``: eager launches). On the CPU nothing is timed unless ``do_bench`` is given:
            backends keep their priority order (the reference is the only one that matters there, and a loaded
            machine's timings would decide at random).
        screen_bench: the brief timer that picks the few candidates ``do_bench`` times (``tuner.Search``); default
            ``timer.screen_for_device`` when ``do_bench`` is the default one, else none: a given ``do_bench`` times
            every candidate. ``FP4DISPATCH_SEARCH=full`` turns screening off.
        settings: environment knobs (default: read from ``FP4DISPATCH_*`` now).
        guard: guard mode (default ``FP4DISPATCH_GUARD``).
    """

    def __init__(self, backends: list[Backend] | None = None, *, cache_dir: str | Path | None = None,
                 do_bench: DoBench | None = None, settings: Settings | None = None, guard: bool | None = None,
                 screen_bench: DoBench | None = None):
        check_options(cache_dir, settings, guard)
        self.settings = settings or read_settings()
        self.backends: list[Backend] = check_backends(backends) if backends is not None else default_backends()
        self._by_name = {b.name: b for b in self.backends}
        self._check_disabled()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else (self.settings.cache_dir or default_cache_dir())
        for b in self.backends:  # a backend with a cache of its own (loop:fp4_mm's) keeps it under this directory
            getattr(b, "set_cache_root", lambda root: None)(self.cache_dir)
        self._do_bench = check_timer("do_bench", do_bench)
        self._screen_bench = check_timer("screen_bench", screen_bench)
        self._forced = self.settings.forced_backend
        self._choices: dict[tuple, Choice] = {}
        self.memo = CallMemo(self._choices)  # repeat calls skip validation and lookup (dispatch/call_memo.py)
        self._named: dict[tuple, Choice] = {}
        self._proven: dict[tuple, set] = {}  # (key, ident) -> M proven, shared by every Choice of that pair
        self._states: dict[torch.device, tuple[DecisionCache, dict[str, Verdict]]] = {}
        self._probed_ops: dict[torch.device, set[str]] = {}  # the ops whose backends have verdicts in _states
        self._lock = threading.RLock()
        _live.add(self)
        self._warned: set[str] = set()
        self._keys_ahead: set[tuple] = set()  # the keys compile_keys was given (their kernels compiled together)
        # guard mode (fp4dispatch.dispatch.guard): checks outputs for non-finite values without a host sync per call
        self.guard = None
        if guard if guard is not None else self.settings.guard:
            from .guard import Guard

            self.guard = Guard(every=self.settings.guard_every)

    def _after_fork(self) -> None:
        """In a fork child: a lock that another thread of the parent held (tuning a key, probing, writing the cache)
        would never be released here, and the next new key would wait for it forever. The locks are made anew; a
        probe that was under way then left its ops marked without their verdicts: they are probed again here."""
        self._lock = threading.RLock()
        if self.guard is not None:
            self.guard.renew_lock()
        for dev, (cache, health) in list(self._states.items()):
            cache.renew_lock()
            self._probed_ops[dev] = {op for op in self._probed_ops.get(dev, ()) if all(
                b.name in health for b in self.backends if computes(b, op))}

    def _check_disabled(self) -> None:
        from ..backends import names

        builtin = set(names())  # every built-in backend made once: a name of one is known even if not passed here
        known = set(self._by_name) | builtin
        if unknown := self.settings.disabled - known:
            raise InvalidInputError(f"FP4DISPATCH_DISABLE={','.join(sorted(self.settings.disabled))!r} names no "
                                    f"backend {sorted(unknown)}; accepted names: {sorted(known)}. Fix the names or "
                                    "unset the variable")
        if (forced := self.settings.forced_backend) is not None and forced not in known:  # before any call needs it
            raise InvalidInputError(f"FP4DISPATCH_BACKEND={forced!r} names no backend; accepted names: "
                                    f"{sorted(known)}. Fix the name or unset the variable")

    # -- the call ------------------------------------------------------------------------------------------------
    def fp4_mm(self, a, b, a_scale, b_scale, alpha=None, *, out_dtype=torch.bfloat16, out=None,
               scale_layout="swizzled", backend=None) -> torch.Tensor:
        """Same contract as :func:`fp4dispatch.fp4_mm`, through this dispatcher (the path of api.run_fp4_mm)."""
        hit = self.memo.fp4_mm(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend)
        return self.execute(*hit) if hit is not None else self.run_new(
            check_fp4_mm_args(a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout),
            (a, b, a_scale, b_scale, alpha, out), out_dtype, scale_layout, backend)

    def w4a16_mm(self, a, b, b_scale, alpha=None, *, out_dtype=None, out=None, scale_layout="swizzled",
                 backend=None) -> torch.Tensor:
        """Same contract as :func:`fp4dispatch.w4a16_mm`, through this dispatcher."""
        hit = self.memo.w4a16_mm(a, b, b_scale, alpha, out_dtype, out, scale_layout, backend)
        return self.execute(*hit) if hit is not None else self.run_new(
            check_w4a16_mm_args(a, b, b_scale, alpha, out_dtype, out, scale_layout), (a, b, b_scale, alpha, out),
            out_dtype, scale_layout, backend)

    def run_new(self, checked: tuple, args: tuple, out_dtype, scale_layout: str, backend,
                check_offs: bool = False) -> torch.Tensor:
        """A call the memo did not know, given validate's ``(problem, ops)`` and the call's tensors as passed (out
        last; ``CallMemo.remember``): decided (and remembered), then run. api.run_fp4_mm spells these steps out."""
        problem, ops = checked
        if not (problem.m and problem.n):
            return self.empty(problem, ops, backend)
        choice = self.choose(problem, backend)
        self.memo.remember(args, out_dtype, scale_layout, backend, choice, problem, ops, check_offs)
        return self.execute(choice, problem, ops)

    def empty(self, problem: Problem, ops: Operands, backend: str | None) -> torch.Tensor:
        """The result of a call with M = 0 or N = 0: its validated ``out``, which has no element to write. Nothing is
        decided or probed (no backend need run, and a check on an empty problem proves nothing), but a ``backend=`` or
        ``FP4DISPATCH_BACKEND`` that no call could take is refused as on any other call."""
        if backend is not None or self._forced is not None:
            self.named_backend(backend, problem)
        return ops.out

    def fp4_grouped_mm(self, a, b, a_scale, b_scale, alpha, offs, *, out_dtype=torch.bfloat16, out=None,
                       scale_layout="swizzled", backend=None, check_offs=True) -> torch.Tensor:
        """Same contract as :func:`fp4dispatch.fp4_grouped_mm`, through this dispatcher."""
        hit = self.memo.grouped(a, b, a_scale, b_scale, alpha, offs, out_dtype, out, scale_layout, backend, check_offs)
        return self.execute(*hit) if hit is not None else self.run_new(
            check_fp4_grouped_mm_args(a, b, a_scale, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs),
            (a, b, a_scale, b_scale, alpha, offs, out), out_dtype, scale_layout, backend, check_offs)

    def w4a16_grouped_mm(self, a, b, b_scale, alpha, offs, *, out_dtype=None, out=None, scale_layout="swizzled",
                         backend=None, check_offs=True) -> torch.Tensor:
        """Same contract as :func:`fp4dispatch.w4a16_grouped_mm`, through this dispatcher."""
        hit = self.memo.grouped(a, b, None, b_scale, alpha, offs, out_dtype, out, scale_layout, backend, check_offs)
        return self.execute(*hit) if hit is not None else self.run_new(
            check_w4a16_grouped_mm_args(a, b, b_scale, alpha, offs, out_dtype, out, scale_layout, check_offs),
            (a, b, b_scale, alpha, offs, out), out_dtype, scale_layout, backend, check_offs)

    def choose(self, problem: Problem, backend: str | None = None) -> Choice:
        """The backend and config for ``problem``: a dict and a set lookup once the key is decided and M proven."""
        if backend is not None or self._forced is not None:  # None: FP4DISPATCH_BACKEND's backend is another op's
            c = self._named_choice(backend, problem)
            if c is not None:
                return c
        m, n, k, dt, dev, adt, e = problem
        key = (dev, m_bucket(m), n, k, dt, adt, e)  # Problem.key, written out: this runs on every call
        c = self._choices.get(key)
        return c if c is not None and m in c.verified else self._decide(key, problem)

    def execute(self, choice: Choice, problem: Problem, ops: Operands) -> torch.Tensor:
        try:
            choice.backend.run(problem, ops, choice.config)
        except Exception as e:  # noqa: BLE001 - a runtime fault falls back; the caller still gets a right result
            if choice.key is None:
                raise BackendError(f"{problem.call}: backend {choice.backend.name!r} failed on {problem}: "
                                   f"{describe_exception(e)}") from e
            return self._recover(choice, problem, ops, e)
        if self.guard is not None and choice.key is not None:
            return self.guard.after_run(self, choice, problem, ops)
        return ops.out

    def blacklist(self, choice: Choice, problem: Problem, reason: str) -> Choice:
        """Ban ``choice``'s backend from its key (memory and disk) and return the next pick, proven at
        ``problem.m`` (the key is tuned again when no verified fallback is left). Raises NoUsableBackendError."""
        with self._lock:
            cache, _ = self._state(problem.device, problem.op)
            self._ban(cache, choice.key, choice.backend.name, reason)
            new = self._prove(choice.key, problem, self._next(choice))
            self._choices[choice.key] = new
            return new

    # -- decisions -----------------------------------------------------------------------------------------------
    def _decide(self, key: tuple, problem: Problem) -> Choice:
        with self._lock:
            c = self._choices.get(key)
            if c is not None and problem.m in c.verified:
                return c
            if problem.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return self._capture_choice(key, problem, c)
            check_not_traced(problem.call)
            self._state(problem.device, problem.op)
            if c is None:
                c = self._cached_choice(key, problem) or self._tune_key(key, problem)
            c = self._prove(key, problem, c)
            self._choices[key] = c
            return c

    def _choice(self, key: tuple, backend: Backend, config: Config, fallbacks: tuple) -> Choice:
        return Choice(backend, config, fallbacks, key, self._proven.setdefault((key, ident(backend, config)), set()))

    def _next(self, c: Choice) -> Choice | None:
        return self._choice(c.key, *c.fallbacks[0], c.fallbacks[1:]) if c.fallbacks else None

    def _usable(self, key: tuple, name: str) -> str | None:
        """Why backend ``name`` may not serve ``key`` (unhealthy, banned, wrong at a probe M in its bucket)."""
        cache, health = self._states[key[0]]
        v = health.get(name)
        if v is None or v.status != "ok":
            return f"{v.status}: {v.reason}" if v else "unknown backend"
        return cache.shape_blacklist.get(key_str(key), {}).get(name) or wrong_when_probed(v, key[1])

    def _cached_choice(self, key: tuple, problem: Problem) -> Choice | None:
        """The cached decision of ``key``, or None when there is none or its winner can no longer serve (unhealthy,
        banned, or its config is no longer offered: the key is then tuned again). Never raises."""
        cache, _ = self._states[key[0]]
        ks = key_str(key)
        entry = cache.decisions.get(ks)
        if entry is None or any(self._usable(key, n) is None for n in entry.get("unjudged", ())):
            return None  # none yet, or decided without a verdict on a backend that can serve it now: decided again
        try:
            ranked: list[tuple[Backend, Config]] = []
            for t in [entry] + list(entry.get("ranking", [])):
                b = self._by_name.get(t["backend"])
                if b is not None and not computes(b, problem.op):  # another op's backend (a hand edit, a bad merge)
                    self._warn(f"op:{ks}:{b.name}", "fp4dispatch: ignoring %s in the cached decision of %s: it does "
                               "not compute %s", b.name, ks, problem.call)
                    b = None
                if t.get("time_us") is None or b is None or any(r[0] is b for r in ranked):
                    continue
                if self._usable(key, b.name) is None:
                    cfg = next((c for c in b.configs(problem) if config_json(c) == t.get("config", {})), None)
                    if cfg is not None:
                        ranked.append((b, cfg))
                    elif t is entry:  # new candidates may exist: they are tried
                        self._warn(f"stale:{ks}", "fp4dispatch: the cached config of %s (%s %s) is no longer "
                                   "offered; tuning the key again", ks, b.name, t.get("config"))
                        return None
        except Exception as e:  # noqa: BLE001 - cache content never raises out of fp4_mm
            self._warn(f"entry:{ks}", "fp4dispatch: ignoring the cached decision of %s (%s)", ks, describe_exception(e))
            return None
        if not ranked:
            return None  # nothing the entry ranked can serve any more: decide again
        proven = cache.verified.get(ks, {})
        for b, cfg in ranked:
            who = ident(b, cfg)
            self._proven.setdefault((key, who), set()).update(proven.get(who, ()))
        return self._choice(key, *ranked[0], tuple(ranked[1:]))

    def _prove(self, key: tuple, problem: Problem, c: Choice | None, *, retune: bool = True,
               walk: bool = True) -> Choice:
        """``c`` or (``walk``) the first of its fallbacks proven right at ``problem.m`` (each one found wrong is
        banned from the key); with none left, the key is tuned again at this M (``retune``) or NoUsableBackendError."""
        cache, _ = self._states[key[0]]
        m, case = problem.m, None
        while c is not None and m not in c.verified:
            if case is None:
                case = make_case(problem, 1000 + m, reference_mm)
            outcome = check_run(c.backend, case, c.config)
            if outcome is None:
                c.verified.add(m)
                self._remember_proven(cache, key, m, ident(c.backend, c.config))
                return c
            if outcome[0] == OUT_OF_MEMORY:  # no verdict: the call fails as any would that the memory cannot hold
                raise DeviceMemoryError(f"{problem.call}: the device ran out of memory while fp4dispatch proved "
                                        f"{c.backend.name} right at M={m}, a new M of {key_str(key)} (each backend is "
                                        f"proven at every new M before it serves it): {outcome[1]}. {MEMORY_ADVICE}",
                                        {c.backend.name: outcome[1]})
            self._ban(cache, key, c.backend.name, f"{outcome[0]} when proven at M={m}: {outcome[1]}")
            c = self._next(c) if walk else None
        if c is not None:
            return c
        if not retune:
            raise NoUsableBackendError(f"{problem.call}: no verified fallback left for {problem} on {problem.device}")
        return self._tune_key(key, problem)

    @staticmethod
    def _remember_proven(cache: DecisionCache, key: tuple, m: int, ident: str) -> None:
        ks = key_str(key)
        if len(cache.verified.get(ks, {}).get(ident, ())) < MAX_VERIFIED_M:
            # deferred: the first call at each new M (every prefill length) must not rewrite the cache file
            cache.update("verified", {ks: {ident: [m]}}, merge=add_proven, defer=True)

    def _ban(self, cache: DecisionCache, key: tuple, name: str, reason: str) -> None:
        ks = key_str(key)
        if (cur := self._choices.get(key)) is not None and cur.backend.name == name:
            del self._choices[key]  # it serves the key no more, even where what replaces it cannot be had now
        cache.update("shape_blacklist", {ks: {name: reason}}, merge_nested=True)
        self._warn(f"ban:{ks}:{name}", "fp4dispatch: backend %s is banned from %s: %s", name, ks, reason)

    def _warn(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    # -- probing -------------------------------------------------------------------------------------------------
    def _state(self, device: torch.device, *ops: str, upcoming=(), meanwhile=None) -> tuple[DecisionCache, dict]:
        """The device's cache and verdicts, every backend of ``ops`` probed (or read from the cache): a probe compiles
        and runs kernels, so a process that only calls ``fp4_mm`` never probes the grouped or W4A16-only backends.
        ``upcoming``, ``meanwhile()``: ``device_health``'s (the in-process verdicts are in the state when it runs)."""
        st = self._states.get(device)
        if st is None:
            check_device(device)
            st = self._states[device] = (DecisionCache(self.cache_dir, device_fingerprint(device)), {})
            self._probed_ops[device] = set()
        if todo := [op for op in ops if op not in self._probed_ops[device]]:
            # marked first: a backend whose probe calls a dispatcher (loop:fp4_mm's own) must not probe again here
            self._probed_ops[device].update(todo)
            new = [b for b in self.backends if b.name not in st[1] and any(computes(b, op) for op in todo)]
            try:
                known = (lambda v: (st[1].update(v), meanwhile())) if meanwhile else None
                st[1].update(device_health(new, device, st[0], self.settings, upcoming=upcoming, meanwhile=known))
            except BaseException:  # interrupted: the next call probes these ops again
                self._probed_ops[device].difference_update(todo)
                raise
        return st

    # -- public helpers ------------------------------------------------------------------------------------------
    def report(self, device=None, ops: tuple[str, ...] = OPS) -> Report:
        """One record per backend: status, reason, wins/losses per decided key on ``device``; prints as a table. The
        backends of ``ops`` (default: all) are probed first; another op's that no call needed yet shows not probed."""
        dev = resolve_device(device, "report")
        with self._lock:
            cache, health = self._state(dev, *check_ops(ops))
            return build_report(self.backends, health, cache.decisions, cache.shape_blacklist, cache.faults)

    def entry_for(self, problem: Problem) -> dict | None:
        """The decision record (winner, time, ranking) of ``problem``'s key as it serves now, deciding it if needed
        (``report.serving_entry``); None for a forced backend."""
        c = self.choose(problem)
        entry = self.cache_for(problem.device).decisions.get(key_str(problem.key))
        return None if c.key is None else serving_entry(entry, c.backend.name, config_json(c.config))

    def cache_for(self, device=None) -> DecisionCache:
        with self._lock:
            return self._state(resolve_device(device))[0]  # the cache only: nothing is probed


def check_dispatcher(who: str, dispatcher, none_is: str, fix: str) -> None:
    """``dispatcher`` as ``who`` takes it: None (``none_is``) or a Dispatcher; anything else (a name, the class) is
    refused here, before a call trips over it far from the cause."""
    if dispatcher is not None and not isinstance(dispatcher, Dispatcher):
        what = "the class itself" if dispatcher is Dispatcher else f"{type(dispatcher).__name__} {dispatcher!r}"
        raise InvalidInputError(f"{who}: dispatcher must be None ({none_is}) or a "
                                f"fp4dispatch.dispatch.dispatcher.Dispatcher; got {what}. {fix}")


def _after_fork_in_child() -> None:
    for d in list(_live):
        d._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
