"""Triton kernels for GPUs without FP4 tensor cores (Hopper, Ada, Ampere): fused NVFP4 GEMM/GEMV, dequantize,
quantize. Every module imports Triton lazily or only when a kernel of its own runs, so ``import fp4dispatch`` never
needs it.

- ``fp4_mm.py``: ``fp4_mm(a, b, a_scale, b_scale, alpha, out, config)``, a table from config class to launcher;
- ``config.py``: one frozen dataclass per kernel family; ``heuristics.py``: the candidate configs of a problem;
- ``gemv/`` and ``gemm/``: one module per kernel family (its ``@triton.jit``/Gluon code and its launcher);
- ``numerics/``: e2m1/e4m3 decode, fp16x2 pairs, int8 dot products; ``tiles.py``: epilogue, split-K reduction;
- ``runtime.py``: launches, TMA descriptors, device queries; ``workspace.py``: scratch kept per (device, stream)
  (pre-decoded operands, split-K partials and counters); ``plan.py``: launch plans (an eager call's launches
  recorded once, replayed with only the addresses bound); ``target.py``: what the device and Triton allow;
  ``compile_processes.py`` / ``compile_worker.py``: many keys' compiles in worker processes, out of the GIL;
  ``cache_keys.py``: one Triton cache key per kernel in every process;
- ``dequant.py`` / ``quantize.py`` (kernels in ``_dequant.py`` / ``_quantize.py``).
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (Triton's interpreter), which is how CI tests them.
docs/kernels.md describes each family; docs/architecture.md how to add one.
"""
from __future__ import annotations

from .runtime import cuda_index, interpreting, jit_interpreted
from .target import device_problem, gluon_missing, triton_missing

__all__ = ["triton_missing", "gluon_missing", "interpreting", "jit_interpreted", "cuda_index", "device_problem"]
