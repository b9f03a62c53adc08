"""Shareable profiles: one device's decisions, exported to a file a fleet ships with its image, imported elsewhere.

A profile is the device fingerprint (GPU model, driver, CUDA, library versions, relevant env) plus the cache's
``health``, ``decisions`` and ``shape_blacklist`` sections. Import refuses a profile whose fingerprint differs from
the importing device's, naming every difference: a decision measured with other libraries or another GPU proves
nothing here.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from ..dispatch.cache import SECTIONS as _SECTIONS
from ..dispatch.cache import DecisionCache, write_json_atomic
from ..errors import FP4DispatchError
from ..dispatch.fingerprint import fingerprint_diff, fingerprint_hash
from ..dispatch.records import clean_section

__all__ = ["ProfileError", "PROFILE_FORMAT", "PROFILE_VERSION", "export_profile", "read_profile", "import_profile"]

PROFILE_FORMAT = "fp4dispatch-profile"
PROFILE_VERSION = 1


class ProfileError(FP4DispatchError, ValueError):
    """A profile cannot be exported, read or imported (the message says why and what to do)."""


def export_profile(cache: DecisionCache, path: str | Path) -> dict:
    """Write ``cache``'s fingerprint and sections to ``path`` (JSON, written atomically); return the profile."""
    cache.reload()
    if not cache.decisions and not cache.health:
        raise ProfileError(f"export: the cache {cache.path} holds nothing for this device yet; run "
                           "`python -m fp4dispatch.tune` (with your shapes) first, then export")
    profile = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "exported_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "fingerprint_hash": cache.hash,
        "fingerprint": cache.fingerprint,
        **{s: cache.data[s] for s in _SECTIONS},
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(p, profile)
    return profile


def read_profile(path: str | Path) -> dict:
    """Load and check a profile file's structure (not its fingerprint)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"import: no such file {str(p)!r}; pass a file written by `python -m fp4dispatch.tune "
                           "export FILE`") from None
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        raise ProfileError(f"import: {str(p)!r} is not readable JSON ({type(e).__name__}: {str(e)[:100]}); "
                           "re-export the profile") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ProfileError(f"import: {str(p)!r} must be an fp4dispatch profile (format {PROFILE_FORMAT!r}); got "
                           f"format {got!r}. Decision cache files are not profiles: export one with "
                           "`python -m fp4dispatch.tune export FILE`")
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"import: {str(p)!r} has profile version {data.get('version')!r}; this fp4dispatch reads "
                           f"version {PROFILE_VERSION}. Re-export it with this fp4dispatch")
    if not isinstance(data.get("fingerprint"), dict):
        raise ProfileError(f"import: {str(p)!r} has no fingerprint object; re-export the profile")
    bad = []
    for s in _SECTIONS:
        data[s] = data.get(s, {})  # a section this version added may be missing from an older profile
        if not isinstance(data[s], dict):
            raise ProfileError(f"import: {str(p)!r} section {s!r} must be a JSON object; got "
                               f"{type(data[s]).__name__}. Re-export the profile")
        bad += clean_section(s, data[s])[1]
    if bad:
        lines = "\n".join(f"  {b}" for b in bad[:10])
        raise ProfileError(f"import: {str(p)!r} has {len(bad)} malformed entries, so nothing was imported:\n{lines}"
                           "\nRe-export the profile with `python -m fp4dispatch.tune export FILE`")
    return data


def import_profile(path: str | Path, cache: DecisionCache) -> dict:
    """Merge the profile at ``path`` into ``cache`` (this device's cache file) if the fingerprints match.

    Returns the count per section of its entries the cache kept, and ``dropped``: those over the cache's key bound
    (``MAX_KEYS`` a section). Raises :class:`ProfileError` naming every fingerprint difference otherwise.
    """
    data = read_profile(path)
    theirs = data["fingerprint"]
    diff = fingerprint_diff(cache.fingerprint, theirs)
    if diff:
        lines = "\n".join(f"  {d}" for d in diff)
        raise ProfileError(f"import: refusing {str(path)!r}: it was made on a different device or library set "
                           f"(fingerprint {fingerprint_hash(theirs)}, this device {cache.hash}):\n{lines}\n"
                           "Tune on this machine instead (python -m fp4dispatch.tune), or build the profile on a "
                           "machine that matches")
    for s in _SECTIONS:
        if data[s]:
            cache.update(s, data[s], merge_nested=(s == "shape_blacklist"))
    # what the cache kept: a section holds at most MAX_KEYS keys, the profile's last ones and then the newest
    kept = {s: sum(k in cache.data[s] for k in data[s]) for s in _SECTIONS}
    return {**kept, "dropped": sum(len(data[s]) - kept[s] for s in _SECTIONS)}
