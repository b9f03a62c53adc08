"""Cold start (issue 34): how long until a new key's first result, and where that time goes.

Every part runs in a fresh process with its own empty decision cache; the device probe is measured once (part
``probe``: in-process, as on fp4_mm's first call) and its verdicts are copied into the cell parts' caches, since a
device is probed once and a new key meets an already probed device.
- ``fast``: the 30 cells of the Hopper table (6 layer shapes x M 1, 16, 128, 1024, 4096) one after another in one
  process with an empty Triton cache, then the cells at M 8 and 2048 (next to tuned buckets: ``neighbours.py``).
  Per cell: the wall time of the first ``fp4_mm`` call and the seconds of each tuning phase (``tune_s``).
- ``full``: the same cells with ``FP4DISPATCH_SEARCH=full`` (every correct candidate timed in full, no neighbour
  shortcut) and a warm Triton cache. Its rankings hold every candidate's full time, so each fast pick is looked up in
  them: ``pick/best`` is the fast pick's time over the full search's best time (1.00: same pick or as fast).
- ``preset``: ``python -m fp4dispatch.tune --preset llama-3.1-70b-nvfp4 --tp 8`` with empty caches (its probe
  included); ``preset-no-humming``: the same with Humming's backends disabled (``FP4DISPATCH_DISABLE``: what
  Humming's shape compiles cost a cold start, issue 30); ``moe``: ``--preset qwen3.5-397b-a17b-nvfp4 --tp 8 --ep 8
  --m 1,16,128`` (its dense layers and its routed experts' grouped keys).

    export PYTHONPATH=$PWD; python benchmarks/bench_cold_start.py --out $OUT [--parts probe,fast,full,preset,moe,...]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672), (6144, 2048), (2048, 6144), (768, 6144)]
MS = [1, 16, 128, 1024, 4096]
NEIGHBOUR_MS = [8, 2048]
PARTS = ("probe", "fast", "full", "preset", "preset-no-humming", "moe")
NO_HUMMING = "humming:w4a16,humming:w4a4,humming:grouped"


def _cells(ms: list[int]) -> list[tuple[int, int, int]]:
    return [(m, n, k) for n, k in SHAPES for m in ms]


def run_cells(cells: list[tuple[int, int, int]]) -> None:
    """In this process: the first call of each cell, one JSON line per cell on stdout."""
    import torch

    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.dispatch.records import key_str
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_nvfp4_inputs

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    d = Dispatcher()
    d.report(dev, ("fp4_mm",))  # the probe of fp4_mm's backends (its first call's), unless the cache holds them
    cache = d.cache_for(dev)
    print(json.dumps({"state_s": round(time.perf_counter() - t0, 3),
                      "health": {n: v.get("seconds") for n, v in cache.health.items() if v.get("status") == "ok"}}),
          flush=True)
    for m, n, k in cells:
        ops = make_nvfp4_inputs(m, n, k, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.fp4_mm(*ops)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        entry = cache.decisions.get(key_str(Problem(m, n, k, torch.bfloat16, dev).key), {})
        print(json.dumps({"m": m, "n": n, "k": k, "first_s": round(first, 3), "mode": entry.get("mode"),
                          "backend": entry.get("backend"), "config": entry.get("config"),
                          "time_us": entry.get("time_us"), "tune_s": entry.get("tune_s"),
                          "ranking": entry.get("ranking", [])}), flush=True)


def _subprocess(args: list[str], env: dict, timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds and the finished process; one that runs past ``timeout`` is killed and keeps what it printed
    (returncode -9)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = [x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        p = subprocess.CompletedProcess(e.cmd, -9, text[0], text[1] + f"\n(killed after {timeout:.0f} s)")
    return time.perf_counter() - t0, p


def _env(root: str, name: str, triton: str, *, probed: bool = True, **extra) -> dict:
    """A part's environment: its own decision cache (holding the probe part's verdicts when ``probed`` and there are
    some), the Triton cache dir ``triton`` and Humming's beside it."""
    cache = os.path.join(root, "cache-" + name)
    if probed and os.path.isdir(os.path.join(root, "cache-probe")):
        shutil.copytree(os.path.join(root, "cache-probe"), cache)
    # Humming's compiled kernels live in its own disk cache: it is emptied (or kept warm) along with Triton's
    return {**os.environ, "FP4DISPATCH_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(root, triton),
            "HUMMING_CACHE_DIR": os.path.join(root, "humming-" + triton), **extra}


def _lines(p: subprocess.CompletedProcess) -> list[dict]:
    out = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
    return out


def _probe_seconds(cache_dir: str) -> dict[str, float]:
    """Seconds of each backend's device probe, from the verdicts a tune run left in its cache files."""
    out: dict[str, float] = {}
    for path in glob.glob(os.path.join(cache_dir, "**", "decisions-*.json"), recursive=True):
        with open(path) as f:
            for name, v in json.load(f).get("health", {}).items():
                out[name] = round(out.get(name, 0.0) + float(v.get("seconds", 0.0)), 2)
    return out


# a key's tuning phases (tuner.PHASES) and, within compile, the wall time until its Triton configs were compiled and
# until the first runs of a library that compiles on its first run (Humming) were over (tuner.COMPILE_PARTS)
PHASES = ("case", "compile", "compile_triton", "compile_first_runs", "check", "screen", "time")


def _phase_table(rows: list[dict]) -> list[str]:
    phases = PHASES
    out = ["| M | N x K | first call s | mode | " + " | ".join(f"{p} s" for p in phases) + " | winner |",
           "|---|---|---|---|" + "---|" * len(phases) + "---|"]
    for r in rows:
        ts = r.get("tune_s") or {}
        out.append(f"| {r['m']} | {r['n']}x{r['k']} | {r['first_s']:.2f} | {r['mode']} | "
                   + " | ".join(f"{ts.get(p, 0):.2f}" for p in phases) + f" | {r['backend']} |")
    return out


def _summary(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"{name}: no results (the process failed: its stderr is above)"
    firsts = sorted(r["first_s"] for r in rows)
    tot = {p: sum((r.get("tune_s") or {}).get(p, 0) for r in rows) for p in PHASES}
    return (f"{name}: {len(rows)} keys, first call median {statistics.median(firsts):.2f} s, worst {firsts[-1]:.2f} s, "
            f"sum {sum(firsts):.1f} s; phases summed: " + ", ".join(f"{p} {v:.1f} s" for p, v in tot.items()))


def _compare(fast: list[dict], full: list[dict]) -> list[str]:
    """Each fast pick's full-search time over the full search's best."""
    by_cell = {(r["m"], r["n"], r["k"]): r for r in full}
    out = ["| M | N x K | fast pick | full-search best | pick/best |", "|---|---|---|---|---|"]
    for r in fast:
        f = by_cell.get((r["m"], r["n"], r["k"]))
        if f is None:
            continue
        same = [t["time_us"] for t in f["ranking"] if t["backend"] == r["backend"] and t["config"] == r["config"]
                and t.get("time_us") is not None]
        ratio = f"{same[0] / f['time_us']:.3f}" if same and f.get("time_us") else "n/a"
        out.append(f"| {r['m']} | {r['n']}x{r['k']} | {r['backend']} {r['config']} | {f['backend']} {f['config']} "
                   f"({f['time_us']} us) | {ratio} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--cells", default="", help="M,N,K;M,N,K... instead of the Hopper table (for a quick run)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds each part's process may take")
    ap.add_argument("--run-cells", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_cells is not None:
        run_cells([tuple(int(x) for x in c.split(",")) for c in args.run_cells.split(";") if c])
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; accepted: {', '.join(PARTS)}")
    cells = ([tuple(int(x) for x in c.split(",")) for c in args.cells.split(";")] if args.cells
             else _cells(MS) + _cells(NEIGHBOUR_MS))
    spec = ";".join(",".join(map(str, c)) for c in cells)
    root = tempfile.mkdtemp(prefix="fp4dispatch-cold-")
    me = os.path.abspath(__file__)
    # every part's imports compile Python again where bytecode is not written (PYTHONDONTWRITEBYTECODE, as on the
    # lent H200): seconds more per process (RESULTS.md, "Cold start"), so the report says which it was
    bytecode = "not written" if sys.dont_write_bytecode else f"written ({sys.pycache_prefix or '__pycache__'})"
    report: dict = {"cells": cells, "bytecode": bytecode}
    lines: list[str] = [f"bytecode caches: {bytecode}"]
    if "probe" in parts:  # in this part's cache, which the cell parts copy (tune --self-test would not keep it)
        wall, p = _subprocess([me, "--run-cells", ""], _env(root, "probe", "triton-probe"), args.timeout)
        got = _lines(p)
        report["probe"] = {"wall_s": round(wall, 2), "rc": p.returncode, **(got[0] if got else {})}
        lines.append(f"probe (fresh process, empty caches, in-process as fp4_mm's first call): "
                     f"{report['probe'].get('state_s')} s, per backend {report['probe'].get('health')}")
    for part, extra in (("fast", {}), ("full", {"FP4DISPATCH_SEARCH": "full"})):
        if part not in parts:
            continue
        wall, p = _subprocess([me, "--run-cells", spec], _env(root, part, "triton-cells", **extra), args.timeout)
        got = _lines(p)
        rows = [r for r in got if "m" in r]
        report[part] = {"wall_s": round(wall, 2), "rc": p.returncode, "state_s": got[0].get("state_s") if got else None,
                        "rows": rows}
        near = [r for r in rows if r["m"] not in MS]
        lines += [f"\n### {part} ({'empty' if part == 'fast' else 'warm'} Triton cache; process {wall:.1f} s)",
                  _summary(part, [r for r in rows if r["m"] in MS] or rows),
                  *([_summary(part + " (next to tuned buckets)", near)] if near else []), *_phase_table(rows)]
    if "fast" in report and "full" in report:
        lines += ["\n### fast pick against the full search", *_compare(report["fast"]["rows"], report["full"]["rows"])]
    llama = ["--preset", "llama-3.1-70b-nvfp4", "--tp", "8"]
    for part, extra, more in (("preset", llama, {}), ("preset-no-humming", llama, {"FP4DISPATCH_DISABLE": NO_HUMMING}),
                              ("moe", ["--preset", "qwen3.5-397b-a17b-nvfp4", "--tp", "8", "--ep", "8", "--m",
                                       "1,16,128"], {})):
        if part not in parts:
            continue
        env = _env(root, part, "triton-" + part, probed=False, **more)  # from empty caches: its probe included
        wall, p = _subprocess(["-m", "fp4dispatch.tune", *extra, "--json"], env, args.timeout)
        try:
            payload = json.loads(p.stdout)
        except ValueError:
            payload = {}
            print(p.stdout[-2000:], p.stderr[-3000:], file=sys.stderr)
        shapes, stages = payload.get("shapes", []), payload.get("seconds", {})
        tune_s = [s.get("tune_s") or {} for s in shapes]
        probe = _probe_seconds(env["FP4DISPATCH_CACHE_DIR"])
        phases = {ph: round(sum(t.get(ph, 0.0) for t in tune_s), 1) for ph in PHASES}
        # stages: the tune CLI's wall time of probe, compile_keys, deciding the keys, the cuBLAS baselines ("beside"
        # and "hand_out": parts of the probe); the rest of the wall time is the process's start-up and its output
        report[part] = {"wall_s": round(wall, 2), "rc": p.returncode, "keys": len(shapes), "tune_s": tune_s,
                        "probe_s": probe, "phases_s": phases, "stages_s": stages,
                        "startup_s": round(wall - sum(v for k, v in stages.items()
                                                      if k not in ("beside", "hand_out")), 2)}
        lines.append(f"\n{part}: `tune {' '.join(extra)}`{''.join(f' {k}={v}' for k, v in more.items())} from empty "
                     f"caches (probe included): {wall:.1f} s wall, "
                     f"{len(shapes)} keys, rc {p.returncode}; stages {stages}, the rest (start-up, output) "
                     f"{report[part]['startup_s']} s; probes {sum(probe.values()):.1f} s {probe}; the keys' phases "
                     f"summed {phases}")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cold_start.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
