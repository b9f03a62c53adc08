"""Built-in backends, in priority order (the order used when tuning is off, and the tie-break).

Native FP4 tensor-core kernels come first (fastest where they work), then the Triton kernels for GPUs without
FP4 tensor cores, then the exact reference. Probing goes the other way round: safe backends first, risky ones last.
"""
from __future__ import annotations

import importlib

from .base import Backend, BaseBackend, Config, config_id

__all__ = ["Backend", "BaseBackend", "Config", "config_id", "default_backends", "names"]

# (module, factory) per backend, lazily imported so that a missing optional library never breaks anything.
_REGISTRY: list[tuple[str, str]] = [
    ("flashinfer", "stable_backends"),
    ("sgl_kernel", "SglKernelBackend"),
    ("torch_scaled_mm", "TorchScaledMmBackend"),
    ("flashinfer", "experimental_backends"),
    ("triton_fused", "TritonFusedBackend"),
    ("triton_dequant", "TritonDequantBackend"),
    ("reference", "ReferenceBackend"),
]


def default_backends() -> list[Backend]:
    """Fresh instances of every built-in backend, in priority order."""
    out: list[Backend] = []
    for mod, factory in _REGISTRY:
        made = getattr(importlib.import_module(f"{__name__}.{mod}"), factory)()
        out.extend(made if isinstance(made, list) else [made])
    return out


def names() -> list[str]:
    """Names of the built-in backends, in priority order."""
    return [b.name for b in default_backends()]
