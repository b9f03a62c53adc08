"""The grouped (MoE) kernel families' configs (``grouped_mm.py``): typed, frozen, checked when built, as in
``config.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .config import KernelConfig, TmaGemvConfig, _check_dot_tile, _check_word_gemv

__all__ = ["MmaGroupedConfig", "GemvGroupedConfig", "MmaW4A16GroupedConfig", "TmaGemvGroupedConfig"]


@dataclass(frozen=True)
class MmaGroupedConfig(KernelConfig):
    """``gemm/mma_grouped``: ``fp4_grouped_mm`` in one launch; each CTA owns one ``block_m``-row tile of one expert's
    rows (found from ``offs`` on the GPU) by ``block_n`` columns, so an expert with no rows costs nothing and one
    with r rows costs ceil(r / block_m) tiles."""

    family: ClassVar[str] = "gemm_mma_grouped"
    block_m: int
    block_n: int
    k_blocks: int
    warps: int
    stages: int

    def check(self) -> None:
        _check_dot_tile(self)


@dataclass(frozen=True)
class GemvGroupedConfig(KernelConfig):
    """``gemv/cuda_core_grouped``: ``fp4_grouped_mm`` for decode batches, the ``gemv/cuda_core`` GEMV per expert;
    each CTA owns ``rows`` rows of one expert by ``block_n`` columns over the whole K. Switches as in
    :class:`CudaCoreGemvConfig`."""

    family: ClassVar[str] = "gemv_cuda_core_grouped"
    rows: int
    block_n: int
    k_blocks: int
    warps: int
    stages: int = 3
    fp16x2: bool = True
    prefetch: bool = False
    e4m3x2_convert: bool = False
    max_registers: int | None = None

    def check(self) -> None:
        _check_word_gemv(self)


@dataclass(frozen=True)
class MmaW4A16GroupedConfig(MmaGroupedConfig):
    """``gemm/mma_w4a16_grouped``: ``w4a16_grouped_mm`` in one launch, tiles as :class:`MmaGroupedConfig`'s with the
    activations read as they are (bf16/fp16) and the weight decoded as in ``mma_w4a16`` or, with ``register_a``
    (SM89+), into the register operand as in ``wgmma_register_a_w4a16`` (its activations permuted first). It
    serves ``fp4_grouped_mm`` too: the NVFP4 tokens are decoded to bf16 first (exact; a second launch)."""

    family: ClassVar[str] = "gemm_mma_w4a16_grouped"
    register_a: bool = False

    def check(self) -> None:
        super().check()
        self._require("k_blocks", not self.register_a or self.k_blocks % 4 == 0,
                      "a multiple of 4 with register_a (the K order goes by scale groups of 4)")


@dataclass(frozen=True)
class TmaGemvGroupedConfig(TmaGemvConfig):
    """``gemv/tma_warp_specialized_grouped`` (SM90, Gluon): ``fp4_grouped_mm`` for decode batches, the TMA-fed GEMV
    of :class:`TmaGemvConfig` (same fields) over every touched expert in one launch; ``rows`` (1 or 2) rows of one
    expert per pass over its weight tile, so an expert of r rows reads each tile ceil(r / rows) times."""

    family: ClassVar[str] = "gemv_tma_warp_specialized_grouped"
