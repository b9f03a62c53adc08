"""Kernel configs: one frozen dataclass per kernel family, checked when built.

A config names one compiled variant of one kernel family: its tile, K split, pipeline depth and code-path switches.
``heuristics.configs_for`` offers a short list of them per problem; the dispatcher benchmarks them, stores the best
one's :meth:`KernelConfig.to_json` in its cache and passes the object itself back to ``fp4_mm``. A config that cannot
run (a tile the kernel cannot lay out, a ring that deadlocks) is refused here with an ``InvalidInputError`` naming
the field; what depends on the operands (alignment, N and K multiples) is checked at launch.

Units: ``k_blocks`` counts 16-element NVFP4 blocks (one int64 word of packed codes, one e4m3 scale byte) per K step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ..errors import InvalidInputError

__all__ = ["KernelConfig", "BytewiseGemvConfig", "CudaCoreGemvConfig", "TmaGemvConfig", "MmaBf16Config",
           "WgmmaRegisterAConfig", "WgmmaWarpSpecializedConfig", "WgmmaDecodeWarpsConfig",
           "WgmmaDecodeWarpsW4A16Config", "WgmmaWarpSpecializedW4A16Config", "CudaCoreW4A16Config",
           "WgmmaRegisterAW4A16Config", "MmaW4A16Config",
           "register_a_resident", "decode_warps_work"]


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class KernelConfig:
    """Base of the config classes: the JSON form and the checks shared by all."""

    family: ClassVar[str] = ""
    launches: ClassVar[int] = 1  # kernel launches per call: 2 where a kernel of its own decodes an operand first

    def to_json(self) -> dict:
        """``{"family": ..., <field>: <value>, ...}``: what the dispatcher's cache stores."""
        return {"family": self.family, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def _require(self, name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise InvalidInputError(f"{type(self).__name__}.{name} must be {expected}; got {getattr(self, name)!r}")

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool",):
                self._require(f.name, isinstance(v, bool), "a bool")
            elif f.type == "int":
                self._require(f.name, isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an int >= 1")
            elif f.type == "int | None":
                self._require(f.name, v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                              "None or an int >= 1")
        self.check()

    def check(self) -> None:
        """The family's own constraints (fields already typed)."""

    def _require_pow2(self, *names: str) -> None:
        for name in names:
            self._require(name, _pow2(getattr(self, name)), "a power of two (a tl.arange extent)")


def _check_dot_tile(cfg: KernelConfig) -> None:
    """A ``tl.dot`` tile's fields: powers of two, M and N >= 16."""
    cfg._require_pow2("block_m", "block_n", "k_blocks", "warps")
    cfg._require("block_m", cfg.block_m >= 16, ">= 16 (tl.dot's smallest M)")
    cfg._require("block_n", cfg.block_n >= 16, ">= 16 (tl.dot's smallest N)")


def _check_word_gemv(cfg: KernelConfig) -> None:
    """The int64-word GEMV's fields (``gemv/cuda_core`` and its grouped form)."""
    cfg._require_pow2("rows", "block_n", "k_blocks", "warps")
    cfg._require("k_blocks", cfg.k_blocks % 4 == 0, "a multiple of 4 (whole 128x4-swizzled scale groups)")
    cfg._require("e4m3x2_convert", not cfg.e4m3x2_convert or cfg.fp16x2,
                 "False without fp16x2 (the conversion feeds the fp16x2 products)")
    _check_regs(cfg)


def _check_register_a_tile(cfg: KernelConfig) -> None:
    """A weight-as-register-operand tile's fields (``WgmmaRegisterAConfig`` and its W4A16 form)."""
    cfg._require_pow2("block_m", "block_n", "k_blocks", "warps")
    cfg._require("block_m", cfg.block_m >= 16, ">= 16 (tl.dot's smallest N: the tile is W @ A.T)")
    cfg._require("k_blocks", cfg.k_blocks % 4 == 0, "a multiple of 4 (the K order goes by scale groups of 4)")
    _check_regs(cfg)


def _check_stream_k(cfg: KernelConfig) -> None:
    cfg._require("split_k", not cfg.stream_k or cfg.split_k == 1, "1 with stream_k (stream-K cuts K itself)")
    cfg._require("stream_ctas", cfg.stream_k or cfg.stream_ctas is None, "None without stream_k")


def _check_regs(cfg: KernelConfig) -> None:
    cfg._require("max_registers", cfg.max_registers is None or (cfg.max_registers % 8 == 0
                                                                  and 24 <= cfg.max_registers <= 255),
                 "None or a multiple of 8 in 24..255 (ptxas' maxnreg)")


@dataclass(frozen=True)
class BytewiseGemvConfig(KernelConfig):
    """``gemv/cuda_core_bytes``: the byte-wise CUDA-core GEMV, M <= ``rows``."""

    family: ClassVar[str] = "gemv_cuda_core_bytes"
    rows: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int

    def check(self) -> None:
        self._require_pow2("rows", "block_n", "k_blocks", "warps")


@dataclass(frozen=True)
class CudaCoreGemvConfig(KernelConfig):
    """``gemv/cuda_core``: the CUDA-core GEMV over int64 words, ``rows`` activation rows per CTA.

    ``fp16x2``: products two per instruction in fp16x2 (exact); ``e4m3x2_convert`` (with ``fp16x2``, SM89+): decode
    through the hardware e4m3x2 -> f16x2 conversion; ``pair_decode``: the one-lop3 nibble-pair decode of the fp32
    path; ``prefetch``: the next K step's raw tiles double-buffered in registers; ``max_registers``: ptxas' register
    cap (more resident warps); ``pdl``: programmatic dependent launch where the device has it."""

    family: ClassVar[str] = "gemv_cuda_core"
    rows: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int
    stages: int = 3
    pair_decode: bool = True
    fp16x2: bool = False
    prefetch: bool = False
    e4m3x2_convert: bool = False
    max_registers: int | None = None
    pdl: bool = True

    def check(self) -> None:
        _check_word_gemv(self)


@dataclass(frozen=True)
class TmaGemvConfig(KernelConfig):
    """``gemv/tma_warp_specialized`` (SM90, Gluon): a TMA producer warp feeds ``warps`` consumer warps, ``rows`` <= 2
    activation rows. A tile is ``rows_per_quarter`` rows of each 32-row quarter of a 128-row group (how the scales are
    stored); ``k_blocks`` per step; a ring of ``stages`` slots; ``ctas_per_sm`` persistent CTAs per SM;
    ``int8_dot``: 16-block sums as exact int8 dot products instead of fp16x2 pairs."""

    family: ClassVar[str] = "gemv_tma_warp_specialized"
    rows: int
    rows_per_quarter: int
    k_blocks: int
    stages: int
    warps: int = 4
    ctas_per_sm: int = 1
    int8_dot: bool = False

    def check(self) -> None:
        self._require("rows", self.rows <= 2, "1 or 2 (the activation box holds whole rows)")
        self._require("rows_per_quarter", _pow2(self.rows_per_quarter) and self.rows_per_quarter <= 32,
                      "a power of two <= 32 (rows of a 32-row quarter)")
        self._require("k_blocks", _pow2(self.k_blocks) and self.k_blocks >= 4,
                      "a power of two >= 4 (whole scale groups per box)")
        self._require("warps", _pow2(self.warps), "a power of two")
        self._require("stages", self.stages >= 2, ">= 2 (the producer refills a slot while the next is read)")


@dataclass(frozen=True)
class MmaBf16Config(KernelConfig):
    """``gemm/mma_bf16``: bf16 tensor-core tiles, any M; ``group_m`` M tiles per L2 group."""

    family: ClassVar[str] = "gemm_mma_bf16"
    block_m: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int
    stages: int
    group_m: int = 8

    def check(self) -> None:
        _check_dot_tile(self)


@dataclass(frozen=True)
class WgmmaRegisterAConfig(KernelConfig):
    """``gemm/wgmma_register_a`` (SM89+): the weight decoded in registers as the first dot operand (SM90's wgmma
    reads it from registers). ``predecode_a``: A decoded once by a small kernel first; ``stream_k``: one wave of
    ``stream_ctas`` CTAs (default: as many as fit) sharing out all tiles' K steps; ``e4m3x2_convert``: the decode
    through the hardware e4m3x2 -> f16x2 conversion (else bit placement)."""

    family: ClassVar[str] = "gemm_wgmma_register_a"
    block_m: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int
    stages: int
    predecode_a: bool = False
    stream_k: bool = False
    stream_ctas: int | None = None
    e4m3x2_convert: bool = True
    max_registers: int | None = None
    pdl: bool = True

    @property
    def launches(self) -> int:  # type: ignore[override] - the A pre-decode is a field here
        return 2 if self.predecode_a else 1

    def check(self) -> None:
        _check_register_a_tile(self)
        _check_stream_k(self)


@dataclass(frozen=True)
class WgmmaWarpSpecializedConfig(KernelConfig):
    """``gemm/wgmma_warp_specialized`` (SM90, Gluon): ``WgmmaRegisterAConfig``'s tiles fed by a TMA producer warp
    through a ring of ``stages`` slots; one operand decoded first (A, or with ``swap`` the weight); ``persistent``:
    one CTA per SM running whole tiles."""

    family: ClassVar[str] = "gemm_wgmma_warp_specialized"
    launches: ClassVar[int] = 2  # the pre-decode, then the GEMM
    swappable: ClassVar[bool] = True  # whether ``swap`` may be set (the heuristics offer swapped tiles only then)
    block_m: int
    block_n: int
    k_blocks: int
    stages: int
    persistent: bool = False
    swap: bool = False
    pdl: bool = True

    def check(self) -> None:
        self._require("block_m", _pow2(self.block_m) and self.block_m >= 64, "a power of two >= 64")
        self._require("block_n", _pow2(self.block_n) and self.block_n >= 64,
                      "a power of two >= 64 (a consumer warpgroup per 64 weight rows)")
        self._require("k_blocks", _pow2(self.k_blocks) and self.k_blocks >= 4,
                      "a power of two >= 4 (whole scale groups)")
        self._require("stages", self.stages >= 2,
                      ">= 2 (the consumers free a step's slot only after issuing the next step's wgmma)")


@dataclass(frozen=True)
class WgmmaDecodeWarpsConfig(KernelConfig):
    """``gemm/wgmma_decode_warps`` (SM90, Gluon): ``decode_partitions`` partitions of block_n / 16 decode warps turn
    the weight into fp16 wgmma operand tiles in shared memory for a warpgroup that only issues wgmma. Rings: the
    weight's ``stages``, the pre-decoded activation's ``act_stages``, the decoded tiles' ``decoded_stages``;
    ``split_k`` K parts per tile on CTAs of their own; ``persistent``: one CTA per SM."""

    family: ClassVar[str] = "gemm_wgmma_decode_warps"
    launches: ClassVar[int] = 2  # the pre-decode, then the GEMM
    block_m: int = 128
    block_n: int = 64
    k_blocks: int = 8
    stages: int = 4
    act_stages: int = 4
    decoded_stages: int = 3
    decode_partitions: int = 2
    split_k: int = 1
    persistent: bool = False
    decode_registers: int = 128
    pdl: bool = True

    def check(self) -> None:
        # two partitions of 8 decode warps at block_n 128 do not get the registers they need to compile
        self._require("block_n", self.block_n == 64, "64")
        self._require("block_m", _pow2(self.block_m) and self.block_m >= 64, "a power of two >= 64")
        self._require("k_blocks", _pow2(self.k_blocks) and self.k_blocks >= 4,
                      "a power of two >= 4 (whole scale groups)")
        self._require("decode_partitions", self.decode_partitions in (1, 2), "1 or 2")
        # a ring of one slot deadlocks: the MMA frees a step's slots after issuing the next step; a decode partition
        # runs decode_partitions steps ahead
        for name in ("stages", "act_stages", "decoded_stages"):
            self._require(name, getattr(self, name) >= max(2, self.decode_partitions),
                          f">= max(2, decode_partitions) = {max(2, self.decode_partitions)}")
        # a weight slot must go to the same partition every time: a partition that finds the slot's previous load
        # (another partition's) still in flight passes its phase wait at once (the parity is the one before),
        # decodes stale words and frees the slot twice
        self._require("stages", self.stages % self.decode_partitions == 0, "a multiple of decode_partitions")
        self._require("decode_registers", self.decode_registers % 8 == 0 and 24 <= self.decode_registers <= 256,
                      "a multiple of 8 in 24..256 (setmaxnreg)")


@dataclass(frozen=True)
class WgmmaDecodeWarpsW4A16Config(WgmmaDecodeWarpsConfig):
    """``gemm/wgmma_decode_warps_w4a16`` (SM90, Gluon): ``w4a16_mm`` on ``WgmmaDecodeWarpsConfig``'s kernel and
    fields, the weight decoded into tiles of the activations' dtype, the activations put in the decode's K order by a
    small kernel first (``act_stages``: its ring)."""

    family: ClassVar[str] = "w4a16_wgmma_decode_warps"
    launches: ClassVar[int] = 2  # the activation permute, then the GEMM


@dataclass(frozen=True)
class WgmmaWarpSpecializedW4A16Config(WgmmaWarpSpecializedConfig):
    """``gemm/wgmma_warp_specialized_w4a16`` (SM90, Gluon): ``w4a16_mm`` on ``WgmmaWarpSpecializedConfig``'s kernel
    and tiles, the weight decoded into the wgmma register operand in the activations' dtype, the activations put in
    the decode's K order by a small kernel first."""

    family: ClassVar[str] = "w4a16_wgmma_warp_specialized"
    launches: ClassVar[int] = 2  # the activation permute, then the GEMM
    swappable: ClassVar[bool] = False

    def check(self) -> None:
        super().check()
        self._require("swap", not self.swap,
                      "False (swapped, the operand decoded first would be the weight: a whole dequantize)")


@dataclass(frozen=True)
class CudaCoreW4A16Config(KernelConfig):
    """``gemv/cuda_core_w4a16``: ``w4a16_mm`` for M <= ``rows`` per M tile on CUDA cores: 16-bit activations read as
    they are, the weight decoded in registers, fp32 products and sums."""

    family: ClassVar[str] = "w4a16_gemv_cuda_core"
    rows: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int

    def check(self) -> None:
        self._require_pow2("rows", "block_n", "k_blocks", "warps")


@dataclass(frozen=True)
class WgmmaRegisterAW4A16Config(KernelConfig):
    """``gemm/wgmma_register_a_w4a16`` (SM89+): ``w4a16_mm`` on ``WgmmaRegisterAConfig``'s tile, the weight decoded in
    registers as the first dot operand in the activations' dtype, the activations put in the decode's K order by a
    small kernel first; ``stream_k`` / ``stream_ctas`` as ``WgmmaRegisterAConfig``'s."""

    family: ClassVar[str] = "w4a16_wgmma_register_a"
    block_m: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int
    stages: int
    max_registers: int | None = None
    pdl: bool = True
    stream_k: bool = False
    stream_ctas: int | None = None
    launches: ClassVar[int] = 2  # the activation permute, then the GEMM

    def check(self) -> None:
        _check_register_a_tile(self)
        _check_stream_k(self)


@dataclass(frozen=True)
class MmaW4A16Config(KernelConfig):
    """``gemm/mma_w4a16``: ``w4a16_mm`` on 16-bit tensor cores, any M: the activations as they are, the weight
    decoded in registers to the activations' dtype (exact); ``group_m`` M tiles per L2 group."""

    family: ClassVar[str] = "w4a16_mma"
    block_m: int
    block_n: int
    k_blocks: int
    split_k: int
    warps: int
    stages: int
    group_m: int = 8

    def check(self) -> None:
        _check_dot_tile(self)


@dataclass(frozen=True)
class TmaMmaW4A16Config(KernelConfig):
    """``gemv/tma_mma_w4a16`` (SM90, Gluon): ``w4a16_mm`` at M <= ``rows`` by mma.sync fed by a TMA ring; tiles of
    ``rows_per_quarter`` rows of each 32-row quarter, ``k_blocks`` per step shared by ``k_warps`` warps."""

    family: ClassVar[str] = "w4a16_gemv_tma_mma"
    rows: int
    rows_per_quarter: int
    k_blocks: int
    stages: int
    k_warps: int = 1
    ctas_per_sm: int = 1

    warps = property(lambda self: self.rows_per_quarter // 4 * self.k_warps)  # a warp per 16 rows per K share

    def check(self) -> None:
        self._require("rows", self.rows in (1, 8, 16), "1, 8 or 16 (one token, or whole mma.sync columns)")
        self._require("rows_per_quarter", self.rows_per_quarter in (8, 16), "8 or 16")
        self._require("k_warps", _pow2(self.k_warps) and self.warps % 4 == 0, "a power of two, warps % 4 == 0")
        self._require("k_blocks", _pow2(self.k_blocks) and self.k_blocks % (8 * self.k_warps) == 0,
                      "a power of two, a multiple of 8 * k_warps (each warp whole 8-block chunks)")
        self._require("stages", self.stages >= 2, ">= 2 (the producer refills a slot while the next is read)")


def register_a_resident(block_m: int, warps: int) -> int:
    """CTAs of a ``WgmmaRegisterAConfig`` tile resident per SM on SM90 (its registers and shared memory): 4-warp tiles
    of block_m <= 64 fit 4, 8-warp tiles 2, block_m >= 128 one."""
    return 1 if block_m >= 128 else max(1, 16 // warps)


def decode_warps_work(m: int, n: int, kb: int, cfg: WgmmaDecodeWarpsConfig) -> tuple[int, int, int]:
    """(N tiles, tiles, K steps per tile) of ``WgmmaDecodeWarpsConfig`` over out [m, n] and kb 16-blocks: a tile takes
    block_n / 4 rows of each 32-row quarter of a 128-row group, so each group makes 128 / block_n N tiles."""
    nt = -(-n // 128) * (128 // cfg.block_n)
    return nt, nt * -(-m // cfg.block_m), -(-kb // cfg.k_blocks)
