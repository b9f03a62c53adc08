"""Choices made without tuning: a backend named by the caller (``backend=`` or ``FP4DISPATCH_BACKEND``), and a key
met for the first time during CUDA-graph capture, when nothing may probe, tune or prove. A mixin of
:class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`: it uses the dispatcher's backends, lock, states, choices and
``_warn``."""
from __future__ import annotations

from ..backends.base import Backend, backend_ops, computes
from ..errors import BackendError, InvalidInputError, NoUsableBackendError
from ..problem import Problem
from .choice import Choice
from .health import wrong_when_probed
from .records import key_str

__all__ = ["UntunedChoices"]


class UntunedChoices:
    def _capture_choice(self, key: tuple, problem: Problem, c: Choice | None) -> Choice:
        """During CUDA-graph capture nothing may probe, tune or prove: use the key's pick unproven at this M, else the
        nearest decided bucket, else the first healthy backend in priority order; warn once."""
        if c is None:
            near = [(abs(k[1].bit_length() - key[1].bit_length()), c) for k, c in self._choices.items()
                    if k[0] == key[0] and k[2:] == key[2:]]
            if near:
                c = min(near, key=lambda x: x[0])[1]
            else:
                health = self._states[key[0]][1] if key[0] in self._states else {}
                pick = next((b for b in self.backends if computes(b, problem.op) and health.get(b.name) is not None
                             and health[b.name].status == "ok" and b.unsupported(problem) is None), None)
                if pick is None:
                    raise NoUsableBackendError(f"{problem.call}: {problem} has no decision and none can be made "
                                               "during CUDA graph capture; warm the shape up before capture "
                                               "(fp4dispatch.warmup)")
                c = Choice(pick, pick.configs(problem)[0], (), key)
        self._warn(f"capture:{key_str(key)}:{problem.m}", "fp4dispatch: %s at M=%d was not warmed up before CUDA "
                   "graph capture; using %s unproven at this M (fp4dispatch.warmup proves it)", key_str(key),
                   problem.m, c.backend.name)
        return c

    def named_backend(self, name: str | None, problem: Problem) -> Backend | None:
        """The backend that ``name`` (None: ``FP4DISPATCH_BACKEND``) forces on ``problem``'s op, or None where the
        variable's backend computes other ops only (those calls are decided as usual). An unknown name, or a
        ``backend=`` of another op, is the caller's mistake: InvalidInputError. Nothing is probed."""
        given = name or self._forced
        b = self._by_name.get(given)
        if b is None:
            what = "backend" if name is not None else "FP4DISPATCH_BACKEND"
            raise InvalidInputError(f"{problem.call}: {what} must be one of {sorted(self._by_name)}; got {given!r}"
                                    + ("" if name is not None else ". Fix or unset the variable"))
        if not computes(b, problem.op):
            if name is None:  # FP4DISPATCH_BACKEND forces the ops its backend computes; others are decided as usual
                return None
            ok = sorted(x.name for x in self.backends if computes(x, problem.op))
            raise InvalidInputError(f"{problem.call}: backend {b.name!r} computes {' and '.join(backend_ops(b))} "
                                    f"only; pass one of {ok} or none")
        return b

    def _named_choice(self, name: str | None, problem: Problem) -> Choice | None:
        nk = (name or self._forced, *problem.key)
        c = self._named.get(nk)
        if c is not None:
            return c
        b = self.named_backend(name, problem)
        if b is None:
            return None
        with self._lock:
            cache, health = self._state(problem.device, problem.op)
            v = health[b.name]
        if v.status != "ok":
            raise BackendError(f"{problem.call}: backend {b.name!r} was requested but is {v.status} on "
                               f"{problem.device}: {v.reason}")
        # known wrong on this shape: a forced call is not proven, so it would return what was found wrong
        ks = key_str(problem.key)
        wrong = cache.shape_blacklist.get(ks, {}).get(b.name) or wrong_when_probed(v, problem.key[1])
        if wrong:
            raise BackendError(f"{problem.call}: backend {b.name!r} was requested but is banned from {ks} on "
                               f"{problem.device}: {wrong}. Call without backend=, or clear the cache (python -m "
                               "fp4dispatch.tune clear) if its library was fixed")
        why = b.unsupported(problem)
        if why is not None:
            raise BackendError(f"{problem.call}: backend {b.name!r} was requested but does not support {problem}: "
                               + why)
        c = self._named[nk] = Choice(b, b.configs(problem)[0], (), None)
        return c
