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

# pointer types by parameter name (others: uint8 bytes); every int is i32
_PTR_TYPES = {"alpha_ptr": "*fp32", "gs_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
              "offs_ptr": "*i32"}
# what a launch cannot specialize as 16-divisible: the rows, the split-K part length, the stream-K schedule, the
# one-element scalars
_ODD = ("M", "T", "blocks_per_split", "NT", "TILES", "STEPS", "alpha_ptr", "gs_ptr")


def _build(kernel, consts: dict, warps: int, stages: int = 3, **ptr_types) -> list[str]:
    """The opcodes of ``kernel`` compiled for sm_90a with ``consts``, its other parameters typed by name
    (``ptr_types`` overrides, e.g. ``a_ptr="*bf16"``) and specialized as a launch on a layer whose sizes and
    pointers are 16-divisible would be, all but ``_ODD``."""
    sig = {n: {**_PTR_TYPES, **ptr_types}.get(n, "*u8") if n.endswith("_ptr") else "i32"
           for n in kernel.arg_names if n not in consts}
    built = compile_sm90(lambda s, c, a: ASTSource(kernel, s, c, attrs=a), sig, consts, warps,
                         tuple(n for n in sig if n not in _ODD), arg_names=kernel.arg_names, num_stages=stages)
    return opcodes(built["sass"])


def _w4a16(sk: bool, dtype: str, tile: tuple) -> list[str]:
    from fp4dispatch.kernels.gemm import wgmma_register_a_w4a16 as W

    bm, bn, bkb, warps, stages = tile
    consts = dict(BM=bm, BN=bn, BKB=bkb, ASM=True, BF16=dtype == "bf16", PDL=False, **({} if sk else {"SPLIT": True}))
    return _build(W.wmma_w4a16_sk_kernel if sk else W.wmma_w4a16_kernel, consts, warps, stages, a_ptr=f"*{dtype}",
                  b_ptr="*i64")


def _kernels():
    from fp4dispatch.kernels.gemm.mma_w4a16 import mma_w4a16_kernel
    from fp4dispatch.kernels.gemm.mma_w4a16_grouped import grouped_w4a16_kernel
    from fp4dispatch.kernels.gemm.wgmma_register_a import wmma_kernel
    from fp4dispatch.kernels.gemv.cuda_core import gemv2_kernel
    from fp4dispatch.kernels.gemv.cuda_core_bytes import gemv_kernel
    from fp4dispatch.kernels.gemv.cuda_core_w4a16 import gemv_w4a16_kernel

    return {
        "nvfp4-16x64": lambda: _build(wmma_kernel, dict(BM=16, BN=64, BKB=16, SPLIT=True, ASM=True, APRE=True,
                                                        PDL=False, CVT=False), 4, a_ptr="*fp16", b_ptr="*i64"),
        "w4a16-bf16-16x64": lambda: _w4a16(False, "bf16", (16, 64, 16, 4, 3)),
        "w4a16-fp16-16x64": lambda: _w4a16(False, "fp16", (16, 64, 16, 4, 3)),
        "w4a16-bf16-128x128": lambda: _w4a16(False, "bf16", (128, 128, 8, 8, 3)),
        "w4a16-stream-k-bf16-128x128": lambda: _w4a16(True, "bf16", (128, 128, 8, 8, 3)),
        "w4a16-grouped-bf16-16x64": lambda: _build(grouped_w4a16_kernel, dict(
            ALPHA_E=True, EP=256, BM=16, BN=64, BKB=16, DOT_F32=False, REG_A=True, BF16=True), 4, a_ptr="*bf16"),
        "w4a16-mma-16x64": lambda: _build(mma_w4a16_kernel, dict(BM=16, BN=64, BKB=8, GROUP_M=8, SPLIT=True,
                                                                 DOT_F32=False), 4, a_ptr="*bf16"),
        "w4a16-gemv": lambda: _build(gemv_w4a16_kernel, dict(MB=1, BN=32, BKB=16, SPLIT=True), 4, a_ptr="*bf16"),
        "nvfp4-gemv-bytes": lambda: _build(gemv_kernel, dict(MB=4, BN=16, BKB=32, SPLIT=True), 8),
        "nvfp4-gemv-words": lambda: _build(gemv2_kernel, dict(MB=1, BN=4, BKB=128, PAIR=False, SPLIT=True, H2=True,
                                                              ASM=True, EVEN_K=False, PREFETCH=True, CVT=False,
                                                              PDL=False), 2, a_ptr="*i64", b_ptr="*i64"),
    }


CASES = ("nvfp4-16x64", "w4a16-bf16-16x64", "w4a16-fp16-16x64", "w4a16-bf16-128x128", "w4a16-stream-k-bf16-128x128",
         "w4a16-grouped-bf16-16x64", "w4a16-mma-16x64", "w4a16-gemv", "nvfp4-gemv-bytes", "nvfp4-gemv-words")


@pytest.mark.parametrize("case", CASES)
def test_kernels_load_the_weight_16_bytes_at_a_time_and_pipeline_the_scales(case):
    ops = _kernels()[case]()
    # tensor cores (wgmma, or mma.sync for mma_w4a16) where expected, not in the GEMVs
    gemv = "gemv" in case
    assert any(op.startswith(("HGMMA", "HMMA")) for op in ops) is not gemv, sorted(set(ops))
    assert "LDGSTS.E.64" not in ops, "8-byte weight copies: a size's divisibility did not reach the compiler"
    assert any(op.startswith(("LDGSTS.E.BYPASS.128", "LDG.E.128")) for op in ops), sorted(set(ops))
    if gemv:  # plain loads into registers; scale bytes are loaded one by one there by design
        assert "LDG.E.64" not in ops, "8-byte weight loads in the GEMV"
    else:
        assert "LDG.E.U8" not in ops and "LDG.E.S8" not in ops, "scale bytes loaded outside the pipeline"
