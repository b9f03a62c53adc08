"""Check the logs of benchmarks/h200_multi_gpu.sh: both torchrun ranks end with the same decision table, the shared
cache holds each decision once (written by the rank that tuned it), the warm re-run tuned nothing, and --devices all
split the shapes between the GPUs into one cache.   python3 benchmarks/check_multi_gpu.py OUT_DIR"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TABLE = ("key", "winner", "config", "time_us", "tuned_by", "m_bucket", "n", "k")


def table(run: dict) -> list[tuple]:
    return [tuple(json.dumps(r.get(c), sort_keys=True) for c in TABLE) for r in run["shapes"]]


def decisions(cache_dir: Path) -> dict:
    files = sorted(cache_dir.glob("decisions-*.json"))
    print(f"{cache_dir.name}: {len(files)} cache file(s): {[f.name for f in files]}")
    out: dict = {}
    for f in files:
        raw = f.read_text()
        for key in json.loads(raw)["decisions"]:
            # JSON objects may repeat a key; count occurrences in the text, not in the parsed dict
            n = raw.count(json.dumps(key) + ": {")
            out.setdefault(key, 0)
            out[key] += n
    return out


def main(out: Path) -> int:
    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        ok &= cond
        print(("PASS " if cond else "FAIL ") + what)

    runs = [json.loads(p.read_text()) for p in sorted((out / "logs-torchrun-json").glob("*/attempt_0/*/stdout.log"))]
    check(len(runs) == 2 and {r["rank"] for r in runs} == {0, 1}, "torchrun --json: two ranks answered")
    check(table(runs[0]) == table(runs[1]), f"torchrun: rank 0 and rank 1 tables identical ({len(runs[0]['shapes'])} rows)")
    check(all(r["source"] == "cache" for run in runs for r in run["shapes"]), "torchrun re-run: every key from cache")
    keys = [r["key"] for r in runs[0]["shapes"]]
    counts = decisions(out / "cache-torchrun")
    check(set(counts) == set(keys) and all(v == 1 for v in counts.values()),
          f"torchrun cache: {len(counts)} decisions, each once, same keys as the table")
    by = {}
    for r in runs[0]["shapes"]:
        by[r["tuned_by"]] = by.get(r["tuned_by"], 0) + 1
    print(f"torchrun: decisions per tuning rank {by}")

    text = (out / "devices.log").read_text()  # stdout and stderr together: the JSON object starts at the first '{'
    dev, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    dcounts = decisions(out / "cache-devices")
    dkeys = [r["key"] for r in dev["shapes"]]
    check(dev["exit_code"] == 0 and len(dkeys) == len(set(dkeys)), f"--devices all: exit 0, {len(dkeys)} distinct keys")
    check(set(dcounts) == set(dkeys) and all(v == 1 for v in dcounts.values()),
          f"--devices cache: {len(dcounts)} decisions, each once")
    by = {}
    for r in dev["shapes"]:
        by[r["tuned_by"]] = by.get(r["tuned_by"], 0) + 1
    print(f"--devices all: decisions per device {by}")
    same = sum(a["winner"] == b["winner"] for a, b in zip(sorted(runs[0]["shapes"], key=lambda r: r["key"]),
                                                          sorted(dev["shapes"], key=lambda r: r["key"])))
    print(f"torchrun and --devices agree on the winner for {same}/{len(keys)} keys (timing may differ)")
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
