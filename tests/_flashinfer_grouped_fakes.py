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
