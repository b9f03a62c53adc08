"""A key's picks from its cached decision: the graph order and the eager order of the trials it ranked, each kept to
what may still serve the key. A mixin of :class:`~fp4dispatch.dispatch.dispatcher.Dispatcher`: it uses the
dispatcher's states, backends by name, proven sets, and its ``_usable``, ``_choice`` and ``_warn``."""
from __future__ import annotations

from ..backends.base import Backend, Config, config_json
from ..errors import describe_exception
from ..problem import Problem
from .choice import Choice, ident
from .records import key_str

__all__ = ["CachedPicks"]


class CachedPicks:
    def _cached_picks(self, key: tuple, problem: Problem, *, benched: bool = False) -> tuple[Choice, Choice] | None:
        """The cached decision of ``key`` as (graph pick, eager pick), each with its fallbacks; None when there is
        none, nothing it ranked can serve any more, or its winner's config is no longer offered (the key is then
        tuned again, so that new candidates are tried). Never raises."""
        cache, _ = self._states[key[0]]
        ks = key_str(key)
        entry = cache.decisions.get(ks)
        if entry is None:
            return None
        try:
            trials = [t for t in entry.get("ranking", []) if t.get("time_us") is not None] or [entry]
            b = self._by_name.get(entry["backend"])
            if b is not None and self._usable(key, b.name, benched=benched) is None and not any(
                    config_json(c) == entry.get("config", {}) for c in b.configs(problem)):
                self._warn(f"stale:{ks}", "fp4dispatch: the cached config of %s (%s %s) is no longer offered; tuning "
                           "the key again", ks, b.name, entry.get("config"))
                return None
            chains = [self._chain(key, problem, order, benched) for order in
                      (trials, sorted(trials, key=lambda t: _eager_us(t, trials)))]
        except Exception as e:  # noqa: BLE001 - cache content never raises out of fp4_mm
            self._warn(f"entry:{ks}", "fp4dispatch: ignoring the cached decision of %s (%s)", ks, describe_exception(e))
            return None
        if not chains[0]:
            return None  # nothing the entry ranked can serve any more: decide again
        proven = cache.verified.get(ks, {})
        for b, cfg in chains[0]:
            who = ident(b, cfg)
            self._proven.setdefault((key, who), set()).update(proven.get(who, ()))
        g, e = (self._choice(key, *c[0], tuple(c[1:])) for c in chains)
        return g, e

    def _chain(self, key: tuple, problem: Problem, trials: list, benched: bool) -> list[tuple[Backend, Config]]:
        """The (backend, config) of ``trials`` in their order, the first config of each backend, those that may serve
        ``key`` and whose config the backend still offers."""
        out: list[tuple[Backend, Config]] = []
        for t in trials:
            b = self._by_name.get(t["backend"])
            if b is None or any(r[0] is b for r in out) or self._usable(key, b.name, benched=benched) is not None:
                continue
            cfg = next((c for c in b.configs(problem) if config_json(c) == t.get("config", {})), None)
            if cfg is not None:
                out.append((b, cfg))
        return out


def _eager_us(t: dict, trials: list) -> float:
    """A cached trial's eager time; where none was measured, its place in the graph order (after every timed one)."""
    v = t.get("eager_us")
    return v if v is not None else 1e30 + trials.index(t)
