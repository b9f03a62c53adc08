"""Backend comparison: every healthy fp4dispatch backend and cuBLAS bf16, time vs M for a few (N, K) shapes.

Writes the tables under the ``## Backend comparison`` heading of benchmarks/RESULTS.md (creating the file, or
replacing only that section) and one PNG per shape (time vs M per backend, cuBLAS bf16, and the FP4-byte roofline
``((M+N)*K*9/16 + 2*M*N) bytes / measured copy bandwidth``) into benchmarks/. On a machine without a GPU it says
so and exits 0.

    export PYTHONPATH=$PWD; python benchmarks/run_benchmarks.py                       # defaults below
    python benchmarks/run_benchmarks.py --shapes 4096x4096 --ms 1,16,128 --json out.json
    python benchmarks/run_benchmarks.py --from-json out.json   # re-render tables/plots from saved numbers

Modes: ``tuned`` (default) times each backend at its best config for the point, found by fp4dispatch's tuner
(every config verified against the exact reference on random inputs, then timed with triton.testing.do_bench,
median), i.e. what the dispatcher chooses among; ``forced`` times ``fp4_mm(..., backend=name, out=out)`` end to
end (the backend's default config plus the call's validation and dispatch).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADING = "## Backend comparison"
DEFAULT_SHAPES = "4096x4096,14336x4096"
DEFAULT_MS = "1,16,128,1024,4096"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for s in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", s)
        if not m or int(m.group(2)) % 16:
            raise SystemExit(f"--shapes: expected NxK pairs with K % 16 == 0, e.g. 4096x4096; got {s!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def fp4_roofline_us(m: int, n: int, k: int, bw_bytes_s: float) -> float:
    """Time to move the NVFP4 operands (packed codes + e4m3 scales = 9/16 byte per value) and a bf16 output."""
    return ((m + n) * k * 9 / 16 + 2 * m * n) / bw_bytes_s * 1e6


# ---------------------------------------------------------------------------------------------------------------
# measuring (GPU)
# ---------------------------------------------------------------------------------------------------------------
def _bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def copy_bandwidth(device, bench=_bench_ms, numel: int = 1 << 27) -> float:
    """Bytes/s of a device-to-device copy (512 MiB by default: far beyond L2)."""
    import torch

    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / (bench(lambda: y.copy_(x)) * 1e-3)


def measure(shapes, ms, mode: str, budget_s: float, device=None, bench=_bench_ms, copy_numel: int = 1 << 27) -> dict:
    """Time every healthy backend and cuBLAS bf16 at each (M, N, K); ``device``/``bench`` default to the current
    CUDA device and triton's do_bench (a CPU timer lets the CPU tests run this on tiny shapes)."""
    import torch

    import fp4dispatch
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.problem import Problem
    from fp4dispatch.testing import make_operands
    from fp4dispatch.dispatch.tuner import tune
    from fp4dispatch.dispatch.verify import check_output
    from fp4dispatch.backends.base import computes
    from fp4dispatch.backends.reference import reference_mm

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    d = Dispatcher()
    recs = d.report(dev)
    by_name = {b.name: b for b in d.backends}
    healthy = [r.name for r in recs if r.status == "ok" and computes(by_name[r.name], "fp4_mm")]
    print(f"healthy backends: {healthy}", flush=True)
    for r in recs:
        if r.status != "ok":
            print(f"  not measured: {r.name}: {r.status}: {r.reason[:120]}", flush=True)
    bw = copy_bandwidth(dev, bench, copy_numel)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res = {"device": dev_name, "torch": torch.__version__, "mode": mode,
           "triton": _version("triton"), "fp4dispatch": fp4dispatch.__version__, "copy_bw_bytes_s": bw,
           "backends": healthy, "points": [], "skipped": []}
    for n, k in shapes:
        for m in ms:
            if time.perf_counter() - t0 > budget_s:
                res["skipped"].append([m, n, k])
                continue
            problem = Problem(m, n, k, torch.bfloat16, dev)
            ops = make_operands(problem, seed=m + n + k) if mode == "forced" else None  # tune() makes its own
            point = {"m": m, "n": n, "k": k, "roofline_us": fp4_roofline_us(m, n, k, bw), "us": {}, "notes": {}}
            for name in healthy:
                b = by_name[name]
                why = b.unsupported(problem)
                if why:
                    point["notes"][name] = f"unsupported: {why}"
                    continue
                if mode == "tuned":
                    trials = tune(problem, [b], bench).trials
                    best = trials[0]
                    if best.ok:
                        point["us"][name] = best.time_ms * 1e3
                        point["notes"][name] = _cfg(best.config)
                    else:
                        point["notes"][name] = best.reason[:160]
                else:
                    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                    a, bb, sa, sb, al = ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha
                    try:
                        d.fp4_mm(a, bb, sa, sb, al, out=out, backend=name)
                        bad = check_output(out, reference_mm(problem, ops), problem)
                    except Exception as e:  # noqa: BLE001 - a failing backend is a table entry
                        bad = f"{type(e).__name__}: {e}"
                    if bad:
                        point["notes"][name] = bad[:160]
                        continue
                    point["us"][name] = bench(
                        lambda: d.fp4_mm(a, bb, sa, sb, al, out=out, backend=name)) * 1e3
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            o = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            point["us"]["cuBLAS bf16"] = bench(lambda: torch.mm(x, w.t(), out=o)) * 1e3
            res["points"].append(point)
            print(f"N={n} K={k} M={m}: " + ", ".join(f"{kk} {v:.1f}us" for kk, v in point["us"].items())
                  + f", roofline {point['roofline_us']:.1f}us  [{time.perf_counter() - t0:.0f}s]", flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _cfg(config) -> str:
    from fp4dispatch.backends.base import config_json  # a dict, or a typed kernel config (its JSON form)

    return ",".join(f"{k}={v}" for k, v in sorted(config_json(config).items())) or "default"


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "absent"


# ---------------------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------------------
def _columns(res: dict) -> list[str]:
    return [b for b in res["backends"] if any(b in p["us"] for p in res["points"])] + ["cuBLAS bf16"]


def render_section(res: dict, command: str, date: str, plots: dict) -> str:
    bw = res["copy_bw_bytes_s"] / 1e12
    how = ("each backend at its best config for the point (fp4dispatch's tuner: every config verified against "
           "the exact reference, then timed)" if res["mode"] == "tuned" else
           "`fp4_mm(..., backend=name, out=out)` end to end (default config, validation and dispatch included)")
    lines = [HEADING, "",
             f"{date} · {res['device']} · torch {res['torch']}, triton {res['triton']}, fp4dispatch "
             f"{res['fp4dispatch']} · copy bandwidth {bw:.2f} TB/s · {res.get('seconds', '?')} s", "",
             f"Command: `{command}`", "",
             f"Times in microseconds, `triton.testing.do_bench` median, random NVFP4 inputs (never zeros), bf16 "
             f"output; {how}. cuBLAS bf16: `torch.mm` of random bf16 [M,K] x [N,K]^T in the same run. Roofline: "
             f"FP4-byte time ((M+N)·K·9/16 + 2·M·N bytes at the measured copy bandwidth). `best/bf16` < 1 means "
             f"the best NVFP4 backend beats cuBLAS bf16.", ""]
    cols = _columns(res)
    shapes = []
    for p in res["points"]:
        if (p["n"], p["k"]) not in shapes:
            shapes.append((p["n"], p["k"]))
    for n, k in shapes:
        pts = [p for p in res["points"] if (p["n"], p["k"]) == (n, k)]
        lines += [f"### N={n}, K={k}", "", "| M | " + " | ".join(cols) + " | roofline | best / bf16 | % roofline |",
                  "|---:|" + "---:|" * (len(cols) + 3)]
        for p in pts:
            fp4 = {c: v for c, v in p["us"].items() if c != "cuBLAS bf16"}
            best = min(fp4.values()) if fp4 else math.nan
            cells = [f"{p['us'][c]:.1f}" if c in p["us"] else "—" for c in cols]
            lines.append(f"| {p['m']} | " + " | ".join(cells) + f" | {p['roofline_us']:.1f} | "
                         f"{best / p['us']['cuBLAS bf16']:.2f} | {100 * p['roofline_us'] / best:.0f} |")
        notes = sorted({f"{c}: {v}" for p in pts for c, v in p["notes"].items() if c not in p["us"]})
        if notes:
            lines += [""] + [f"- not timed: {x}" for x in notes]
        if (n, k) in plots:
            lines += ["", f"![time vs M, N={n} K={k}]({plots[(n, k)]})"]
        lines.append("")
    if res.get("skipped"):
        lines += [f"Skipped (time budget): {res['skipped']}", ""]
    return "\n".join(lines)


def plot(res: dict, out_dir: Path) -> dict:
    """One small PNG per shape; {} when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", flush=True)
        return {}
    made = {}
    cols = _columns(res)
    for n, k in sorted({(p["n"], p["k"]) for p in res["points"]}):
        pts = sorted((p for p in res["points"] if (p["n"], p["k"]) == (n, k)), key=lambda p: p["m"])
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
        for c in cols:
            xs = [p["m"] for p in pts if c in p["us"]]
            ys = [p["us"][c] for p in pts if c in p["us"]]
            style = dict(ls="--", color="black") if c == "cuBLAS bf16" else dict(marker="o", ms=3)
            ax.plot(xs, ys, label=c, **style)
        ax.plot([p["m"] for p in pts], [p["roofline_us"] for p in pts], ls=":", color="gray",
                label="FP4-byte roofline")
        ax.set(xscale="log", yscale="log", xlabel="M", ylabel="time (us)", title=f"{res['device']}: N={n}, K={k}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = _png_name(n, k)
        fig.savefig(out_dir / name)
        plt.close(fig)
        made[(n, k)] = name
    return made


def _png_name(n: int, k: int) -> str:
    return f"backend_comparison_{n}x{k}.png"


def replace_section(path: Path, section: str) -> None:
    """Replace the ``## Backend comparison`` section of ``path`` (up to the next ``## `` heading), or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == HEADING), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new_lines = lines[:start] + section.rstrip("\n").splitlines() + ([""] + lines[end:] if end < len(lines)
                                                                         else [])
        new = "\n".join(new_lines) + "\n"
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK pairs, comma separated")
    ap.add_argument("--ms", default=DEFAULT_MS, help="M values, comma separated")
    ap.add_argument("--mode", choices=("tuned", "forced"), default="tuned")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new points after this many s")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--out-dir", type=Path, default=HERE, help="where the PNGs go")
    ap.add_argument("--json", type=Path, help="also save the raw numbers here")
    ap.add_argument("--from-json", type=Path, help="render saved numbers instead of measuring")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--command", help="command line to show in RESULTS.md (default: this one)")
    args = ap.parse_args(argv)
    command = args.command or "python benchmarks/run_benchmarks.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        import torch

        if not torch.cuda.is_available():
            print("run_benchmarks: needs a CUDA GPU (none found); nothing measured", flush=True)
            return 0
        ms = [int(x) for x in args.ms.split(",")]
        res = measure(parse_shapes(args.shapes), ms, args.mode, args.budget_s)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    made = plot(res, args.out_dir)
    # link every shape's PNG that exists (made now, or copied next to the results when re-rendering from JSON)
    links = {}
    for p in res["points"]:
        f = args.out_dir / _png_name(p["n"], p["k"])
        if f.exists():
            same = args.out_dir.resolve() == args.results.resolve().parent
            links[(p["n"], p["k"])] = f.name if same else str(f)
    replace_section(args.results, render_section(res, command, args.date, links))
    print(f"wrote {args.results}; {len(made)} plot(s) made in {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
