"""``sgl_kernel:cutlass``: ``sgl_kernel.cutlass_scaled_fp4_mm(a, b, a_sf, b_sf, alpha, out_dtype)``.

sgl-kernel's contract is fp4dispatch's canonical one (CUTLASS family, see docs/backends.md): a and b uint8 [M, K/2]
and [N, K/2] contiguous (b NOT transposed), float8_e4m3fn 128x4-swizzled zero-padded 2-D scales, alpha a float32
one-element CUDA tensor, K and N multiples of 32; SM100 writes bf16/fp16/fp32, SM120 bf16/fp16 only.

Only ``sgl-kernel==0.3.21`` exports the function (built for torch 2.9.1, sm_100a/sm_120a cubins); ``sglang-kernel``
>= 0.4.1 dropped it. Importing a wheel built against another torch fails with an undefined symbol: that, and a
missing function, are ``unavailable`` reasons, never a crash. N and K are not padded (unsupported instead).
"""
from __future__ import annotations

from importlib import metadata

import torch

from ..problem import Operands, Problem
from ._native import NativeBackend, alignment_reason
from .base import Config

__all__ = ["SglKernelBackend"]

INSTALL_HINT = "pip install fp4dispatch[sgl], i.e. sgl-kernel==0.3.21, which needs torch==2.9.1"
_CUBIN_SMS = (100, 120)  # the 0.3.21 wheel carries sm_100a and sm_120a kernels only (readelf, notes/engines.md)


def _dist_version() -> str:
    for dist in ("sgl-kernel", "sglang-kernel"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "sgl_kernel"


class SglKernelBackend(NativeBackend):
    """sgl-kernel's CUTLASS NVFP4 GEMM (SM100/SM120, sgl-kernel 0.3.21 only)."""

    name = "sgl_kernel:cutlass"
    library, install_hint = "sgl_kernel", INSTALL_HINT
    function = "cutlass_scaled_fp4_mm"  # what run calls (named in the reasons)

    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return "needs CUDA (sgl-kernel's CUTLASS FP4 GEMM runs on SM100/SM120 GPUs only)"
        sk, why = self._import()
        if sk is None:
            if "import failed" in (why or ""):
                why += f" (sgl-kernel wheels are built against one torch; this is torch {torch.__version__})"
            return why
        if not callable(getattr(sk, self.function, None)):
            return (f"sgl_kernel has no {self.function} ({_dist_version()} installed; sglang-kernel >= 0.4.1 "
                    "dropped it; only sgl-kernel==0.3.21 has it)")
        if cc not in _CUBIN_SMS:
            return f"sgl_kernel's {self.function} ships sm_100a/sm_120a kernels only; this is SM{cc}"
        self._lib = sk
        return None

    def unsupported(self, problem: Problem) -> str | None:
        why = alignment_reason(problem, 32, 32, "sgl_kernel cutlass_scaled_fp4_mm")
        if why:
            return why
        cc = self.device_capability(problem.device)
        if problem.out_dtype == torch.float32 and cc != 100:
            return f"sgl_kernel writes float32 only on SM100 (SM120 kernels: bf16/fp16); this is SM{cc}"
        return None

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        sk = self._lib or self._load()
        # the function allocates its own out; copying costs M*N, which the canonical contract cannot avoid here
        ops.out.copy_(sk.cutlass_scaled_fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, problem.out_dtype))
