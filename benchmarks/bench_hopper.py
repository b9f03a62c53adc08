"""Hopper (no FP4 tensor cores) benchmark of the Triton NVFP4 kernels, with correctness checks first.

Modes (all on one CUDA GPU; results are printed and written under $OUT or --out):
  --check     exactness of every fused config and the dequant backend vs a float64 reference of the dequantized
              inputs (fresh random inputs, NaN-poisoned out, M in {1,3,127,4096}, N and K off the block sizes),
              NaN-scale propagation, subnormal scales, and bit-identity + speed of the Triton quantize kernel.
  --variants  every config of the fused kernels on a few shapes, next to cuBLAS bf16 (kernel times via CUDA graphs).
  --sweep     exactness of the GEMV, mma and wmma variants (M in {1,3,16,127}), then their graph times at M in
              --sweep-ms (default 1,4,16,128) on --sweep-shapes (default: the three large ones) next to cuBLAS bf16;
              a short table last (benchmarks/hopper_sweep.py). --sweep-kernels picks the families (default gemv2,mma,wmma).
  (default)   the table: fp4_mm through a fresh dispatcher (its pick, tuned), cuBLAS bf16 on pre-dequantized
              weights, torch eager dequant+matmul; us, TFLOP/s, % of FP4-byte roofline, ratio to bf16; a PNG plot.

    export PYTHONPATH=$PWD; python benchmarks/bench_hopper.py --check --variants
    python benchmarks/bench_hopper.py            # full table (fits one 10-minute run on an H200)
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
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
    from fp4dispatch.kernels import splitk

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    splitk.prepare_capture(torch.device("cuda"))  # as fp4dispatch.warmup() does
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


def ref64(ops, m: int, n: int, k: int) -> torch.Tensor:
    from fp4dispatch.format import dequantize_nvfp4

    a = dequantize_nvfp4(ops.a, ops.a_scale).double()
    b = dequantize_nvfp4(ops.b, ops.b_scale).double()
    return (a @ b.t()) * ops.alpha.double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - ref).norm() / ref.norm())


def cublas_bf16_graph_ms(m: int, n: int, k: int) -> float:
    """Graph ms of cuBLAS bf16 ``A @ W.T`` on random [m, k] and [n, k] operands: the baseline of the ratios."""
    wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return graph_ms(lambda: torch.mm(wa, wb.t()))


def check_configs(named: list, shapes, run) -> list:
    """Exactness against the float64 reference of every (key, config) in ``named`` on each (m, n, k) of ``shapes``,
    fp32 and bf16 out, fresh operands per shape and dtype, NaN-filled out; ``run(ops, config)`` returns out. Prints
    each failure and the worst error per key; a config that raises (e.g. out of shared memory) is reported and
    dropped. Returns the (key, config) pairs that ran."""
    worst, named = {}, list(named)
    for m, n, k in shapes:
        for dt in (torch.float32, torch.bfloat16):
            ops = rand_operands(m, n, k, seed=11, out_dtype=dt, scale_lo=0x01, scale_hi=0x50)
            ref = ref64(ops, m, n, k)
            for key, cfg in list(named):
                ops.out.fill_(float("nan"))
                try:
                    o = run(ops, cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - reported and dropped, the rest still run
                    print(f"DROP {key}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    named.remove((key, cfg))
                    continue
                e = rel_err(o, ref)
                worst[(str(dt)[6:], *key)] = max(worst.get((str(dt)[6:], *key), 0.0), e)
                if not e <= (1e-5 if dt == torch.float32 else 4e-3):
                    print(f"FAIL m={m} n={n} k={k} {key} {dt}: rel err {e:.3g}", flush=True)
    for key, e in sorted(worst.items()):
        print(f"check worst {key}: {e:.3g}", flush=True)
    return named


def extra_fused_configs(m: int) -> list[dict]:
    """Variants beyond configs_for, to learn which shapes of tile/split pay off."""
    if m <= 8:
        mb = 1 << max(0, (m - 1).bit_length())
        return [{"kernel": "gemv", "MB": mb, "BN": 8, "BKB": 16, "split": 1, "warps": 2},
                {"kernel": "gemv", "MB": mb, "BN": 16, "BKB": 32, "split": 1, "warps": 8},
                {"kernel": "gemv", "MB": mb, "BN": 16, "BKB": 16, "split": 4, "warps": 4},
                {"kernel": "mma", "BM": 16, "BN": 128, "BKB": 8, "split": 1, "warps": 4, "stages": 4}]
    if m <= 128:
        return [{"kernel": "mma", "BM": 16 if m <= 16 else 64, "BN": 64, "BKB": 16, "split": 1, "warps": 4,
                 "stages": 3},
                {"kernel": "mma", "BM": 16 if m <= 16 else 128, "BN": 64, "BKB": 8, "split": 4, "warps": 4,
                 "stages": 3}]
    return [{"kernel": "mma", "BM": 128, "BN": 128, "BKB": 4, "split": 1, "warps": 4, "stages": 4},
            {"kernel": "mma", "BM": 64, "BN": 256, "BKB": 4, "split": 1, "warps": 8, "stages": 3}]


# ------------------------------------------------------------------------------------------------------------------
def run_check(res: dict) -> bool:
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.kernels.fused import configs_for, fused_mm
    from fp4dispatch.problem import Problem

    ok_all = True
    n, k = 1000, 2064  # N, K off every tile size; K/16 = 129 blocks
    dq = TritonDequantBackend()
    rows = []
    for m in (1, 3, 127, 4096):
        for odt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4e-3), (torch.float16, 4e-3)):
            if odt == torch.float16 and m not in (3, 127):
                continue
            p = Problem(m, n, k, odt, torch.device("cuda"))
            cands = [("triton:fused", c) for c in configs_for(m, n, k, p.device) + extra_fused_configs(m)]
            cands += [(dq.name, c) for c in dq.configs(p)]
            for name, cfg in cands:
                ops = rand_operands(m, n, k, seed=hash((m, str(odt), json.dumps(cfg, sort_keys=True))) % 10**6,
                                    out_dtype=odt)
                ref = ref64(ops, m, n, k)
                try:
                    if name == "triton:fused":
                        fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
                    else:
                        dq.run(p, ops, cfg)
                    torch.cuda.synchronize()
                    err = rel_err(ops.out, ref)
                    why = ""
                except Exception as e:  # noqa: BLE001 - a failing variant is a result
                    err, why = math.inf, f"{type(e).__name__}: {str(e)[:200]}"
                ok = err <= tol
                ok_all &= ok
                rows.append({"m": m, "out": str(odt), "backend": name, "config": cfg, "rel_err": err, "ok": ok,
                             "error": why})
                if not ok:
                    log(f"FAIL m={m} {odt} {name} {cfg}: rel_err={err:.3g} {why}")
    worst = {}
    for r in rows:
        key = (r["backend"], r["out"])
        worst[key] = max(worst.get(key, 0.0), r["rel_err"])
    log(f"check: {len(rows)} runs, {sum(not r['ok'] for r in rows)} failures; worst rel err per backend/out dtype:")
    for (b, o), e in sorted(worst.items()):
        log(f"  {b:24s} {o:16s} {e:.3g}")
    # NaN block scale propagates to exactly its column; subnormal e4m3 scales (bytes 1..15) stay exact
    from fp4dispatch.format import swizzle_scales, unswizzle_scales

    for m in (3, 37):
        ops = rand_operands(m, n, k, seed=5 + m, out_dtype=torch.float32, scale_lo=0x01, scale_hi=0x10)
        lin = unswizzle_scales(ops.b_scale, n, k // 16).clone()
        lin.view(torch.uint8)[7, 3] = 0x7F
        ops = ops._replace(b_scale=swizzle_scales(lin))
        ref = ref64(ops, m, n, k)
        for cfg in configs_for(m, n, k, torch.device("cuda"))[:2]:
            ops.out.fill_(0.0)
            fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)
            col_nan = bool(torch.isnan(ops.out[:, 7]).all())
            fin = torch.ones(n, dtype=torch.bool, device="cuda")
            fin[7] = False
            e = rel_err(ops.out[:, fin], ref[:, fin])
            good = col_nan and e <= 1e-5
            ok_all &= good
            log(f"NaN scale + subnormal scales, M={m} {cfg}: NaN column={col_nan}, rel err elsewhere={e:.3g}")
            rows.append({"nan_check": cfg, "m": m, "ok": good, "rel_err": e})
    ok_all &= check_quantize(res)
    res["check"] = rows
    return ok_all


def check_quantize(res: dict) -> bool:
    from fp4dispatch.format import _quantize_torch, swizzle_scales
    from fp4dispatch.kernels import quantize as tq

    ok = True
    out = []
    for (m, k) in ((300, 4112), (4096, 8192)):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            g = torch.Generator(device="cuda").manual_seed(m + k)
            x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(dt)
            gs = torch.tensor([448 * 6 / float(x.float().abs().amax()) * 4], device="cuda")  # 4x: values saturate
            # ties of the e2m1 grid after scaling (block amax pinned to 6/gs*sf): put exact midpoints in row 0
            x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                                      -2.5, -3.5, -5.0, -6.0], device="cuda").to(dt)
            x[1, :16] = 1e4
            for sw in (True, False):
                p0, s0 = _quantize_torch(x, gs)
                if sw:
                    s0 = swizzle_scales(s0)
                p1, s1 = tq.quantize(x, gs, swizzled=sw)
                same = torch.equal(p0, p1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))
                ok &= same
                t_tr = bench_ms(lambda: tq.quantize(x, gs, swizzled=sw))
                t_to = bench_ms(lambda: (lambda p, s: swizzle_scales(s) if sw else s)(*_quantize_torch(x, gs)))
                out.append({"m": m, "k": k, "dtype": str(dt), "swizzled": sw, "bit_identical": same,
                            "triton_us": t_tr * 1e3, "torch_us": t_to * 1e3})
                log(f"quantize {m}x{k} {str(dt):15s} swizzled={sw!s:5s}: bit-identical={same} "
                    f"triton {t_tr * 1e3:8.1f} us  torch {t_to * 1e3:8.1f} us  ({t_to / t_tr:.1f}x)")
    res["quantize"] = out
    return ok


# ------------------------------------------------------------------------------------------------------------------
def run_variants(res: dict, bw: float) -> None:
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.kernels.fused import configs_for, fused_mm
    from fp4dispatch.problem import Problem

    dq = TritonDequantBackend()
    rows = []
    for (n, k) in ((8192, 8192), (28672, 8192)):
        for m in (1, 4, 16, 128, 1024, 4096):
            if n == 28672 and m in (4, 1024):
                continue
            ops = rand_operands(m, n, k, seed=m)
            p = Problem(m, n, k, torch.bfloat16, torch.device("cuda"))
            t_bf16 = cublas_bf16_graph_ms(m, n, k)
            roof_us = ((m + n) * k * 9 / 16 + 2 * m * n) / bw * 1e6
            line = f"M={m:5d} N={n:5d} K={k:5d}  cuBLAS bf16 {t_bf16 * 1e3:8.1f} us  roofline {roof_us:7.1f} us"
            log(line)
            cands = [("fused", c) for c in configs_for(m, n, k, p.device) + extra_fused_configs(m)]
            cands += [("dequant", c) for c in dq.configs(p)]
            for kind, cfg in cands:
                if kind == "fused":
                    fn = lambda c=cfg: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, c)  # noqa: E731
                else:
                    fn = lambda c=cfg: dq.run(p, ops, c)  # noqa: E731
                try:
                    tg = graph_ms(fn)
                    td = bench_ms(fn)
                except Exception as e:  # noqa: BLE001
                    log(f"    {kind} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                rows.append({"m": m, "n": n, "k": k, "kind": kind, "config": cfg, "graph_us": tg * 1e3,
                             "direct_us": td * 1e3, "bf16_us": t_bf16 * 1e3, "roof_us": roof_us})
                log(f"    {kind:7s} {json.dumps(cfg):110s} graph {tg * 1e3:8.1f} us direct {td * 1e3:8.1f} us "
                    f"x bf16 {t_bf16 / tg:5.2f}  roof {roof_us / (tg * 1e3) * 100:5.1f}%")
    res["variants"] = rows


# ------------------------------------------------------------------------------------------------------------------
# Ratios and roofline use the kernel's CUDA-graph time: eager fp4_mm times on the lent machine move with its host
# (40-130 us per call at M <= 16, RESULTS.md, fourth session), the GPU work does not.
TABLE_HEADER = ("| N | K | M | kernel us (graph) | fp4_mm us (eager) | pick | TFLOP/s | % roofline | x bf16 "
                "| cuBLAS bf16 us | torch dq+mm us | x torch |")


def table_row(r: dict) -> str:
    """One markdown row of the table from a row of table.json."""
    cfg = ",".join(f"{a}={b}" for a, b in r["config"].items() if a not in ("kernel", "PAIR", "stages"))
    g = r["graph_us"]
    return (f"| {r['n']} | {r['k']} | {r['m']} | {g:.1f} | {r['fp4_mm_us']:.1f} | {r['backend']} "
            f"{r['config'].get('kernel', '')}({cfg}) | {2 * r['m'] * r['n'] * r['k'] / (g * 1e-6) / 1e12:.1f} | "
            f"{r['roof_us'] / g * 100:.1f} | {r['bf16_us'] / g:.2f} | {r['bf16_us']:.1f} | {r['torch_dq_us']:.1f} | "
            f"{r['torch_dq_us'] / g:.1f} |")


def run_table(res: dict, bw: float, out_dir: str, shapes, ms) -> None:
    from fp4dispatch.dispatch.dispatcher import Dispatcher
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
                 "backend": choice.backend.name, "config": choice.config, "bf16_us": t_bf16 * 1e3,
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
    ap.add_argument("--check", action="store_true", help="correctness checks (and quantize bit-identity)")
    ap.add_argument("--variants", action="store_true", help="time every fused config on a few shapes")
    ap.add_argument("--sweep", action="store_true", help="check + time GEMV variants at M in {1, 4, 16, 128}")
    ap.add_argument("--sweep-kernels", default="gemv2,mma,wmma", help="kernel families in --sweep (comma list)")
    ap.add_argument("--sweep-ms", default="1,4,16,128", help="M values timed in --sweep (comma list)")
    ap.add_argument("--sweep-shapes", default="8192x8192,28672x8192,8192x28672",
                    help="NxK weight shapes timed in --sweep (comma list)")
    ap.add_argument("--table", action="store_true", help="the dispatcher table (default when no mode is given)")
    ap.add_argument("--quick", action="store_true", help="table on two shapes only")
    ap.add_argument("--table-shapes", default="", help="NxK shapes of the table (comma list; default: all six)")
    ap.add_argument("--table-ms", default="", help="M values of the table (comma list; default: MS)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (default $OUT or .)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("bench_hopper: needs a CUDA GPU")
        return 2
    os.makedirs(args.out, exist_ok=True)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    import triton

    res["triton"] = triton.__version__
    bw = copy_bandwidth()
    res["copy_bw"] = bw
    log(f"{res['gpu']}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth {bw / 1e12:.3f} TB/s")
    ok = True
    try:
        if args.check:
            ok = run_check(res)
            log(f"CHECK {'PASSED' if ok else 'FAILED'}")
        if args.variants:
            run_variants(res, bw)
        if args.sweep:
            from hopper_sweep import run_sweep  # benchmarks/ is on sys.path when this file runs as a script

            ok &= run_sweep(res, bw, tuple(args.sweep_kernels.split(",")),
                            tuple(int(x) for x in args.sweep_ms.split(",")),
                            tuple(tuple(int(v) for v in s.split("x")) for s in args.sweep_shapes.split(",")))
            log(f"SWEEP CHECK {'PASSED' if ok else 'FAILED'}")
        if args.table or not (args.check or args.variants or args.sweep):
            shapes = SHAPES[:2] if args.quick else SHAPES
            if args.table_shapes:
                shapes = [tuple(int(v) for v in x.split("x")) for x in args.table_shapes.split(",")]
            run_table(res, bw, args.out, shapes, [int(x) for x in args.table_ms.split(",")] if args.table_ms else MS)
    finally:
        with open(os.path.join(args.out, "bench_hopper.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
