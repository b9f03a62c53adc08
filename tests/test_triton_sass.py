"""Compile-only checks of the plain-Triton tensor-core and GEMV kernels' sm_90a SASS (no GPU; the ptxas inside Triton's
wheel; tests/_sass_compile.py): the weight moves 16 bytes at a time and the scale bytes go through the pipeline.

Where a size that feeds the loads' addresses or bound masks has a divisibility the compiler cannot see, the weight
copies become 8-byte (``LDGSTS.E.64``, ``LDG.E.64``) and the scale bytes plain loads waited for in the K loop
(``LDG.E.U8``). A W4A16 tile that derived K/16 from K in the kernel took 1.75x the time of the NVFP4 tile that was
otherwise the same (docs/kernels.md); any split-K part length that is not a multiple of 16 did the same to every
split-K kernel until ``tiles.k_part``. Each kernel is specialized as a launch would specialize it on 16-divisible
sizes and pointers, with ``blocks_per_split`` not divisible (a split-K part of, e.g., 24 blocks)."""
from __future__ import annotations

import pytest
from triton.compiler import ASTSource

from _sass_compile import compile_sm90, nvidia_tools_missing, opcodes

pytestmark = pytest.mark.skipif(nvidia_tools_missing() is not None, reason=str(nvidia_tools_missing()))

_PTRS = ("b_ptr", "sb_ptr", "out_ptr", "ws_ptr", "cnt_ptr")
_BYTES_SIG = {"a_ptr": "*bf16", "b_ptr": "*u8", "sb_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*bf16",
              "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K2": "i32", "KB": "i32", "CB": "i32",
              "blocks_per_split": "i32"}


def _dense(sk: bool, dtype: str, tile: tuple):
    from fp4dispatch.kernels.gemm import wgmma_register_a_w4a16 as W

    bm, bn, bkb, warps, stages = tile
    sig = {"a_ptr": f"*{dtype}", "b_ptr": "*i64", "sb_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "KB": "i32", "LDA": "i32", "CB": "i32"}
    sig.update({"NT": "i32", "TILES": "i32", "STEPS": "i32"} if sk else {"blocks_per_split": "i32"})
    consts = dict(BM=bm, BN=bn, BKB=bkb, ASM=True, BF16=dtype == "bf16", PDL=False, **({} if sk else {"SPLIT": True}))
    kernel = W.wmma_w4a16_sk_kernel if sk else W.wmma_w4a16_kernel
    return kernel, sig, consts, warps, stages, ("a_ptr", *_PTRS, "N", "KB", "LDA", "CB")


def _grouped(dtype: str, tile: tuple):
    from fp4dispatch.kernels.gemm.mma_w4a16_grouped import grouped_w4a16_kernel

    bm, bn, bkb, warps, stages = tile
    sig = {"a_ptr": f"*{dtype}", "b_ptr": "*u8", "sb_ptr": "*u8", "alpha_ptr": "*fp32", "out_ptr": "*bf16",
           "offs_ptr": "*i32", "T": "i32", "N": "i32", "K2": "i32", "KB": "i32", "CB": "i32", "RN": "i32", "E": "i32",
           "LDA": "i32"}
    consts = dict(ALPHA_E=True, EP=256, BM=bm, BN=bn, BKB=bkb, DOT_F32=False, REG_A=True, BF16=dtype == "bf16")
    return (grouped_w4a16_kernel, sig, consts, warps, stages,
            ("a_ptr", "b_ptr", "sb_ptr", "out_ptr", "offs_ptr", "N", "K2", "KB", "CB", "RN", "E", "LDA"))


def _nvfp4(tile: tuple):
    from fp4dispatch.kernels.gemm.wgmma_register_a import wmma_kernel

    bm, bn, bkb, warps, stages = tile
    sig = {"a_ptr": "*fp16", "b_ptr": "*i64", "sa_ptr": "*u8", "sb_ptr": "*u8", "alpha_ptr": "*fp32",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "KB": "i32", "CB": "i32",
           "blocks_per_split": "i32"}
    consts = dict(BM=bm, BN=bn, BKB=bkb, SPLIT=True, ASM=True, APRE=True, PDL=False, CVT=False)
    return wmma_kernel, sig, consts, warps, stages, ("a_ptr", "sa_ptr", *_PTRS, "N", "KB", "CB")


def _bytes(kernel_name: str, consts: dict, warps: int, stages: int):
    """The kernels over weight bytes: ``mma_w4a16``, the W4A16 GEMV and the NVFP4 byte-wise GEMV."""
    from fp4dispatch.kernels.gemm import mma_w4a16
    from fp4dispatch.kernels.gemv import cuda_core_bytes, cuda_core_w4a16

    sig, div16 = dict(_BYTES_SIG), ("a_ptr", *_PTRS, "N", "K2", "KB", "CB")
    if kernel_name == "gemv_bytes":  # NVFP4 activations: bytes and their scales
        sig = {"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*u8", **{k: v for k, v in sig.items() if k != "a_ptr"}}
        div16 += ("sa_ptr",)
    kernel = {"mma": mma_w4a16.mma_w4a16_kernel, "gemv": cuda_core_w4a16.gemv_w4a16_kernel,
              "gemv_bytes": cuda_core_bytes.gemv_kernel}[kernel_name]
    return kernel, sig, consts, warps, stages, div16


def _gemv_words(consts: dict, warps: int, stages: int):
    """The NVFP4 CUDA-core GEMV over int64 words (``gemv/cuda_core``)."""
    from fp4dispatch.kernels.gemv.cuda_core import gemv2_kernel

    sig = {"a_ptr": "*i64", "b_ptr": "*i64", "sa_ptr": "*u8", **{k: v for k, v in _BYTES_SIG.items()
                                                                  if k not in ("a_ptr", "b_ptr", "K2")}}
    return gemv2_kernel, sig, consts, warps, stages, ("a_ptr", "sa_ptr", *_PTRS, "N", "KB", "CB")


CASES = {
    "nvfp4-16x64": lambda: _nvfp4((16, 64, 16, 4, 3)),
    "w4a16-bf16-16x64": lambda: _dense(False, "bf16", (16, 64, 16, 4, 3)),
    "w4a16-fp16-16x64": lambda: _dense(False, "fp16", (16, 64, 16, 4, 3)),
    "w4a16-bf16-128x128": lambda: _dense(False, "bf16", (128, 128, 8, 8, 3)),
    "w4a16-stream-k-bf16-128x128": lambda: _dense(True, "bf16", (128, 128, 8, 8, 3)),
    "w4a16-grouped-bf16-16x64": lambda: _grouped("bf16", (16, 64, 16, 4, 3)),
    "w4a16-mma-16x64": lambda: _bytes("mma", dict(BM=16, BN=64, BKB=8, GROUP_M=8, SPLIT=True, DOT_F32=False), 4, 3),
    "w4a16-gemv": lambda: _bytes("gemv", dict(MB=1, BN=32, BKB=16, SPLIT=True), 4, 3),
    "nvfp4-gemv-bytes": lambda: _bytes("gemv_bytes", dict(MB=4, BN=16, BKB=32, SPLIT=True), 8, 3),
    "nvfp4-gemv-words": lambda: _gemv_words(dict(MB=1, BN=4, BKB=128, PAIR=False, SPLIT=True, H2=True, ASM=True,
                                                 EVEN_K=False, PREFETCH=True, CVT=False, PDL=False), 2, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_load_the_weight_16_bytes_at_a_time_and_pipeline_the_scales(case):
    kernel, sig, consts, warps, stages, div16 = CASES[case]()
    built = compile_sm90(lambda s, c, a: ASTSource(kernel, s, c, attrs=a), sig, consts, warps, div16,
                         num_stages=stages)
    ops = opcodes(built["sass"])
    # tensor cores (wgmma, or mma.sync for mma_w4a16) where expected, not in the GEMVs
    gemv = "gemv" in case
    assert any(op.startswith(("HGMMA", "HMMA")) for op in ops) is not gemv, sorted(set(ops))
    assert "LDGSTS.E.64" not in ops, "8-byte weight copies: a size's divisibility did not reach the compiler"
    assert any(op.startswith(("LDGSTS.E.BYPASS.128", "LDG.E.128")) for op in ops), sorted(set(ops))
    if gemv:  # plain loads into registers; scale bytes are loaded one by one there by design
        assert "LDG.E.64" not in ops, "8-byte weight loads in the GEMV"
    else:
        assert "LDG.E.U8" not in ops and "LDG.E.S8" not in ops, "scale bytes loaded outside the pipeline"


@pytest.mark.parametrize("swizzled", [True, False])
def test_the_quantize_kernel_reads_each_block_in_16_byte_loads(swizzled):
    """``quant_kernel`` (bf16 activations): two 16-byte loads per thread, one 4-byte load (the global scale); reading
    each block as [8, 2] pairs instead gave eight 4-byte loads per thread and warp shuffles for every block's amax."""
    from fp4dispatch.kernels._quantize import quant_kernel

    sig = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "p_ptr": "*u8", "s_ptr": "*u8", "M": "i32", "K": "i32", "KB": "i32",
           "CB": "i32"}
    built = compile_sm90(lambda s, c, a: ASTSource(quant_kernel, s, c, attrs=a), sig,
                         dict(BM=16, BKB=8, SWIZZLED=swizzled), 4, ("x_ptr", "p_ptr", "s_ptr", "K", "KB", "CB"))
    ops = opcodes(built["sass"])
    assert ops.count("LDG.E.128") == 2 and ops.count("LDG.E") == 1, sorted(ops)
