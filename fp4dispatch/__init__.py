"""fp4dispatch: ``fp4_mm`` for NVFP4 — correct, and as fast as the GPU allows, on whatever GPU it lands on."""
from __future__ import annotations

__version__ = "0.1.0"

from .api import fp4_mm, get_dispatcher, set_dispatcher  # noqa: E402
from .errors import BackendError, FP4DispatchError, InvalidInputError, NoUsableBackendError  # noqa: E402
from .format import dequantize_nvfp4, quantize_nvfp4, swizzle_scales, unswizzle_scales  # noqa: E402
from .graphs import warmup  # noqa: E402
from . import nn, ops  # noqa: E402,F401  (ops registers torch.ops.fp4dispatch.*)
from .dispatcher import Dispatcher  # noqa: E402

__all__ = [
    "__version__",
    "fp4_mm",
    "Dispatcher",
    "warmup",
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
]
