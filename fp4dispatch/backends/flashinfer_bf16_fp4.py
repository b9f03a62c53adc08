"""``flashinfer:bf16_fp4``: ``w4a16_mm`` through FlashInfer's weight-only BF16 x NVFP4 GEMM ``mm_bf16_fp4``.

FlashInfer's contract (0.7.4: ``flashinfer/gemm/gemm_bf16_fp4.py``, ``gemm_bf16_fp4_cudnn.py``,
``gemm_bf16_fp4_cute_dsl.py``, ``trace/templates/gemm.py``; docs/backends.md), as its tests call it:

- ``prepare_bf16_fp4_weights(b, b_sf, alpha, backend=X)`` once per weight, then
  ``mm_bf16_fp4(a, b_p, sf_p, alpha_p, backend=X, out_dtype=..., out=...)`` = ``(a @ dequant(b).T) * alpha``. ``b`` is
  the canonical uint8 [N, K/2] (low nibble = even k), ``b_sf`` the 128x4-swizzled e4m3 scales: fp4dispatch's own
  operands. What the preparation makes depends on the backend and the GPU: cuDNN keeps ``b`` and unswizzles the
  scales to row-major e4m3 [N, K/16]; cute-dsl on SM100/103/107 keeps ``b`` and views the swizzled scales as a 6-D
  MMA layout (no copy); cute-dsl on SM12x repacks ``b`` into int32 [K/16, 2N] MMA tiles and the scales into S0E5M3
  bytes [K/16, N]. The adapter calls FlashInfer's own preparation and keeps its result in a
  ``_native.PreparedWeightCache`` per (weight, backend). Parts of the result that are views of the caller's weight
  are kept as view descriptions, never as tensors, so a freed weight still drops its entry.
- alpha is prepared as ``None`` (so nothing of it can be folded into the cached weight; in 0.7.4 every backend
  returns alpha unchanged) and passed with each call as the device fp32 ``(1,)`` tensor: cuDNN multiplies the fp32
  accumulator by it, the cute-dsl kernels read it through a pointer. No host sync; alpha may change per call.
- Activations: bfloat16 only (FlashInfer's common check raises ``TypeError`` for fp16: "not implemented yet"); an fp16
  ``w4a16`` problem is ``unsupported`` (converting it would not be the activations as given).
- Out dtype: cuDNN bf16 or fp16; cute-dsl bf16 only (SM100: bf16 output; SM12x: out dtype == a's).
- SM: FlashInfer's own ``mm_bf16_fp4.is_backend_supported(backend, cc)`` (cudnn and cute-dsl: 100, 103, 107, 110,
  120, 121), less cute-dsl on SM110, which FlashInfer lists but cannot prepare (``NotImplementedError``).
- Shapes, not padded: cute-dsl SM100 N % 8, K % 32 (its kernel's ``can_implement``: 16-byte rows of the FP4 weight
  and the 16-bit output), SM12x N % 64, K % 64 (the weight repack's 64-column tiles, tile_K 64 or 128); cuDNN N, K
  % 32 (fp4dispatch's FP4 rule; FlashInfer checks none, its tests use multiples of 64).
- Pointers: the SM100 kernel checks 32-byte aligned ``a`` and ``out`` and a 16-byte aligned ``alpha``, the SM12x
  kernels are compiled assuming 16-byte ``a`` and ``out``; a misaligned one goes through an aligned copy (16 bytes
  for cuDNN as well).

Only ``cudnn`` and ``cute-dsl`` are served (the backends FlashInfer's own tests cover); ``cute-dsl-native`` and the
source-built ``blackwell-*`` backends are not. Written against FlashInfer 0.7.4 and, so far, run only against the
contract emulator in tests/_flashinfer_w4a16_fakes.py, never on a GPU.
"""
from __future__ import annotations

import importlib

import torch

from ..errors import describe_exception
from ..problem import Operands, Problem
from ._native import NativeBackend, PreparedWeightCache, aligned_alpha, alignment_reason
from .base import Config
from .flashinfer import INSTALL_HINT

__all__ = ["FlashInferBf16Fp4Backend", "MM_BACKENDS"]

MM_BACKENDS = ("cudnn", "cute-dsl")  # in priority order: FlashInfer's tests' order
WRITTEN_AGAINST = "0.7.4"
_HALF = (torch.bfloat16, torch.float16)
_SM100_LAYOUT = (100, 103, 107)  # gemm_bf16_fp4.py _cute_dsl_uses_sm100_layout
_CUDNN_MIN_BACKEND = 92301  # gemm_bf16_fp4.py _CUDNN_BF16_FP4_MIN_BACKEND_VERSION (cuDNN 9.23.1)


def _alignments(backend: str, cc: int) -> tuple[int, int, int]:
    """Byte alignment of the (a, out, alpha) data pointers that ``backend`` takes on ``cc``."""
    if backend == "cute-dsl":
        return (32, 32, 16) if cc in _SM100_LAYOUT else (16, 16, 4)
    return 16, 16, 4


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    """``t``, or a fresh contiguous copy when its data pointer is not ``align``-byte aligned (allocations are)."""
    return t if t.data_ptr() % align == 0 else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _keep(t, ops: Operands):
    """What the cache keeps of one prepared tensor: a view of the caller's weight or scale as its description (a
    strong reference would keep a freed weight alive), anything else as it is."""
    for name in ("b", "b_scale"):
        src = getattr(ops, name)
        if (isinstance(t, torch.Tensor) and t.element_size() == src.element_size()
                and t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()):
            return (name, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    return t


def _restore(kept, ops: Operands):
    if isinstance(kept, tuple):
        name, dtype, shape, stride, offset = kept
        return getattr(ops, name).view(dtype).as_strided(shape, stride, offset)
    return kept


class FlashInferBf16Fp4Backend(NativeBackend):
    """``flashinfer.mm_bf16_fp4`` on weights prepared once by ``flashinfer.prepare_bf16_fp4_weights``; one config
    per FlashInfer backend usable on the device (``{"backend": "cudnn"}``, ``{"backend": "cute-dsl"}``)."""

    name = "flashinfer:bf16_fp4"
    library, install_hint = "flashinfer", INSTALL_HINT
    ops = ("w4a16",)
    # W4A16 only: it never runs fp4_mm (its cuDNN path even multiplies in bf16), so its health says nothing about
    # whether W4A4 pays here (Fp4Linear's mode="auto")
    fp4_tensor_cores = False
    probe_timeout_s = 120.0  # CuTe DSL compiles each kernel it launches on first use (cute.compile per tactic)
    _transient = ("_lib", "prepared", "_usable", "_checked")

    def __init__(self) -> None:
        super().__init__()
        self._reset_transient()

    def _reset_transient(self) -> None:
        self._lib = None
        self.prepared = PreparedWeightCache(self.name)
        self._usable: dict[int, tuple[str, ...]] = {}  # capability -> the FlashInfer backends usable there
        self._checked: set[tuple] = set()

    # -- availability --------------------------------------------------------------------------------------------
    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return "needs CUDA (FlashInfer mm_bf16_fp4 runs on NVIDIA GPUs only)"
        fi, why = self._import()
        if fi is None:
            return why
        version = str(getattr(fi, "__version__", "?"))
        mm = getattr(fi, "mm_bf16_fp4", None)
        if mm is None or getattr(fi, "prepare_bf16_fp4_weights", None) is None:
            return (f"flashinfer {version} has no mm_bf16_fp4/prepare_bf16_fp4_weights (fp4dispatch's "
                    f"flashinfer:bf16_fp4 is written against flashinfer {WRITTEN_AGAINST})")
        if getattr(mm, "is_backend_supported", None) is None:
            return f"flashinfer {version}: mm_bf16_fp4 has no is_backend_supported; upgrade flashinfer"
        usable, refused, reasons = [], [], []
        for b in MM_BACKENDS:
            try:
                ok = bool(mm.is_backend_supported(b, cc))
            except Exception as e:  # noqa: BLE001 - a broken check is a reason, not a crash
                reasons.append(f"mm_bf16_fp4.is_backend_supported('{b}', {cc}) raised {describe_exception(e)}")
                continue
            if not ok:
                refused.append(b)
                continue
            why = self._library_gate(b, cc)
            if why:
                reasons.append(why)
            else:
                usable.append(b)
        self._usable[cc] = tuple(usable)
        if usable:
            self._lib = fi
            return None
        if refused:  # FlashInfer's own wording of what mm_bf16_fp4(backend=...) raises on this device
            reasons.insert(0, "BackendSupportedError: mm_bf16_fp4 does not support backend "
                              f"{' or '.join(repr(b) for b in refused)} with capability {cc}")
        return "; ".join(reasons)

    def _library_gate(self, backend: str, cc: int) -> str | None:
        """Why FlashInfer's requirement check or preparation would refuse ``backend`` on ``cc`` beyond its SM table
        (cuDNN missing or older than 9.23.1, CuTe DSL missing, cute-dsl on SM110), or None. Private helpers of
        FlashInfer: when a version lacks them the probe decides."""
        if backend == "cute-dsl" and cc not in _SM100_LAYOUT and cc // 10 != 12:
            return (f"cute-dsl: prepare_bf16_fp4_weights has no cute-dsl layout for SM{cc} (NotImplementedError: "
                    "SM100/103/107 and SM12x only)")
        try:
            gb = importlib.import_module("flashinfer.gemm.gemm_base")
        except Exception:  # noqa: BLE001 - older layout or a stand-in module: leave it to the probe
            return None
        name = "_check_cudnn_fp4_availability" if backend == "cudnn" else "_check_cute_dsl_availability"
        check = getattr(gb, name, None)
        if check is not None:
            try:
                check()
            except Exception as e:  # noqa: BLE001 - FlashInfer raises RuntimeError/ValueError with its own reason
                hint = "" if backend == "cudnn" else " (pip install nvidia-cutlass-dsl)"
                return f"{backend}: {describe_exception(e)}{hint}"
        if backend == "cudnn":
            try:
                mod = importlib.import_module("flashinfer.gemm.gemm_bf16_fp4")
                need = int(getattr(mod, "_CUDNN_BF16_FP4_MIN_BACKEND_VERSION", _CUDNN_MIN_BACKEND))
                have = int(mod.cudnn.backend_version())
            except Exception:  # noqa: BLE001 - no cudnn handle to ask: the probe decides
                return None
            if have < need:
                return f"cudnn: mm_bf16_fp4 needs cuDNN backend version >= {need}; found {have}"
        return None

    # -- per-problem rules ---------------------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        if problem.op != "w4a16":
            return f"FlashInfer mm_bf16_fp4 serves w4a16_mm only (16-bit activations); got {problem.call}"
        if problem.a_dtype != torch.bfloat16:
            return (f"FlashInfer mm_bf16_fp4 takes bfloat16 activations only (fp16 is not implemented: its common "
                    f"check raises TypeError); got a_dtype={problem.a_dtype}")
        if problem.out_dtype not in _HALF:
            return f"FlashInfer mm_bf16_fp4 writes bfloat16/float16 only; got out_dtype={problem.out_dtype}"
        cc = self.device_capability(problem.device) or 0
        reasons = [self._backend_rule(b, problem, cc) for b in self._candidates(cc)]
        return None if None in reasons else "; ".join(r for r in reasons if r)

    def _candidates(self, cc: int) -> tuple[str, ...]:
        """The usable backends ``unavailable`` found, or (before it ran) those that can prepare a weight on ``cc``."""
        return self._usable.get(cc) or tuple(b for b in MM_BACKENDS if b == "cudnn" or cc in _SM100_LAYOUT
                                             or cc // 10 == 12)

    def _backend_rule(self, backend: str, problem: Problem, cc: int) -> str | None:
        if backend == "cudnn":
            return alignment_reason(problem, 32, 32, "cudnn (fp4dispatch's FP4 rule)")
        if problem.out_dtype != torch.bfloat16:
            return f"cute-dsl on SM{cc} writes bfloat16 only; got out_dtype={problem.out_dtype}"
        if cc in _SM100_LAYOUT:
            return alignment_reason(problem, 8, 32, f"cute-dsl on SM{cc} (its kernel's can_implement)")
        return alignment_reason(problem, 64, 64, f"cute-dsl on SM{cc} (64-column weight tiles)")

    def configs(self, problem: Problem) -> list[Config]:
        cc = self.device_capability(problem.device) or 0
        fit = [b for b in self._candidates(cc) if self._backend_rule(b, problem, cc) is None]
        return [{"backend": b} for b in fit or self._candidates(cc)]

    # -- the call ------------------------------------------------------------------------------------------------
    def weight(self, ops: Operands) -> torch.Tensor:
        """The canonical weight as ``prepare_bf16_fp4_weights`` takes it: uint8 [N, K/2], low nibble = even k."""
        return ops.b.view(torch.uint8)

    def weight_scale(self, ops: Operands) -> torch.Tensor:
        """The 128x4-swizzled e4m3 scales (``nvfp4_quantize(..., sfLayout=layout_128x4)``'s), 2-D, zero-padded."""
        return ops.b_scale

    def prepare(self, ops: Operands, backend: str) -> tuple:
        """FlashInfer's own preparation for ``backend``: ``(b_p, sf_p)`` (alpha goes with each call)."""
        fi = self._lib or self._load()
        b_p, sf_p, alpha_p = fi.prepare_bf16_fp4_weights(self.weight(ops), self.weight_scale(ops), None,
                                                          backend=backend, block_size=16)
        if alpha_p is not None:
            raise RuntimeError(f"{self.name}: prepare_bf16_fp4_weights(alpha=None) returned an alpha; this flashinfer "
                               f"folds alpha into the weight, which fp4dispatch passes per call (written against "
                               f"{WRITTEN_AGAINST})")
        return b_p, sf_p

    def prepared_weight(self, ops: Operands, backend: str) -> tuple:
        kept = self.prepared.get(ops.b, ops.b_scale, lambda: tuple(_keep(t, ops) for t in self.prepare(ops, backend)),
                                 variant=backend)
        return tuple(_restore(t, ops) for t in kept)

    def activations(self, problem: Problem, ops: Operands) -> torch.Tensor:
        """``a`` as given: bf16 [M, K]."""
        return ops.a

    def epilogue_alpha(self, ops: Operands, align: int) -> torch.Tensor:
        """alpha as FlashInfer takes it: the device fp32 ``(1,)`` tensor, copied on the device when misaligned."""
        return aligned_alpha(ops.alpha, align)

    def run(self, problem: Problem, ops: Operands, config: Config) -> None:
        fi = self._lib or self._load()
        backend = config.get("backend") or self.configs(problem)[0]["backend"]
        cc = self.device_capability(problem.device) or 0
        b_p, sf_p = self.prepared_weight(ops, backend)
        align_a, align_out, align_alpha = _alignments(backend, cc)
        a = _aligned(self.activations(problem, ops), align_a)
        alpha = self.epilogue_alpha(ops, align_alpha)
        out = ops.out if ops.out.data_ptr() % align_out == 0 else torch.empty_like(ops.out)
        key = (problem.key, backend)
        # FlashInfer validated this shape class once; its decorator's checks cost CPU time on every decode-sized call
        kw = {"skip_check": True} if key in self._checked else {}
        fi.mm_bf16_fp4(a, b_p, sf_p, alpha, backend=backend, out_dtype=problem.out_dtype, out=out, block_size=16,
                       **kw)
        self._checked.add(key)
        if out is not ops.out:
            ops.out.copy_(out)
