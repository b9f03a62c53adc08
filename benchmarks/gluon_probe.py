"""Gluon probe for issue 8 (sixth session; benchmarks/notes_hopper.md v10): the M <= 16 swapped-operand kernel
(``kernels/_wmma.py``) rewritten in ``triton.experimental.gluon`` without Triton's pipeliner: TMA loads of the weight
words and the pre-decoded A into an mbarrier ring, the weight decoded straight into the register operand of an async
``warpgroup_mma`` (``convert_layout(..., assert_trivial=True)`` compiles: no shuffle), split-K by fp32 atomics.

Exact since the seventh session (H200 run 1: rel err <= 7.4e-6 with fp32 out at every split, stage count and wait):
the sixth session's errors (0.12-0.98) were alpha, which it did not apply (out / alpha: 1/alpha - 1). A timing probe,
not a backend: it timed 26.3 / 62.3 / 61.8 us against the ``wmma`` pick's 24.9 / 59.0-61.8 / 59.8 (RESULTS.md,
sixth session, run 5). Its loop step (``mma_step``), scale addressing, epilogue and build helpers serve
``gluon_ws.py`` too.

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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4dispatch.kernels import _fused, _wmma
from fp4dispatch.kernels.fused import decode_a


# the decode and the scale addressing are wmma's own: Gluon compiles a @triton.jit function's body with its semantics
# (its tl builtins take the caller's), so the probe decodes exactly as wmma does
_dec16 = gluon.jit(_wmma._dec16.fn)
_scale_cols = gluon.jit(_wmma._scale_cols.fn)
_swz_row = gluon.jit(_fused._swz_row.fn)


@triton.constexpr_function
def raw_layout(bkb: int, warps: int = 4) -> gl.DistributedLinearLayout:
    """The layout Triton 3.6 gives the raw words of a [16 * warps, bkb] int64 tile (read from its TTGIR for 4 warps,
    bkb 16): in it the decoded weight is already the wgmma register operand (warps_per_cta [warps, 1]), so the
    convert to DotOperandLayout is free. Lanes hold the 4 blocks of a scale group; registers take row 8 and the
    further groups; each warp 16 rows."""
    bkb, warps = getattr(bkb, "value", bkb), getattr(warps, "value", warps)
    regs = [[8, 0]] + [[0, 4 << i] for i in range(bkb.bit_length() - 3)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)],
                                      block_bases=[], shape=[16 * warps, bkb])


@gluon.jit
def scale_ptrs(sb_ptr, n0, CB, N, BN: gl.constexpr, BKB: gl.constexpr, RAW: gl.constexpr):
    """Pointers (K step 0; step j adds (j * BKB // 4) * 512) and row mask of the e4m3 scale bytes of weight rows
    [n0, n0 + BN), in RAW's layout."""
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, RAW))
    t = gl.arange(0, BKB, layout=gl.SliceLayout(0, RAW))
    return sb_ptr + _swz_row(rn, CB)[:, None] + _scale_cols(t)[None, :], (rn < N)[:, None]


@gluon.jit
def mma_step(w_s, a_s, ready, it, sb, acc, RAW: gl.constexpr, DOT: gl.constexpr):
    """Step ``it`` of the ring: wait for its slot, decode the weight words (scales ``sb``) straight into the wgmma
    register operand (the convert is free in RAW) and issue the async wgmma with the slot's A tile."""
    STAGES: gl.constexpr = w_s.type.shape[0]
    BKB: gl.constexpr = w_s.type.shape[2]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    w = gl.convert_layout(_dec16(w_s.index(s).load(RAW), sb, BKB, True, True), DOT, assert_trivial=True)
    return warpgroup_mma(w, a_s.index(s).permute((1, 0)), acc, is_async=True)


@gluon.jit
def epilogue(acc, alpha_ptr, out_ptr, n0, m0, M, N, atomic):
    """Wait for the last wgmma, apply alpha and write out.T's tile: fp32 atomics into a zeroed out (``atomic``: a
    split of K) or a store in out's dtype."""
    MMA: gl.constexpr = acc.type.layout
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    acc = acc * (0.25 * gl.load(alpha_ptr))  # 2**-2 undoes the CVT decode's factor 2 on each operand
    on = n0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, MMA))
    offs = om[None, :] * N + on[:, None]
    mask = (om[None, :] < M) & (on[:, None] < N)
    if atomic:
        gl.atomic_add(out_ptr + offs, acc, mask=mask, sem="relaxed")
    else:
        gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
    sptr, smask = scale_ptrs(sb_ptr, n0, CB, N, BN, BKB, RAW)
    sb = gl.load(sptr + (st0 * BKB // 4) * 512, mask=smask, other=0)
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    for it in range(steps):
        nxt = it + AHEAD
        if nxt < steps:
            ns = nxt % STAGES
            mbarrier.expect(bars.index(ns), nbytes)
            tma.async_copy_global_to_shared(b_desc, [n0, (st0 + nxt) * BKB], bars.index(ns), b_s.index(ns))
            tma.async_copy_global_to_shared(a_desc, [0, (st0 + nxt) * BKB * 16], bars.index(ns), a_s.index(ns))
        sb_next = gl.load(sptr + ((st0 + it + 1) * BKB // 4) * 512, mask=smask & (it + 1 < steps), other=0)
        acc = mma_step(b_s, a_s, bars, it, sb, acc, RAW, DOT)
        acc = warpgroup_mma_wait(num_outstanding=WAIT, deps=[acc])
        sb = sb_next
    epilogue(acc, alpha_ptr, out_ptr, n0, 0, M, N, True)


def build(kernel, sig: dict, consts: dict, warps: int, div16: tuple) -> None:
    """Compile ``kernel`` for sm_90a on this machine (no GPU) and write its TTGIR, PTX, cubin and SASS to $OUT;
    ``div16`` names the arguments to specialize as multiples of 16, as a launch with such values would."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(sig, **{k: "constexpr" for k in consts})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    c = triton.compile(GluonASTSource(kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    out = os.environ.get("OUT", "/tmp/gluon_probe")
    os.makedirs(out, exist_ok=True)
    open(f"{out}/k.ttgir", "w").write(c.asm["ttgir"])
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.7", c.asm["ptx"])  # the local ptxas is older than 3.6's PTX
    open(f"{out}/k.ptx", "w").write(ptx)
    b = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    r = subprocess.run([f"{b}/ptxas", "-arch=sm_90a", "-v", f"{out}/k.ptx", "-o", f"{out}/k.cubin"],
                       capture_output=True, text=True)
    print(r.stderr.strip().splitlines()[-2:])
    s = subprocess.run([f"{b}/cuobjdump", "-sass", f"{out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/k.sass", "w").write(s)


def layouts(BN: int, BM: int, BKB: int) -> tuple:
    """Shared-memory layouts of a [BN, BKB] weight-word tile and a [BM, BKB*16] pre-decoded A tile (TMA and wgmma)."""
    return (gl.NVMMASharedLayout.get_default_for([BN, BKB], gl.int64),
            gl.NVMMASharedLayout.get_default_for([BM, BKB * 16], gl.float16))


def signature(BN: int, BM: int, BKB: int) -> dict:
    """The argument types of a kernel over (weight words, pre-decoded A) descriptors of these tiles, then sb_ptr,
    alpha_ptr, out_ptr (fp32), M, N, KB, CB, steps_per_split, for ``build``."""
    from triton.runtime.jit import mangle_type
    bl, al = layouts(BN, BM, BKB)
    bd = TensorDescriptor.from_tensor(torch.zeros(1024, 512, dtype=torch.int64), [BN, BKB], bl)
    ad = TensorDescriptor.from_tensor(torch.zeros(BM, 8192, dtype=torch.float16), [BM, BKB * 16], al)
    return {"b_desc": mangle_type(bd), "a_desc": mangle_type(ad), "sb_ptr": "*u8", "alpha_ptr": "*fp32",
            "out_ptr": "*fp32", "M": "i32", "N": "i32", "KB": "i32", "CB": "i32", "steps_per_split": "i32"}


def compile_only(BN=64, BM=16, BKB=16, STAGES=3, WAIT=1):
    build(probe_kernel, signature(BN, BM, BKB),
          {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "WAIT": WAIT, "RAW": raw_layout(BKB)}, 4,
          ("sb_ptr", "out_ptr", "KB", "CB", "N"))


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
        ad = decode_a(a64, sa, m, kb, cb, True, CVT=True)
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
