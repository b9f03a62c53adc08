"""Contract emulators: fakes of FlashInfer ``mm_fp4``, sgl-kernel ``cutlass_scaled_fp4_mm`` and ``torch._scaled_mm`` /
``F.scaled_mm`` that check a call exactly as each library's own tests make it, then compute the result *from the
arguments they were given*.

The NVFP4 math here is written independently of fp4dispatch (own e2m1 table, own closed-form unswizzle, own
shuffle map), so an adapter and the code under test cannot share a mistake. Facts are from
../shared/notes/flashinfer.md and engines.md (FlashInfer 0.7.4 gemm_base.py, tests/gemm/test_mm_fp4.py, sgl-kernel
tests, PyTorch test_scaled_matmul_cuda.py).
"""
from __future__ import annotations

import copy
import json
import subprocess
import types

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# mm_fp4's @supported_compute_capability per backend (FlashInfer 0.7.4, notes/flashinfer.md section 2)
FLASHINFER_CCS = {
    "cudnn": {100, 103, 107, 110, 120, 121},
    "cutlass": {100, 103, 107, 110, 120, 121},
    "trtllm": {100, 103, 107},
    "cute-dsl": {100, 103, 107, 120, 121},
    "cutedsl_low_latency": {100, 103, 107},
    "b12x": {120, 121},
    "cake": {100, 103},
}
# FlashInfer's srcToDstBlk32RowMap (flashinfer/utils.py): trtllm's weight rows are permuted inside 32-row blocks
_BLK32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
          4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]


class ContractError(ValueError):
    """The adapter called the library in a way the library (or its kernel) does not accept."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractError(msg)


def rup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------------------------
# independent NVFP4 math
# ---------------------------------------------------------------------------------------------------------------
def unpack(packed_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] -> float32 [R, K], low nibble = even k."""
    p = packed_u8.long()
    return torch.stack((E2M1[p & 0xF], E2M1[p >> 4]), dim=-1).reshape(p.shape[0], -1)


def unswizzle_flat(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Closed form of the 128x4 layout: (r, c) at ((r//128)*ceil(C/4) + c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4."""
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    idx = ((r // 128) * (rup(cols, 4) // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat.reshape(-1)[idx.reshape(-1)].reshape(rows, cols)


def dequant(packed_u8: torch.Tensor, scales_e4m3_linear: torch.Tensor) -> torch.Tensor:
    rows, k = packed_u8.shape[0], packed_u8.shape[1] * 2
    v = unpack(packed_u8).reshape(rows, k // 16, 16)
    return (v * scales_e4m3_linear.float().unsqueeze(-1)).reshape(rows, k)


def shuffle_row_indices(x: torch.Tensor, epilogue_tile_m: int) -> torch.Tensor:
    """FlashInfer's get_shuffle_matrix_a_row_indices for epilogue_tile_m=128: new row r takes old row idx[r]."""
    _need(epilogue_tile_m == 128, f"fake supports epilogue_tile_m=128 only; got {epilogue_tile_m}")
    m = x.shape[0]
    _need(m % 32 == 0, f"input_tensor.shape[0]={m} must be a multiple of 32")
    old = torch.arange(m)
    new = (old // 32) * 32 + torch.tensor(_BLK32)[old % 32]
    idx = torch.empty(m, dtype=torch.long)
    idx[new] = old
    return idx


def as_e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer
# ---------------------------------------------------------------------------------------------------------------
class BackendSupportedError(Exception):
    pass


class FakeMmFp4:
    """``flashinfer.mm_fp4`` as its tests call it: ``mm_fp4(a, b.T, a_sf, b_sf.T, alpha, out_dtype, out, ...)``."""

    def __init__(self, cc: int, backends=tuple(FLASHINFER_CCS)):
        self.cc = cc
        self.backends = set(backends)
        self.calls: list[dict] = []

    def has_backend(self, backend: str) -> bool:
        return backend in self.backends

    def is_backend_supported(self, backend: str, cc: int | None = None) -> bool:
        if backend not in self.backends:
            return False
        return True if cc is None else cc in FLASHINFER_CCS[backend]

    def __call__(self, a, b, a_descale, b_descale, alpha=None, out_dtype=torch.bfloat16, out=None, block_size=16,
                 use_8x4_sf_layout=False, backend="auto", use_nvfp4=True, enable_pdl=True, *, skip_check=False,
                 batch_invariant=False):
        self.calls.append(dict(backend=backend, skip_check=skip_check))
        # -- FlashInfer's own checks (decorator + common check + requirement functions)
        _need(backend in self.backends, f"Backend '{backend}' is not supported for mm_fp4")
        if not self.is_backend_supported(backend, self.cc):
            raise BackendSupportedError(f"mm_fp4 does not support backend '{backend}' with capability {self.cc}")
        _need(a.ndim == 2 and b.ndim == 2, f"mm_fp4 accepts 2d tensors, got {a.shape} and {b.shape}")
        _need(a.shape[1] == b.shape[0],
              f"K dimension mismatch in mm_fp4. got a.shape[1] = {a.shape[1]}, b.shape[0] = {b.shape[0]}")
        _need(isinstance(alpha, torch.Tensor) and alpha.dtype == torch.float32, f"alpha must be a float tensor, got {alpha!r}")
        _need(out_dtype in (torch.bfloat16, torch.float16), f"Unsupported output dtype: {out_dtype}")
        _need(block_size == 16 and use_nvfp4 and not use_8x4_sf_layout and not batch_invariant,
              "NVFP4 with block_size=16, 128x4 scales, use_nvfp4=True expected")
        m, k2, n = a.shape[0], a.shape[1], b.shape[1]
        k = 2 * k2
        kp, np_, mp = rup(k // 16, 4), rup(n, 128), rup(m, 128)
        # -- what the kernels need and FlashInfer's tests always give (the quantizer's uint8 outputs)
        _need(a.dtype == torch.uint8 and b.dtype == torch.uint8, f"a, b must be uint8; got {a.dtype}, {b.dtype}")
        _need(a.is_contiguous(), f"a must be contiguous [M, K/2]; strides {a.stride()}")
        _need(b.stride() == (1, k2), f"b must be the column-major [K/2, N] view b_fp4.T; strides {b.stride()}")
        _need(a_descale.dtype == torch.uint8 and b_descale.dtype == torch.uint8,
              f"scales must be uint8 (the quantizer's dtype); got {a_descale.dtype}, {b_descale.dtype}")
        _need(tuple(a_descale.shape) == (mp, kp) and a_descale.is_contiguous(),
              f"a_descale must be swizzled [pad128(M), pad4(K/16)]={(mp, kp)} contiguous; got {tuple(a_descale.shape)}")
        want_b = (k // 16, n) if backend == "trtllm" else (kp, np_)
        _need(tuple(b_descale.shape) == want_b and b_descale.T.is_contiguous(),
              f"b_descale must be b_sf.T of shape {want_b} (column-major); got {tuple(b_descale.shape)} "
              f"strides {b_descale.stride()}")
        want_alpha = m if backend == "cake" else 1
        _need(alpha.numel() == want_alpha and alpha.is_contiguous() and alpha.device == a.device,
              f"alpha must hold {want_alpha} float32 on {a.device}; got shape {tuple(alpha.shape)}")
        _need(isinstance(out, torch.Tensor) and tuple(out.shape) == (m, n) and out.dtype == out_dtype
              and out.is_contiguous() and out.device == a.device, "out must be a contiguous [M, N] of out_dtype")
        self._backend_rules(backend, m, n, k, out_dtype)
        # -- the result, computed from the arguments as given
        b_rows = b.T
        sfb = unswizzle_flat(b_descale.T.contiguous(), n, k // 16)
        if backend == "trtllm":
            idx = shuffle_row_indices(b_rows, 128)
            orig = torch.empty_like(b_rows)
            orig[idx] = b_rows
            sfo = torch.empty_like(sfb)
            sfo[idx] = sfb
            b_rows, sfb = orig, sfo
        A = dequant(a, as_e4m3(unswizzle_flat(a_descale, m, k // 16)))
        B = dequant(b_rows, as_e4m3(sfb))
        res = A @ B.T
        res = res * (alpha.float().reshape(m, 1) if backend == "cake" else alpha.float())
        out.copy_(res)
        return out

    def _backend_rules(self, backend: str, m: int, n: int, k: int, out_dtype) -> None:
        if backend == "trtllm":
            _need(out_dtype == torch.bfloat16, "Only torch.bfloat16 is supported for TRTLLM FP4 GEMM operations.")
        if backend == "cutlass" or backend == "b12x":
            _need(k % 32 == 0 and (backend == "b12x" or n % 32 == 0), "Expected k/n to be divisible by 32")
        if backend == "cute-dsl":
            if self.cc // 10 == 12:
                _need(n % 64 == 0 and k % 64 == 0 and out_dtype == torch.bfloat16, "SM12x cute-dsl: N%64, K%64, bf16")
            _need(n % 8 == 0, f"CuTe-DSL FP4 GEMM requires N % 8 == 0, got n={n}")
        if backend == "cutedsl_low_latency":
            _need(m <= 8 and k % 64 == 0, "cutedsl_low_latency FP4 GEMM requires M <= 8 and K divisible by 64")
        if backend == "cake":
            _need(k % 256 == 0 and n % 8 == 0, f"the cake mm_fp4 backend requires K % 256 == 0, got k={k}")


def fake_flashinfer(cc: int, backends=tuple(FLASHINFER_CCS), version: str = "0.7.4") -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    mod.mm_fp4 = FakeMmFp4(cc, backends)
    mod.BackendSupportedError = BackendSupportedError
    utils = types.ModuleType("flashinfer.utils")
    utils.get_shuffle_matrix_a_row_indices = shuffle_row_indices
    mod.utils = utils
    return mod


# ---------------------------------------------------------------------------------------------------------------
# sgl-kernel
# ---------------------------------------------------------------------------------------------------------------
def fake_sgl_kernel(cc: int) -> types.ModuleType:
    """``sgl_kernel.cutlass_scaled_fp4_mm(a, b, sa, sb, alpha, out_dtype)`` with its C++ checks (CUTLASS family)."""
    mod = types.ModuleType("sgl_kernel")
    mod.calls = []

    def cutlass_scaled_fp4_mm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
        mod.calls.append(out_dtype)
        _need(a.ndim == 2 and b.ndim == 2, "a and b must be 2-D")
        _need(a.dtype == torch.uint8 and b.dtype == torch.uint8, f"a/b must be uint8; got {a.dtype}, {b.dtype}")
        _need(a.is_contiguous() and b.is_contiguous(), "a and b must be contiguous")
        _need(a.shape[1] == b.shape[1], f"b must be [N, K/2] (not transposed); got a {tuple(a.shape)}, b {tuple(b.shape)}")
        m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
        _need(k % 32 == 0 and n % 32 == 0, "Expected k/n to be divisible by 32")
        for name, s, rows in (("scale_a", block_scale_a, m), ("scale_b", block_scale_b, n)):
            want = (rup(rows, 128), rup(k // 16, 4))
            _need(s.dtype == torch.float8_e4m3fn and s.is_contiguous() and tuple(s.shape) == want,
                  f"{name} must be padded and swizzled to a shape {want}; got {tuple(s.shape)} {s.dtype}")
        _need(alpha.dtype == torch.float32 and alpha.numel() == 1 and alpha.device == a.device, "alpha: fp32, 1 elt")
        allowed = (torch.bfloat16, torch.float16) + ((torch.float32,) if cc == 100 else ())
        _need(out_dtype in allowed, f"Unsupported output data type of nvfp4 mm on SM{cc}: {out_dtype}")
        A = dequant(a, unswizzle_flat(block_scale_a, m, k // 16))
        B = dequant(b, unswizzle_flat(block_scale_b, n, k // 16))
        return ((A @ B.T) * alpha.float()).to(out_dtype)

    mod.cutlass_scaled_fp4_mm = cutlass_scaled_fp4_mm
    return mod


# ---------------------------------------------------------------------------------------------------------------
# torch._scaled_mm / F.scaled_mm
# ---------------------------------------------------------------------------------------------------------------
def _check_fp4_pair(mat_a, mat_b, scale_a, scale_b):
    fp4 = torch.float4_e2m1fn_x2
    _need(mat_a.dtype == fp4 and mat_b.dtype == fp4, f"operands must be float4_e2m1fn_x2; got {mat_a.dtype}, {mat_b.dtype}")
    _need(mat_a.is_contiguous(), "mat_a must be row-major [M, K/2]")
    m, k2 = mat_a.shape
    _need(mat_b.shape[0] == k2 and mat_b.stride() == (1, k2),
          f"mat_b must be B.t(), the column-major [K/2, N] view; got shape {tuple(mat_b.shape)} strides {mat_b.stride()}")
    n, k = mat_b.shape[1], 2 * k2
    for name, s, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        _need(s.dtype == torch.float8_e4m3fn and s.is_contiguous()
              and s.numel() == rup(rows, 128) * rup(k // 16, 4) and s.dim() == 1,
              f"{name}: Invalid scaling configuration (want flattened to_blocked e4m3 scales); got {tuple(s.shape)}")
    A = dequant(mat_a.view(torch.uint8), unswizzle_flat(scale_a, m, k // 16))
    B = dequant(mat_b.view(torch.uint8).T, unswizzle_flat(scale_b, n, k // 16))
    return A @ B.T


def fake_scaled_mm(calls: list):
    def _scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False):
        calls.append("_scaled_mm")
        _need(bias is None and scale_result is None and not use_fast_accum, "no bias/scale_result/fast accum for fp4")
        _need(out_dtype in (torch.bfloat16, torch.float16, torch.float32), f"out_dtype {out_dtype}")
        return _check_fp4_pair(mat_a, mat_b, scale_a, scale_b).to(out_dtype)

    return _scaled_mm


def fake_f_scaled_mm(calls: list):
    F = torch.nn.functional

    def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
                  bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        calls.append("scaled_mm_v2")
        recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
        swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        _need(list(scale_recipe_a) == recipe and list(scale_recipe_b) == recipe, "NVFP4 two-level recipe expected")
        _need(list(swizzle_a) == swz and list(swizzle_b) == swz, "SWIZZLE_32_4_4 block scales expected")
        _need(len(scale_a) == 2 and len(scale_b) == 2, "[block scales, global scale] pairs expected")
        for g in (scale_a[1], scale_b[1]):
            _need(g.dtype == torch.float32 and g.numel() == 1 and g.device == mat_a.device, "fp32 global scales")
        res = _check_fp4_pair(mat_a, mat_b, scale_a[0], scale_b[0])
        return (res * scale_a[1].float() * scale_b[1].float()).to(output_dtype)

    return scaled_mm



def fake_f_scaled_grouped_mm(calls: list):
    """``torch.nn.functional.scaled_grouped_mm`` for NVFP4 2d-3d (MoE), as PyTorch's
    ``test_mxfp8_scaled_grouped_mm_2d_3d`` (format="nvfp4") calls it and FBGEMM's ``set_grouped_gemm_args_kernel``
    (``_2D3D``) reads the scales: group g's activation scales start at row ``sum_{j<g} round_up(m_j, 128)``, its
    weight scales at ``g * round_up(N,128) * round_up(K/16,4)``; alpha per group = global_a[g] * global_b[g]."""
    F = torch.nn.functional

    def scaled_grouped_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                          swizzle_b=None, bias=None, offs=None, output_dtype=torch.bfloat16, contraction_dim=(),
                          use_fast_accum=False):
        calls.append("scaled_grouped_mm")
        fp4 = torch.float4_e2m1fn_x2
        recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
        swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        _need(list(scale_recipe_a) == recipe and list(scale_recipe_b) == recipe, "NVFP4 two-level recipe expected")
        _need(list(swizzle_a) == swz and list(swizzle_b) == swz, "SWIZZLE_32_4_4 block scales expected")
        _need(bias is None and output_dtype == torch.bfloat16, "NVFP4 grouped: no bias, bfloat16 output only")
        _need(mat_a.dtype == fp4 and mat_b.dtype == fp4, "operands must be float4_e2m1fn_x2")
        _need(mat_a.dim() == 2 and mat_a.is_contiguous(), "mat_a must be row-major [T, K/2]")
        t, k2 = mat_a.shape
        _need(mat_b.dim() == 3 and mat_b.shape[1] == k2 and mat_b.stride(1) == 1,
              f"mat_b must be the transposed [G, K/2, N] view of [G, N, K/2]; got {tuple(mat_b.shape)} strides "
              f"{mat_b.stride()}")
        g, n, k = mat_b.shape[0], mat_b.shape[2], 2 * k2
        _need(isinstance(offs, torch.Tensor) and offs.dtype == torch.int32 and tuple(offs.shape) == (g,),
              "offs must be int32 [G] group ends")
        cp = rup(k // 16, 4)
        sa, ga = scale_a
        sb, gb = scale_b
        for gl in (ga, gb):
            _need(gl.dtype == torch.float32 and tuple(gl.shape) == (g,), "global scales must be fp32 [G]")
        _need(sb.dtype == torch.float8_e4m3fn and tuple(sb.shape) == (g, rup(n, 128) * cp),
              f"scale_b must be [G, round_up(N,128)*round_up(K/16,4)] e4m3; got {tuple(sb.shape)}")
        ends = offs.tolist()
        _need(ends == sorted(ends) and ends[-1] == t, "offs must be sorted group ends ending at T")
        out = torch.zeros(t, n)
        start, row = 0, 0
        for i, end in enumerate(ends):
            m = end - start
            blk = rup(m, 128)
            _need(sa.dtype == torch.float8_e4m3fn and sa.dim() == 2 and sa.shape[1] == cp
                  and sa.shape[0] >= row + blk, f"scale_a must be [S, {cp}] e4m3 holding group {i} at row {row}")
            if m:
                A = dequant(mat_a.view(torch.uint8)[start:end], unswizzle_flat(sa[row:row + blk].reshape(-1), m,
                                                                                 k // 16))
                B = dequant(mat_b.view(torch.uint8)[i].T, unswizzle_flat(sb[i], n, k // 16))
                out[start:end] = A @ B.T * (ga[i] * gb[i])
            start, row = end, row + blk
        return out.to(torch.bfloat16)

    return scaled_grouped_mm


# ---------------------------------------------------------------------------------------------------------------
# Humming (humming-kernels 0.1.20: layer.py, schema/modelopt.py, forward.py, config/config.py, tune/; its tests'
# reference, utils/weight.py + testing/runner.py: W = e2m1(w) * weight_scale (per 16 along K) * weight_scale_2,
# out = inputs @ W.T)
# ---------------------------------------------------------------------------------------------------------------
class FakeHummingLayer(torch.nn.Module):
    """``humming.layer.HummingLayer`` for ModelOpt NVFP4 weights, with 16-bit activations (W4A16) or, given a
    ModelOpt NVFP4 ``input_config``, static-scale FP4 activations (W4A4, block-scaled MMA: SM100+)."""

    cc = 90  # the GPU the fake runs on (FakeHumming.module sets it)

    def __init__(self, shape_n, shape_k, weight_config, input_config=None, pad_n_to_multiple=1,
                 pad_k_to_multiple=1, num_experts=None, has_bias=False, torch_dtype=None):
        super().__init__()
        _need(weight_config.get("quant_method") == "modelopt" and str(weight_config.get("quant_algo")).lower()
              == "nvfp4", f"weight_config must describe ModelOpt NVFP4; got {weight_config}")
        _need(torch_dtype in (torch.bfloat16, torch.float16), f"torch_dtype must be bf16/fp16; got {torch_dtype}")
        self.a4 = input_config is not None
        if self.a4:
            _need(input_config == {"quant_method": "modelopt", "quant_algo": "nvfp4"} or input_config.get("dynamic")
                  is False, f"input_config: ModelOpt NVFP4, static scale; got {input_config}")
            _need(shape_n % 64 == 0 and shape_k % 128 == 0, f"padded N % 64 and K % 128; got N={shape_n}, K={shape_k}")
            self.input_scale = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        else:
            _need(shape_n % 64 == 0 and shape_k % 32 == 0, f"padded N % 64 and K % 32; got N={shape_n}, K={shape_k}")
        self.n, self.k, self.dtype = shape_n, shape_k, torch_dtype
        self.e = num_experts or 0  # experts stacked in front of every weight tensor (a MoE layer)
        ex = (self.e,) if self.e else ()
        self.weight = torch.nn.Parameter(torch.zeros(*ex, shape_n, shape_k // 2, dtype=torch.uint8),
                                         requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.zeros(*ex, shape_n, shape_k // 16, dtype=torch.float8_e4m3fn),
                                               requires_grad=False)
        self.weight_scale_2 = torch.nn.Parameter(torch.zeros(self.e or 1), requires_grad=False)
        self.register_buffer("locks", torch.zeros(2048, dtype=torch.int32))
        self.humming_config = None

    def load_from_tensors(self, tensors, prefix=""):
        for name in ("weight", "weight_scale", "weight_scale_2") + (("input_scale",) if self.a4 else ()):
            _need(name in tensors, f"missing {name}")
            have, got = getattr(self, name), tensors[name]
            _need(tuple(got.shape) == tuple(have.shape), f"size mismatch for {name}: copying a param with shape "
                  f"{tuple(got.shape)}, the shape in current model is {tuple(have.shape)}")
            # load_state_dict converts by value: uint8 scale bytes would become e4m3 numbers 0..255
            _need(got.dtype == have.dtype, f"{name} must be {have.dtype}; got {got.dtype} (converted by value)")
            have.data.copy_(got)

    def transform(self):
        _need(self.humming_config is None, "transform() twice")
        if self.a4:
            # LayerConfig's check, as Humming raises it (an AssertionError) below SM100
            assert self.cc >= 100, "static_tensor_dynamic_group requires block-scaled MMA"
            # the scales go to the SM100 tile layout: int32 [G/4, N], four groups of a row to a word
            self.weight_scale = torch.nn.Parameter(self.weight_scale.data.view(torch.int32).T.contiguous(),
                                                   requires_grad=False)
            self.input_scale_2 = torch.nn.Parameter(self.input_scale.data.amax().reshape(1), requires_grad=False)
            del self.input_scale
        self.humming_config = FakeLayerConfig(n=self.n, k=self.k, dtype=self.dtype, a4=self.a4, e=self.e)
        self.humming_config.sm_version = self.cc
        # the kernel layout: words of 8 codes, least significant nibble first
        self.weight = torch.nn.Parameter(self.weight.data.view(torch.int32).clone(), requires_grad=False)


class FakeLayerConfig(dict):
    """``HummingLayer.humming_config``: ``to_str()`` (its JSON, which ``prepare_kernels`` merges into each kernel's
    config) and ``sm_version`` (set on the layer's device)."""

    sm_version = 0

    def to_str(self) -> str:
        return json.dumps({"shape_n": self["n"], "shape_k": self["k"], "c_dtype": str(self["dtype"]),
                           "sublayer_name": "", "sm_version": self.sm_version})


class FakeHummingKernel:
    """``humming.kernel.HummingKernel`` as the background compile meets it: constructing one compiles it (recorded
    in ``compiled``, or raises for a config with ``fail``), then ``register_kernel`` loads it into the CUDA driver
    (recorded in ``registered``); every object made is kept in ``_instances``."""

    compiled: list[dict] = []
    registered: list[dict] = []
    _instances: dict = {}
    compiler_nice: list[int] = []  # the niceness of the compiler each construction started (``nice`` prints it)

    def __init__(self, **config):
        if config.get("fail"):
            raise RuntimeError("NVRTC failed with exit code 1")
        if config.get("run_compiler"):  # Humming compiles in a subprocess (humming/jit/compiler.py)
            out = subprocess.run(["nice"], capture_output=True, text=True, check=True).stdout
            type(self).compiler_nice.append(int(out))
        type(self).compiled.append(config)
        type(self)._instances[("HummingKernel", 0, tuple(sorted(config.items())))] = self
        self.register_kernel()

    def register_kernel(self):
        type(self).registered.append(True)


class FakeHumming:
    """``humming`` with ``layer``, ``forward``, ``tune``, ``kernel`` and ``device``; records each forward's tuning
    config, and the kernels compiled (``kernel_class``)."""

    def __init__(self):
        self.calls: list[dict] = []
        # a class per fake: the background compile's records of one test are not another's
        self.kernel_class = type("HummingKernel", (FakeHummingKernel,), {"compiled": [], "registered": [],
                                                                        "_instances": {}, "compiler_nice": []})
        self.searches = 0  # get_heuristics_config calls
        self.heuristics = [[0, 1 << 30, {"block_m": 64, "use_stream_k": True}]]  # lru-cached upstream: shared

    def module(self, version: str = "0.1.20", cc: int = 90) -> types.ModuleType:
        mod = types.ModuleType("humming")
        mod.__version__ = version
        mod.layer = types.ModuleType("humming.layer")
        mod.layer.HummingLayer = type("HummingLayer", (FakeHummingLayer,), {"cc": cc})
        mod.forward = types.ModuleType("humming.forward")
        mod.forward.humming_forward = self.humming_forward
        mod.tune = types.ModuleType("humming.tune")
        mod.tune.get_heuristics_config = self.get_heuristics_config
        mod.kernel = types.ModuleType("humming.kernel")
        mod.kernel.HummingKernel = self.kernel_class
        mod.device = types.ModuleType("humming.device")
        mod.device.current_device = types.SimpleNamespace(sm_version=cc)  # Humming's view of the current GPU
        return mod

    def get_heuristics_config(self, config, gemm_type="dense", device=None):
        self.searches += 1
        if config.sm_version // 10 == 9 and not config["a4"]:
            # tune/sm90_policies.py, build_sm90_seed_config: a four-warp WGMMA group of 32-column warps along N
            assert config["n"] % 128 == 0, "block_shape_n >= min_warp_shape_n * 4"
        _need(gemm_type == ("grouped_contiguous" if config["e"] else "dense"),
              f"heuristics for gemm_type={gemm_type!r} of a layer with {config['e']} experts")
        return self.heuristics

    def humming_forward(self, config, inputs, weight, weight_scale=None, zero_point=None, bias=None,
                        weight_scale_2=None, outputs=None, input_scale=None, input_scale_2=None, locks=None,
                        tuning_config=None, expert_layout=None, compute_config=None, **kw):
        _need(isinstance(config, dict), "config must be layer.humming_config (after transform)")
        n, k, dt, e = config["n"], config["k"], config["dtype"], config["e"]
        if e:  # the grouped MoE GEMM: bs2 [E] fp32, expert_layout [E+1] (each expert's first row, then the end)
            return self._grouped(config, inputs, weight, weight_scale, weight_scale_2, outputs, locks,
                                 tuning_config, expert_layout, compute_config)
        _need(expert_layout is None and compute_config is None, "a dense layer takes no expert_layout")
        _need(weight.dtype == torch.int32 and tuple(weight.shape) == (n, k // 8), "weight must be the transformed one")
        if config["a4"]:
            # path B: pre-quantized inputs (any dtype but bf16/fp16/fp32 is taken as quantized; the launcher wants
            # Byte), e4m3 group scales row-major four to an int32 (not the 128x4 swizzle), the static decode scale
            _need(inputs.dtype == torch.uint8 and inputs.dim() == 2 and inputs.shape[1] == k // 2
                  and inputs.is_contiguous() and inputs.data_ptr() % 16 == 0,
                  f"inputs must be contiguous uint8 [M, {k // 2}]; got {tuple(inputs.shape)} {inputs.dtype}")
            m = inputs.shape[0]
            _need(input_scale is not None and input_scale.dtype == torch.int32 and tuple(input_scale.shape)
                  == (m, k // 64) and input_scale.is_contiguous(), f"input_scale must be int32 [M, {k // 64}] (e4m3 "
                  f"row-major, four to a word); got {None if input_scale is None else tuple(input_scale.shape)}")
            _need(input_scale_2 is not None and input_scale_2.dtype == torch.float32 and input_scale_2.numel() == 1,
                  "input_scale_2: the layer's fp32 static scale")
            _need(weight_scale.dtype == torch.int32 and tuple(weight_scale.shape) == (k // 64, n),
                  "weight_scale must be the transformed (SM100 tile) one")
            x = dequant(inputs, input_scale.view(torch.float8_e4m3fn)).double() * input_scale_2.double()
            ws = weight_scale.T.contiguous().view(torch.float8_e4m3fn)
        else:
            _need(inputs.dim() == 2 and inputs.shape[1] == k and inputs.dtype == dt and inputs.is_contiguous(),
                  f"inputs must be contiguous [M, {k}] {dt}; got {tuple(inputs.shape)} {inputs.dtype}")
            _need(weight_scale.dtype == torch.float8_e4m3fn and tuple(weight_scale.shape) == (n, k // 16),
                  f"weight_scale must be e4m3 [N, K/16]; got {tuple(weight_scale.shape)} {weight_scale.dtype}")
            x, ws = inputs.double(), weight_scale
        _need(weight_scale_2.dtype == torch.float32 and weight_scale_2.numel() == 1 and weight_scale_2.is_contiguous()
              and weight_scale_2.data_ptr() % 16 == 0, "weight_scale_2: fp32, one element, 16-byte aligned")
        m = inputs.shape[0]
        _need(outputs is not None and tuple(outputs.shape) == (m, n) and outputs.dtype == dt
              and outputs.is_contiguous(), f"outputs must be contiguous [{m}, {n}] {dt}")
        _need(locks is not None and locks.dtype == torch.int32, "locks: the layer's int32 buffer")
        # Humming takes a dict, a list or their JSON string (the string is its compiled-kernel cache key as it is)
        parsed = json.loads(tuning_config) if isinstance(tuning_config, str) else copy.deepcopy(tuning_config)
        self.calls.append({"tuning_config": parsed, "tuning_as_json": isinstance(tuning_config, str)})
        W = dequant(weight.view(torch.uint8), ws)  # the kernel's K order is the packed one
        acc = x @ W.double().T
        outputs.copy_((acc * weight_scale_2.double()).to(dt))
        return outputs

    def _grouped(self, config, inputs, weight, weight_scale, weight_scale_2, outputs, locks, tuning_config,
                 expert_layout, compute_config):
        n, k, dt, e = config["n"], config["k"], config["dtype"], config["e"]
        cc = json.loads(compute_config) if isinstance(compute_config, str) else compute_config
        _need(isinstance(cc, dict) and cc.get("gemm_type") == "grouped_contiguous",
              f"compute_config must ask for gemm_type grouped_contiguous; got {compute_config!r}")
        _need(weight.dtype == torch.int32 and tuple(weight.shape) == (e, n, k // 8),
              "weight must be the transformed one")
        _need(weight_scale.dtype == torch.float8_e4m3fn and tuple(weight_scale.shape) == (e, n, k // 16),
              f"weight_scale must be e4m3 [E, N, K/16]; got {tuple(weight_scale.shape)} {weight_scale.dtype}")
        _need(inputs.dim() == 2 and inputs.shape[1] == k and inputs.dtype == dt and inputs.is_contiguous(),
              f"inputs must be contiguous [T, {k}] {dt}; got {tuple(inputs.shape)} {inputs.dtype}")
        # check_tensor_bs2 / check_tensor_moe of csrc/launcher/tensor.h
        _need(weight_scale_2.dtype == torch.float32 and tuple(weight_scale_2.shape) == (e,)
              and weight_scale_2.is_contiguous() and weight_scale_2.data_ptr() % 16 == 0,
              f"bs2 must be fp32 [{e}] (one per expert), contiguous, 16-byte aligned; got "
              f"{tuple(weight_scale_2.shape)}")
        _need(expert_layout is not None and expert_layout.dtype in (torch.int32, torch.int64)
              and tuple(expert_layout.shape) == (e + 1,), f"expert_token_offset must be int32/int64 [{e + 1}]")
        t = inputs.shape[0]
        lay = expert_layout.tolist()
        _need(lay[0] == 0 and lay == sorted(lay) and lay[-1] <= t, f"expert_layout must run from 0 up to T; got {lay}")
        _need(outputs is not None and tuple(outputs.shape) == (t, n) and outputs.dtype == dt
              and outputs.is_contiguous(), f"outputs must be contiguous [{t}, {n}] {dt}")
        _need(locks is not None and locks.dtype == torch.int32, "locks: the layer's int32 buffer")
        parsed = json.loads(tuning_config) if isinstance(tuning_config, str) else copy.deepcopy(tuning_config)
        self.calls.append({"tuning_config": parsed, "tuning_as_json": isinstance(tuning_config, str),
                           "expert_layout": lay})
        for i in range(e):
            lo, hi = lay[i], lay[i + 1]
            if hi > lo:
                W = dequant(weight[i].view(torch.uint8), weight_scale[i])
                acc = inputs[lo:hi].double() @ W.double().T
                outputs[lo:hi] = (acc * weight_scale_2[i].double()).to(dt)
        return outputs
