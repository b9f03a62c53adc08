"""fp4dispatch: ``fp4_mm`` for NVFP4 — correct, and as fast as the GPU allows, on whatever GPU it lands on."""
from __future__ import annotations

from .version import __version__
from .api import fp4_grouped_mm, fp4_mm, get_dispatcher, set_dispatcher, w4a16_grouped_mm, w4a16_mm
from .errors import BackendError, DeviceMemoryError, FP4DispatchError, InvalidInputError, NoUsableBackendError
from .format import dequantize_nvfp4, quantize_nvfp4, swizzle_scales, unswizzle_scales
from .graphs import warmup
from . import nn, torch_ops  # noqa: F401  (torch_ops registers torch.ops.fp4dispatch.*)
from .dispatch.dispatcher import Dispatcher
from .checkpoint import LoadReport, load_nvfp4

__all__ = [
    "__version__",
    "fp4_mm",
    "w4a16_mm",
    "fp4_grouped_mm",
    "w4a16_grouped_mm",
    "Dispatcher",
    "warmup",
    "load_nvfp4",
    "LoadReport",
    "nn",
    "get_dispatcher",
    "set_dispatcher",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "swizzle_scales",
    "unswizzle_scales",
    "FP4DispatchError",
    "InvalidInputError",
    "BackendError",
    "NoUsableBackendError",
    "DeviceMemoryError",
]
