"""``flashinfer:<backend>``: one fp4dispatch backend per FlashInfer ``mm_fp4`` backend.

FlashInfer's contract (0.7.4, ``flashinfer/gemm/gemm_base.py``; see docs/backends.md), as its own tests call it:
``mm_fp4(a, b.T, a_sf, b_sf.T, alpha, out_dtype, out, block_size=16, use_8x4_sf_layout=False, backend=...)`` with
``a`` uint8 [M, K/2], ``b.T`` the column-major [K/2, N] view of the contiguous [N, K/2] weight, 128x4-swizzled uint8
scales (``b_sf.T`` likewise the transposed view), ``alpha`` a float32 one-element tensor, bf16/fp16 out only.

Availability comes from FlashInfer itself (``mm_fp4.is_backend_supported(backend, cc)``, the check behind its
``BackendSupportedError``); the shape rules FlashInfer leaves to the kernel (SM120 cutlass checks no strides, K and N
multiples of 32, ...) are checked here. Nothing is padded: a misaligned N or K is ``unsupported`` and goes to another
backend. ``trtllm`` needs a shuffled weight and lives in :mod:`.flashinfer_trtllm` (which imports this module, never
the reverse; the registry in ``backends/__init__.py`` lists both).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..errors import describe_exception
from ..problem import Operands, Problem
from ._native import NativeBackend, alignment_reason
from .base import Config

__all__ = ["FlashInferBackend", "FlashInferCakeBackend", "BACKENDS"]

# Priority order: cudnn and cutlass are what engines default to; b12x wins small M on SM120; cute-dsl and the
# low-latency variant are newer; trtllm needs a prepared weight; cake is experimental (FlashInfer never auto-selects
# it) and comes last.
BACKENDS = ("cudnn", "cutlass", "b12x", "cute-dsl", "cutedsl_low_latency", "trtllm", "cake")
INSTALL_HINT = "pip install fp4dispatch[flashinfer]"
# first FlashInfer release with each mm_fp4 backend (named in the reason when an older one is installed)
_SINCE = {"cudnn": "0.3.0", "cutlass": "0.3.0", "trtllm": "0.3.0", "cute-dsl": "0.6.6", "b12x": "0.6.9",
          "cutedsl_low_latency": "0.7.4", "cake": "0.7.4"}
_CUTE_DSL = frozenset({"cute-dsl", "b12x", "cutedsl_low_latency"})
_HALF = (torch.bfloat16, torch.float16)


def _version(fi: ModuleType) -> str:
    return str(getattr(fi, "__version__", "?"))


class FlashInferBackend(NativeBackend):
    """``flashinfer.mm_fp4(..., backend=<backend>)`` on the canonical operands (b and its scale transposed)."""

    library, install_hint = "flashinfer", INSTALL_HINT

    _transient = ("_lib", "_checked")

    def __init__(self, backend: str):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"FlashInferBackend: backend must be one of {BACKENDS}; got {backend!r}")
        self.backend = backend
        self.name = f"flashinfer:{backend}"
        self._checked: set[tuple] = set()

    def _reset_transient(self) -> None:
        self._lib = None
        self._checked = set()

    # -- availability ----------------------------------------------------------------------------------------------
    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return "needs CUDA (FlashInfer mm_fp4 runs on NVIDIA GPUs only)"
        fi, why = self._import()
        if fi is None:
            return why
        mm = getattr(fi, "mm_fp4", None)
        if mm is None:
            return f"flashinfer {_version(fi)} has no mm_fp4 (it needs flashinfer >= 0.3.0)"
        has = getattr(mm, "has_backend", None)
        if has is not None and not has(self.backend):
            return (f"flashinfer {_version(fi)}: mm_fp4 has no backend '{self.backend}' (added in flashinfer "
                    f"{_SINCE[self.backend]})")
        supported = getattr(mm, "is_backend_supported", None)
        if supported is None:
            return f"flashinfer {_version(fi)}: mm_fp4 has no is_backend_supported; upgrade flashinfer"
        try:
            ok = supported(self.backend, cc)
        except Exception as e:  # noqa: BLE001 - a broken check is a reason, not a crash
            return f"flashinfer mm_fp4.is_backend_supported('{self.backend}', {cc}) raised {describe_exception(e)}"
        if not ok:
            # FlashInfer's own wording: what mm_fp4(backend=...) raises on this device
            return f"BackendSupportedError: mm_fp4 does not support backend '{self.backend}' with capability {cc}"
        why = self._library_gate(cc)
        if why:
            return why
        self._lib = fi
        return None

    def _library_gate(self, cc: int) -> str | None:
        """FlashInfer's own availability checks beyond the capability table (cuDNN version, CuTe DSL present).

        They are private helpers of ``flashinfer.gemm.gemm_base``; when a version lacks them the probe decides."""
        try:
            gb = importlib.import_module("flashinfer.gemm.gemm_base")
        except Exception:  # noqa: BLE001 - older layout or a stand-in module: leave it to the probe
            return None
        if self.backend == "cudnn":
            check = getattr(gb, "_check_cudnn_fp4_availability", None)
            if check is not None:
                try:
                    check()
                except Exception as e:  # noqa: BLE001 - FlashInfer raises RuntimeError with its own reason
                    return f"cudnn: {describe_exception(e)}"
        if self.backend in _CUTE_DSL:
            check = getattr(gb, "_check_cute_dsl_availability", None)
            if check is not None:
                try:
                    check()
                except Exception as e:  # noqa: BLE001 - FlashInfer raises ValueError("CuTe DSL is not available.")
                    return f"{describe_exception(e)} (pip install nvidia-cutlass-dsl)"
        if self.backend == "cute-dsl" and cc // 10 == 12 and int((torch.version.cuda or "0").split(".")[0]) < 13:
            return (f"cute-dsl on SM{cc} needs a CUDA 13 torch (sm12x_cute runner); this torch has CUDA "
                    f"{torch.version.cuda}")
        return None

    # -- per-problem rules -----------------------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        if problem.out_dtype not in _HALF:
            return f"FlashInfer mm_fp4 writes bfloat16/float16 only; got out_dtype={problem.out_dtype}"
        why = alignment_reason(problem, 32, 32, "FlashInfer mm_fp4")
        if why:
            return why
        cc = self.device_capability(problem.device) or 0
        return self._backend_rules(problem, cc)

    def _backend_rules(self, problem: Problem, cc: int) -> str | None:
        b = self.backend
        if b == "cute-dsl" and cc // 10 == 12:
            if problem.out_dtype != torch.bfloat16:
                return f"cute-dsl on SM{cc} writes bfloat16 only; got out_dtype={problem.out_dtype}"
            return alignment_reason(problem, 64, 64, f"cute-dsl on SM{cc}")
        if b == "cutedsl_low_latency":
            if problem.m > 8:
                return f"cutedsl_low_latency serves M <= 8 only; got M={problem.m}"
            return alignment_reason(problem, 32, 64, "cutedsl_low_latency")
        return None

    # -- the call --------------------------------------------------------------------------------------------------
    def operands(self, problem: Problem, ops: Operands) -> tuple:
        """``(a, b, a_sf, b_sf, alpha)`` exactly as FlashInfer's tests pass them."""
        b = ops.b.T  # [K/2, N], column-major view of the contiguous [N, K/2] weight
        sb = ops.b_scale.view(torch.uint8).T
        # SM120 cutlass checks no strides (notes: fp4_gemm_cutlass_sm120.cu): a wrong view would compute garbage
        if not (ops.a.is_contiguous() and b.T.is_contiguous() and sb.T.is_contiguous()):
            raise RuntimeError(f"{self.name}: operands must be a contiguous a and column-major b, b_sf views; got "
                               f"strides a={ops.a.stride()}, b={b.stride()}, b_sf={sb.stride()}")
        return ops.a, b, ops.a_scale.view(torch.uint8), sb, ops.alpha

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        fi = self._lib or self._load()
        a, b, sa, sb, alpha = self.operands(problem, ops)
        kw = {}
        key = problem.key
        if key in self._checked:
            # FlashInfer validated this shape class once; its checks cost CPU time on every decode-sized call
            kw["skip_check"] = True
        fi.mm_fp4(a, b, sa, sb, alpha, problem.out_dtype, ops.out, block_size=16, use_8x4_sf_layout=False,
                  backend=self.backend, use_nvfp4=True, **kw)
        self._checked.add(key)


class FlashInferCakeBackend(FlashInferBackend):
    """``cake`` (experimental, SM100/103) implements only the per-token-alpha path: alpha is expanded to [M]."""

    def __init__(self) -> None:
        super().__init__("cake")

    def _backend_rules(self, problem: Problem, cc: int) -> str | None:
        return alignment_reason(problem, 32, 256, "cake (smallest K tile 256)")

    def operands(self, problem: Problem, ops: Operands) -> tuple:
        a, b, sa, sb, alpha = super().operands(problem, ops)
        # one fp32 scale per row, contiguous: the kernel reads alpha[m] (a stride-0 expand would not do)
        return a, b, sa, sb, alpha.expand(problem.m).contiguous()
