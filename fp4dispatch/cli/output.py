"""What a ``python -m fp4dispatch.tune`` run prints: the per-shape and per-backend tables (Markdown off a terminal),
its notes, the shapes without a usable backend, and its exit code."""
from __future__ import annotations

import json
import sys

from . import distributed
from ..dispatch.cache import DecisionCache

__all__ = ["finish", "console", "print_table", "fmt", "LOCK_WAIT_S"]

# how long a run waits at its end for a cache lock another process holds, to write its decisions
LOCK_WAIT_S = 30


def console():
    from rich.console import Console

    tty = sys.stdout.isatty()
    # markup off: configs and reasons hold brackets ("[BLOCK_M=64]") that rich would read as style tags
    return Console(file=sys.stdout, width=None if tty else 220, highlight=False, markup=False, soft_wrap=False), tty


def print_table(con, title: str, columns: list[str], rows: list[list[str]], tty: bool) -> None:
    from rich import box
    from rich.table import Table

    # off a terminal the tables are plain Markdown (title as a heading), ready to paste into benchmarks/RESULTS.md
    t = Table(title=title if tty else None, box=box.ROUNDED if tty else box.MARKDOWN, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    if tty:
        con.print(t)
        return
    with con.capture() as cap:
        con.print(t)
    body = "\n".join(line.rstrip() for line in cap.get().splitlines() if line.strip())  # drop the blank edge rows
    con.print(f"\n### {title}\n\n{body}")


def fmt(v, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _print_tables(rows: list[dict], backends: list[dict], notes: list[str]) -> None:
    con, tty = console()
    for note in notes:
        con.print(note)
    gpu = any(r.get("cublas_bf16_us") is not None for r in rows)
    several = len({r["tuned_by"] for r in rows}) > 1
    cols = ["M bucket", "N", "K", "layer", "tried", "winner", "time (us)", "TFLOP/s", "vs runner-up",
            "slowest first run"]
    cols += ["vs cuBLAS bf16"] if gpu else []
    cols += ["by"] if several else []
    body = []
    for r in rows:
        ok = r["status"] == "ok"
        cfg = ",".join(f"{k}={v}" for k, v in sorted(r.get("config", {}).items())) if ok else ""
        tried = r.get("tried", [])
        line = [str(r["m_bucket"]), str(r["n"]), str(r["k"]), ", ".join(r["layers"]) or "-",
                f"{sum(not t.get('reason') for t in tried)}/{len(tried)} ok" if ok else "-",
                (r["winner"] + (f" [{cfg}]" if cfg else "")) if ok else "NONE",
                fmt(r.get("time_us")), fmt(r.get("tflops"), ".3g"),
                fmt(r.get("speedup_vs_runner_up"), ".2f", "x")
                + (f" ({r['runner_up']})" if r.get("runner_up") else ""), _slowest_first_run(tried)]
        line += [fmt(r.get("speedup_vs_cublas_bf16"), ".2f", "x")] if gpu else []
        line += [r["tuned_by"]] if several else []
        body.append(line)
    w4 = any(r.get("op") == "w4a16" for r in rows)
    print_table(con, "Per shape" + (" (w4a16_mm: 16-bit activations)" if w4 else ""), cols, body, tty)
    per_backend = [[b["device"], b["name"], b["status"], b["reason"] or "-", str(b["wins"])] for b in backends]
    print_table(con, "Per backend", ["device", "name", "status", "reason", "wins"], per_backend, tty)
    for note in distributed.auto_mode_notes(backends):
        con.print("\n" + note)
    cached = sum(r.get("source") == "cache" for r in rows)
    if cached:
        con.print(f"\n{cached} of {len(rows)} shape{'s' if len(rows) > 1 else ''} came from the cache "
                  "(python -m fp4dispatch.tune clear to measure them again).")


def _slowest_first_run(tried: list[dict]) -> str:
    """The candidate whose check (its first run on the shape: a JIT compile, a weight preparation) took longest."""
    timed = [t for t in tried if t.get("check_s") is not None]
    if not timed:
        return "-"
    t = max(timed, key=lambda t: t["check_s"])
    return f"{t['check_s']:.2f} s ({t['backend']})"


def _failed_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["status"] != "ok":
            why = "; ".join(f"{n}: {w}" for n, w in r.get("reasons", {}).items()) or r.get("error", "")
            out.append(f"  {r['key']} ({', '.join(r['layers']) or 'shape'}): {why}")
    return out


def finish(args, payload: dict, rows: list[dict], backends: list[dict], notes: list[str],
            cache: DecisionCache | None = None) -> int:
    failed = _failed_lines(rows)
    code = 1 if failed else 0
    if cache is not None:
        written = cache.flush(timeout=LOCK_WAIT_S)  # updates kept in memory while another process held the lock
        if cache.write_error:
            code = 1
            notes = notes + [f"could not write the cache {cache.path} ({cache.write_error}): these decisions are "
                             "lost when this process ends. Make the directory writable or pass --cache-dir"]
        elif not written:
            code = 1
            notes = notes + [f"the cache lock {cache.path}.lock was held by another process for {LOCK_WAIT_S:g} "
                             f"s: these decisions are not written to {cache.path} yet (tried once more at exit). Run "
                             "tune again once that process is done"]
        else:
            notes = notes + [f"cache: {cache.path}"]
    if args.json:
        payload.update(notes=notes, shapes=rows, backends=backends, failed=[r["key"] for r in rows
                                                                          if r["status"] != "ok"], exit_code=code)
        print(json.dumps(payload, indent=1, default=str))
        return code
    _print_tables(rows, backends, notes)
    if failed:
        print(f"No usable backend for {len(failed)} shape(s):\n" + "\n".join(failed))
    return code
