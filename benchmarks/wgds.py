"""``wgds``, the NVFP4 GEMM with the decode in warps of its own (``fp4dispatch/kernels/_wgds.py``; issue 8, twelfth
session; notes_hopper.md v16): exactness, then graph us against the dispatcher's candidates and cuBLAS bf16.

    # local sm_90a build, no GPU: BN BM BKB STAGES ASTAGES DSTAGES DREGS PARTS
    python3 benchmarks/wgds.py --compile 64 128 8 4 4 2 128 2
    ncu --profile-from-start off -k regex:wgds python3 benchmarks/wgds.py --profile M N K "BN,BM,...,PERSIST"
    # H200; a config: "BN,BM,BKB,STAGES,ASTAGES,DSTAGES,DREGS,PARTS[,PERSIST[,SPLIT]]", several joined by ";"
    python3 benchmarks/wgds.py [--no-check] [--ms 16,128] [--shapes large|small|all] [--n 0,1] [--configs ...] [--pdl-ab]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import build, desc_types, profile_once, report  # noqa: E402

SHAPES = {"large": ((8192, 8192), (28672, 8192), (8192, 28672)), "small": ((6144, 2048), (2048, 6144), (768, 6144))}
SHAPES["all"] = SHAPES["large"] + SHAPES["small"]


def build_wgds(BN: int, BM: int, BKB: int, STAGES: int, ASTAGES: int = 4, DSTAGES: int = 2, DREGS: int = 128,
               PARTS: int = 2, out: str | None = None, out_type: str = "bf16") -> dict:
    """``gluon_probe.build`` of the library kernel (sm_90a, no GPU), specialized as a launch would be; ``out_type``
    the output's (fp32 needs the most shared memory: the epilogue's layout conversion)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from fp4dispatch.kernels._gvws import _layouts
    from fp4dispatch.kernels._wgds import wgds_kernel
    _, ad = desc_types(BN, BM, BKB)
    wl, wsl, _, _ = _layouts()
    xd = TensorDescriptor.from_tensor(torch.zeros(32, 32, 512, dtype=torch.int64), [4, BN // 4, BKB], wl)
    sd = TensorDescriptor.from_tensor(torch.zeros(8, 128, 128, dtype=torch.int32), [1, BKB // 4, BN], wsl)
    sig = {"x_desc": mangle_type(xd), "s_desc": mangle_type(sd), "y_desc": ad, "alpha_ptr": "*fp32",
           "out_ptr": f"*{out_type}", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "NT": "i32",
           "UNITS": "i32", "SPLIT": "i32", "SPS": "i32", "STEPS": "i32"}
    consts = {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "ASTAGES": ASTAGES, "DSTAGES": DSTAGES, "DREGS": DREGS,
              "PARTS": PARTS}
    return build(wgds_kernel, sig, consts, 4, ("out_ptr", "ws_ptr", "cnt_ptr", "M", "N"), out)


def wgds(bn: int, bm: int, bkb: int, stages: int, astages: int = 4, dstages: int = 2, dregs: int = 128,
         parts: int = 2, persist: int = 0, split: int = 1) -> dict:
    """A ``fused_mm`` config of the library kernel."""
    return {"kernel": "wgds", "BM": bm, "BN": bn, "BKB": bkb, "stages": stages, "astages": astages,
            "dstages": dstages, "dregs": dregs, "parts": parts, **({"persist": True} if persist else {}),
            **({"split": split} if split > 1 else {})}


def parse(spec: str) -> list[dict]:
    return [wgds(*map(int, c.split(","))) for c in spec.split(";") if c]


DEFAULT = "64,128,8,4,4,2,128,2;64,128,8,4,4,2,128,2,1;64,128,8,4,4,2,128,1"


def runner(ops, cfg):
    from fp4dispatch.kernels.fused import fused_mm
    return lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, cfg)


def check(configs: list[dict]) -> list[dict]:
    """Exactness of every config (``bench_hopper.check_configs``) on shapes with partial tiles, odd step counts and
    steps past K; returns the configs that ran (one over the shared memory is dropped)."""
    from bench_hopper import check_configs
    named = [(tuple(cfg[x] for x in ("BN", "BM", "BKB", "stages", "astages", "dstages", "parts")) +
              (bool(cfg.get("persist")), cfg.get("split", 1)), cfg) for cfg in configs]
    kept = check_configs(named, ((128, 1024, 4096), (3, 512, 2048), (300, 640, 8192), (130, 768, 1152),
                                 (257, 992, 2080), (16, 1024, 4096)), lambda ops, cfg: runner(ops, cfg)())
    return [cfg for _, cfg in kept]


def label(c: dict) -> str:
    """A wgds config as printed: BNxBM/BKB/stages/astages/dstages/dregs x parts [p] [sN] [nopdl]."""
    return (f"{c['BN']}x{c['BM']}/{c['BKB']}/{c['stages']}/{c['astages']}/{c['dstages']}/{c['dregs']}x{c['parts']}"
            f"{' p' if c.get('persist') else ''}{' s%d' % c['split'] if c.get('split') else ''}"
            f"{' nopdl' if c.get('pdl') is False else ''}")


def timings(configs: list[dict], shapes, ms, kind: str = "wgds", name=label, run=runner) -> None:
    """Graph us of every config (``run(ops, cfg)`` returns the call; printed as ``kind``: ``name(cfg)``) against the
    best of the dispatcher's candidates (``configs_for``, through ``fused_mm``) and cuBLAS bf16."""
    from bench_hopper import cublas_bf16_graph_ms, graph_ms, rand_operands

    from fp4dispatch.kernels.fused import configs_for
    for n, k in shapes:
        for m in ms:
            ops = rand_operands(m, n, k, seed=m)
            cub = cublas_bf16_graph_ms(m, n, k)
            cands = [(graph_ms(runner(ops, c)), c) for c in configs_for(m, n, k, ops.a.device)]
            best, bc = min(cands, key=lambda tc: tc[0])
            res = []
            for cfg in configs:
                try:
                    res.append((graph_ms(run(ops, cfg)), name(cfg)))
                except Exception as e:  # noqa: BLE001 - a config that fails to build or launch is reported, not fatal
                    print(f"  {name(cfg)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            res.sort()
            pick = {key: v for key, v in bc.items() if key != "kernel"}
            print(f"N={n} K={k} M={m} us: cuBLAS bf16 {cub * 1e3:.1f}; candidates' best {best * 1e3:.1f} "
                  f"({cub / best:.2f}x, {bc['kernel']} {pick}); {kind}: " +
                  ", ".join(f"{nm} {t * 1e3:.1f} ({cub / t:.2f}x)" for t, nm in res), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--compile"]:
        report(build_wgds(*map(int, argv[1:]), out=os.environ.get("OUT", "/tmp/wgds")))
        return
    if argv[:1] == ["--profile"]:  # M N K config: one call under cudaProfilerStart/Stop, for ncu
        from bench_hopper import rand_operands
        m, n, k = map(int, argv[1:4])
        profile_once(runner(rand_operands(m, n, k, seed=m), parse(argv[4])[0]))
        return

    def opt(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default
    configs = parse(opt("--configs", DEFAULT))
    if "--no-check" not in argv:
        configs = check(configs)
    if "--pdl-ab" in argv:  # each config also launched without PDL (the pre-decode then ends before wgds starts)
        configs += [dict(c, pdl=False) for c in configs]
    shapes = SHAPES[opt("--shapes", "large")]
    if "--n" in argv:  # shapes by index: "0,1"
        shapes = [shapes[int(i)] for i in opt("--n", "0").split(",")]
    timings(configs, shapes, [int(x) for x in opt("--ms", "16,128").split(",")])


if __name__ == "__main__":
    main(sys.argv[1:])
