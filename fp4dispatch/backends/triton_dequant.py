"""``triton:dequant+matmul``: a Triton kernel dequantizes both operands to bf16 (fp16 for fp16 out), then cuBLAS
(torch on CPU) multiplies them. Where cuBLAS wins (large M) the tuner takes this; the per-call dequant is counted.

Configs: ``alpha="epilogue"`` (exact: fp32-output GEMM, then alpha in fp32 and the cast) and, for bf16 out,
``alpha="fold"`` (alpha multiplied into the dequantized values of A — of B for ``w4a16_mm``, whose A is the user's —
before their bf16 cast: one extra rounding of that operand, relative output error ~1e-3, so cuBLAS writes bf16 out
directly with no fp32 pass; at large M that pass costs more than the dequantize). Not with ``cache_weight``: the
cached copy is alpha-free.

``TritonDequantBackend(cache_weight=True)`` (explicit opt-in, not a default backend) keeps a bf16 copy of each
weight it sees, keyed by storage pointer and version: it costs 3.6x the NVFP4 weight memory (2 bytes per value vs
9/16) and is only right while a weight is not modified in place without a version bump.
"""
from __future__ import annotations

import torch

from ..kernels import device_problem
from ..kernels.dequant import dequantize_rows, dequantize_to_scratch
from ..problem import Operands, Problem
from .base import BaseBackend, Config

__all__ = ["TritonDequantBackend"]


class TritonDequantBackend(BaseBackend):
    """Triton dequantize of A and B, then a dense GEMM; alpha in an fp32 epilogue (or folded into A for bf16)."""

    risky = False
    ops = ("fp4_mm", "w4a16")

    def __init__(self, cache_weight: bool = False):
        self.cache_weight = bool(cache_weight)
        self.name = "triton:dequant+matmul" + ("(cached)" if cache_weight else "")
        self._weights: dict[tuple, torch.Tensor] = {}
        # its Triton kernel (the dequantize) compiles with the other candidates' (precompile), not serially in its
        # check: inside compiles_ahead the dequantize is only handed out, and the GEMM then runs on scratch whose
        # values do not matter. Not while keeping weights: that run would keep a copy the dequantize never wrote.
        self.compiles_ahead = not self.cache_weight

    def unavailable(self, device: torch.device) -> str | None:
        return device_problem(device)

    def _can_fold(self, problem: Problem) -> bool:
        return problem.out_dtype == torch.bfloat16 and (problem.op == "fp4_mm" or (
            problem.a_dtype == torch.bfloat16 and not self.cache_weight))

    def configs(self, problem: Problem) -> list[Config]:
        return [{"alpha": "fold"}, {"alpha": "epilogue"}] if self._can_fold(problem) else [{"alpha": "epilogue"}]

    def _weight(self, ops: Operands, dtype: torch.dtype, factor: torch.Tensor | None = None) -> torch.Tensor:
        """B dequantized (times ``factor``): into scratch, or with ``cache_weight`` the kept copy, which holds no
        factor (alpha may change from call to call), so a factor always goes through scratch."""
        if not self.cache_weight or factor is not None:
            return dequantize_to_scratch("dequant_b", ops.b, ops.b_scale, dtype, factor=factor)
        key = (ops.b.data_ptr(), ops.b._version, tuple(ops.b.shape), ops.b_scale.data_ptr(), ops.b_scale._version,
               dtype, ops.b.device)
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = dequantize_rows(ops.b, ops.b_scale, dtype)
        return w

    @torch.no_grad()  # the ops are not differentiable, and torch's out= variants refuse inputs that require grad
    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        fold = config.get("alpha") == "fold" and self._can_fold(problem)
        if problem.op == "w4a16":  # a as given: the weight is dequantized to its dtype (exact in bf16 and fp16)
            dt, a = problem.a_dtype, ops.a
            b = self._weight(ops, dt, ops.alpha if fold else None)
        else:
            dt = torch.float16 if problem.out_dtype == torch.float16 else torch.bfloat16
            a = dequantize_to_scratch("dequant_a", ops.a, ops.a_scale, dt, factor=ops.alpha if fold else None)
            b = self._weight(ops, dt)
        if fold and a.is_cuda:
            torch.mm(a, b.t(), out=ops.out)
            return
        if not a.is_cuda:  # CPU (interpreter): exact fp32 matmul of exactly dequantized values
            acc = a.float() @ b.float().t()
            if fold:
                ops.out.copy_(acc)
                return
        elif problem.out_dtype == torch.float32:
            acc = _mm_f32(a, b, ops.out)
        else:
            acc = _mm_f32(a, b, None)
        torch.mul(acc, ops.alpha, out=ops.out)


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.mm takes out_dtype there (asked once)


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """a @ b.T with fp32 output from 16-bit operands (cuBLAS accumulates in fp32; no 16-bit rounding of the sum).
    A torch without ``mm(..., out_dtype=)`` for the device is asked once per process, not on every call: a raised
    error costs more host time than the GEMM at small M."""
    kind = a.device.type
    if _MM_OUT_DTYPE.get(kind, True):
        try:
            acc = (torch.mm(a, b.t(), out_dtype=torch.float32, out=out) if out is not None
                   else torch.mm(a, b.t(), out_dtype=torch.float32))
            _MM_OUT_DTYPE[kind] = True
            return acc
        except (TypeError, RuntimeError, NotImplementedError):  # torch without out_dtype here: exact, slower
            _MM_OUT_DTYPE[kind] = False
    acc = torch.mm(a.float(), b.float().t())
    if out is not None:
        out.copy_(acc)
        return out
    return acc
