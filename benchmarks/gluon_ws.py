"""Experiments with the warp-specialized Gluon kernel ``wgws`` (``fp4dispatch/kernels/_gluon.py``; issue 8, seventh
and eighth sessions; benchmarks/RESULTS.md, notes_hopper.md v11-v12).

Seventh session: as a benchmark it was not faster at M=128, and with one wgmma group in flight across steps it gave
wrong results at BM 256. Eighth session: the cause was the rolled loop (each step decoded into the registers the
wgmma still in flight was reading: the SASS wrote them right after WARPGROUP.DEPBAR.LE 1); two steps per pass give
each operand its own registers, and every check passes. A store from the wgmma layout cost ~50 us per 128x256 tile;
through ``store_layout`` the kernel made 0.89-0.99x cuBLAS bf16 at M = 1024 on the large shapes (H200, runs 3-6), and
it became the dispatcher's ``wgws`` config (``fused.configs_for``).

Ninth session: the kernel takes whole tiles per CTA (``persist``: one CTA per SM) and can swap the operands' roles
(``swap``: the weight pre-decoded, the activation decoded in registers); every variant goes through ``fused_mm``.

    python3 benchmarks/gluon_ws.py --compile 128 256 4 5 [1]   # local sm_90a build (BN BM BKB STAGES [SWAP]), no GPU
    python3 benchmarks/gluon_ws.py [--no-check] [--tiles 0,2] [--small [--pdl-ab] [--ms 1024]] [--large] [--m128] [--k]
    ncu --profile-from-start off ... python3 benchmarks/gluon_ws.py --profile 8192 8192 1024 128 256 4 5 0 0
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import build, desc_types, profile_once, report  # noqa: E402

from fp4dispatch.kernels._gluon import wgws_kernel  # noqa: E402


def signature(BN: int, BM: int, BKB: int, out: str = "bf16") -> dict:
    """The argument types of ``wgws_kernel`` with descriptors of these tiles, for ``build``."""
    bd, ad = desc_types(BN, BM, BKB)
    return {"x_desc": bd, "y_desc": ad, "sx_ptr": "*u8", "alpha_ptr": "*fp32",
            "out_ptr": f"*{out}", "M": "i32", "N": "i32", "KB": "i32", "CB": "i32", "NT": "i32", "TILES": "i32",
            "STEPS": "i32"}


def build_wgws(BN: int, BM: int, BKB: int, STAGES: int, SWAP: bool = False, out: str | None = None) -> dict:
    """``gluon_probe.build`` of the library kernel (sm_90a, no GPU), specialized as a launch with 16-divisible sizes
    and pointers would be."""
    return build(wgws_kernel, signature(BN, BM, BKB), {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "SWAP": SWAP},
                 BN // 16, ("sx_ptr", "out_ptr", "M", "N", "KB", "CB"), out)


def compile_only(BN=128, BM=256, BKB=4, STAGES=5, SWAP=0):
    report(build_wgws(BN, BM, BKB, STAGES, bool(SWAP), os.environ.get("OUT", "/tmp/gluon_ws")))


def wgws(bn: int, bm: int, bkb: int, stages: int, sched: str = "", swap: bool = False) -> dict:
    """A ``fused_mm`` config of the library kernel; ``sched`` "" or "persist"."""
    return {"kernel": "wgws", "BM": bm, "BN": bn, "BKB": bkb, "stages": stages,
            **({sched: True} if sched else {}), **({"swap": True} if swap else {})}


SCHEDS = ("", "persist")


def runner(ops, cfg):
    from fp4dispatch.kernels.fused import fused_mm
    return lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)


TILES = ((128, 256, 4, 5), (64, 256, 8, 3), (128, 128, 8, 4), (64, 128, 8, 4))  # (BN, BM, BKB, stages)


def check(tiles=TILES) -> None:
    """Exactness against the float64 reference, each tile plain / persistent, swapped or not, fp32 and bf16 out,
    NaN-poisoned out; K = 1152 and 2080 give odd step counts and steps past K; persistent CTAs run several tiles."""
    from bench_hopper import check_configs
    named = [((bn, bm, sched, swap), wgws(bn, bm, bkb, stages, sched, swap))
             for bn, bm, bkb, stages in tiles for sched in SCHEDS for swap in (False, True)]
    check_configs(named, ((128, 1024, 4096), (3, 512, 2048), (300, 640, 8192), (130, 768, 1152), (257, 1000, 2080),
                          (1024, 768, 6144)), lambda ops, cfg: runner(ops, cfg)())


def exp_small(shapes=((6144, 2048), (2048, 6144), (768, 6144)), ms=(1024, 4096), tiles=TILES, pdls=(True,)) -> None:
    """The small table shapes at M >= 1024 (the 0.90x goal is missed there): plain, persistent and swapped wgws
    tiles against cuBLAS bf16, graph us; with ``pdls`` (True, False) each also without programmatic dependent
    launch."""
    from bench_hopper import cublas_bf16_graph_ms, graph_ms, rand_operands
    for n, k in shapes:
        for m in ms:
            ops = rand_operands(m, n, k, seed=m)
            cub = cublas_bf16_graph_ms(m, n, k)
            res = []
            for bn, bm, bkb, stages in tiles:
                for sched in SCHEDS:
                    for swap in (False, True):
                        for pdl in pdls:
                            t = graph_ms(runner(ops, dict(wgws(bn, bm, bkb, stages, sched, swap), pdl=pdl)))
                            res.append((t, f"{bn}x{bm}/{bkb}/{stages} {sched}{' swap' if swap else ''}"
                                           f"{'' if pdl else ' nopdl'}"))
            res.sort()
            print(f"N={n} K={k} M={m} cuBLAS bf16 {cub * 1e3:.1f} us; " +
                  ", ".join(f"{name} {t * 1e3:.1f} ({cub / t:.2f}x)" for t, name in res), flush=True)


def exp_large() -> None:
    """The large shapes at M >= 1024: the dispatcher's tiles plain and persistent against cuBLAS bf16."""
    exp_small(((8192, 8192), (28672, 8192), (8192, 28672)), (1024, 4096), TILES[:2])


def exp_m128() -> None:
    """M = 128: BM 128 tiles of one (BN 64) or two (BN 128) consumer warpgroups, plain and persistent, against the
    wmma pick and cuBLAS bf16. BN 128 makes 64 tiles on 8192^2, under one wave; BN 64 makes 128."""
    from bench_hopper import cublas_bf16_graph_ms, graph_ms, rand_operands
    pick = {"kernel": "wmma", "BM": 128, "BN": 128, "BKB": 8, "warps": 8, "stages": 3, "split": 2, "APRE": True}
    for n, k in ((8192, 8192), (28672, 8192), (8192, 28672), (2048, 6144)):
        m = 128
        ops = rand_operands(m, n, k, seed=m)
        cub = cublas_bf16_graph_ms(m, n, k)
        res = [f"cuBLAS bf16 {cub * 1e3:.1f}", f"wmma pick {graph_ms(runner(ops, pick)) * 1e3:.1f}"]
        for bn, bm, bkb, stages in ((128, 128, 8, 4), (64, 128, 8, 4), (64, 128, 8, 6), (64, 128, 4, 8),
                                    (64, 128, 16, 3)):
            for sched in SCHEDS:
                t = graph_ms(runner(ops, wgws(bn, bm, bkb, stages, sched)))
                res.append(f"{bn}x{bm}/{bkb}/{stages} {sched} {t * 1e3:.1f} ({cub / t:.2f}x)")
        print(f"N={n} K={k} M={m} us: " + ", ".join(res), flush=True)


def exp_k() -> None:
    """Time against K at N=8192, M=1024 (the 128x256 tile), to split the per-tile fixed cost from the per-step one
    (eighth session, run 2)."""
    from bench_hopper import cublas_bf16_graph_ms, graph_ms, rand_operands
    n, m = 8192, 1024
    for k in (2048, 4096, 8192, 16384, 28672):
        ops = rand_operands(m, n, k, seed=k)
        print(f"N={n} K={k} M={m} us: cuBLAS bf16 {cublas_bf16_graph_ms(m, n, k) * 1e3:.1f}, wgws 128x256 "
              f"{graph_ms(runner(ops, wgws(128, 256, 4, 5))) * 1e3:.1f}", flush=True)


def profile(N=8192, K=8192, M=1024, BN=128, BM=256, BKB=4, STAGES=5, SCHED=0, SWAP=0) -> None:
    """One launch inside cudaProfilerStart/Stop (warm-up outside), for ncu --profile-from-start off."""
    from bench_hopper import rand_operands
    profile_once(runner(rand_operands(M, N, K, seed=M), wgws(BN, BM, BKB, STAGES, SCHEDS[SCHED], bool(SWAP))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        compile_only(*map(int, sys.argv[2:]))
    elif sys.argv[1:2] == ["--profile"]:
        profile(*map(int, sys.argv[2:]))
    else:
        # --tiles 0,2: those of TILES (checked and timed by --small); --ms 1024,4096; --pdl-ab: also without PDL
        arg = {a: sys.argv[sys.argv.index(a) + 1] for a in ("--ms", "--tiles") if a in sys.argv}
        tiles = tuple(TILES[int(i)] for i in arg["--tiles"].split(",")) if "--tiles" in arg else TILES
        if "--no-check" not in sys.argv:
            check(tiles)
        if "--small" in sys.argv:
            exp_small(ms=tuple(map(int, arg.get("--ms", "1024,4096").split(","))), tiles=tiles,
                      pdls=(True, False) if "--pdl-ab" in sys.argv else (True,))
        if "--large" in sys.argv:
            exp_large()
        if "--m128" in sys.argv:
            exp_m128()
        if "--k" in sys.argv:
            exp_k()
