"""A new M bucket next to tuned ones: check and time fewer configs.

The candidates of one (N, K, dtypes, experts) change little from one M bucket to the next: the heuristics offer the
same configs within one M regime (docs/kernels.md), and the same config wins both edges of most buckets
(benchmarks/RESULTS.md, "M buckets"). So when the bucket below or above a new key's was tuned (``mode`` ``"tuned"``),
the new key tries, of each backend, only the ``NEIGHBOUR_TOP`` configs that ran best there and are offered at this M.
A backend that did not run right there (banned from that bucket, failed, or new) and one whose best configs there
are not offered here have all their configs tried, as in a full tune. The entry is recorded with ``mode:
"neighbours"`` and the keys it came from; if any tried config fails here, the key is tuned in full instead. Its pick
is proven at each M like any other, and a neighbours entry is never itself a neighbour: every chain starts at a full
tune.
"""
from __future__ import annotations

from ..backends.base import Backend, config_id, config_json
from ..problem import M_BUCKETS
from .records import key_str

__all__ = ["NEIGHBOUR_TOP", "neighbour_keys", "neighbour_picks", "offered_configs"]

NEIGHBOUR_TOP = 2  # configs per backend that the new key takes from each neighbour's ranking (its best: timed first)


def neighbour_keys(key: tuple) -> list[tuple]:
    """The keys of the M buckets just below and above ``key``'s (same device, N, K, dtypes, experts)."""
    i = M_BUCKETS.index(key[1])
    return [(key[0], M_BUCKETS[j], *key[2:]) for j in (i - 1, i + 1) if 0 <= j < len(M_BUCKETS)]


def neighbour_picks(key: tuple, decisions: dict, offered: dict[str, list]) -> tuple[set[tuple[str, str]], list[str]]:
    """(the (backend, config id) pairs to try, the neighbour keys they come from) for ``key``; empty when no
    neighbour was tuned. ``offered``: backend name -> the configs it offers at this M (usable backends only)."""
    best: dict[str, list] = {}  # backend -> its best configs' JSON in the neighbours (each ranking: best first)
    sources = []
    for nk in neighbour_keys(key):
        ks = key_str(nk)
        entry = decisions.get(ks)
        if not isinstance(entry, dict) or entry.get("mode") != "tuned":
            continue
        sources.append(ks)
        seen: dict[str, int] = {}
        for t in entry.get("ranking", []):
            if isinstance(t, dict) and t.get("time_us") is not None and seen.get(t.get("backend"), 0) < NEIGHBOUR_TOP:
                seen[t["backend"]] = seen.get(t["backend"], 0) + 1
                best.setdefault(t["backend"], []).append(t.get("config", {}))
    if not sources:
        return set(), []
    only = set()
    for name, cfgs in offered.items():
        top = [config_id(c) for c in cfgs if config_json(c) in best.get(name, [])]
        only.update((name, cid) for cid in (top or [config_id(c) for c in cfgs]))
    if len(only) == sum(len(c) for c in offered.values()):
        return set(), []  # nothing left out: a full tune
    return only, sources


def offered_configs(candidates: list[Backend], problem) -> dict[str, list]:
    """backend name -> the configs it offers for ``problem`` (a backend whose ``configs`` raises offers none)."""
    out = {}
    for b in candidates:
        try:
            out[b.name] = list(b.configs(problem))
        except Exception:  # noqa: BLE001 - the full tune reports it
            out[b.name] = []
    return out
