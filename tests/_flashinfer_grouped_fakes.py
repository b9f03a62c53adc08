"""Contract emulator of FlashInfer's NVFP4 grouped GEMM ``flashinfer.gemm.group_gemm_nvfp4_nt_groupwise`` (0.7.4).

It checks a call as FlashInfer does (``_check_group_gemm_nvfp4_nt_groupwise_problem_size``: dtypes, tiles, out dtype,
alpha [E] or empty, N % 8, K % 128), as its SM120 kernel reads the arguments (``group_gemm_nvfp4_groupwise_sm120.cuh``:
packed strides, weight scales [E, round_up(N, 128), K/16], group i's activation scale block at row
``(m_indptr[i] + 127 i) // 128 * 128``) and as tests/gemm/test_group_gemm_fp4.py builds them (``m_indptr`` values
multiples of 4, per-group 128x4-swizzled scales), then computes each group from the arguments it was given with the
independent NVFP4 math of _native_fakes.py. Rows of ``out`` outside every group are left as they were, as the kernel
leaves them.
"""
from __future__ import annotations

import types

import torch

from _native_fakes import _need, dequant, rup, unswizzle_flat

CCS = (120, 121)


def fake_group_gemm(calls: list):
    def group_gemm_nvfp4_nt_groupwise(a, b, a_scale, b_scale, m_indptr, alpha=None, tile_m=128, tile_n=128,
                                      tile_k=128, swap_ab=True, out=None, out_dtype=None):
        calls.append({"tile_n": tile_n, "tile_k": tile_k, "swap_ab": swap_ab})
        for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
            _need(t.dtype == torch.uint8, f"{name} must be a uint8 tensor, but got {t.dtype}")
            _need(t.is_contiguous(), f"{name} must be contiguous (the kernel builds packed strides)")
        _need(m_indptr.dtype == torch.int32 and m_indptr.dim() == 1, "m_indptr must be a 1-D int32 tensor")
        _need(tile_m == 128 and tile_n in (32, 64, 128) and tile_k in (128, 256) and swap_ab in (True, False),
              f"tiles must be tile_m 128, tile_n 32/64/128, tile_k 128/256; got {tile_m}, {tile_n}, {tile_k}")
        out_dtype = out_dtype or (out.dtype if out is not None else torch.bfloat16)
        _need(out_dtype in (torch.bfloat16, torch.float16), f"out_dtype must be bf16 or fp16, got {out_dtype}")
        groups = m_indptr.shape[0] - 1
        _need(b.dim() == 3 and b.shape[0] == groups, f"b.shape[0] must equal num_groups {groups}")
        n, k = b.shape[1], b.shape[2] * 2
        _need(a.dim() == 2 and a.shape[1] * 2 == k, f"a.shape[1] * 2 must equal k={k}")
        _need(n % 8 == 0 and k % 128 == 0, f"n must be a multiple of 8 and k of 128, got n={n}, k={k}")
        if alpha is not None:
            _need(alpha.dtype == torch.float32, f"alpha must be a float32 tensor, but got {alpha.dtype}")
            _need(alpha.numel() == 0 or tuple(alpha.shape) == (groups,),
                  f"alpha must be a empty or have shape {(groups,)}, but got alpha.shape={tuple(alpha.shape)}")
        _need(tuple(b_scale.shape) == (groups, rup(n, 128), k // 16),
              f"b_scale must be [E, round_up(N, 128), K/16] = {(groups, rup(n, 128), k // 16)}; got "
              f"{tuple(b_scale.shape)}")
        ind = m_indptr.tolist()
        _need(ind[0] == 0 and all(x <= y for x, y in zip(ind, ind[1:])), "m_indptr must rise from 0")
        _need(all(x % 4 == 0 for x in ind), f"each m_indptr value must be a multiple of 4; got {ind}")
        _need(ind[-1] <= a.shape[0], f"m_indptr[-1]={ind[-1]} is past a's {a.shape[0]} rows")
        _need(a_scale.dim() == 2 and a_scale.shape[1] == k // 16, f"a_scale must be [rows, K/16={k // 16}]")
        if out is None:
            out = torch.zeros((a.shape[0], n), dtype=out_dtype)
        _need(tuple(out.shape) == (a.shape[0], n) and out.dtype == out_dtype, "out.shape must be (cum_m, n)")
        for i in range(groups):
            m0, m1 = ind[i], ind[i + 1]
            if m1 == m0:
                continue
            off = (m0 + 127 * i) // 128 * 128
            rows = rup(m1 - m0, 128)
            _need(off + rows <= a_scale.shape[0], f"group {i}'s scale block [{off}, {off + rows}) is past a_scale's "
                                                  f"{a_scale.shape[0]} rows")
            sa = unswizzle_flat(a_scale[off:off + rows].view(torch.float8_e4m3fn), m1 - m0, k // 16)
            sb = unswizzle_flat(b_scale[i].view(torch.float8_e4m3fn), n, k // 16)
            acc = dequant(a[m0:m1], sa) @ dequant(b[i], sb).T
            scale = alpha[i].float() if alpha is not None and alpha.numel() else 1.0
            out[m0:m1] = (acc * scale).to(out_dtype)
        return out

    group_gemm_nvfp4_nt_groupwise.is_compute_capability_supported = lambda cc: cc in CCS
    return group_gemm_nvfp4_nt_groupwise


def fake_flashinfer_with_group_gemm(calls: list, version: str = "0.7.4") -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    mod.gemm = types.ModuleType("flashinfer.gemm")
    mod.gemm.group_gemm_nvfp4_nt_groupwise = fake_group_gemm(calls)
    return mod


# ---------------------------------------------------------------------------------------------------------------
# grouped_mm.grouped_mm_fp4 (cuDNN's block-scaled MoE grouped GEMM)
# ---------------------------------------------------------------------------------------------------------------
CUDNN_CCS = (100, 103, 107, 110, 120, 121)  # @supported_compute_capability of _check_grouped_mm_fp4


def fake_grouped_mm_fp4(calls: list):
    """As ``_check_grouped_mm_fp4`` checks a call and tests/grouped_mm/test_grouped_mm_fp4.py builds one: ``a_descale``
    one 128x4-swizzled matrix over all of a's rows, weight scales swizzled per expert, every segment a multiple of
    128 rows (all the tests use; other segments are not known to be right), the last expert running to cum_m
    (``_cudnn_moe_first_token_offset``), alpha None or float32 (1,)."""
    def grouped_mm_fp4(a, b, a_descale, b_descale, m_indptr, alpha=None, out=None, out_dtype=torch.bfloat16,
                       block_size=16, *, backend="cudnn", tactic=-1):
        calls.append({"alpha": None if alpha is None else tuple(alpha.shape), "out_dtype": out_dtype})
        _need(backend == "cudnn" and block_size == 16, "backend must be cudnn and block_size 16 (NVFP4)")
        _need(a.dtype == torch.uint8 and b.dtype == torch.uint8 and a.dim() == 2 and b.dim() == 3,
              "a must be 2D (cum_m, k) and b 3D (num_experts, n, k), uint8")
        _need(out_dtype in (torch.float16, torch.bfloat16, torch.float32), f"out_dtype: got {out_dtype}")
        _need(a_descale.dtype == torch.float8_e4m3fn and b_descale.dtype == torch.float8_e4m3fn,
              f"a_descale and b_descale must be float8_e4m3fn, got {a_descale.dtype} and {b_descale.dtype}")
        e, n, k = b.shape[0], b.shape[1], b.shape[2] * 2
        _need(m_indptr.dtype == torch.int32 and tuple(m_indptr.shape) == (e + 1,), "m_indptr: int32 [E+1]")
        _need(a.shape[1] == b.shape[2], f"K mismatch: a has {a.shape[1]}, b has {b.shape[2]}")
        _need(alpha is None or (alpha.dtype == torch.float32 and tuple(alpha.shape) == (1,)),
              f"alpha must be a scalar, got {None if alpha is None else tuple(alpha.shape)}")
        cum_m = a.shape[0]
        _need(tuple(a_descale.shape) == (rup(cum_m, 128), k // 16), f"a_descale must be [{rup(cum_m, 128)}, {k // 16}]")
        _need(tuple(b_descale.shape) == (e, rup(n, 128), k // 16), f"b_descale must be [E, {rup(n, 128)}, {k // 16}]")
        ind = m_indptr.tolist()
        _need(ind[0] == 0 and all(x <= y for x, y in zip(ind, ind[1:])) and ind[-1] <= cum_m, "m_indptr must rise")
        _need(all(x % 128 == 0 for x in ind), f"segments must be multiples of 128 rows (the tests'); got {ind}")
        sa = unswizzle_flat(a_descale, cum_m, k // 16)
        out = torch.zeros((cum_m, n), dtype=out_dtype) if out is None else out
        for i in range(e):
            m0, m1 = ind[i], (ind[i + 1] if i < e - 1 else cum_m)
            if m1 > m0:
                acc = dequant(a[m0:m1], sa[m0:m1]) @ dequant(b[i], unswizzle_flat(b_descale[i], n, k // 16)).T
                out[m0:m1] = (acc * (alpha.float() if alpha is not None else 1.0)).to(out_dtype)
        return out

    grouped_mm_fp4.is_compute_capability_supported = lambda cc: cc in CUDNN_CCS
    return grouped_mm_fp4


def fake_flashinfer_with_grouped_mm(calls: list, cudnn_error: str | None = None) -> dict[str, types.ModuleType]:
    """The modules to install as ``flashinfer``, ``flashinfer.grouped_mm`` and ``flashinfer.grouped_mm.core``;
    ``cudnn_error``: what FlashInfer's cuDNN version check raises (None: it passes)."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.7.4"
    gm = types.ModuleType("flashinfer.grouped_mm")
    gm.grouped_mm_fp4 = fake_grouped_mm_fp4(calls)
    core = types.ModuleType("flashinfer.grouped_mm.core")
    core._cudnn_moe_block_scale_min_version = lambda arch: 92200 if arch in (120, 121) else 92100

    def check(min_ver, feature):
        if cudnn_error:
            raise RuntimeError(cudnn_error)
    core._check_cudnn_version = check
    mod.grouped_mm = gm
    return {"flashinfer": mod, "flashinfer.grouped_mm": gm, "flashinfer.grouped_mm.core": core}
