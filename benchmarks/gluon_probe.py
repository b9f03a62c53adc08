"""Gluon probe for issue 8 (sixth session; benchmarks/notes_hopper.md v10): the M <= 16 swapped-operand kernel
(``kernels/_wmma.py``) rewritten in ``triton.experimental.gluon`` without Triton's pipeliner: TMA loads of the weight
words and the pre-decoded A into an mbarrier ring, the weight decoded straight into the register operand of an async
``warpgroup_mma`` (``convert_layout(..., assert_trivial=True)`` compiles: no shuffle), split-K by fp32 atomics.

Exact since the seventh session (H200 run 1: rel err <= 7.4e-6 with fp32 out at every split, stage count and wait):
the sixth session's errors (0.12-0.98) were alpha, which it did not apply (out / alpha: 1/alpha - 1). A timing probe,
not a backend: it timed 26.3 / 62.3 / 61.8 us against the ``wmma`` pick's 24.9 / 59.0-61.8 / 59.8 (RESULTS.md,
sixth session, run 5). Its loop step, scale addressing and store layout now come from the library kernel
(``fp4dispatch/kernels/_gluon.py``, eighth session); ``build`` and ``signature`` serve ``gluon_ws.py`` and
tests/test_gluon_sass.py. Its WAIT 1 loop has the rolled-loop race that ``sass_race.py`` flags (217 writes to an
in-flight wgmma operand; the eighth session's run 4 saw inf once): a timing probe only, and that race's positive
control in tests/test_gluon_sass.py.

    python3 benchmarks/gluon_probe.py --compile 64 16 16 3 1   # local sm_90a build (BN BM BKB STAGES WAIT), no GPU
    python3 benchmarks/gluon_probe.py [--check]                # H200: exactness, then graph us against the pick
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4dispatch.kernels._gluon import layouts, load_scales, mma_step, raw_layout, scale_ptrs, store_layout
from fp4dispatch.kernels.fused import predecode


@gluon.jit
def probe_kernel(b_desc, a_desc, sb_ptr, alpha_ptr, out_ptr, M, N, KB, CB, steps_per_split, BN: gl.constexpr,
                 BM: gl.constexpr, BKB: gl.constexpr, STAGES: gl.constexpr, WAIT: gl.constexpr, RAW: gl.constexpr):
    """acc [BN, BM] += W @ A.T over one K split; W words and pre-decoded A by TMA (STAGES-deep ring), WAIT wgmma
    groups left in flight; alpha applied, then fp32 atomics."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    n0 = gl.program_id(0) * BN
    st0 = gl.program_id(1) * steps_per_split
    steps = gl.minimum(KB // BKB - st0, steps_per_split)
    b_s = gl.allocate_shared_memory(gl.int64, [STAGES, BN, BKB], b_desc.layout)
    a_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BKB * 16], a_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nbytes: gl.constexpr = BN * BKB * 8 + BM * BKB * 32
    AHEAD: gl.constexpr = STAGES - 1 - WAIT  # loads in flight ahead of the step being decoded
    for i in gl.static_range(AHEAD):
        if i < steps:
            mbarrier.expect(bars.index(i), nbytes)
            tma.async_copy_global_to_shared(b_desc, [n0, (st0 + i) * BKB], bars.index(i), b_s.index(i))
            tma.async_copy_global_to_shared(a_desc, [0, (st0 + i) * BKB * 16], bars.index(i), a_s.index(i))
    sptr, smask, t = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
    sb = load_scales(sptr, smask, t, st0 * BKB, KB)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    for it in range(steps):
        nxt = it + AHEAD
        if nxt < steps:
            ns = nxt % STAGES
            mbarrier.expect(bars.index(ns), nbytes)
            tma.async_copy_global_to_shared(b_desc, [n0, (st0 + nxt) * BKB], bars.index(ns), b_s.index(ns))
            tma.async_copy_global_to_shared(a_desc, [0, (st0 + nxt) * BKB * 16], bars.index(ns), a_s.index(ns))
        sb_next = load_scales(sptr, smask, t, (st0 + it + 1) * BKB, KB)
        acc = mma_step(b_s, a_s, bars, it, sb, acc, RAW, DOT)
        acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc])
        sb = sb_next
    # fp32 atomics into a zeroed out (the library kernel sums split tiles in a workspace instead)
    ST: gl.constexpr = store_layout(BN, BM, False, 4)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    acc = acc * (0.25 * gl.load(alpha_ptr))  # 2**-2 undoes the CVT decode's factor 2 on each operand
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, ST))
    om = gl.arange(0, BM, layout=gl.SliceLayout(0, ST))
    gl.atomic_add(out_ptr + om[None, :].to(gl.int64) * N + on[:, None], gl.convert_layout(acc, ST),
                  mask=(om[None, :] < M) & (on[:, None] < N), sem="relaxed")


def build(kernel, sig: dict, consts: dict, warps: int, div16: tuple, out: str | None = None, **opts) -> dict:
    """Compile ``kernel`` for sm_90a on this machine (no GPU needed): {"sass", "ptxas" (its -v report), "shared"
    (bytes)}; with ``out``, also write its TTGIR, PTX, cubin and SASS there. ``div16`` names the arguments to
    specialize as multiples of 16, as a launch with such values would; ``opts`` are further compile options
    (``maxnreg``)."""
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(sig, **{k: "constexpr" for k in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    c = triton.compile(GluonASTSource(kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, **opts})
    out = out or tempfile.mkdtemp(prefix="gluon_build")
    os.makedirs(out, exist_ok=True)
    open(f"{out}/k.ttgir", "w").write(c.asm["ttgir"])
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.7", c.asm["ptx"])  # the local ptxas is older than 3.6's PTX
    open(f"{out}/k.ptx", "w").write(ptx)
    b = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    r = subprocess.run([f"{b}/ptxas", "-arch=sm_90a", "-v", f"{out}/k.ptx", "-o", f"{out}/k.cubin"],
                       capture_output=True, text=True)
    s = subprocess.run([f"{b}/cuobjdump", "-sass", f"{out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/k.sass", "w").write(s)
    return {"sass": s, "ptxas": r.stderr, "shared": c.metadata.shared}


def report(built: dict) -> None:
    """The --compile line: ptxas's last two report lines and the shared memory."""
    print(built["ptxas"].strip().splitlines()[-2:], f"shared memory {built['shared']} bytes")


def profile_once(run) -> None:
    """``run()`` once inside cudaProfilerStart/Stop after a warm-up call outside, for ncu --profile-from-start off."""
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def desc_types(BN: int, BM: int, BKB: int) -> tuple[str, str]:
    """The argument types of the (words, pre-decoded operand) TMA descriptors of these tiles, for ``build``."""
    from triton.runtime.jit import mangle_type
    bl, al = layouts(BN, BM, BKB)
    bd = TensorDescriptor.from_tensor(torch.zeros(1024, 512, dtype=torch.int64), [BN, BKB], bl)
    ad = TensorDescriptor.from_tensor(torch.zeros(BM, 8192, dtype=torch.float16), [BM, BKB * 16], al)
    return mangle_type(bd), mangle_type(ad)


def signature(BN: int, BM: int, BKB: int) -> dict:
    """The probe's argument types: the two descriptors, then sb_ptr, alpha_ptr, out_ptr (fp32), M, N, KB, CB,
    steps_per_split, for ``build``."""
    bd, ad = desc_types(BN, BM, BKB)
    return {"b_desc": bd, "a_desc": ad, "sb_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32",
            "N": "i32", "KB": "i32", "CB": "i32", "steps_per_split": "i32"}


def compile_only(BN=64, BM=16, BKB=16, STAGES=3, WAIT=1):
    report(build(probe_kernel, signature(BN, BM, BKB),
          {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "WAIT": WAIT, "RAW": raw_layout(BKB)}, 4,
          ("sb_ptr", "out_ptr", "KB", "CB", "N"), os.environ.get("OUT", "/tmp/gluon_probe")))


def _setup(ops, m, n, k, BN, BKB, split):
    """A launcher for one problem: A decoded as wmma's APRE does, out zeroed (atomics), then the probe."""
    kb, cb = k // 16, triton.cdiv(k // 16, 4)
    a64, b64 = ops.a.view(torch.int64), ops.b.view(torch.int64)
    sa, sb = ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8)
    bl, a_layout = layouts(BN, 16, BKB)
    bd = TensorDescriptor.from_tensor(b64, [BN, BKB], bl)
    out = torch.empty((m, n), dtype=torch.float32, device="cuda")
    per = triton.cdiv(kb // BKB, split)
    grid = (triton.cdiv(n, BN), triton.cdiv(kb // BKB, per))

    def run(stages, wait):
        ad = predecode(a64, sa, True, CVT=True)
        add = TensorDescriptor.from_tensor(ad, [16, BKB * 16], a_layout)
        out.zero_()
        probe_kernel[grid](bd, add, sb, ops.alpha, out, m, n, kb, cb, per, BN=BN, BM=16, BKB=BKB, STAGES=stages,
                           WAIT=wait, RAW=raw_layout(BKB), num_warps=4)
        return out
    return run


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_hopper import graph_ms, rand_operands, ref64, rel_err
    from fp4dispatch.kernels.fused import fused_mm
    BN, BKB = 64, 16
    for m, n, k in ((16, 1024, 4096), (3, 512, 2048), (16, 8192, 8192)):
        ops = rand_operands(m, n, k, seed=7, out_dtype=torch.float32, scale_lo=0x01, scale_hi=0x50)
        ref = ref64(ops, m, n, k)
        for split in (1, 3):
            for stages, wait in ((3, 0), (3, 1), (4, 1)):
                o = _setup(ops, m, n, k, BN, BKB, split)(stages, wait)
                torch.cuda.synchronize()
                print(f"check m={m} n={n} k={k} split={split} stages={stages} wait={wait}: rel err "
                      f"{rel_err(o, ref):.3g}", flush=True)
    if "--check" in sys.argv:
        return
    pick = {"kernel": "wmma", "BM": 16, "BN": 64, "BKB": 16, "warps": 4, "stages": 3, "split": 4, "APRE": True}
    for n, k in ((8192, 8192), (28672, 8192), (8192, 28672)):
        m = 16
        ops = rand_operands(m, n, k, seed=m)
        for sp in (2, 4):
            c = dict(pick, split=sp)
            t = graph_ms(lambda: fused_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.out, c))
            print(f"N={n} K={k} M={m} wmma pick split={sp}: {t * 1e3:.1f} us", flush=True)
        for split in (2, 4, 6):
            for stages, wait in ((3, 0), (3, 1), (4, 1), (4, 2), (5, 2)):
                r = _setup(ops, m, n, k, BN, BKB, split)
                t = graph_ms(lambda: r(stages, wait))
                print(f"N={n} K={k} M={m} gluon split={split} stages={stages} wait={wait}: {t * 1e3:.1f} us",
                      flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        compile_only(*map(int, sys.argv[2:]))
    else:
        main()
