"""Tuning one key: its candidates, the search (``tuner.tune``, narrowed by the neighbours), and the record of the
outcome (the decision entry, bans, proven M). A mixin of :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`: it
uses the dispatcher's backends, settings, timers, states and ``_choice``.

A key can also be tuned in two rounds (``decide_beside`` then ``finish_beside``, used by ``compile_keys``): while
probe workers still run, the key is searched among the backends whose verdicts are in; once every verdict is in,
the backends that were still being probed are searched on the key too, and the two rankings are recorded as one.
The first round's outcome is kept in memory only until then (a key is never recorded, nor served, without all of
its candidates), and it serves as the neighbours of the other keys' first rounds.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..backends.base import Backend, computes
from ..devices import resolve_device
from ..errors import MEMORY_ADVICE, DeviceMemoryError, NoUsableBackendError, describe_exception
from ..problem import Problem
from .choice import Choice, add_proven, ident
from .health import wrong_when_probed
from .neighbours import neighbour_picks, offered_configs
from .records import key_str
from .timer import DoBench, for_device, screen_for_device
from .tuner import FULL, Search, Tuning, merge_tunings, tune, verify_only
from .verify import OUT_OF_MEMORY

__all__ = ["KeyTuning", "FirstRound"]

log = logging.getLogger("fp4dispatch")


@dataclass(frozen=True)
class FirstRound:
    """A key searched while probe workers ran: the tuning among the backends with verdicts, and the backends of its
    op that were still being probed."""

    problem: Problem
    tuning: Tuning
    sources: tuple[str, ...]
    pending: frozenset[str]


class KeyTuning:
    def _timer(self, problem: Problem) -> DoBench | None:
        if not self.settings.tune:
            return None
        if self._do_bench is not None:
            return self._do_bench
        return None if problem.device.type == "cpu" else for_device(problem.device, self.settings.timer)

    def _screen(self, problem: Problem) -> DoBench | None:
        if self.settings.search == "full":
            return None
        if self._screen_bench is not None or self._do_bench is not None:
            return self._screen_bench
        return screen_for_device(problem.device, self.settings.timer)

    def _candidates(self, key: tuple, problem: Problem) -> tuple[list[Backend], dict[str, str]]:
        """The backends that may serve ``key`` (its op's, usable, accepting the bucket's largest M too), and why
        each other backend of its op may not."""
        reasons: dict[str, str] = {}
        candidates = []
        for b in self.backends:
            if not computes(b, problem.op):
                continue  # another op's backend: not a candidate, and no reason to list
            why = self._usable(key, b.name)
            # a decision serves the whole M bucket: a backend must accept the bucket's largest M too
            if why is None and (u := b.unsupported(problem) or b.unsupported(problem.with_m(key[1]))) is not None:
                why = f"unsupported: {u}"
            if why is None:
                candidates.append(b)
            else:
                reasons[b.name] = why
        return candidates, reasons

    def _compile_other_buckets(self, key: tuple, problem: Problem, candidates: list[Backend]) -> None:
        """Before a key is tuned: each candidate that compiles per M bucket on its first run (Humming) is asked to
        compile, in the background, its kernels for the shape's other buckets, so that the shape's next keys find them
        compiled (backends/humming_compile.py). Not for a key that ``compile_keys`` was given: its model's keys are
        compiled together, and the buckets that none of them needs are left alone. ``FP4DISPATCH_BACKGROUND_COMPILE=0``
        turns it off."""
        if key in self._keys_ahead or not self.settings.background_compile:
            return
        for b in candidates:
            start = getattr(b, "compile_other_buckets", None)
            if start is None:
                continue
            try:
                start(problem)
            except Exception as e:  # noqa: BLE001 - a head start only: each key still compiles what it needs
                log.debug("fp4dispatch: %s could not compile ahead for %s (%s)", b.name, key_str(key),
                          describe_exception(e))

    def _rule(self, problem: Problem) -> tuple[Search, DoBench | None]:
        """How much of a key's candidates is timed in full, and the screen timer that picks them (none: all)."""
        return FULL if self.settings.search == "full" else Search(), self._screen(problem)

    def _tune_key(self, key: tuple, problem: Problem) -> Choice:
        candidates, reasons = self._candidates(key, problem)
        if not candidates:
            raise self._no_backend(problem, reasons)
        self._compile_other_buckets(key, problem, candidates)
        if self._timer(problem) is None:
            return self._settle(key, problem, verify_only(problem, candidates), reasons, ())
        tuning, sources = self._search(key, problem, candidates, self._states[key[0]][0].decisions)
        return self._settle(key, problem, tuning, reasons, sources)

    def _search(self, key: tuple, problem: Problem, candidates: list[Backend], decisions: dict
                ) -> tuple[Tuning, tuple[str, ...]]:
        """``candidates`` checked and timed on ``key``; next to tuned buckets of ``decisions``, their best few only
        (neighbours.py). Returns the tuning and the neighbour keys it drew on."""
        timer = self._timer(problem)
        only, sources = set(), []
        if self.settings.search == "fast":
            only, sources = neighbour_picks(key, decisions, offered_configs(candidates, problem))
        search, screen = self._rule(problem)
        beside = self.settings.timer == "graph"  # an eager screen waits for the key's compiles (tuner.tune)
        tuning = tune(problem, candidates, timer, screen=screen, search=search, only=only or None,
                      screen_beside_compiles=beside)
        if only and not all(t.ok for t in tuning.trials):  # a neighbours' pick fails here: every candidate
            tuning, sources = tune(problem, candidates, timer, screen=screen, search=search,
                                   screen_beside_compiles=beside), []
        return tuning, tuple(sources)

    def _settle(self, key: tuple, problem: Problem, tuning: Tuning, reasons: dict[str, str],
                sources: tuple[str, ...]) -> Choice:
        """Record ``tuning`` as ``key``'s decision (entry, bans of the backends that failed, proven M) and return the
        choice: its best trial, the other correct backends as fallbacks. A trial short of device memory bans nothing;
        the record names the backends it or a transient probe left without a verdict (``unjudged``). Raises
        NoUsableBackendError, or DeviceMemoryError when memory was what every backend lacked."""
        cache, health = self._states[key[0]]
        ks = key_str(key)
        trials = tuning.trials
        best: dict[str, object] = {}
        for t in trials:  # sorted: the first trial of a backend is its best config
            best.setdefault(t.backend, t)
        starved: dict[str, str] = {}  # no verdict on these: neither banned nor left out of a recorded decision
        for t in trials:
            if t.short_of_memory:
                starved.setdefault(t.backend, t.reason)
        bad = {n: t.reason for n, t in best.items() if not t.ok and n not in starved}
        bad.update((n, r) for n, r in reasons.items() if n in health and r == wrong_when_probed(health[n], key[1]))
        if bad:
            cache.update("shape_blacklist", {ks: bad}, merge_nested=True, defer=True)  # one write per key, below
            reasons = {**reasons, **bad}
        ok = [t for t in best.values() if t.ok]
        if not ok:
            cache.flush()
            raise self._no_backend(problem, {**reasons, **starved})
        timed = self._timer(problem) is not None
        entry = {**ok[0].to_json(), "ranking": [t.to_json() for t in trials], "tuned_at_m": problem.m,
                 "mode": ("neighbours" if sources else "tuned") if timed else "priority", "at": round(time.time()),
                 "tune_s": {p: round(v, 3) for p, v in tuning.seconds.items()},
                 **({"from": list(sources)} if sources else {})}
        ranked = tuple((self._by_name[t.backend], t.config) for t in ok)
        for b, cfg in ranked:  # every ok trial was proven right at this M on the same inputs
            self._proven.setdefault((key, ident(b, cfg)), set()).add(problem.m)
        cache.update("verified", {ks: {ident(b, cfg): [problem.m] for b, cfg in ranked}}, merge=add_proven,
                     defer=True)
        # without a verdict (a probe that timed out or was interrupted, a probe, check or timing short of memory): the
        # record says so, and a process that can judge them decides the key again (_cached_choice)
        unjudged = {**{n: health[n].reason for n in reasons if n in health and health[n].transient}, **starved}
        if unjudged:
            entry["unjudged"] = list(unjudged)
            self._warn(f"unjudged:{ks}", "fp4dispatch: %s decided (%s) without a verdict on %s; a process that has one "
                       "decides it again", ks, ok[0].backend, "; ".join(f"{n} ({r})" for n, r in unjudged.items()))
        cache.update("decisions", {ks: entry})  # writes the deferred blacklist and proven M with it
        log.info("fp4dispatch: %s on %s -> %s", ks, problem.device, ok[0].backend)
        return self._choice(key, *ranked[0], ranked[1:])

    def adopt_decisions(self, entries: dict[str, dict], device=None, *, persist: bool = False) -> None:
        """Take decision records made elsewhere (another rank, a profile) as this device's own; ``persist`` also
        writes them to the disk cache. In-memory choices of those keys are re-derived on next use."""
        dev = resolve_device(device)
        with self._lock:
            cache, _ = self._state(dev)
            if persist:
                cache.update("decisions", entries)
            else:
                cache.decisions.update(entries)
            for key in [k for k in self._choices if k[0] == dev and key_str(k) in entries]:
                del self._choices[key]

    def _no_backend(self, problem: Problem, reasons: dict[str, str]) -> NoUsableBackendError | DeviceMemoryError:
        """The error of a key no backend can serve: DeviceMemoryError where one ran short of memory (probed, checked
        or timed: it may serve once memory is free), else NoUsableBackendError; each with every backend's reason."""
        lines = "\n".join(f"  {n}: {r}" for n, r in reasons.items())
        if any(OUT_OF_MEMORY in r for r in reasons.values()):
            return DeviceMemoryError(f"{problem.call}: no backend served {problem} on {problem.device}, and the "
                                     f"device ran short of memory while they were probed, checked or timed:\n"
                                     f"{lines}\n{MEMORY_ADVICE}", reasons)
        return NoUsableBackendError(
            f"{problem.call}: no usable backend for {problem} on {problem.device}:\n{lines}\n"
            "Install a backend's library, unset FP4DISPATCH_DISABLE, or clear the cache (python -m fp4dispatch.tune "
            "clear) if a library was fixed.", reasons)

    # -- two rounds: beside the probe workers, then with every verdict ----------------------------------------------
    def decide_beside(self, problems, rounds: dict[tuple, FirstRound], wait=lambda key: None) -> None:
        """Into ``rounds``, the first round of each undecided key of ``problems`` whose op has backends without a
        verdict yet (being probed in workers): searched among the others, once ``wait(key)`` says its kernels are
        compiled. Not recorded; ``finish_beside`` completes them. Keys without a timer, with no candidate yet, or whose
        search raised are left to the usual decision."""
        provisional: dict[str, dict] = {}  # the first rounds as neighbours of the next keys
        for p in problems:
            key = p.key
            try:
                cache, health = self._states[key[0]]
                if key in rounds or key in self._choices or key_str(key) in cache.decisions or not self._timer(p):
                    continue
                pending = frozenset(b.name for b in self.backends if computes(b, p.op) and b.name not in health)
                candidates = self._candidates(key, p)[0] if pending else []
                if not candidates:
                    continue
                wait(key)
                tuning, sources = self._search(key, p, candidates, {**cache.decisions, **provisional})
            except Exception as e:  # noqa: BLE001 - a head start only: the key is decided as usual afterwards
                log.warning("fp4dispatch: deciding %s beside the probe workers failed (%s)", key_str(key),
                            describe_exception(e))
                continue
            rounds[key] = FirstRound(p, tuning, sources, pending)
            provisional[key_str(key)] = {"mode": "neighbours" if sources else "tuned",
                                         "ranking": [t.to_json() for t in tuning.trials]}

    def finish_beside(self, rounds: dict[tuple, FirstRound], wait=lambda key: None) -> int:
        """Each first round completed now that every verdict is in: the backends that were pending and are usable on
        the key are searched on it (next to already recorded keys, their best few only), and the two tunings are
        recorded as one decision (``merge_tunings``: ranked as one search). A first-round trial of a backend that
        can no longer serve the key is dropped; a backend that raised in the first round (the GPU was shared with the
        workers then: their load, their memory) is not banned for it but searched again in the second. Returns how
        many keys were decided; a key that is decided already, or that this fails on, is left to the usual decision
        (which raises NoUsableBackendError with every reason when none can serve it). ``wait(key)``: as in
        ``decide_beside``."""
        done = 0
        for key, r in rounds.items():
            try:
                if key in self._choices or key_str(key) in self._states[key[0]][0].decisions:
                    continue
                candidates, reasons = self._candidates(key, r.problem)
                usable = {b.name for b in candidates}
                # a backend that raised beside the workers (their load, their memory) is searched again now, whole
                raised = {t.backend for t in r.tuning.trials if t.reason.startswith("failed") or t.short_of_memory}
                first = [t for t in r.tuning.trials if t.backend in usable and t.backend not in raised]
                tuning, sources = Tuning(first, r.tuning.seconds), r.sources
                if late := [b for b in candidates if b.name in r.pending or b.name in raised]:
                    wait(key)
                    more, near = self._search(key, r.problem, late, self._states[key[0]][0].decisions)
                    search, screen = self._rule(r.problem)
                    tuning = merge_tunings(tuning, more, search if screen is not None else None)
                    sources = tuple(dict.fromkeys(sources + near))
                self._choices[key] = self._settle(key, r.problem, tuning, reasons, sources)
            except Exception as e:  # noqa: BLE001 - the usual decision of the key tells the caller
                log.warning("fp4dispatch: %s not decided after the probe workers (%s); deciding it alone",
                            key_str(key), describe_exception(e))
                continue
            done += 1
        return done
