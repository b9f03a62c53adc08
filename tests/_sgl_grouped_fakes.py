"""Contract emulator of sgl-kernel's CUTLASS NVFP4 grouped GEMM ``cutlass_fp4_group_mm``.

It checks a call as SGLang's test of the kernel builds it (``test_nvfp4_blockwise_moe_grouped_mm``: uint8 codes,
float8_e4m3fn scales, activation scale blocks at ``blockscale_offsets``, weight scales [E, round_up(N, 128),
round_up(K/16, 4)], alphas float32 [E], ``params`` ab_strides = K, c_strides = N, problem_sizes (rows, N, K),
expert_offsets) and as the CUTLASS kernel reads them (contiguous operands, K and N multiples of 32), then computes
each expert from the arguments it was given with the independent NVFP4 math of _native_fakes.py.
``with_device``: sgl-kernel 0.3.21's form (``device`` before ``params``); without it, SGLang's JIT kernel's form.
"""
from __future__ import annotations

import types

import torch

from _native_fakes import _need, dequant, rup, unswizzle_flat

_KEYS = ("ab_strides", "c_strides", "problem_sizes", "expert_offsets", "blockscale_offsets")


def _group_mm(calls, a_fp4, b_fp4, a_blockscale, b_blockscale, alphas, out_dtype, params):
    calls.append(out_dtype)
    _need(a_fp4.dtype == torch.uint8 and b_fp4.dtype == torch.uint8, "a and b must be uint8 (packed FP4)")
    _need(a_fp4.dim() == 2 and b_fp4.dim() == 3 and a_fp4.is_contiguous() and b_fp4.is_contiguous(),
          "a must be contiguous [M, K/2] and b contiguous [E, N, K/2]")
    e, n, k = b_fp4.shape[0], b_fp4.shape[1], b_fp4.shape[2] * 2
    _need(a_fp4.shape[1] * 2 == k and k % 32 == 0 and n % 32 == 0, "K and N must be multiples of 32, a and b agree")
    kb = rup(k // 16, 4)
    _need(a_blockscale.dtype == torch.float8_e4m3fn and a_blockscale.dim() == 2 and a_blockscale.shape[1] == kb,
          f"a_blockscale must be float8_e4m3fn [rows, {kb}]")
    _need(b_blockscale.dtype == torch.float8_e4m3fn and tuple(b_blockscale.shape) == (e, rup(n, 128), kb),
          f"b_blockscale must be float8_e4m3fn {(e, rup(n, 128), kb)}; got {tuple(b_blockscale.shape)}")
    _need(alphas.dtype == torch.float32 and tuple(alphas.shape) == (e,), f"alphas must be float32 [{e}]")
    _need(out_dtype in (torch.bfloat16, torch.float16), f"out_dtype must be bf16 or fp16, got {out_dtype}")
    _need(all(key in params for key in _KEYS), f"params must hold {_KEYS}")
    p = {key: params[key] for key in _KEYS}
    _need(p["ab_strides"].dtype == torch.int64 and p["ab_strides"].tolist() == [k] * e, f"ab_strides: int64 [{k}]*E")
    _need(p["c_strides"].dtype == torch.int64 and p["c_strides"].tolist() == [n] * e, f"c_strides: int64 [{n}]*E")
    sizes = p["problem_sizes"]
    _need(sizes.dtype == torch.int32 and tuple(sizes.shape) == (e, 3), "problem_sizes must be int32 [E, 3]")
    _need(all(row[1:] == [n, k] for row in sizes.tolist()), "problem_sizes rows must be (rows_e, N, K)")
    for key in ("expert_offsets", "blockscale_offsets"):
        _need(p[key].dtype == torch.int32 and tuple(p[key].shape) == (e,), f"{key} must be int32 [E]")
    out = torch.zeros((a_fp4.shape[0], n), dtype=out_dtype)
    for i in range(e):
        m, start, sf = int(sizes[i, 0]), int(p["expert_offsets"][i]), int(p["blockscale_offsets"][i])
        if m == 0:
            continue
        _need(start + m <= a_fp4.shape[0] and sf + rup(m, 128) <= a_blockscale.shape[0],
              f"expert {i}'s rows or scale block run past a / a_blockscale")
        sa = unswizzle_flat(a_blockscale[sf:sf + rup(m, 128)], m, k // 16)
        sb = unswizzle_flat(b_blockscale[i], n, k // 16)
        out[start:start + m] = ((dequant(a_fp4[start:start + m], sa) @ dequant(b_fp4[i], sb).T)
                                * alphas[i].float()).to(out_dtype)
    return out


def fake_sgl_kernel_grouped(with_device: bool = True) -> types.ModuleType:
    mod = types.ModuleType("sgl_kernel")
    mod.calls = []
    if with_device:
        def cutlass_fp4_group_mm(a_fp4, b_fp4, a_blockscale, b_blockscale, alphas, out_dtype, device, params):
            _need(isinstance(device, torch.device), "device must be a torch.device")
            return _group_mm(mod.calls, a_fp4, b_fp4, a_blockscale, b_blockscale, alphas, out_dtype, params)
    else:
        def cutlass_fp4_group_mm(a_fp4, b_fp4, a_blockscale, b_blockscale, alphas, out_dtype, params):
            return _group_mm(mod.calls, a_fp4, b_fp4, a_blockscale, b_blockscale, alphas, out_dtype, params)
    mod.cutlass_fp4_group_mm = cutlass_fp4_group_mm
    return mod
