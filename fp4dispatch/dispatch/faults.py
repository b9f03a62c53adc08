"""Runtime faults in users' calls: redo the call on the next proven backend, and record the fault only once another
backend computed that call (docs/tuning.md, "Faults"). A mixin of :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`:
it uses the dispatcher's lock, states, choices and its ``_next``, ``_prove``, ``_cached_choice``, ``_ban`` and
``_warn``."""
from __future__ import annotations

import time

import torch

from ..devices import check_not_traced
from ..errors import MEMORY_ADVICE, DeviceMemoryError, NoUsableBackendError, describe_exception, out_of_memory
from ..problem import Operands, Problem
from .choice import Choice, add_faults
from .records import key_str
from .verify import reset_cuda_error

__all__ = ["FaultRecovery", "FAULT_LIMIT"]

FAULT_LIMIT = 3  # runtime faults (each one another backend then computed right) before a backend is banned


class FaultRecovery:
    def _recover(self, first: Choice, problem: Problem, ops: Operands, e: Exception) -> torch.Tensor:
        """Redo a call whose backend raised: on its verified fallbacks, then on the key's whole cached ranking (a
        backend benched earlier may work again), each proven at this M, skipping those that raised on this call.
        The faults are recorded only once one of them computed the call, and one for want of device memory never
        (the process's state, not the backend's: it is only benched for this process)."""
        check_not_traced(problem.call)  # a fake or proxy tensor's fault says nothing of the backend
        reset_cuda_error(problem.device)
        faults = {first.backend.name: describe_exception(e)}
        starved = [first.backend.name] if out_of_memory(e) else []
        key = first.key
        for c in self._alternatives(first, problem):
            if c.backend.name in faults:
                continue
            with self._lock:
                try:
                    c = self._prove(key, problem, c, retune=False, walk=False)
                except NoUsableBackendError:
                    continue  # wrong at this M: banned by _prove
            try:
                c.backend.run(problem, ops, c.config)
            except Exception as e2:  # noqa: BLE001
                reset_cuda_error(problem.device)
                faults[c.backend.name] = describe_exception(e2)
                starved += [c.backend.name] if out_of_memory(e2) else []
                continue
            self._record_faults(key, problem, faults, starved, c)
            if self.guard is not None:
                return self.guard.after_run(self, c, problem, ops)
            return ops.out
        lines = "\n".join(f"  {n}: {r}" for n, r in faults.items())
        if starved:
            raise DeviceMemoryError(f"{problem.call}: every backend raised on this call ({problem} on "
                                    f"{problem.device}), {', '.join(starved)} for want of device memory:\n{lines}\n"
                                    f"{MEMORY_ADVICE}", faults) from e
        raise NoUsableBackendError(
            f"{problem.call}: every backend raised on this call ({problem} on {problem.device}):\n{lines}\nNothing was "
            "recorded against them: when no backend can run a call, the call itself (its tensors or the process's "
            "state, e.g. out of memory) is the likely cause.", faults) from e

    def _alternatives(self, first: Choice, problem: Problem):
        c = self._next(first)
        while c is not None:
            yield c
            c = self._next(c)
        with self._lock:
            c = self._cached_choice(first.key, problem)
        while c is not None:
            yield c
            c = self._next(c)

    def _record_faults(self, key: tuple, problem: Problem, faults: dict[str, str], starved: list[str],
                       good: Choice) -> None:
        """``faults`` recorded (``starved``, those for want of device memory, only warned of) once ``good``
        computed the call; every faulted backend benched for ``key`` in this process."""
        ks = key_str(key)
        now = round(time.time(), 3)
        with self._lock:
            self._choices[key] = good  # the faulted backends are benched for this key in this process
            for name in starved:
                self._warn(f"memory:{ks}:{name}", "fp4dispatch: backend %s ran short of device memory on %s (%s); "
                           "this call was redone on %s, which serves the key for the rest of this process (not "
                           "recorded)", name, problem, faults[name], good.backend.name)
            faults = {n: r for n, r in faults.items() if n not in starved}
            if not faults:
                return
            cache, _ = self._states[key[0]]
            cache.update("faults", {ks: {n: {"count": 1, "last": now, "reason": f"{r} (at M={problem.m})"}
                                         for n, r in faults.items()}}, merge=add_faults)
            for name, why in faults.items():
                count = cache.faults.get(ks, {}).get(name, {}).get("count", 1)
                self._warn(f"fault:{name}", "fp4dispatch: backend %s raised on %s (%s); this call was redone on %s "
                           "(fault %d of %d before it is banned from this key)", name, problem, why,
                           good.backend.name, count, FAULT_LIMIT)
                if count >= FAULT_LIMIT:
                    self._ban(cache, key, name, f"failed at runtime on {count} calls, last: {why} (at M={problem.m})")

