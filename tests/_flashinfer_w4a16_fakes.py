"""CPU contract emulator of FlashInfer's weight-only ``mm_bf16_fp4`` (for ``flashinfer:bf16_fp4``), in the style of
``_native_fakes.py``."""
from __future__ import annotations

import types

import torch

from _native_fakes import BackendSupportedError, ContractError, _need, dequant, rup, unpack, unswizzle_flat
# ---------------------------------------------------------------------------------------------------------------
# FlashInfer mm_bf16_fp4 / prepare_bf16_fp4_weights (weight-only BF16 x NVFP4; FlashInfer 0.7.4: gemm/gemm_bf16_fp4.py,
# gemm_bf16_fp4_cudnn.py, gemm_bf16_fp4_cute_dsl.py, cute_dsl/utils.py convert_sf_to_mma_layout, utils.py
# backend_requirement; the per-backend references of trace/templates/gemm.py; tests/gemm/test_mm_bf16_fp4.py). Only
# cudnn and cute-dsl are emulated: the preparation each does, the checks FlashInfer and its kernels make (raised as
# FlashInfer raises them: TypeError / NotImplementedError where it does), and out = (a @ dequant(b).T) * alpha in
# float64, decoded from the *prepared* tensors as the trace references define them.
# ---------------------------------------------------------------------------------------------------------------
MM_BF16_FP4_CCS = {"cudnn": {100, 103, 107, 110, 120, 121}, "cute-dsl": {100, 103, 107, 110, 120, 121},
                   "cute-dsl-native": {120, 121}, "blackwell-native": {100, 103}, "blackwell-tiled": {100, 103}}
_SM100_FAMILY = (100, 103, 107)  # _cute_dsl_uses_sm100_layout: native weight + 6-D scale view


class ContractTypeError(ContractError, TypeError):
    pass


class ContractNotImplementedError(ContractError, NotImplementedError):
    pass


def _need_t(cond: bool, msg: str, exc=ContractError) -> None:
    if not cond:
        raise exc(msg)


def _sm12x_tile_source() -> torch.Tensor:
    """Byte j = 4 * word + byte of a packed (16 K x 64 N) tile comes from byte ``src[j]`` of the tile's row-major
    (8 K/2-rows, 64 N) bytes (gemm_bf16_fp4_cute_dsl.py _cute_dsl_pack_fp4_weight)."""
    src = []
    for word in range(128):
        lane, pair = (word // 2) % 32, word % 2
        for byte in range(4):
            kh = lane % 4 + (0, 4, 0, 4)[byte]
            n = (word // 64) * 8 + lane // 4 + ((0, 0, 16, 16), (32, 32, 48, 48))[pair][byte]
            src.append(kh * 64 + n)
    _need(sorted(src) == list(range(512)), "the tile map must be a permutation")
    return torch.tensor(src)


def pack_sm12x(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the cute-dsl SM12x int32 [K/16, 2N] weight."""
    n, k = b.shape[0], b.shape[1] * 2
    _need(k % 16 == 0, f"K must be a multiple of 16 (got K={k})")
    _need(n % 64 == 0, f"N must be a multiple of 64 (got N={n})")
    tiles = b.T.reshape(k // 16, 8, n // 64, 64).permute(0, 2, 1, 3).reshape(k // 16, n // 64, 512)
    return tiles[:, :, _sm12x_tile_source()].contiguous().view(torch.int32).reshape(k // 16, 2 * n)


def unpack_sm12x(w: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_sm12x`: int32 [K/16, 2N] -> uint8 [N, K/2]."""
    kt, n = w.shape[0], w.shape[1] // 2
    gathered = w.contiguous().view(torch.uint8).reshape(kt, n // 64, 512)
    tiles = torch.empty_like(gathered)
    tiles[:, :, _sm12x_tile_source()] = gathered
    return tiles.reshape(kt, n // 64, 8, 64).permute(0, 2, 1, 3).reshape(kt * 8, n).T.contiguous()


def to_s0e5m3(e4m3_u8: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes -> S0E5M3 bytes: the top byte but the sign of the value's fp16 bit pattern (_e4m3_to_s0e5m3)."""
    bits = e4m3_u8.view(torch.float8_e4m3fn).float().half().view(torch.int16).to(torch.int32) & 0xFFFF
    return ((bits >> 7) & 0xFF).to(torch.uint8)


def from_s0e5m3(s: torch.Tensor) -> torch.Tensor:
    return (s.to(torch.int16) << 7).view(torch.float16).double()


class FakeMmBf16Fp4:
    """``flashinfer.mm_bf16_fp4`` (with its ``backend_requirement`` attributes) and ``prepare_bf16_fp4_weights``."""

    def __init__(self, cc: int, cudnn_backend: int = 92301):
        self.cc = cc
        self.cudnn_backend = cudnn_backend
        self.calls: list[dict] = []
        self.prepares: list[str] = []

    def has_backend(self, backend: str) -> bool:
        return backend in MM_BF16_FP4_CCS

    def is_backend_supported(self, backend: str, cc: int | None = None) -> bool:
        return backend in MM_BF16_FP4_CCS and (cc is None or cc in MM_BF16_FP4_CCS[backend])

    # -- prepare_bf16_fp4_weights ----------------------------------------------------------------------------------
    def prepare(self, b, b_descale, alpha=None, *, backend, block_size=16):
        self.prepares.append(backend)
        _need(b.dim() == 2, f"b must be 2-D (N, K/2); got shape {tuple(b.shape)}")
        _need_t(b.dtype == torch.uint8, f"b must be uint8; got {b.dtype}", ContractTypeError)
        n, k = b.shape[0], b.shape[1] * 2
        _need(k % block_size == 0, f"K={k} must be a multiple of block_size={block_size}")
        need = rup(n, 128) * rup(k // 16, 4)
        _need(b_descale.numel() * b_descale.element_size() >= need,
              f"b_descale has {b_descale.numel() * b_descale.element_size()} bytes but the 128x4-swizzled layout for "
              f"N={n}, K_sf={k // 16} requires at least {need}")
        if alpha is not None:
            _need(alpha.dim() == 1 and alpha.shape[0] == 1, f"alpha must be shape (1,); got {tuple(alpha.shape)}")
            _need_t(alpha.dtype == torch.float32, f"alpha must be float32; got {alpha.dtype}", ContractTypeError)
        _need(backend in ("cudnn", "cute-dsl"), f"the emulator prepares cudnn and cute-dsl only; got {backend!r}")
        flat = b_descale.contiguous().view(torch.uint8).reshape(-1)
        if backend == "cudnn":  # b as it is, the scales unswizzled to row-major e4m3 [N, K/16]
            return b, unswizzle_flat(flat[:need], n, k // 16).contiguous().view(torch.float8_e4m3fn), alpha
        if self.cc in _SM100_FAMILY:  # b as it is, a 6-D view of the swizzled buffer (convert_sf_to_mma_layout)
            _need(b_descale.numel() == need, f"Scale factor tensor has {b_descale.numel()} elements, expected {need} "
                  f"for m={n}, k={k}, num_groups=1")
            sf = b_descale.contiguous().view(1, rup(n, 128) // 128, rup(k // 16, 4) // 4, 32, 4, 4)
            return b.contiguous(), sf.permute(3, 4, 1, 5, 2, 0), alpha
        _need_t(self.cc // 10 == 12, "cute-dsl w4a16 GEMM only supports SM100/103/107 and SM12x; got "
                f"{self.cc // 10}.{self.cc % 10}", ContractNotImplementedError)
        sf = to_s0e5m3(unswizzle_flat(flat[:need], n, k // 16).T.contiguous())
        return pack_sm12x(b), sf, alpha

    # -- mm_bf16_fp4 -------------------------------------------------------------------------------------------------
    def __call__(self, a, b, b_descale, alpha=None, *, backend, out_dtype=None, out=None, block_size=16,
                 enable_pdl=True, skip_check=False):
        self.calls.append(dict(backend=backend, skip_check=skip_check))
        if not skip_check:  # the backend_requirement decorator: capability, common check, requirement
            if not self.is_backend_supported(backend, self.cc):
                raise BackendSupportedError(f"mm_bf16_fp4 does not support backend '{backend}' with capability "
                                            f"{self.cc}")
            _need(a.dim() == 2, f"a must be 2-D (M, K); got shape {tuple(a.shape)}")
            _need_t(a.dtype == torch.bfloat16, f"a must be bfloat16; got {a.dtype}.  fp16 support is not implemented "
                    "yet.", ContractTypeError)
            _need(out_dtype in (None, torch.bfloat16, torch.float16),
                  f"out_dtype must be bfloat16 or float16; got {out_dtype}")
            _need(block_size == 16, f"block_size must be 16 for FP4; got {block_size}")
            _need(alpha is None or alpha.device == a.device, "alpha must be on the same device as a")
            if backend == "cudnn":
                _need(b.dtype == torch.uint8, f"cudnn bf16 x fp4 expects the uint8 prepared weight; got {b.dtype}.")
                _need(self.cudnn_backend >= 92301, "cuDNN bf16 x fp4 GEMM requires backend version >= 92301")
            else:
                want = torch.uint8 if self.cc in _SM100_FAMILY else torch.int32
                _need(b.dtype == want, f"cute-dsl bf16 x fp4 on SM{self.cc} expects the {want} weight; got {b.dtype}.")
        out_dtype = out_dtype or a.dtype
        _need(backend in ("cudnn", "cute-dsl"), f"the emulator computes cudnn and cute-dsl only; got {backend!r}")
        _need(alpha is None or (isinstance(alpha, torch.Tensor) and alpha.dtype == torch.float32
                                and alpha.numel() == 1), f"alpha must be a float32 (1,) tensor; got {alpha!r}")
        if backend == "cudnn":
            W = self._cudnn_weight(a, b, b_descale)
        elif self.cc in _SM100_FAMILY:
            W = self._sm100_weight(a, b, b_descale, alpha, out_dtype)
        else:
            W = self._sm12x_weight(a, b, b_descale, out_dtype)
        m, n = a.shape[0], W.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=out_dtype)
        _need(tuple(out.shape) == (m, n), f"out shape {tuple(out.shape)} != expected {(m, n)}")
        _need_t(out.dtype == out_dtype, f"out dtype {out.dtype} != requested out_dtype {out_dtype}", ContractTypeError)
        _need(out.is_contiguous() and out.device == a.device, "out must be contiguous [M, N] on a's device")
        align = 1 if backend == "cudnn" else 32 if self.cc in _SM100_FAMILY else 16  # checked / compiled assumption
        _need(out.data_ptr() % align == 0, f"cute-dsl on SM{self.cc} requires a {align}-byte aligned out")
        res = a.double() @ W.T
        out.copy_(res * alpha.double() if alpha is not None else res)
        return out

    def _cudnn_weight(self, a, b, b_descale) -> torch.Tensor:
        n, k = b.shape[0], b.shape[1] * 2
        _need(a.shape[1] == k, f"a.shape[1]={a.shape[1]} but k inferred from b.shape={tuple(b.shape)} is {k}")
        # the graph's tensors: a (M, K) row-major, b the (N, K) fp4 bytes row-major, scales row-major (N, K/16)
        _need(a.is_contiguous() and b.is_contiguous(), "a and b must be row-major (the cuDNN graph's strides)")
        _need(b_descale.dtype == torch.float8_e4m3fn and tuple(b_descale.shape) == (n, k // 16)
              and b_descale.is_contiguous(), f"b_descale must be the row-major e4m3 (N, K/16)={(n, k // 16)} scales "
              f"of prepare_bf16_fp4_weights(backend='cudnn'); got {tuple(b_descale.shape)} {b_descale.dtype}")
        return dequant(b, b_descale).double()

    def _sm100_weight(self, a, b, sf, alpha, out_dtype) -> torch.Tensor:
        _need(a.is_contiguous() and b.is_contiguous(), "SM100 cute-dsl requires contiguous a and b tensors.")
        _need_t(out_dtype == torch.bfloat16, "SM100 cute-dsl currently requires a bfloat16 output; got "
                f"{out_dtype}.", ContractNotImplementedError)
        m, k = a.shape
        n = b.shape[0]
        _need(b.shape[1] * 2 == k, f"a.shape[1]={k} but b.shape={tuple(b.shape)} encodes K={b.shape[1] * 2}")
        # Sm100DenseGemmBf16Fp4Kernel.can_implement: 16-byte rows of the fp4 weight and of the bf16 output
        _need(k % 32 == 0 and n % 8 == 0, f"no SM100 cute-dsl w4a16 tactic supports m={m}, n={n}, k={k}")
        for name, t, align in (("b", b, 32), ("b_descale", sf, 16), ("a", a, 32), ("alpha", alpha, 16)):
            _need(t is None or t.data_ptr() % align == 0, f"SM100 cute-dsl requires a {align}-byte aligned {name}")
        nt, kt = rup(n, 128) // 128, rup(k // 16, 4) // 4
        _need(sf.dim() == 6 and tuple(sf.shape) == (32, 4, nt, 4, kt, 1)
              and sf.stride() == (16, 4, kt * 512, 1, 512, nt * kt * 512) and sf.dtype == torch.float8_e4m3fn,
              f"b_descale must be the 6-D MMA view of the 128x4 scales (32, 4, {nt}, 4, {kt}, 1); got "
              f"{tuple(sf.shape)} strides {sf.stride()}")
        flat = sf.permute(5, 2, 4, 0, 1, 3).reshape(-1).view(torch.uint8)
        return dequant(b, unswizzle_flat(flat, n, k // 16).view(torch.float8_e4m3fn)).double()

    def _sm12x_weight(self, a, b, sf, out_dtype) -> torch.Tensor:
        _need_t(out_dtype == a.dtype, f"cute-dsl backend requires out_dtype == a.dtype (got out_dtype={out_dtype}, "
                f"a.dtype={a.dtype}).", ContractNotImplementedError)
        k, n = b.shape[0] * 16, b.shape[1] // 2
        _need(a.shape[1] == k, f"a.shape[1]={a.shape[1]} but k inferred from prepared b.shape={tuple(b.shape)} is {k}")
        _need(k % 64 == 0 and n % 64 == 0, f"cute-dsl SM12x tiles are 64 x 64 (tile_K 64 or 128); got N={n}, K={k}")
        sf = sf.view(torch.uint8).contiguous()
        _need(tuple(sf.shape) == (k // 16, n), f"b_descale must be the S0E5M3 (K/16, N)={(k // 16, n)} scales; got "
              f"{tuple(sf.shape)}")
        # the compiled kernel's fake tensors: compact row-major, assumed_align=16
        _need(a.is_contiguous() and b.is_contiguous() and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0,
              "a and the packed b must be contiguous and 16-byte aligned")
        codes = unpack(unpack_sm12x(b)).double().reshape(n, k // 16, 16)
        return (codes * from_s0e5m3(sf).T.unsqueeze(-1)).reshape(n, k)


def fake_flashinfer_bf16_fp4(cc: int, *, version: str = "0.7.4", cudnn_backend: int = 92301,
                             cudnn_error: str | None = None, dsl_error: str | None = None) -> dict:
    """The modules to put in ``sys.modules``: ``flashinfer`` with ``mm_bf16_fp4`` and ``prepare_bf16_fp4_weights``,
    and the private ``flashinfer.gemm`` helpers the adapter asks (availability checks, cuDNN's backend version)."""
    fake = FakeMmBf16Fp4(cc, cudnn_backend)
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    mod.mm_bf16_fp4 = fake
    mod.prepare_bf16_fp4_weights = fake.prepare
    mod.BackendSupportedError = BackendSupportedError
    mod.fake = fake
    gemm = types.ModuleType("flashinfer.gemm")
    base = types.ModuleType("flashinfer.gemm.gemm_base")

    def raiser(exc, msg):
        def check():
            if msg:
                raise exc(msg)
        return check

    base._check_cudnn_fp4_availability = raiser(RuntimeError, cudnn_error)
    base._check_cute_dsl_availability = raiser(ValueError, dsl_error)
    bf16 = types.ModuleType("flashinfer.gemm.gemm_bf16_fp4")
    bf16._CUDNN_BF16_FP4_MIN_BACKEND_VERSION = 92301
    bf16.cudnn = types.SimpleNamespace(backend_version=lambda: cudnn_backend)
    return {"flashinfer": mod, "flashinfer.gemm": gemm, "flashinfer.gemm.gemm_base": base,
            "flashinfer.gemm.gemm_bf16_fp4": bf16}
