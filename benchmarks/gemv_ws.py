"""Experiments with ``gvws``, the warp-specialized Gluon GEMV for M <= 2 (``fp4dispatch/kernels/_gvws.py``; issue 8,
tenth session; benchmarks/RESULTS.md, notes_hopper.md v14).

    python3 benchmarks/gemv_ws.py --compile 16 32 1 5 4 2   # local sm_90a build (R BW MB STAGES WARPS CTAS), no GPU
    python3 benchmarks/gemv_ws.py [--no-check] [--shapes large|small|all] [--ms 1,2]   # H200: exactness, then times
    ncu --profile-from-start off ... python3 benchmarks/gemv_ws.py --profile 28672 8192 1 8 64 8 8 1

Times are graph us (``bench_hopper.graph_ms``) next to cuBLAS bf16 and the pick before this kernel (``gemv2`` with
H2 and CVT); the % of roofline uses the FP4-byte roofline of issue 8 over the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GEMV2 = {"kernel": "gemv2", "MB": 1, "BN": 4, "BKB": 128, "split": 1, "warps": 2, "stages": 3, "PAIR": True,
         "prefetch": True, "H2": True, "CVT": True}  # the M = 1 pick of the eighth session's table


def gvws(r: int, bw: int, stages: int, warps: int, mb: int = 1, ctas: int = 1) -> dict:
    """A ``fused_mm`` config of the library kernel."""
    return {"kernel": "gvws", "MB": mb, "R": r, "BW": bw, "stages": stages, "warps": warps, "ctas": ctas}


# (R, BW, stages, warps, CTAs per SM): shared memory per stage is 4R*BW*8 + R*BW*4 + MB*BW*12 bytes, <= 227 KB per
# SM in all
CONFIGS = ((16, 32, 5, 4, 2), (8, 32, 5, 4, 2), (16, 32, 3, 4, 3), (8, 32, 6, 4, 3), (8, 64, 3, 4, 3), (8, 64, 5, 4, 2),
           (16, 32, 5, 8, 2), (16, 32, 8, 8, 1), (8, 32, 8, 8, 1))


def build_gvws(R: int, BW: int, MB: int, STAGES: int, WARPS: int, CTAS: int = 1, out: str | None = None) -> dict:
    """``gluon_probe.build`` of the library kernel (sm_90a, no GPU) with the register cap ``_gvws.run`` launches it
    with for CTAS CTAs per SM."""
    from gluon_probe import build
    from triton.runtime.jit import mangle_type

    from fp4dispatch.kernels import _gvws
    n, k = 8192, 8192
    a = torch.zeros(MB, k // 2, dtype=torch.uint8)
    b = torch.zeros(n, k // 2, dtype=torch.uint8)
    sa = torch.zeros(128, k // 16, dtype=torch.uint8)
    sb = torch.zeros(n, k // 16, dtype=torch.uint8)
    d = _gvws.descriptors(a, b, sa, sb, R, BW, MB)
    sig = {"w_desc": mangle_type(d[0]), "ws_desc": mangle_type(d[1]), "a_desc": mangle_type(d[2]),
           "as_desc": mangle_type(d[3]), "alpha_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "TILES": "i32", "STEPS": "i32"}
    return build(_gvws.gvws_kernel, sig, {"R": R, "BW": BW, "MB": MB, "STAGES": STAGES}, WARPS, ("out_ptr", "N"), out,
                 **_gvws.reg_cap(WARPS, CTAS))


def compile_only(R=16, BW=32, MB=1, STAGES=5, WARPS=4, CTAS=2) -> None:
    """Build for sm_90a here (no GPU): ptxas's register and spill report, shared memory."""
    from gluon_probe import report
    report(build_gvws(R, BW, MB, STAGES, WARPS, CTAS, os.environ.get("OUT", "/tmp/gemv_ws")))


def runner(ops, cfg):
    from fp4dispatch.kernels.fused import fused_mm
    return lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)


def check() -> bool:
    """Exactness against the float64 reference for every config, M 1 and 2 (MB 1 and 2), fp32 and bf16 out,
    NaN-poisoned out, scale bytes down to subnormals; K 2080 and 1152 leave a partial last step and padded scale
    groups, N 4064 and 992 a partial 128-row group, N 32 three empty quarters."""
    from bench_hopper import rand_operands, ref64, rel_err
    ok, worst = True, {}
    for m, n, k in ((1, 1024, 4096), (2, 992, 2080), (1, 4064, 1152), (2, 256, 8192), (1, 32, 512), (1, 8192, 8192)):
        for dt in (torch.float32, torch.bfloat16):
            ops = rand_operands(m, n, k, seed=5 + m + n, out_dtype=dt, scale_lo=0x01, scale_hi=0x50)
            ref = ref64(ops, m, n, k)
            for r, bw, stages, warps, ctas in CONFIGS:
                for mb in sorted({m, 2}):
                    ops.out.fill_(float("nan"))
                    o = runner(ops, gvws(r, bw, stages, warps, mb, ctas))()
                    torch.cuda.synchronize()
                    e = rel_err(o, ref)
                    key = (str(dt)[6:], r, bw, warps, ctas, mb)
                    worst[key] = max(worst.get(key, 0.0), e)
                    if not e <= (1e-5 if dt == torch.float32 else 4e-3):
                        ok = False
                        again = []  # a race gives other errors on the same inputs, a wrong address the same
                        for _ in range(3):
                            ops.out.fill_(float("nan"))
                            again.append(rel_err(runner(ops, gvws(r, bw, stages, warps, mb, ctas))(), ref))
                        bad = (o.double() - ref).abs() > 1e-3 * ref.abs().max()
                        print(f"FAIL m={m} n={n} k={k} {key}: rel err {e:.3g}, again {[f'{x:.3g}' for x in again]}, "
                              f"wrong columns {bad.nonzero()[:8, 1].tolist()} of {int(bad.sum())}", flush=True)
    for key, e in sorted(worst.items()):
        print(f"check worst {key}: {e:.3g}", flush=True)
    return ok


def times(shapes, ms) -> None:
    """Graph us of every config, gemv2's pick and cuBLAS bf16 per shape and M."""
    from bench_hopper import bench_ms, copy_bandwidth, graph_ms, rand_operands
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for n, k in shapes:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            ops = rand_operands(m, n, k, seed=3)
            wa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench_ms(lambda: torch.mm(wa, wb.t())) * 1e3
            roof = ((m + n) * k * 9 / 16 + 2 * m * n) / bw * 1e6
            cfgs = [dict(GEMV2, MB=m)] + [gvws(r, b, s, w, m, c) for r, b, s, w, c in CONFIGS]
            res = []
            for cfg in cfgs:
                try:
                    t = graph_ms(runner(ops, cfg)) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not build is a result too
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                res.append((t, cfg))
            for t, cfg in sorted(res, key=lambda x: x[0]):
                name = cfg["kernel"] + ("" if cfg["kernel"] == "gemv2" else f" R={cfg['R']} BW={cfg['BW']} "
                                        f"st={cfg['stages']} w={cfg['warps']} ctas={cfg['ctas']}")
                print(f"{n}x{k} M={m} {name}: {t:.1f} us, {roof / t * 100:.0f} % roofline, {t_bf16 / t:.2f}x bf16 "
                      f"({t_bf16:.1f})", flush=True)


def profile(n: int, k: int, m: int, r: int, bw: int, stages: int, warps: int, ctas: int) -> None:
    """One launch inside cudaProfilerStart/Stop (warm-up outside), for ncu --profile-from-start off."""
    from bench_hopper import rand_operands
    from gluon_probe import profile_once
    profile_once(runner(rand_operands(m, n, k, seed=m), gvws(r, bw, stages, warps, m, ctas)))


SHAPES = {"large": ((8192, 8192), (28672, 8192), (8192, 28672)), "small": ((6144, 2048), (2048, 6144), (768, 6144))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", nargs=6, type=int, metavar=("R", "BW", "MB", "STAGES", "WARPS", "CTAS"))
    p.add_argument("--profile", nargs=8, type=int, metavar=("N", "K", "M", "R", "BW", "STAGES", "WARPS", "CTAS"))
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--shapes", default="large", choices=("large", "small", "all"))
    p.add_argument("--ms", default="1")
    args = p.parse_args()
    if args.compile:
        compile_only(*args.compile)
        return
    if args.profile:
        profile(*args.profile)
        return
    if not args.no_check and not check():
        print("CHECK FAILED", flush=True)
    if args.check_only:
        return
    shapes = SHAPES["large"] + SHAPES["small"] if args.shapes == "all" else SHAPES[args.shapes]
    times(shapes, [int(x) for x in args.ms.split(",")])


if __name__ == "__main__":
    main()
