"""Experiments with ``gvws``, the warp-specialized Gluon GEMV for M <= 2 (``fp4dispatch/kernels/_gvws.py``; issue 8,
tenth and eleventh sessions; benchmarks/RESULTS.md, notes_hopper.md v14-v15).

    python3 benchmarks/gemv_ws.py --compile 16 32 1 5 4 2 1   # sm_90a build here (R BW MB STAGES WARPS CTAS DP)
    python3 benchmarks/gemv_ws.py [--no-check] [--shapes large|small|all] [--ms 1,2]   # H200: exactness, then times
    python3 benchmarks/gemv_ws.py --configs "8,32,6,4,3,1;16,32,5,4,2,1"   # configs: R,BW,STAGES,WARPS,CTAS,DP
    python3 benchmarks/gemv_ws.py --feed default --compute ...   # also the feed alone and the consumers alone
    ncu --profile-from-start off ... python3 benchmarks/gemv_ws.py --profile 28672 8192 1 8 32 6 4 3 --dp 1

Times are graph us (``bench_hopper.graph_ms``) next to cuBLAS bf16 and the pick before this kernel (``gemv2`` with
H2 and CVT); the % of roofline uses the FP4-byte roofline of issue 8 over the measured copy bandwidth. ``--feed``
times the library's producer with consumers that only free slots, ``--compute`` the library's consumers with a
producer that frees slots without loading: the two halves of the kernel apart.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GEMV2 = {"kernel": "gemv2", "MB": 1, "BN": 4, "BKB": 128, "split": 1, "warps": 2, "stages": 3, "PAIR": True,
         "prefetch": True, "H2": True, "CVT": True}  # the M = 1 pick of the eighth session's table


def gvws(r: int, bw: int, stages: int, warps: int, mb: int = 1, ctas: int = 1, dp: int = 0) -> dict:
    """A ``fused_mm`` config of the library kernel (``dp``: its DP, the int8 dot-product path)."""
    return {"kernel": "gvws", "MB": mb, "R": r, "BW": bw, "stages": stages, "warps": warps, "ctas": ctas,
            "DP": bool(dp)}


# (R, BW, stages, warps, CTAs per SM, DP): shared memory per stage is 4R*BW*8 + R*BW*4 + MB*BW*12 bytes, <= 227 KB
# per SM in all
CONFIGS = tuple((r, bw, st, 4, c, dp) for r, bw, st, c in ((16, 32, 5, 2), (8, 32, 6, 3)) for dp in (0, 1))


def build_gvws(R: int, BW: int, MB: int, STAGES: int, WARPS: int, CTAS: int = 1, out: str | None = None,
               DP: bool = False) -> dict:
    """``gluon_probe.build`` of the library kernel (sm_90a, no GPU) with the register cap ``_gvws.run`` launches it
    with for CTAS CTAs per SM, specialized as a launch is at M = MB: M = 1 becomes a constant."""
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
    consts = {"R": R, "BW": BW, "MB": MB, "STAGES": STAGES, "DP": DP}
    if MB == 1:  # Triton specializes an int argument equal to 1
        del sig["M"]
        consts["M"] = 1
    return build(_gvws.gvws_kernel, sig, consts, WARPS, ("out_ptr", "N"), out, **_gvws.reg_cap(WARPS, CTAS))


def compile_only(R=16, BW=32, MB=1, STAGES=5, WARPS=4, CTAS=2, DP=0) -> None:
    """Build for sm_90a here (no GPU): ptxas's register and spill report, shared memory."""
    from gluon_probe import report
    report(build_gvws(R, BW, MB, STAGES, WARPS, CTAS, os.environ.get("OUT", "/tmp/gemv_ws"), bool(DP)))


def runner(ops, cfg):
    from fp4dispatch.kernels.fused import fused_mm
    return lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)


def check(configs) -> bool:
    """Exactness against the float64 reference for every config, M 1 and 2 (MB 1 and 2), fp32 and bf16 out,
    NaN-poisoned out, scale bytes down to subnormals; K 2080 and 1152 leave a partial last step and padded scale
    groups, N 4064 and 992 a partial 128-row group, N 32 three empty quarters."""
    from bench_hopper import rand_operands, ref64, rel_err
    ok, worst = True, {}
    for m, n, k in ((1, 1024, 4096), (2, 992, 2080), (1, 4064, 1152), (2, 256, 8192), (1, 32, 512), (1, 8192, 8192)):
        for dt in (torch.float32, torch.bfloat16):
            ops = rand_operands(m, n, k, seed=5 + m + n, out_dtype=dt, scale_lo=0x01, scale_hi=0x50)
            ref = ref64(ops, m, n, k)
            for r, bw, stages, warps, ctas, dp in configs:
                for mb in sorted({m, 2}):
                    ops.out.fill_(float("nan"))
                    o = runner(ops, gvws(r, bw, stages, warps, mb, ctas, dp))()
                    torch.cuda.synchronize()
                    e = rel_err(o, ref)
                    key = (str(dt)[6:], r, bw, warps, ctas, dp, mb)
                    worst[key] = max(worst.get(key, 0.0), e)
                    if not e <= (1e-5 if dt == torch.float32 else 4e-3):
                        ok = False
                        again = []  # a race gives other errors on the same inputs, a wrong address the same
                        for _ in range(3):
                            ops.out.fill_(float("nan"))
                            again.append(rel_err(runner(ops, gvws(r, bw, stages, warps, mb, ctas, dp))(), ref))
                        bad = (o.double() - ref).abs() > 1e-3 * ref.abs().max()
                        print(f"FAIL m={m} n={n} k={k} {key}: rel err {e:.3g}, again {[f'{x:.3g}' for x in again]}, "
                              f"wrong columns {bad.nonzero()[:8, 1].tolist()} of {int(bad.sum())}", flush=True)
    for key, e in sorted(worst.items()):
        print(f"check worst {key}: {e:.3g}", flush=True)
    return ok


def times(shapes, ms, configs) -> None:
    """Graph us of every (R, BW, stages, warps, CTAs per SM, DP) of ``configs``, gemv2's pick and cuBLAS bf16 per
    shape and M."""
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
            cfgs = [dict(GEMV2, MB=m)] + [gvws(r, b, s, w, m, c, dp) for r, b, s, w, c, dp in configs]
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
                                        f"st={cfg['stages']} w={cfg['warps']} ctas={cfg['ctas']} DP={int(cfg['DP'])}")
                print(f"{n}x{k} M={m} {name}: {t:.1f} us, {roof / t * 100:.0f} % roofline, {t_bf16 / t:.2f}x bf16 "
                      f"({t_bf16:.1f})", flush=True)


def _feed_kernel():
    """A gvws kernel whose consumers only take each slot's weight words (an xor keeps the loads) and free it: the
    ceiling of the TMA ring itself, same producer, same boxes."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from fp4dispatch.kernels import _gvws
    from fp4dispatch.kernels._gluon import _first_tile

    @gluon.jit
    def consume(w_s, ready, empty, out_ptr, TILES, STEPS):
        STAGES: gl.constexpr = w_s.type.shape[0]
        R: gl.constexpr = w_s.type.shape[2]
        BW: gl.constexpr = w_s.type.shape[3]
        LW: gl.constexpr = _gvws.word_layout(BW, gl.num_warps())
        acc = gl.zeros([4, R, BW // 4, 4], gl.int64, LW)
        for it in range((_first_tile(gl.program_id(0) + 1, TILES) - _first_tile(gl.program_id(0), TILES)) * STEPS):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc ^= w_s._reinterpret(gl.int64, [STAGES, 4, R, BW // 4, 4], _gvws.plain(4)).index(s).load(LW)
            fence_async_shared()
            mbarrier.arrive(empty.index(s))
        gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(gl.sum(gl.sum(acc, 3), 2), 1), 0))

    @gluon.jit
    def feed_kernel(w_desc, ws_desc, a_desc, as_desc, out_ptr, TILES, STEPS, R: gl.constexpr, BW: gl.constexpr,
                    MB: gl.constexpr, STAGES: gl.constexpr):
        w_s, ws_s, a_s, as_s, ready, empty = _gvws.ring(w_desc, ws_desc, a_desc, as_desc, R, BW, MB, STAGES)
        gl.warp_specialize([(consume, (w_s, ready, empty, out_ptr, TILES, STEPS)),
                            (_gvws._producer, (w_desc, ws_desc, a_desc, as_desc, w_s, ws_s, a_s, as_s, ready, empty,
                                               TILES, STEPS))], [1], [40])
    return feed_kernel


def _compute_kernel():
    """A gvws kernel whose producer loads nothing: it frees each slot to the consumers (a plain arrive on ``ready``)
    as soon as it is empty, so the library's consumers decode whatever the ring holds at the rate they can."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from fp4dispatch.kernels import _gvws
    from fp4dispatch.kernels._gluon import _first_tile

    @gluon.jit
    def produce(ready, empty, TILES, STEPS):
        STAGES: gl.constexpr = ready.type.shape[0]
        for it in range((_first_tile(gl.program_id(0) + 1, TILES) - _first_tile(gl.program_id(0), TILES)) * STEPS):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.arrive(ready.index(s))

    @gluon.jit
    def compute_kernel(w_desc, ws_desc, a_desc, as_desc, alpha_ptr, out_ptr, M, N, TILES, STEPS, R: gl.constexpr,
                       BW: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr, DP: gl.constexpr):
        w_s, ws_s, a_s, as_s, ready, empty = _gvws.ring(w_desc, ws_desc, a_desc, as_desc, R, BW, MB, STAGES)
        gl.warp_specialize([(_gvws._consume, (w_s, ws_s, a_s, as_s, ready, empty, alpha_ptr, out_ptr, M, N, TILES,
                                              STEPS, DP)),
                            (produce, (ready, empty, TILES, STEPS))], [1], [40])
    return compute_kernel


def compute_runner(ops, n: int, k: int, cfg: tuple):
    """A call of the compute-only kernel (``_compute_kernel``) for (R, BW, stages, warps, CTAs, DP) at M = 1."""
    from fp4dispatch.kernels import _gvws
    from fp4dispatch.kernels.launch import launch
    global _COMPUTE
    _COMPUTE = _COMPUTE or _compute_kernel()
    r, bwd, st, w, c, dp = cfg
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = _gvws.descriptors(ops.a, ops.b, ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8), r, bwd, 1)
    tiles, steps = _gvws.work(n, k // 16, r, bwd)
    return lambda: launch(_COMPUTE, (min(tiles, sms * c),), *d, ops.alpha, ops.out, 1, n, tiles, steps, R=r, BW=bwd, MB=1, STAGES=st, DP=bool(dp), num_warps=w, **_gvws.reg_cap(w, c))


_COMPUTE = None


def compute(shapes, configs) -> None:
    """Graph us of the compute-only kernel for each (R, BW, stages, warps, CTAs, DP) of ``configs``."""
    from bench_hopper import graph_ms, rand_operands
    for n, k in shapes:
        ops = rand_operands(1, n, k, seed=3)
        for cfg in configs:
            t = graph_ms(compute_runner(ops, n, k, cfg)) * 1e3
            print(f"compute {n}x{k} R={cfg[0]} BW={cfg[1]} st={cfg[2]} w={cfg[3]} ctas={cfg[4]} DP={cfg[5]}: "
                  f"{t:.1f} us", flush=True)


def feed(shapes, configs) -> None:
    """Graph us of the feed-only kernel (``_feed_kernel``) for each (R, BW, stages, warps, CTAs per SM) of
    ``configs``, against the copy roofline of the GEMV's bytes."""
    from bench_hopper import copy_bandwidth, graph_ms, rand_operands

    from fp4dispatch.kernels import _gvws
    from fp4dispatch.kernels.launch import launch
    kern = _feed_kernel()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in shapes:
        ops = rand_operands(1, n, k, seed=3)
        sink = torch.empty(4 * sms, dtype=torch.int64, device="cuda")
        roof = ((1 + n) * k * 9 / 16 + 2 * n) / bw * 1e6
        for r, bwd, st, w, c in configs:
            d = _gvws.descriptors(ops.a, ops.b, ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8), r, bwd,
                                  1)
            tiles, steps = _gvws.work(n, k // 16, r, bwd)
            t = graph_ms(lambda: launch(kern, (min(tiles, sms * c),), *d, sink, tiles, steps, R=r, BW=bwd, MB=1,
                                        STAGES=st, num_warps=w, **_gvws.reg_cap(w, c))) * 1e3
            print(f"feed {n}x{k} R={r} BW={bwd} st={st} w={w} ctas={c}: {t:.1f} us, {roof / t * 100:.0f} % roofline",
                  flush=True)


def profile(n: int, k: int, m: int, r: int, bw: int, stages: int, warps: int, ctas: int, dp: int = 0,
            compute_only: bool = False) -> None:
    """One launch inside cudaProfilerStart/Stop (warm-up outside), for ncu --profile-from-start off; with
    ``compute_only``, of the compute-only kernel (M = 1)."""
    from bench_hopper import rand_operands
    from gluon_probe import profile_once
    ops = rand_operands(m, n, k, seed=m)
    profile_once(compute_runner(ops, n, k, (r, bw, stages, warps, ctas, dp)) if compute_only else
                 runner(ops, gvws(r, bw, stages, warps, m, ctas, dp)))


SHAPES = {"large": ((8192, 8192), (28672, 8192), (8192, 28672)), "small": ((6144, 2048), (2048, 6144), (768, 6144))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", nargs=7, type=int, metavar=("R", "BW", "MB", "STAGES", "WARPS", "CTAS", "DP"))
    p.add_argument("--profile", nargs=8, type=int, metavar=("N", "K", "M", "R", "BW", "STAGES", "WARPS", "CTAS"))
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--feed", help="first time the feed-only kernel (the ring's ceiling) for these 'R,BW,STAGES,"
                   "WARPS,CTAS;...' ('default': CONFIGS' tiles)")
    p.add_argument("--compute", action="store_true", help="first time the compute-only kernel for --configs "
                   "(with --profile: profile it)")
    p.add_argument("--configs", help="time these 'R,BW,STAGES,WARPS,CTAS,DP;...' instead of CONFIGS")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--dp", type=int, default=0, help="--profile: the config's DP")
    p.add_argument("--shapes", default="large", choices=("large", "small", "all"))
    p.add_argument("--ms", default="1")
    args = p.parse_args()
    if args.compile:
        compile_only(*args.compile)
        return
    if args.profile:
        profile(*args.profile, args.dp, args.compute)
        return
    shapes = SHAPES["large"] + SHAPES["small"] if args.shapes == "all" else SHAPES[args.shapes]

    def parse(text):
        return tuple(tuple(int(x) for x in c.split(",")) for c in text.split(";"))
    if args.feed:
        feed(shapes, sorted({c[:5] for c in CONFIGS}) if args.feed == "default" else parse(args.feed))
    configs = parse(args.configs) if args.configs else CONFIGS
    if args.compute:
        compute(shapes, configs)
    if not args.no_check and not check(configs):
        print("CHECK FAILED", flush=True)
    if args.check_only:
        return
    times(shapes, [int(x) for x in args.ms.split(",")], configs)


if __name__ == "__main__":
    main()
