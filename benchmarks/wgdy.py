"""``wgdy``, ``wgws`` with the operand it read pre-decoded decoded in the kernel by its consumers
(``benchmarks/wgdy_kernel.py``; issue 8, sixteenth session; notes_hopper.md v20): exactness, then graph us against
the dispatcher's candidates and cuBLAS bf16 (with ``--configs ""``: the candidates alone).

    # local sm_90a build, no GPU: BN BM BKB STAGES SWAP
    python3 benchmarks/wgdy.py --compile 128 256 4 5 0
    ncu --profile-from-start off -k regex:wgdy python3 benchmarks/wgdy.py --profile M N K "BN,BM,..."
    # H200; a config: "BN,BM,BKB,STAGES,SWAP[,PERSIST]", several joined by ";"
    python3 benchmarks/wgdy.py [--no-check] [--ms 1024,4096] [--shapes small|large|all] [--configs ...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import build, profile_once, report  # noqa: E402
from wgds import SHAPES, timings  # noqa: E402

KEYS = ("BN", "BM", "BKB", "stages", "swap", "persist")
DEFAULT = "128,256,4,5,0;128,256,4,5,1;128,256,4,5,0,1;128,256,4,5,1,1"


def build_wgdy(BN: int, BM: int, BKB: int, STAGES: int, SWAP: int = 0, out: str | None = None,
               out_type: str = "bf16") -> dict:
    """``gluon_probe.build`` of the benchmark kernel (sm_90a, no GPU), specialized as a launch would be."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from wgdy_kernel import wgdy_kernel

    from fp4dispatch.kernels._gluon import layouts
    from fp4dispatch.kernels._gvws import _layouts
    _, ysl, yl, _ = _layouts()
    xd = TensorDescriptor.from_tensor(torch.zeros(1024, 512, dtype=torch.int64), [BN, BKB], layouts(BN, BM, BKB)[0])
    yd = TensorDescriptor.from_tensor(torch.zeros(1024, 512, dtype=torch.int64), [BM, BKB], yl)
    sd = TensorDescriptor.from_tensor(torch.zeros(8, 128, 128, dtype=torch.int32), [BM // 128, BKB // 4, 128], ysl)
    sig = {"x_desc": mangle_type(xd), "y_desc": mangle_type(yd), "ys_desc": mangle_type(sd), "sx_ptr": "*u8",
           "alpha_ptr": "*fp32", "out_ptr": f"*{out_type}", "M": "i32", "N": "i32", "KB": "i32", "CB": "i32",
           "NT": "i32", "TILES": "i32", "STEPS": "i32"}
    consts = {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "SWAP": bool(SWAP)}
    return build(wgdy_kernel, sig, consts, BN // 16, ("sx_ptr", "out_ptr", "M", "N", "KB", "CB"), out)


def parse(spec: str) -> list[dict]:
    """Configs of the benchmark kernel from "BN,BM,...;..." (``KEYS``; swap and persist 0 or 1)."""
    out = []
    for c in filter(None, spec.split(";")):
        cfg = {"kernel": "wgdy", **dict(zip(KEYS, map(int, c.split(","))))}
        for key in ("swap", "persist"):
            cfg[key] = bool(cfg.get(key))
        out.append(cfg)
    return out


def name(cfg: dict) -> str:
    return ("{BN}x{BM}/{BKB}/{stages}".format(**cfg) +
            (" swap" if cfg.get("swap") else "") + (" p" if cfg.get("persist") else ""))


def runner(ops, cfg):
    """A call of the benchmark kernel."""
    from wgdy_kernel import run
    sa, sb = ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8)

    def call():
        run(ops.a, ops.b, sa, sb, ops.alpha, ops.out, cfg)
        return ops.out
    return call


def check(configs: list[dict]) -> list[dict]:
    """Exactness of every config (``bench_hopper.check_configs``: float64 reference, fp32 and bf16 out, NaN-poisoned
    out) on shapes with partial tiles (M, N not multiples of the tile), odd step counts and steps past K, persistent
    CTAs running several tiles; returns the configs that ran."""
    from bench_hopper import check_configs
    named = [(name(cfg), cfg) for cfg in configs]
    kept = check_configs(named, ((1024, 768, 6144), (3, 512, 2048), (300, 640, 8192), (130, 768, 1152),
                                 (257, 1000, 2080), (1100, 1024, 4096)), lambda ops, cfg: runner(ops, cfg)())
    return [cfg for _, cfg in kept]


def main(argv: list[str]) -> None:
    if argv[:1] == ["--compile"]:
        report(build_wgdy(*map(int, argv[1:]), out=os.environ.get("OUT", "/tmp/wgdy")))
        return
    if argv[:1] == ["--profile"]:  # M N K config: one call under cudaProfilerStart/Stop, for ncu
        from bench_hopper import rand_operands
        m, n, k = map(int, argv[1:4])
        profile_once(runner(rand_operands(m, n, k, seed=m), parse(argv[4])[0]))
        return

    def opt(key: str, default: str) -> str:
        return argv[argv.index(key) + 1] if key in argv else default
    configs = parse(opt("--configs", DEFAULT))
    if "--no-check" not in argv:
        configs = check(configs)
    shapes = SHAPES[opt("--shapes", "small")]
    timings(configs, shapes, [int(x) for x in opt("--ms", "1024,4096").split(",")], "wgdy", name, runner)


if __name__ == "__main__":
    main(sys.argv[1:])
