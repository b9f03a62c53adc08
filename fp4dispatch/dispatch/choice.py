"""What a decided key runs (``Choice``) and the merges of the cache sections the dispatcher writes."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.base import Backend, Config, config_id

__all__ = ["Choice", "ident", "add_proven", "add_faults"]


@dataclass(eq=False)
class Choice:
    backend: Backend
    config: Config
    fallbacks: tuple = ()  # ((backend, config), ...) verified on this key, best first
    key: tuple | None = None  # None for a forced backend: no fallback, errors surface
    verified: set = field(default_factory=set)  # the M at which this backend and config were proven right


def ident(backend: Backend, config: Config) -> str:
    return f"{backend.name}|{config_id(config)}"


def add_proven(old: dict, new: dict) -> dict:
    """Merge of the verified section: the union of the M proven per backend and config."""
    return {**old, **{who: sorted(set(old.get(who, [])) | set(ms)) for who, ms in new.items()}}


def add_faults(old: dict, new: dict) -> dict:
    """Merge of the faults section: counts add up, the newest time and reason win."""
    out = dict(old)
    for name, rec in new.items():
        prev = out.get(name)
        out[name] = {**rec, "count": prev["count"] + rec["count"]} if isinstance(prev, dict) else rec
    return out
