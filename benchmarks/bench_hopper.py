"""Hopper (no FP4 tensor cores) benchmark of the Triton NVFP4 kernels (their exactness: tests/test_triton_gpu.py).

Modes (all on one CUDA GPU; results are printed and written under $OUT or --out):
  --candidates  the CUDA-graph time of every candidate config of triton:fused (``configs_for``) per (shape, M), next
                to cuBLAS bf16; candidates.json. Works with this tree's kernels and with those before the kernels/
                restructure (8af9a38), so that ``--ab`` can compare them. With ``--op w4a16``: those of
                triton:w4a16 (``w4a16_configs_for``, bf16 activations) instead. With ``--uncut``: every config the
                heuristics list before their cut at ``MAX_CONFIGS`` (is a config left out ever the fastest?).
  --ab OLD      ``--candidates`` for the fp4dispatch under the folder OLD and for this tree's, each in child
                processes, alternating (--ab-rounds pairs, the faster of each cell kept); ab.json and a table of
                old / new time per cell and per config, flagging cells off by more than --ab-tol.
  (default)     the table: fp4_mm through a fresh dispatcher (its pick, tuned), cuBLAS bf16 on pre-dequantized
                weights, torch eager dequant+matmul; us, TFLOP/s, % of FP4-byte roofline, ratio to bf16; a PNG plot.
--shapes (NxK list) and --ms pick the cells of the table, --candidates and --ab.

    export PYTHONPATH=$PWD; python benchmarks/bench_hopper.py   # full table (fits one 10-minute run on an H200)
    git worktree add /tmp/old 8af9a38 && python benchmarks/bench_hopper.py --ab /tmp/old --ms 1,16,128,1024
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672), (6144, 2048), (2048, 6144), (768, 6144)]
MS = [1, 16, 128, 1024, 4096, 8192]


def log(*a) -> None:
    print(*a, flush=True)


def bench_ms(fn, warmup: int = 5, rep: int = 25) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def capture(*fns) -> torch.cuda.CUDAGraph:
    """The calls ``fns`` captured in order in one CUDA graph, after a pass on the current stream and one on a side
    stream (as torch's capture wants) and with split-K counters prepared for the capture stream."""
    try:
        from fp4dispatch.kernels import workspace
    except ImportError:  # a tree from before workspace.py (--ab against an older commit): its name was splitk
        from fp4dispatch.kernels import splitk as workspace

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    workspace.prepare_capture(torch.device("cuda"))  # as fp4dispatch.warmup() does
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return g


def graph_ms(fn) -> float:
    """GPU time of ``fn`` without Python launch overhead: capture it in a CUDA graph, time the replays."""
    return bench_ms(capture(fn).replay)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    t = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (t * 1e-3)


def rand_operands(m: int, n: int, k: int, seed: int, out_dtype=torch.bfloat16, scale_lo: int = 0x30,
                  scale_hi: int = 0x48):
    """Canonical operands on the GPU: uniform random codes, e4m3 scale bytes in [scale_lo, scale_hi)."""
    from fp4dispatch.format import swizzle_scales
    from fp4dispatch.problem import Operands

    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)

    def sc(rows):
        byt = torch.randint(scale_lo, scale_hi, (rows, k // 16), dtype=torch.uint8, device="cuda", generator=g)
        return swizzle_scales(byt.view(torch.float8_e4m3fn))

    alpha = (0.5 + torch.rand(1, device="cuda", generator=g)).float()
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    return Operands(a, b, sc(m), sc(n), alpha, out)


def cublas_bf16_graph_ms(m: int, n: int, k: int) -> float:
    """Graph ms of cuBLAS bf16 ``A @ W.T`` on random [m, k] and [n, k] operands: the baseline of the ratios."""
    wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return graph_ms(lambda: torch.mm(wa, wb.t()))


# ------------------------------------------------------------------------------------------------------------------
def _kernels(op: str = "fp4_mm"):
    """(configs_for, run(ops, config), config -> JSON) of the fp4dispatch on sys.path: this tree's kernels, or those
    before the kernels/ restructure (dict configs, ``kernels.fused``). op "w4a16": ``w4a16_mm``'s, on bf16
    activations of the operands' shape (random, made once per shape)."""
    if op == "w4a16":
        from fp4dispatch.backends.base import config_json
        from fp4dispatch.kernels.heuristics import w4a16_configs_for
        from fp4dispatch.kernels.w4a16_mm import w4a16_mm
        acts: dict = {}

        def run_w4a16(ops, c):
            m, k = ops.a.shape[0], ops.a.shape[1] * 2
            if (m, k) not in acts:
                acts.clear()
                acts[(m, k)] = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            return w4a16_mm(acts[(m, k)], ops.b, ops.b_scale, ops.alpha, ops.out, c)
        return w4a16_configs_for, run_w4a16, config_json
    try:
        from fp4dispatch.backends.base import config_json
        from fp4dispatch.kernels.fp4_mm import fp4_mm
        from fp4dispatch.kernels.heuristics import configs_for
    except ImportError:
        from fp4dispatch.kernels.fused import configs_for
        from fp4dispatch.kernels.fused import fused_mm as fp4_mm

        def config_json(c):
            return dict(c)

    def run(ops, c):
        return fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, c)
    return configs_for, run, config_json


def run_candidates(res: dict, bw: float, shapes, ms, op: str = "fp4_mm") -> None:
    """Graph time of every candidate config per (shape, M), in configs_for's order (op: ``_kernels``')."""
    import fp4dispatch

    configs_for, run, as_json = _kernels(op)
    res["package"] = os.path.dirname(fp4dispatch.__file__)
    rows = []
    for (n, k) in shapes:
        for m in ms:
            ops = rand_operands(m, n, k, seed=m)
            t_bf16 = cublas_bf16_graph_ms(m, n, k)
            roof_us = ((m + n) * k * 9 / 16 + 2 * m * n) / bw * 1e6
            log(f"M={m:5d} N={n:5d} K={k:5d}  cuBLAS bf16 {t_bf16 * 1e3:8.1f} us  roofline {roof_us:7.1f} us")
            for i, cfg in enumerate(configs_for(m, n, k, torch.device("cuda"))):
                try:
                    tg = graph_ms(lambda c=cfg: run(ops, c)) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that fails is a result
                    log(f"    {i} {as_json(cfg)}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    tg = math.inf
                rows.append({"m": m, "n": n, "k": k, "index": i, "config": as_json(cfg), "graph_us": tg,
                             "bf16_us": t_bf16 * 1e3, "roof_us": roof_us})
                log(f"    {i} {json.dumps(as_json(cfg)):120s} graph {tg:8.1f} us  x bf16 {t_bf16 * 1e3 / tg:5.2f}")
    res["candidates"] = rows


def run_ab(old_root: str, args) -> bool:
    """--candidates under ``old_root`` and under this tree, alternating child processes; per cell (shape, M, config
    index) the faster of the rounds; prints new / old per config and per cell (its best config), flags those off by
    more than ``args.ab_tol``. Returns whether every cell is within it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"old": os.path.abspath(old_root), "new": here}
    best: dict = {"old": {}, "new": {}}
    for r in range(args.ab_rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            out = tempfile.mkdtemp(prefix=f"ab-{name}-")
            env = dict(os.environ, PYTHONPATH=trees[name] + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, os.path.abspath(__file__), "--candidates", "--out", out, "--shapes", args.shapes,
                   "--ms", args.ms, "--op", args.op]
            subprocess.run(cmd, env=env, check=True)
            with open(os.path.join(out, "bench_hopper.json")) as f:
                doc = json.load(f)
            log(f"round {r} {name}: {doc['package']}")
            for row in doc["candidates"]:
                key = (row["n"], row["k"], row["m"], row["index"])
                if key not in best[name] or row["graph_us"] < best[name][key]["graph_us"]:
                    best[name][key] = row
    rows, ok = [], True
    cells = sorted({key[:3] for key in best["new"]} | {key[:3] for key in best["old"]})
    log("| N | K | M | config | old us | new us | new / old |")
    log("|---|---|---|---|---|---|---|")
    for cell in cells:
        for part in ("configs", "cell"):
            if part == "configs":
                pairs = [(best["old"].get(key), best["new"].get(key)) for key in sorted(best["new"])
                         if key[:3] == cell]
            else:  # the cell: the best config of each tree, as the tuner would pick it
                pick = [min((r for key, r in best[t].items() if key[:3] == cell), key=lambda r: r["graph_us"],
                            default=None) for t in ("old", "new")]
                pairs = [tuple(pick)]
            for o, nw in pairs:
                ratio = nw["graph_us"] / o["graph_us"] if o and nw else math.inf
                bad = not abs(ratio - 1) <= args.ab_tol
                ok &= not (bad and part == "cell")
                label = "best" if part == "cell" else f"{nw['index'] if nw else '?'} {nw['config'] if nw else ''}"
                log(f"| {cell[0]} | {cell[1]} | {cell[2]} | {label} | {o['graph_us'] if o else math.inf:.1f} | "
                    f"{nw['graph_us'] if nw else math.inf:.1f} | {ratio:.3f}{' OFF' if bad else ''} |")
                rows.append({"cell": cell, "part": part, "old": o, "new": nw, "ratio": ratio, "off": bad})
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    log(f"A/B: {sum(r['off'] for r in rows if r['part'] == 'cell')} of {len(cells)} cells and "
        f"{sum(r['off'] for r in rows if r['part'] == 'configs')} configs off by more than {args.ab_tol:.0%}")
    return ok


# ------------------------------------------------------------------------------------------------------------------
# Ratios and roofline use the kernel's CUDA-graph time: eager fp4_mm times move with the host's load, the GPU work
# does not.
TABLE_HEADER = ("| N | K | M | kernel us (graph) | fp4_mm us (eager) | pick | TFLOP/s | % roofline | x bf16 "
                "| cuBLAS bf16 us | torch dq+mm us | x torch |")


def table_row(r: dict) -> str:
    """One markdown row of the table from a row of table.json."""
    cfg = ",".join(f"{a}={b}" for a, b in r["config"].items()
                   if a not in ("family", "kernel", "PAIR", "stages"))
    g = r["graph_us"]
    return (f"| {r['n']} | {r['k']} | {r['m']} | {g:.1f} | {r['fp4_mm_us']:.1f} | {r['backend']} "
            f"{r['config'].get('family', r['config'].get('kernel', ''))}({cfg}) | "
            f"{2 * r['m'] * r['n'] * r['k'] / (g * 1e-6) / 1e12:.1f} | "
            f"{r['roof_us'] / g * 100:.1f} | {r['bf16_us'] / g:.2f} | {r['bf16_us']:.1f} | {r['torch_dq_us']:.1f} | "
            f"{r['torch_dq_us'] / g:.1f} |")


def run_table(res: dict, bw: float, out_dir: str, shapes, ms) -> None:
    from fp4dispatch.backends.base import config_json
    from fp4dispatch import Dispatcher
    from fp4dispatch.format import dequantize_nvfp4
    from fp4dispatch.problem import Problem

    cache = tempfile.mkdtemp(prefix="fp4c-bench-")
    d = Dispatcher(cache_dir=cache)
    rows = []
    log(TABLE_HEADER)
    log("|" + "---|" * 12)
    for (n, k) in shapes:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            ops = rand_operands(m, n, k, seed=m * 7 + n)
            t0 = time.perf_counter()
            p = Problem(m, n, k, torch.bfloat16, torch.device("cuda"))
            choice = d.choose(p)
            tune_s = time.perf_counter() - t0
            t_fp4 = bench_ms(lambda: d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, out=ops.out))
            t_graph = graph_ms(lambda: choice.backend.run(p, ops, choice.config))
            wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench_ms(lambda: torch.mm(wa, wb.t()))

            def torch_dq():
                a = dequantize_nvfp4(ops.a, ops.a_scale, dtype=torch.bfloat16)
                b = dequantize_nvfp4(ops.b, ops.b_scale, dtype=torch.bfloat16)
                return (a @ b.t()) * ops.alpha

            t_tdq = bench_ms(torch_dq, warmup=2, rep=10)
            roof_us = ((m + n) * k * 9 / 16 + 2 * m * n) / bw * 1e6
            r = {"n": n, "k": k, "m": m, "fp4_mm_us": t_fp4 * 1e3, "graph_us": t_graph * 1e3,
                 "backend": choice.backend.name, "config": config_json(choice.config), "bf16_us": t_bf16 * 1e3,
                 "torch_dq_us": t_tdq * 1e3, "roof_us": roof_us, "tune_s": tune_s}
            rows.append(r)
            log(table_row(r))
            with open(os.path.join(out_dir, "table.json"), "w") as f:
                json.dump(rows, f, indent=1)
        del wb
    res["table"] = rows
    for path in glob.glob(os.path.join(cache, "decisions-*.json")):  # every candidate's tuned time, per key
        shutil.copy(path, os.path.join(out_dir, "decisions.json"))
    plot(rows, bw, os.path.join(out_dir, "bench_hopper.png"), res["gpu"])


def plot(rows, bw: float, path: str, gpu: str) -> None:
    """Time vs M per shape (log-log): the pick in a CUDA graph and eager, cuBLAS bf16, torch, the roofline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    shapes = sorted({(r["n"], r["k"]) for r in rows}, key=lambda s: -s[0] * s[1])
    fig, axes = plt.subplots(2, 3, figsize=(12, 7), dpi=70)
    for ax, (n, k) in zip(axes.flat, shapes):
        rs = sorted((r for r in rows if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        ms = [r["m"] for r in rs]
        ax.loglog(ms, [r["graph_us"] for r in rs], "o-", label="fp4_mm pick (CUDA graph)")
        ax.loglog(ms, [r["fp4_mm_us"] for r in rs], "o:", alpha=0.5, label="fp4_mm eager")
        ax.loglog(ms, [r["bf16_us"] for r in rs], "s-", label="cuBLAS bf16")
        ax.loglog(ms, [r["torch_dq_us"] for r in rs], "^-", label="torch dequant+mm")
        ax.loglog(ms, [r["roof_us"] for r in rs], "k--", label="FP4-byte roofline")
        ax.set_title(f"N={n} K={k}", fontsize=9)
        ax.set_xlabel("M")
        ax.set_ylabel("us")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"NVFP4 GEMM on {gpu} (copy bw {bw / 1e12:.2f} TB/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    log(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", action="store_true", help="time every candidate config of triton:fused")
    ap.add_argument("--ab", default="", metavar="OLD", help="--candidates (of --op) of the tree OLD against this one's")
    ap.add_argument("--ab-rounds", type=int, default=2, help="(old, new) pairs of child runs in --ab (default 2)")
    ap.add_argument("--ab-tol", type=float, default=0.03, help="flag cells off by more than this (default 0.03)")
    ap.add_argument("--op", choices=("fp4_mm", "w4a16"), default="fp4_mm",
                    help="--candidates of fp4_mm (default) or of w4a16_mm")
    ap.add_argument("--uncut", action="store_true", help="--candidates: also the configs after MAX_CONFIGS")
    ap.add_argument("--table", action="store_true", help="the dispatcher table (default when no mode is given)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK shapes (comma list)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="M values (comma list)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT or .)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("bench_hopper: needs a CUDA GPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    if args.uncut:
        from fp4dispatch.kernels import heuristics

        heuristics.MAX_CONFIGS = 1 << 10  # read by every *configs_for when it returns its list
    if args.ab:
        return 0 if run_ab(args.ab, args) else 1
    shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
    ms = [int(x) for x in args.ms.split(",")]
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    import triton

    res["triton"] = triton.__version__
    bw = copy_bandwidth()
    res["copy_bw"] = bw
    log(f"{res['gpu']}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth {bw / 1e12:.3f} TB/s")
    try:
        if args.candidates:
            run_candidates(res, bw, shapes, ms, args.op)
        if args.table or not args.candidates:
            run_table(res, bw, args.out, shapes, ms)
    finally:
        with open(os.path.join(args.out, "bench_hopper.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
