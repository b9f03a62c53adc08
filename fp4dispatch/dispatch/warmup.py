"""Deciding many keys ahead of their first calls: ``warmup`` has ``compile_keys`` compile, at once, the kernels all of
them will try, and decide each key as soon as its own kernels are compiled; while probe workers run, each key is
already searched among the backends probed so far. A mixin of :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`:
it uses the dispatcher's lock, states, choices, forced backend and key tuning (key_tuning.py)."""
from __future__ import annotations

import logging
import time

import torch

from ..devices import resolve_device
from ..errors import describe_exception
from ..problem import Problem
from .choice import Choice
from .records import key_str
from .precompile import compile_keys_ahead, compiling_keys
from ..kernels.runtime import can_hand_out
from ..kernels.compile_processes import CompileWorkers, worker_count

__all__ = ["Warmup"]

log = logging.getLogger("fp4dispatch")


def _compile_processes(count: int | None):
    """``count`` (None: ``worker_count()``) compile worker processes for many keys' Triton compiles
    (compile_processes.py), where compiles can be handed out (CUDA, ``runtime.can_hand_out``); else None: compiled
    in threads."""
    count = worker_count() if count is None else count
    if not count or not torch.cuda.is_available() or not can_hand_out():
        return None
    return CompileWorkers(count)


def _compiles(device: torch.device) -> bool:
    """Whether keys on ``device`` have kernels to compile ahead (and probe workers to decide beside): CUDA only."""
    return device.type == "cuda"


class Warmup:
    def warmup(self, shapes, *, out_dtype: torch.dtype = torch.bfloat16, device=None,
               activations: torch.dtype = torch.uint8, experts: int = 0) -> dict[tuple, Choice]:
        """Decide every (M, N, K) of ``shapes`` now, proven at that M; ``activations`` bf16/fp16: w4a16_mm's keys;
        ``experts`` E > 0: fp4_grouped_mm's keys (w4a16_grouped_mm's with bf16/fp16 ``activations``; M is then T,
        the routed rows of all E experts). The kernels of all new keys are compiled at once (``compile_keys``)."""
        dev = resolve_device(device, "warmup")
        problems = {(m, n, k): Problem(int(m), int(n), int(k), out_dtype, dev, activations, int(experts))
                    for m, n, k in shapes}
        self.compile_keys(problems.values(), decide=True)
        return {s: self.choose(p) for s, p in problems.items()}

    def compile_keys(self, problems, stages: dict | None = None, *, decide: bool = False) -> int:
        """Compile at once the kernels that the undecided keys of ``problems`` will try
        (``precompile.compile_keys_ahead``: every Triton config of every key, in compile worker processes (see
        ``_compile_processes``) or else on a thread pool, and one first run per ``first_run_unit`` of a library that
        compiles on its first run, in threads beside it); returns how many keys that was. The backends of their ops
        are probed first if they were not, and the two overlap: the safe backends' kernels compile while the probe
        workers work, and a worker probing a first-run library (Humming) makes these keys' first runs too, filling its
        disk cache (``device_health``'s ``upcoming``); the rest compile once every verdict is in. Without CUDA, or
        with a backend forced, it does nothing.

        ``decide``: the keys are also decided, while the kernels of the later keys still compile
        (``precompile.compiling_keys``: a key's search waits only for its own kernels). The part that needs no pending
        verdict runs while the workers still work: each key is searched among the backends already probed
        (``decide_beside``), and once every verdict is in, among the rest (``finish_beside``, key_tuning.py); a key
        without such a first round is decided as usual. Otherwise nothing is decided or timed here. ``stages`` (if
        given) gets the seconds until every verdict is in ("probe"; "beside": the part of it spent deciding; "hand_out":
        the part spent handing the compiles out before that), after it compiling ("compile"; with ``decide``, handing
        the compiles out) and, with ``decide``, deciding the rest ("decide")."""
        t0 = time.perf_counter()
        problems = list(problems)
        todo: dict[tuple, Problem] = {}
        with self._lock:
            self._keys_ahead.update(p.key for p in problems)
        for p in problems:
            if _compiles(p.device) and self._forced is None:
                todo.setdefault(p.key, p)
        with self._lock:
            for dev in dict.fromkeys(key[0] for key in todo):
                cache = self._state(dev)[0]  # the cache only: decided keys compile nothing
                for key in [k for k in todo if k[0] == dev and (k in self._choices or key_str(k) in cache.decisions)]:
                    del todo[key]
        # started now, before the probe: their start-up (an import of torch each) overlaps it
        processes = _compile_processes(self.settings.compile_workers) if todo else None
        try:
            return self._compile_keys(todo, t0, stages, decide, processes)
        finally:
            if processes is not None:
                processes.close()

    def _compile_keys(self, todo: dict, t0: float, stages: dict | None, decide: bool, processes) -> int:
        compiled: set[tuple] = set()  # (key, backend name): handed to a compile already
        keys: set[tuple] = set()
        rounds: dict = {}
        beside = hand_out = 0.0  # seconds of decide_beside, and of handing its keys' compiles out before it

        def jobs(dev: torch.device) -> list:  # each undecided key of dev with its candidates not compiled yet
            out = []
            for key, p in todo.items():
                cands = [] if key[0] != dev else self._candidates(key, p)[0]
                if cands := [b for b in cands if (key, b.name) not in compiled]:
                    compiled.update((key, b.name) for b in cands)
                    keys.add(key)
                    out.append((p, cands))
            return out

        def meanwhile(dev: torch.device, mine: list) -> None:  # the workers still work
            nonlocal beside, hand_out
            if not decide:
                return compile_keys_ahead(jobs(dev), processes=processes)
            t = time.perf_counter()
            with compiling_keys(jobs(dev), processes) as compiles:  # each key is searched once its kernels are compiled
                hand_out += time.perf_counter() - t
                t = time.perf_counter()
                self.decide_beside(mine, rounds, compiles.wait)
                beside += time.perf_counter() - t

        with self._lock:
            for dev in dict.fromkeys(key[0] for key in todo):
                mine = [p for key, p in todo.items() if key[0] == dev]
                self._state(dev, *dict.fromkeys(p.op for p in mine), upcoming=mine,
                            meanwhile=lambda d=dev, mine=mine: meanwhile(d, mine))
            t1 = time.perf_counter()
            rest = [j for dev in dict.fromkeys(key[0] for key in todo) for j in jobs(dev)]
        if not decide:
            compile_keys_ahead(rest, processes=processes)
        else:
            with compiling_keys(rest, processes) as compiles:  # each key is decided once its own kernels are compiled
                t2 = time.perf_counter()
                with self._lock:
                    self.finish_beside(rounds, compiles.wait)
                for p in todo.values():  # the keys not decided in two rounds (no probe worker ran, say)
                    try:
                        compiles.wait(p.key)
                        self.choose(p)
                    except Exception as e:  # noqa: BLE001 - the caller's choose raises it again, with its reasons
                        log.debug("fp4dispatch: deciding %s ahead: %s", key_str(p.key), describe_exception(e))
        t3 = time.perf_counter()
        if stages is not None:
            stages.update(probe=t1 - t0, compile=(t2 if decide else t3) - t1)
            if decide:
                stages.update(beside=beside, hand_out=hand_out, decide=t3 - t2)
        return len(keys)
