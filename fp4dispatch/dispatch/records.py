"""What the decision cache holds, entry by entry, and the checks that keep its content from ever raising.

Cache files and profiles are data from elsewhere (another process, another version, a hand edit, a disk fault):
every entry is checked when read, and one that does not parse is dropped with its reason; nothing in a file can
make ``fp4_mm`` raise. Sections (each ``{key: entry}``; a key is ``m<bucket>-n<N>-k<K>-<out dtype>``):

    health           {backend: {"status", "reason", "seconds"[, "wrong_ms"]}}     one verdict per backend
    decisions        {key: {"backend", "config", "time_us", "ranking", "tuned_at_m", "mode"}}
    shape_blacklist  {key: {backend: reason}}        wrong or broken on this key, until ``tune clear``
    verified         {key: {"<backend>|<config id>": [M, ...]}}   the M at which each pick was proven right
    faults           {key: {backend: {"count", "last", "reason"}}}   runtime exceptions on users' calls
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..problem import M_BUCKETS, m_bucket

__all__ = ["Verdict", "STATUSES", "SECTIONS", "key_str", "check_key", "check_entry", "clean_section"]

STATUSES = ("ok", "unavailable", "unsupported", "failed", "incorrect")
SECTIONS = ("health", "decisions", "shape_blacklist", "verified", "faults")
MODES = ("tuned", "neighbours", "priority")
# an fp4_mm key; a w4a16_mm key adds its activation dtype in front ("w4a16-bfloat16-m16-..."), an fp4_grouped_mm key
# its expert count ("grouped-e256-m16-...": the bucket is then one of T, the routed rows of all experts), a
# w4a16_grouped_mm key both ("w4a16-bfloat16-grouped-e256-m16-...")
_KEY = re.compile(r"(?:w4a16-(?:bfloat16|float16)-)?(?:grouped-e[1-9]\d*-)?m(\d+)-n(\d+)-k(\d+)-"
                  r"(bfloat16|float16|float32)")


def key_str(key: tuple) -> str:
    """``(device, bucket, n, k, out dtype[, activation dtype[, experts]])`` (``Problem.key``) ->
    ``m<bucket>-n<n>-k<k>-<dtype>``, prefixed by ``w4a16-<activation dtype>-`` for a ``w4a16_mm`` key and by
    ``grouped-e<E>-`` for an ``fp4_grouped_mm`` key (both, in that order, for ``w4a16_grouped_mm``)."""
    _, bucket, n, k, dt, *a = key
    text = f"m{bucket}-n{n}-k{k}-{str(dt).replace('torch.', '')}"
    if len(a) > 1 and a[1]:
        text = f"grouped-e{a[1]}-{text}"
    return text if not a or a[0] is torch.uint8 else f"w4a16-{str(a[0]).replace('torch.', '')}-{text}"


@dataclass
class Verdict:
    status: str
    reason: str = ""
    seconds: float = 0.0
    transient: bool = False  # not written to the disk cache (e.g. a probe worker that timed out)
    wrong_ms: tuple[int, ...] = ()  # probe M where an otherwise ok backend was wrong

    def to_json(self) -> dict:
        d = {"status": self.status, "reason": self.reason, "seconds": self.seconds}
        if self.wrong_ms:
            d["wrong_ms"] = list(self.wrong_ms)
        if self.transient:  # only a probe worker's answer carries it: a transient verdict is never cached
            d["transient"] = True
        return d

    @classmethod
    def from_json(cls, d: object) -> "Verdict":
        """A verdict from its JSON form; ValueError naming the field when it is not one."""
        _need(isinstance(d, dict), "a verdict must be a JSON object", d)
        _need(d.get("status") in STATUSES, f"status must be one of {STATUSES}", d.get("status"))
        _need(isinstance(d.get("reason", ""), str), "reason must be a string", d.get("reason"))
        seconds = d.get("seconds", 0.0)
        _need(_number(seconds), "seconds must be a finite number >= 0", seconds)
        wrong = d.get("wrong_ms", [])
        _need(isinstance(wrong, list) and all(_count(m) for m in wrong), "wrong_ms must be positive integers", wrong)
        return cls(d["status"], d.get("reason", ""), float(seconds), d.get("transient") is True, tuple(wrong))


def _need(ok: bool, what: str, got: object) -> None:
    if not ok:
        text = repr(got)
        raise ValueError(f"{what}; got {text[:80]}{'...' if len(text) > 80 else ''}")


def _number(x: object) -> bool:
    """A finite number >= 0 that converts to a float (an integer of 400 digits does not: float() overflows)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x)) and x >= 0
    except OverflowError:
        return False


_MAX_COUNT = 2**63 - 1  # larger is no count or M of this world (and would overflow the sums made of it)


def _count(x: object) -> bool:
    return type(x) is int and 0 < x <= _MAX_COUNT


def _text(x: object) -> bool:
    return isinstance(x, str) and x != ""


def check_key(ks: object) -> None:
    _need(isinstance(ks, str) and _KEY.fullmatch(ks) is not None,
          "a key must look like m16-n4096-k4096-bfloat16 (w4a16_mm: w4a16-bfloat16-m16-..., "
          "fp4_grouped_mm: grouped-e256-m16-...)", ks)
    bucket, n, k = (int(x) for x in _KEY.fullmatch(ks).groups()[:3])
    _need(bucket in M_BUCKETS and n > 0 and k > 0 and k % 16 == 0, "a key needs an M bucket, N > 0, K % 16 == 0", ks)


def _check_trial(t: object) -> None:
    _need(isinstance(t, dict), "a trial must be a JSON object", t)
    _need(_text(t.get("backend")), "backend must be a name", t.get("backend"))
    _need(isinstance(t.get("config", {}), dict), "config must be a JSON object", t.get("config"))
    _need(t.get("time_us") is None or _number(t.get("time_us")), "time_us must be null or a time", t.get("time_us"))
    _need(t.get("check_s") is None or _number(t.get("check_s")), "check_s must be null or a time", t.get("check_s"))
    _need(isinstance(t.get("reason", ""), str), "reason must be a string", t.get("reason"))


def _check_decision(e: object) -> None:
    _check_trial(e)
    ranking = e.get("ranking", [])
    _need(isinstance(ranking, list), "ranking must be a list", ranking)
    for t in ranking:
        _check_trial(t)
    _need(_count(e.get("tuned_at_m", 1)), "tuned_at_m must be a positive integer", e.get("tuned_at_m"))
    _need(e.get("mode", "tuned") in MODES, f"mode must be one of {MODES}", e.get("mode"))
    unjudged = e.get("unjudged", [])
    _need(isinstance(unjudged, list) and all(_text(n) for n in unjudged), "unjudged must be a list of backend names",
          unjudged)


def _check_reasons(e: object) -> None:
    _need(isinstance(e, dict) and e and all(_text(n) and isinstance(r, str) for n, r in e.items()),
          "a blacklist entry must map backend names to reasons", e)


def _check_verified(e: object) -> None:
    _need(isinstance(e, dict) and all(_text(who) and isinstance(ms, list) and all(_count(m) for m in ms)
                                      for who, ms in e.items()), "verified must map a backend to its proven M", e)


def _check_faults(e: object) -> None:
    _need(isinstance(e, dict) and e, "faults must map backend names to records", e)
    for name, f in e.items():
        _need(_text(name) and isinstance(f, dict), "a fault record must be a JSON object", f)
        _need(_count(f.get("count")) and _number(f.get("last")) and isinstance(f.get("reason"), str),
              "a fault record needs count (>= 1), last (a time) and reason", f)


_CHECKS = {"decisions": _check_decision, "shape_blacklist": _check_reasons, "verified": _check_verified,
           "faults": _check_faults}


def check_entry(section: str, key: object, entry: object) -> None:
    """Raise ValueError (saying what is wrong) unless ``entry`` may stand under ``key`` in ``section``."""
    if section == "health":
        _need(_text(key), "a backend name must be a non-empty string", key)
        Verdict.from_json(entry)
        return
    check_key(key)
    _CHECKS[section](entry)
    if section == "decisions" and "tuned_at_m" in entry:  # the M it was tuned at lies in the key's bucket
        bucket = int(_KEY.fullmatch(key).group(1))
        _need(m_bucket(entry["tuned_at_m"]) == bucket, f"tuned_at_m must be an M of the key's bucket {bucket}",
              entry["tuned_at_m"])


def clean_section(section: str, entries: dict) -> tuple[dict, list[str]]:
    """The entries of ``section`` that parse, and one line per dropped entry."""
    kept, dropped = {}, []
    for key, entry in entries.items():
        try:
            check_entry(section, key, entry)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # whatever the content, never raise
            dropped.append(f"{section}[{str(key)[:60]!r}]: {e}")
            continue
        kept[key] = entry
    return kept, dropped
