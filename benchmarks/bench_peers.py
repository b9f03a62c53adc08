"""Every backend that runs here, side by side with the dispatcher's pick and cuBLAS bf16, in CUDA graphs and eagerly.

Per (N x K, M), one run, bf16 out, weights rotated through R copies (R x the weight's bytes > 3x the L2, as layer
after layer in a model; bench_eager.py's method):
  graph  one CUDA graph of R calls, one per weight copy, replayed; time per call;
  eager  median of synchronize -> call -> synchronize.
Rows per cell: each healthy backend of the key at the config its own tuning ranked best, called directly
(``backend.run``: no dispatcher in the way; the picked backend first, at the picked config); "pick", ``fp4_mm``
through the dispatcher (validation and lookup included); cuBLAS bf16 on the dequantized weight. The goal checked at
the end: the pick within 3 % of the fastest backend in every cell, in both modes; "choice" is the same count for
the picked backend and config called directly, which sets the dispatcher's own host cost apart. ``tune_s`` is the
time the dispatcher took to decide the key (the first call of a shape includes Humming's kernel compile).

    export PYTHONPATH=$PWD; python benchmarks/bench_peers.py --out $OUT [--shapes 8192x8192,... --ms 1,16,...]
    python benchmarks/bench_peers.py --plot OUT/bench_peers*.json --out OUT   # the table and PNG of several runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_eager import MS, _eager_us, _graph_us, rotated_operands  # noqa: E402  (the same method)
from bench_hopper import SHAPES  # noqa: E402

TOL = 0.03
SKIP = ("reference",)  # the exact reference: correct everywhere, never a contender


def _label(backend, config) -> str:
    from fp4dispatch.backends.base import config_json

    cfg = config_json(config)
    return backend.name + (f" {cfg['family']}" if "family" in cfg else "")


def cell(d, m: int, n: int, k: int) -> dict:
    import time

    from fp4dispatch.problem import Operands, Problem

    o = rotated_operands(m, n, k)
    xq, xs, alpha, wq, ws, wd, xd, r4, rb = o.xq, o.xs, o.alpha, o.wq, o.ws, o.wd, o.xd, o.r4, o.rb
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    outb = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    problem = Problem(m, n, k, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    ops = [Operands(xq, wq[i], xs, ws[i], alpha, out) for i in range(r4)]

    t0 = time.perf_counter()
    choice = d.choose(problem)
    tune_s = time.perf_counter() - t0
    row = {"n": n, "k": k, "m": m, "copies": [r4, rb], "tune_s": tune_s, "pick": _label(choice.backend, choice.config),
           "backends": {}}
    for backend, config in [(choice.backend, choice.config), *choice.fallbacks]:
        if backend.name in SKIP or backend.name in row["backends"]:
            continue  # the fallbacks are ranked: a backend's first entry is its best config, the pick's own for it
        def call(i, b=backend, c=config):
            b.run(problem, ops[i], c)
        call(0)  # a prepared weight per copy (Humming) is made before anything is timed
        row["backends"][backend.name] = {"graph": _graph_us(call, r4), "eager": _eager_us(call, r4),
                                         "config": _label(backend, config)}

    def pick(i):
        d.fp4_mm(xq, wq[i], xs, ws[i], alpha, out=out)

    def bf16(i):
        torch.mm(xd, wd[i].t(), out=outb)

    row["pick_us"] = {"graph": _graph_us(pick, r4), "eager": _eager_us(pick, r4)}
    row["bf16_us"] = {"graph": _graph_us(bf16, rb), "eager": _eager_us(bf16, rb)}
    torch.cuda.empty_cache()
    return row


def _fastest(r: dict, mode: str) -> tuple[str, float]:
    name = min(r["backends"], key=lambda b: r["backends"][b][mode])
    return name, r["backends"][name][mode]


def table(rows: list[dict]) -> list[str]:
    names = sorted({b.split(" ")[0] for r in rows for b in r["backends"]})
    lines = [f"| N x K | M | mode | {' | '.join(names)} | pick | pick / fastest | choice / fastest | cuBLAS bf16 | "
             "pick's backend |", "|---|---|---|" + "---|" * (len(names) + 5)]
    for r in rows:
        by_lib = {b.split(" ")[0]: v for b, v in r["backends"].items()}
        for mode in ("graph", "eager"):
            _, best = _fastest(r, mode)
            cells = [f"{by_lib[nm][mode]:.1f}" if nm in by_lib else "-" for nm in names]
            ratio, choice = r["pick_us"][mode] / best, _choice_us(r, mode) / best
            lines.append(f"| {r['n']}x{r['k']} | {r['m']} | {mode} | {' | '.join(cells)} | {r['pick_us'][mode]:.1f} | "
                         f"{ratio:.2f}{' MISS' if ratio > 1 + TOL else ''} | {choice:.2f} | {r['bf16_us'][mode]:.1f} | "
                         f"{r['pick']} |")
    for mode in ("graph", "eager"):
        best = [_fastest(r, mode)[1] for r in rows]
        ok = sum(r["pick_us"][mode] <= (1 + TOL) * b for r, b in zip(rows, best))
        chosen = sum(_choice_us(r, mode) <= (1 + TOL) * b for r, b in zip(rows, best))
        lines.append(f"\n{mode}: the pick within {TOL:.0%} of the fastest backend in {ok} of {len(rows)} cells; its "
                     f"choice (its backend and config called directly, no validation or lookup) in {chosen}")
    return lines


def _choice_us(r: dict, mode: str) -> float:
    """The picked backend at the picked config, called directly (its entry holds the pick's label); the pick
    through ``fp4_mm`` where there is none (a skipped backend, or a run before entries held their config)."""
    own = next((v for v in r["backends"].values() if v.get("config") == r["pick"]), None)
    return own[mode] if own else r["pick_us"][mode]


def plot(rows: list[dict], path: str, title: str) -> None:
    """µs vs M per shape (log-log): every backend and the pick, CUDA graph (solid) and eager (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["n"], r["k"]) for r in rows}, key=lambda s: -s[0] * s[1])
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), dpi=70)
    names = sorted({b.split(" ")[0] for r in rows for b in r["backends"]})
    for ax, (n, k) in zip(axes.flat, shapes):
        rs = sorted((r for r in rows if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        series = {nm: [next((v for b, v in r["backends"].items() if b.split(" ")[0] == nm), None) for r in rs]
                  for nm in names}
        series.update({"fp4_mm pick": [r["pick_us"] for r in rs], "cuBLAS bf16": [r["bf16_us"] for r in rs]})
        for i, (nm, vs) in enumerate(series.items()):
            pts = [(r["m"], v) for r, v in zip(rs, vs) if v is not None]
            color = f"C{i}"
            ax.loglog([p[0] for p in pts], [p[1]["graph"] for p in pts], "o-", color=color, label=f"{nm} graph")
            ax.loglog([p[0] for p in pts], [p[1]["eager"] for p in pts], "x:", color=color, label=f"{nm} eager")
        ax.set_title(f"N={n} K={k}", fontsize=9)
        ax.set_xlabel("M")
        ax.set_ylabel("us per call")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only merge these runs' JSON into a table and PNG")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot:
        docs = [json.load(open(p)) for p in args.plot]
        rows = [r for doc in docs for r in doc["rows"]]
        print("\n".join(table(rows)))
        plot(rows, os.path.join(args.out, "bench_peers.png"), docs[0]["title"])
        return 0
    from fp4dispatch import Dispatcher

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    title = f"{torch.cuda.get_device_name()} · torch {torch.__version__}"
    print(title, flush=True)
    d = Dispatcher(cache_dir=tempfile.mkdtemp(prefix="fp4c-peers-"))
    rows = []
    for n, k in shapes:
        for m in ms:
            rows.append(cell(d, m, n, k))
            r = rows[-1]
            print(f"{n}x{k} M={m} tune {r['tune_s']:.1f} s pick {r['pick']}: " + ", ".join(
                f"{b} {v['graph']:.1f}/{v['eager']:.1f}" for b, v in
                [*r["backends"].items(), ("pick", r["pick_us"]), ("bf16", r["bf16_us"])]), flush=True)
            with open(os.path.join(args.out, f"bench_peers-{args.shapes.replace(',', '_')}.json"), "w") as f:
                json.dump({"title": title, "rows": rows}, f, indent=1)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
