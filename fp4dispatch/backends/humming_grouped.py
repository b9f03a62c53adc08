"""``humming:grouped``: ``fp4_grouped_mm`` and ``w4a16_grouped_mm`` (the MoE expert GEMM) through Humming's grouped
MoE GEMM (humming-kernels 0.1.20, ``gemm_type="grouped_contiguous"``): NVFP4 expert weights x bf16/fp16 activations
(``fp4_grouped_mm``'s decoded, ``w4a16_grouped_mm``'s as given), any GPU from SM75. It is ``humming:w4a16``'s
adapter with an expert dimension (docs/backends.md):

- ``a`` [T, K/2] is decoded exactly (every e2m1 x e4m3 product is exact in bf16 and fp16) by one kernel that reads
  each row's scales from its expert's block of the grouped swizzled layout and also writes Humming's routing table,
  ``expert_layout`` int32 [E+1] (0, then ``offs`` clamped to [0, T] and made non-decreasing, so a wrong table that
  the host did not check cannot send Humming out of bounds); ``w4a16_grouped_mm``'s activations go in as they are,
  its table written by ``kernels/routing_table``. No host sync: one CUDA graph serves every routing.
- The experts go in as ModelOpt's stacked tensors: ``weight`` uint8 [E, N, K/2], ``weight_scale`` e4m3 [E, N, K/16]
  row-major, ``weight_scale_2`` fp32 [E] of ones; ``transform()`` repacks them once per weight
  (``PreparedWeightCache``). That copy is as large as the experts themselves, so it is bounded
  (``max_bytes``, default a quarter of the GPU's memory) and a layer whose copy would not fit is refused with the
  reason rather than repacked on every call.
- alpha goes in per call as the per-expert ``weight_scale_2`` [E] (a one-element alpha is spread into kept scratch),
  read by Humming's fp32 epilogue.
- Stream-K is never used (its partial sums land in the 16-bit output in an order that changes from call to call);
  Humming's heuristic tuning configs for the grouped GEMM are run with it off.
"""
from __future__ import annotations

import torch

from ..format import BLOCK
from ..format_grouped import dequantize_grouped, unswizzle_expert_scales
from ..kernels import workspace
from ..kernels.dequant import dequantize_grouped_rows
from ..kernels.routing_table import routing_table
from ..problem import GroupedOperands, Problem
from .humming import HummingBackend

__all__ = ["HummingGroupedBackend"]

_GROUPED = '{"gemm_type": "grouped_contiguous"}'  # humming_forward's compute_config, made into JSON once


class HummingGroupedBackend(HummingBackend):
    """Humming's grouped MoE GEMM for ``fp4_grouped_mm`` (W4A16 on the decoded tokens)."""

    name = "humming:grouped"
    ops = ("grouped", "w4a16_grouped")  # grouped: the tokens decoded first; w4a16_grouped: as given
    gemm_type = "grouped_contiguous"
    # the whole table: Humming's grouped heuristics are indexed by its own measure of M, which fp4dispatch's bucket
    # of T (all experts' rows) does not bound; a layer's kernels compile once, at its first run
    tuning_per_bucket = False
    direct_launch = False  # its call adds the routing table (expert_layout) and a compute config

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes  # None: a quarter of the weight's GPU memory
        self._bounds: dict[torch.device, int] = {}  # the bound per device, asked of the driver once
        super().__init__()

    def unsupported(self, problem: Problem) -> str | None:
        why = super().unsupported(problem)
        if why is not None:
            return why
        if problem.op == "w4a16_grouped" and problem.a_dtype != problem.out_dtype:
            return (f"Humming writes its activations' dtype: out_dtype must be a's dtype ({problem.a_dtype}); got "
                    f"{problem.out_dtype}")
        copy_bytes = problem.experts * problem.n * problem.k * 9 // 16  # the repacked codes and their e4m3 scales
        bound = self._bound(problem.device)
        if copy_bytes > bound:
            return (f"Humming's repacked copy of these experts ({copy_bytes / 2**30:.2f} GiB) exceeds its bound "
                    f"({bound / 2**30:.2f} GiB); construct HummingGroupedBackend(max_bytes=...) to allow it")
        return None

    def _bound(self, device: torch.device) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        bound = self._bounds.get(device)
        if bound is None:  # CPU tensors reach here only in tests, through the contract emulator
            bound = self._bounds[device] = (torch.cuda.get_device_properties(device).total_memory // 4
                                            if device.type == "cuda" else 1 << 30)
        return bound

    def run(self, problem: Problem, ops: GroupedOperands, config) -> None:
        # the prepared copies of all layers together stay within the bound too (least recently used go first)
        self.prepared.max_bytes = self._bound(problem.device)
        super().run(problem, ops, config)

    def layer_options(self, problem: Problem) -> dict:
        return {"num_experts": problem.experts}

    def weight_tensors(self, problem: Problem, ops: GroupedOperands) -> dict:
        scale = unswizzle_expert_scales(ops.b_scale.view(torch.uint8), problem.n, problem.k // BLOCK)
        return {"weight": ops.b.view(torch.uint8), "weight_scale": scale.view(torch.float8_e4m3fn),
                "weight_scale_2": torch.ones(problem.experts, dtype=torch.float32, device=ops.b.device)}

    def forward_inputs(self, problem: Problem, ops: GroupedOperands, layer_extra: dict) -> dict:
        """The decoded tokens and Humming's routing table (``expert_layout``) for the grouped GEMM."""
        t, e, dev = problem.m, problem.experts, ops.a.device
        w4a16 = problem.op == "w4a16_grouped"
        if not ops.a.is_cuda:  # the contract emulator's path: the same values through torch
            ends = ops.offs.long().clamp(0, t).cummax(0).values
            x = ops.a if w4a16 else dequantize_grouped(ops.a, ops.a_scale, ops.offs, problem.out_dtype)
            return {"inputs": x, "expert_layout": torch.nn.functional.pad(ends, (1, 0)).int(),
                    "compute_config": _GROUPED}
        layout = workspace.scratch("humming_grouped_layout", (e + 1,), torch.int32, dev)
        if w4a16:
            return {"inputs": ops.a, "expert_layout": routing_table(ops.offs, t, layout), "compute_config": _GROUPED}
        x = workspace.scratch("humming_grouped_a", (t, problem.k), problem.out_dtype, dev)
        dequantize_grouped_rows(ops.a.view(torch.uint8), ops.a_scale, ops.offs, x, layout)
        return {"inputs": x, "expert_layout": layout, "compute_config": _GROUPED}

    def epilogue_scale(self, problem: Problem, ops: GroupedOperands) -> torch.Tensor:
        """alpha as Humming's per-expert ``weight_scale_2``: fp32 [E], contiguous, 16-byte aligned."""
        e = problem.experts
        alpha = ops.alpha
        if alpha.numel() == e and alpha.is_contiguous() and alpha.data_ptr() % 16 == 0:
            return alpha
        if not alpha.is_cuda:
            return alpha.reshape(-1).expand(e).clone()
        spread = workspace.scratch("humming_grouped_alpha", (e,), torch.float32, alpha.device)
        return spread.copy_(alpha.reshape(-1).expand(e))
