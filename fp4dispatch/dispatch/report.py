"""``Dispatcher.report()``: one record per backend (status, reason, the keys it won and lost), printable as a table."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.base import OPS, backend_ops
from ..errors import InvalidInputError

__all__ = ["serving_entry", "BackendRecord", "Report", "build_report", "check_ops"]


@dataclass
class BackendRecord:
    """One backend's standing on a device: status, reason, and what it won or lost per key."""

    name: str
    status: str
    reason: str
    wins: list[str] = field(default_factory=list)
    losses: dict[str, str] = field(default_factory=dict)


class Report(list):
    """A list of :class:`BackendRecord` that prints as a table (``print(get_dispatcher().report())``)."""

    def __str__(self) -> str:
        if not self:
            return "no backends"
        rows = [("backend", "status", "wins", "reason")]
        rows += [(r.name, r.status, str(len(r.wins)), r.reason or "-") for r in self]
        w = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows]
        for r in self:
            for ks, why in sorted(r.losses.items()):
                lines.append(f"  {r.name} lost {ks}: {why}")
        return "\n".join(lines)


def check_ops(ops) -> tuple[str, ...]:
    """``report()``'s ``ops``: a tuple or list of op names; InvalidInputError naming the ones that are not."""
    bad = [op for op in ops if op not in OPS] if isinstance(ops, (tuple, list)) else [ops]
    if bad:
        raise InvalidInputError(f"report: ops must be a tuple of op names from {OPS}; got {ops!r}. Pass e.g. "
                                f"ops=('fp4_mm',), or leave it out to probe every op")
    return tuple(ops)


def build_report(backends, health: dict, decisions: dict, shape_blacklist: dict, faults: dict) -> Report:
    """Records from a device's verdicts and cache sections (``health``: name -> Verdict, for the probed ones)."""
    recs = Report()
    for b in backends:
        v = health.get(b.name)
        if v is None:  # of an op no call has needed on this device yet
            recs.append(BackendRecord(b.name, "not probed", f"no {' or '.join(backend_ops(b))} call has needed it "
                                      "yet (report() with every op, or tune --self-test, probes it)"))
            continue
        rec = BackendRecord(b.name, v.status, v.reason)
        for ks, e in decisions.items():
            win = _serving(e, shape_blacklist.get(ks, {}))
            if win is not None and win.get("backend") == b.name:
                rec.wins.append(ks)
                continue
            for t in e.get("ranking", []):
                if t.get("backend") == b.name and t.get("time_us") is not None and win is not None:
                    rec.losses.setdefault(ks, f"slower: {t['time_us']} us vs {win.get('time_us')} us "
                                              f"({win.get('backend')})")
        for ks, by_name in faults.items():
            if b.name in by_name:
                f = by_name[b.name]
                rec.losses[ks] = f"raised at runtime on {f['count']} call(s), last: {f['reason']}"
        for ks, banned in shape_blacklist.items():
            if b.name in banned:
                rec.losses[ks] = banned[b.name]
        recs.append(rec)
    return recs


def _serving(entry: dict, banned: dict) -> dict | None:
    """The decision's first timed trial whose backend is not banned from its key since: the one that serves it."""
    for t in [entry, *entry.get("ranking", [])]:
        if isinstance(t, dict) and t.get("time_us") is not None and t.get("backend") not in banned:
            return t
    return None


def serving_entry(entry: dict | None, backend: str, config: dict) -> dict:
    """A key's decision record led by the ``backend`` and ``config`` (JSON) that serve it now: the cached record as it
    is, or with that trial of its ranking first (its winner banned from the key since, or unknown here); a record
    of that choice alone for a key decided for this process only (mode "unrecorded")."""
    lead = {"backend": backend, "config": config}
    if entry is None:
        return {**lead, "time_us": None, "mode": "unrecorded"}

    def serves(t: dict) -> bool:
        return t.get("backend") == backend and (t.get("config") or {}) == config

    if serves(entry):
        return entry
    t = next((t for t in entry.get("ranking", []) if isinstance(t, dict) and serves(t)), {**lead, "time_us": None})
    return {**entry, **t, "ranking": entry.get("ranking", [])}
