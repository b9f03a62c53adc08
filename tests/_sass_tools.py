"""Compile-only tools for tests/test_gluon_sass.py (no GPU): build a Gluon kernel for sm_90a with Triton's own
ptxas and read its SASS, the way a launch would specialize it; and the static SASS checks (a write to a register that
an HGMMA group in flight reads as its A operand, spills in a hot loop).

The race check walks each hot loop (a backward conditional branch whose body issues HGMMA) as a cycle: no instruction
may write a register that an HGMMA group in flight reads as its A operand before the ``WARPGROUP.DEPBAR.LE gsb0, n``
that retires the group, and a write at the top of the next pass counts. A rolled K loop that decodes every step into
the registers the previous step's wgmma still reads has that race; ``probe_kernel`` is such a loop, the checker's
positive control.
"""
from __future__ import annotations

import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

from fp4dispatch.kernels.gemm.gluon_tiles import (load_scales, mma_step, operand_layout, scale_ptrs, store_layout,
                                                 word_tile_layout)

# instructions whose first register operand is not a destination
_NO_DEST = ("HGMMA", "ST", "RED", "ATOM", "BRA", "SYNCS", "BAR", "WARPGROUP", "ISETP", "FSETP", "HSETP", "DSETP")


def _parse(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+([^;]*);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _written(ins: str) -> set[int]:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    op, _, rest = ins.partition(" ")
    m = re.match(r"R(\d+)", rest.strip())
    if op.startswith(_NO_DEST) or not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or "WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def hot_loops(code: list[tuple[int, str]], mark: str = "HGMMA") -> list[tuple[int, int]]:
    """(first, last) indices of loops that issue ``mark`` (HGMMA: wgmma loops): a predicated backward branch over a
    body with no EXIT or unconditional branch (mbarrier retry stubs jump back from the end of the code
    unconditionally)."""
    at = {a: i for i, (a, _) in enumerate(code)}
    loops = []
    for i, (a, ins) in enumerate(code):
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if not (m and ins.startswith("@") and int(m.group(1), 16) < a):
            continue
        first = at[int(m.group(1), 16)]
        body = [x for _, x in code[first:i]]
        if any(mark in x for x in body) and not any(x.startswith(("EXIT", "BRA")) for x in body):
            loops.append((first, i))
    return loops


def loop_spills(sass: str) -> list[str]:
    """Every local-memory access (a register spill: STL/LDL) in the innermost hot loops (the K loops; an outer loop
    over tiles also holds the epilogue), as 'address instruction' lines."""
    code = _parse(sass)
    loops = hot_loops(code)
    inner = [(f, l) for f, l in loops if not any((f, l) != (g, h) and f <= g and h <= l for g, h in loops)]
    return [f"{a:#06x} {ins}" for first, last in inner for a, ins in code[first:last + 1]
            if re.search(r"\b(STL|LDL)", ins)]


def races(sass: str) -> list[str]:
    """Every write to an in-flight HGMMA A operand in the hot loops, as 'address instruction' lines."""
    code = _parse(sass)
    found = []
    for first, last in hot_loops(code):
        body = code[first:last + 1]
        n = len(body)
        groups, cur = [], []  # per group: (index, A registers) of its HGMMAs; gsb0 closes a group
        for j, (_, ins) in enumerate(body):
            m = re.search(r"HGMMA\S* R\d+, R(\d+),", ins)
            if m:
                cur.append((j, set(range(int(m.group(1)), int(m.group(1)) + 4))))
            if "HGMMA" in ins and "gsb0" in ins:
                groups.append(cur)
                cur = []
        for g in filter(None, groups):
            newer, last = 0, g[-1][0]
            for j in range(g[0][0] + 1, last + 1 + n):  # from the group's first HGMMA, at most once around the loop
                ins = body[j % n][1]
                if j > last and "HGMMA" in ins and "gsb0" in ins:
                    newer += 1
                m = re.search(r"DEPBAR.LE gsb0, 0x(\d+)", ins)
                if j > last and m and newer >= int(m.group(1)):
                    break  # the group is retired
                hit = _written(ins) & set().union(*(regs for k, regs in g if k < j))
                if hit:
                    found.append(f"{body[j % n][0]:#06x} {ins}  (writes R{min(hit)}, read by a wgmma in flight)")
    return found


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
    """``_sass_compile.compile_sm90`` of the Gluon kernel ``kernel``."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from _sass_compile import compile_sm90

    return compile_sm90(lambda sig_, consts_, attrs: GluonASTSource(kernel, sig_, consts_, attrs=attrs), sig, consts,
                        warps, div16, out, kernel.arg_names, **opts)


def bank_conflicts(reg_layout, shared_layout, shape: list, bits: int) -> int:
    """Gluon's count of the excess shared-memory accesses per wavefront (``gl.bank_conflicts``) of a load of ``shape``
    elements of ``bits`` bits laid out as ``shared_layout`` into ``reg_layout``; no kernel is built."""
    from triton._C.libtriton import gluon_ir, ir

    ctx = ir.context()
    ir.load_dialects(ctx)
    b = gluon_ir.GluonOpBuilder(ctx)
    return b.get_shared_bank_conflicts(reg_layout._to_ir(b), shared_layout._to_ir(b), list(shape), bits)


def desc_types(BN: int, BM: int, BKB: int, dt: torch.dtype = torch.float16) -> tuple[str, str]:
    """The argument types of the (words, 16-bit operand of dtype ``dt``) TMA descriptors of these tiles, for
    ``build``."""
    bd = TensorDescriptor.from_tensor(torch.zeros(1024, 512, dtype=torch.int64), [BN, BKB], word_tile_layout(BN, BKB))
    ad = TensorDescriptor.from_tensor(torch.zeros(BM, 8192, dtype=dt), [BM, BKB * 16], operand_layout(BM, BKB, dt))
    return mangle_type(bd), mangle_type(ad)


def probe_signature(BN: int, BM: int, BKB: int) -> dict:
    """The probe's argument types: the two descriptors, then sb_ptr, alpha_ptr, out_ptr (fp32), M, N, KB, CB,
    steps_per_split, for ``build``."""
    bd, ad = desc_types(BN, BM, BKB)
    return {"b_desc": bd, "a_desc": ad, "sb_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32",
            "N": "i32", "KB": "i32", "CB": "i32", "steps_per_split": "i32"}


def build_wgws(BN: int, BM: int, BKB: int, STAGES: int, SWAP: bool = False, w4a16: torch.dtype | None = None) -> dict:
    """``build`` of ``wgmma_warp_specialized.wgws_kernel``, specialized as a launch with 16-divisible sizes and
    pointers would be; ``w4a16``: the activations' dtype of its W4A16 form."""
    from fp4dispatch.kernels.gemm.wgmma_warp_specialized import wgws_kernel

    bd, ad = desc_types(BN, BM, BKB, w4a16 or torch.float16)
    sig = {"x_desc": bd, "y_desc": ad, "sx_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
           "N": "i32", "KB": "i32", "CB": "i32", "NT": "i32", "TILES": "i32", "STEPS": "i32"}
    consts = {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "SWAP": SWAP, "W4A16": w4a16 is not None}
    return build(wgws_kernel, sig, consts, BN // 16, ("sx_ptr", "out_ptr", "M", "N", "KB", "CB"))


def build_wgds(BN: int, BM: int, BKB: int, STAGES: int, ASTAGES: int, DSTAGES: int, DREGS: int, PARTS: int,
               out_type: str = "bf16", w4a16: torch.dtype | None = None) -> dict:
    """``build`` of ``wgmma_decode_warps.wgds_kernel``; ``out_type`` the output's (fp32 needs the most shared
    memory: the epilogue's layout conversion); ``w4a16``: the activations' dtype of its W4A16 form."""
    from fp4dispatch.kernels.gemm.gluon_tiles import operand_layout
    from fp4dispatch.kernels.gemm.wgmma_decode_warps import wgds_kernel
    from fp4dispatch.kernels.gemv.tma_warp_specialized import _layouts

    dt = w4a16 or torch.float16
    ad = mangle_type(TensorDescriptor.from_tensor(torch.zeros(BM, 8192, dtype=dt), [BM, BKB * 16],
                                                  operand_layout(BM, BKB, dt)))
    wl, wsl, _, _ = _layouts()
    xd = TensorDescriptor.from_tensor(torch.zeros(32, 32, 512, dtype=torch.int64), [4, BN // 4, BKB], wl)
    sd = TensorDescriptor.from_tensor(torch.zeros(8, 128, 128, dtype=torch.int32), [1, BKB // 4, BN], wsl)
    sig = {"x_desc": mangle_type(xd), "s_desc": mangle_type(sd), "y_desc": ad, "alpha_ptr": "*fp32",
           "out_ptr": f"*{out_type}", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "NT": "i32",
           "UNITS": "i32", "SPLIT": "i32", "SPS": "i32", "STEPS": "i32"}
    consts = {"BN": BN, "BM": BM, "BKB": BKB, "STAGES": STAGES, "ASTAGES": ASTAGES, "DSTAGES": DSTAGES, "DREGS": DREGS,
              "PARTS": PARTS, "W4A16": w4a16 is not None, "UNDO": 128.0 if w4a16 else 0.25}
    return build(wgds_kernel, sig, consts, 4, ("out_ptr", "ws_ptr", "cnt_ptr", "M", "N"))


def build_gvws(R: int, BW: int, MB: int, STAGES: int, WARPS: int, CTAS: int = 1, DP: bool = False,
               grouped: bool = False) -> dict:
    """``build`` of ``tma_warp_specialized.gvws_kernel`` with the register cap its launcher uses for CTAS CTAs per
    SM, specialized as a launch is at M = MB: M = 1 becomes a constant; ``grouped``: of
    ``tma_warp_specialized_grouped.grouped_gvws_kernel`` instead (8 experts of 1024 rows, 64 routed rows)."""
    from fp4dispatch.kernels.gemv import tma_warp_specialized as gv

    e, n, k = (8, 1024, 2048) if grouped else (1, 8192, 8192)
    a = torch.zeros(64 if grouped else MB, k // 2, dtype=torch.uint8)
    b = torch.zeros(e * n, k // 2, dtype=torch.uint8)
    sa = torch.zeros(1024 if grouped else 128, k // 16, dtype=torch.uint8)
    sb = torch.zeros(e * n, k // 16, dtype=torch.uint8)
    d = gv.descriptors(a, b, sa, sb, R, BW, MB)
    sig = {"w_desc": mangle_type(d[0]), "ws_desc": mangle_type(d[1]), "a_desc": mangle_type(d[2]),
           "as_desc": mangle_type(d[3]), "alpha_ptr": "*fp32", "out_ptr": "*bf16"}
    consts = {"R": R, "BW": BW, "MB": MB, "STAGES": STAGES, "DP": DP}
    if grouped:
        from fp4dispatch.kernels.gemv.tma_warp_specialized_grouped import grouped_gvws_kernel

        sig.update({"offs_ptr": "*i32", "T": "i32", "N": "i32", "E": "i32", "STEPS": "i32", "ALPHA_STRIDE": "i32"})
        return build(grouped_gvws_kernel, sig, consts, WARPS, ("out_ptr", "offs_ptr", "N"), **gv.reg_cap(WARPS, CTAS))
    sig.update({"M": "i32", "N": "i32", "TILES": "i32", "STEPS": "i32"})
    if MB == 1:  # Triton specializes an int argument equal to 1
        del sig["M"]
        consts["M"] = 1
    return build(gv.gvws_kernel, sig, consts, WARPS, ("out_ptr", "N"), **gv.reg_cap(WARPS, CTAS))


def build_tma_mma(cfg, dt: torch.dtype) -> dict:
    """``build`` of ``tma_mma_w4a16.tma_mma_w4a16_kernel`` for the ``TmaMmaW4A16Config`` ``cfg`` with activations of
    dtype ``dt``, specialized as a launch is (M = 1 becomes a constant), with its launcher's register cap."""
    from fp4dispatch.kernels.gemv import tma_mma_w4a16 as tm
    from fp4dispatch.kernels.gemv.tma_warp_specialized import reg_cap

    n, k = 8192, 8192
    d = tm.descriptors(torch.zeros(cfg.rows, k, dtype=dt), torch.zeros(n, k // 2, dtype=torch.uint8),
                       torch.zeros(n, k // 16, dtype=torch.uint8), cfg.rows_per_quarter, cfg.k_blocks, cfg.rows)
    sig = {"w_desc": mangle_type(d[0]), "ws_desc": mangle_type(d[1]), "a_desc": mangle_type(d[2]),
           "alpha_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "TILES": "i32", "STEPS": "i32"}
    consts = {"R": cfg.rows_per_quarter, "BW": cfg.k_blocks, "MB": cfg.rows, "STAGES": cfg.stages,
              "KW": cfg.k_warps, "BF16": dt == torch.bfloat16, "SWZ": tm.swizzled_tokens(cfg.rows, cfg.k_blocks, k)}
    if cfg.rows == 1:  # Triton specializes an int argument equal to 1
        del sig["M"]
        consts["M"] = 1
    return build(tm.tma_mma_w4a16_kernel, sig, consts, cfg.warps, ("out_ptr", "N"),
                 **reg_cap(cfg.warps, cfg.ctas_per_sm))
