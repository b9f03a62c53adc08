"""``grouped_mm``: ``fp4_grouped_mm`` (the MoE expert GEMM) by the kernel family a config names
(``heuristics.grouped_configs_for``): the per-expert GEMV for decode batches, tensor-core tiles for larger ones."""
from __future__ import annotations

import torch

from .config import KernelConfig
from .config_grouped import GemvGroupedConfig, MmaGroupedConfig, MmaW4A16GroupedConfig, TmaGemvGroupedConfig
from .launchers import LauncherTable

__all__ = ["grouped_mm", "LAUNCHERS"]

# config class -> the module (under fp4dispatch.kernels) whose run(a, b, sa, sb, alpha, out, offs, config) launches it
LAUNCHERS: dict[type[KernelConfig], str] = {
    GemvGroupedConfig: "gemv.cuda_core_grouped",
    TmaGemvGroupedConfig: "gemv.tma_warp_specialized_grouped",  # SM90 with Gluon (heuristics offer it only there)
    MmaGroupedConfig: "gemm.mma_grouped",
    MmaW4A16GroupedConfig: "gemm.mma_w4a16_grouped",  # w4a16_grouped_mm: a is bf16/fp16, a_scale unused
}
_TABLE = LauncherTable("grouped_mm", "heuristics.grouped_configs_for or w4a16_grouped_configs_for", LAUNCHERS)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor,
               out: torch.Tensor, offs: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """``out[rows of e] = alpha[e] * dequant(a[rows of e]) @ dequant(b[e]).T`` on canonical grouped operands
    (``problem.GroupedOperands``; a w4a16 config takes ``a`` bf16/fp16 as it is)."""
    run = _TABLE[config]
    run(a, b, a_scale.view(torch.uint8), b_scale.view(torch.uint8), alpha, out, offs, config)
    return out
