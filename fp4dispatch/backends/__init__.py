"""Built-in backends, in priority order (the order used when tuning is off, and the tie-break).

Native FP4 tensor-core kernels come first (fastest where they work), then the Triton kernels for GPUs without
FP4 tensor cores, then the exact reference. Probing goes the other way round: safe backends first, risky ones last.
"""
from __future__ import annotations

import importlib

from .base import Backend, BaseBackend, Config, config_id

__all__ = ["Backend", "BaseBackend", "Config", "config_id", "default_backends", "names"]

# (module, class, constructor arguments) per backend, in priority order, lazily imported so that a missing optional
# library never breaks anything. FlashInfer's mm_fp4 backends: cudnn and cutlass are its stable ones, b12x, cute-dsl
# and the low-latency variant are newer; trtllm needs a prepared weight; cake is experimental (FlashInfer never
# auto-selects it), so it comes after every other native backend.
_REGISTRY: list[tuple[str, str, tuple]] = [
    *[("flashinfer", "FlashInferBackend", (b,)) for b in ("cudnn", "cutlass", "b12x", "cute-dsl",
                                                         "cutedsl_low_latency")],
    ("flashinfer_trtllm", "FlashInferTrtllmBackend", ()),
    ("sgl_kernel", "SglKernelBackend", ()),
    ("sgl_kernel_grouped", "SglKernelGroupedBackend", ()),  # fp4_grouped_mm only
    ("torch_scaled_mm", "TorchScaledMmBackend", ()),
    ("torch_scaled_grouped_mm", "TorchScaledGroupedMmBackend", ()),  # fp4_grouped_mm only (SM100)
    ("flashinfer_grouped", "FlashInferGroupGemmBackend", ()),  # fp4_grouped_mm only (SM120/SM121)
    ("flashinfer_cudnn_grouped", "FlashInferCudnnGroupedBackend", ()),  # fp4_grouped_mm only (cuDNN, SM100+)
    ("flashinfer", "FlashInferCakeBackend", ()),
    ("flashinfer_bf16_fp4", "FlashInferBf16Fp4Backend", ()),
    ("humming", "HummingW4A4Backend", ()),  # FP4 activations on block-scaled MMA (SM100+)
    ("triton_fused", "TritonFusedBackend", ()),
    ("triton_w4a16", "TritonW4A16Backend", ()),  # w4a16_mm only
    ("triton_dequant", "TritonDequantBackend", ()),
    ("triton_grouped", "TritonGroupedBackend", ()),  # fp4_grouped_mm only
    ("humming_grouped", "HummingGroupedBackend", ()),  # fp4_grouped_mm: Humming's MoE GEMM on decoded tokens
    ("expert_loop", "ExpertLoopBackend", ()),  # fp4_grouped_mm only: one fp4_mm per expert
    # W4A16 with activations decoded per call; after fp4dispatch's own kernels, which it equals bit for bit where
    # both run (the tuner picks the faster per key)
    ("humming", "HummingBackend", ()),
    ("reference", "ReferenceBackend", ()),
]


def default_backends() -> list[Backend]:
    """Fresh instances of every built-in backend, in priority order."""
    return [getattr(importlib.import_module(f"{__name__}.{mod}"), cls)(*args) for mod, cls, args in _REGISTRY]


def names() -> list[str]:
    """Names of the built-in backends, in priority order."""
    return [b.name for b in default_backends()]
