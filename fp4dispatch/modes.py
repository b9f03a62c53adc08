"""The nn layers' choice between W4A4 and W4A16 (``mode="auto"``): W4A4 (activations quantized to NVFP4 per call)
pays only where a backend multiplies on FP4 tensor cores; everywhere else W4A16 (activations as they are) is both
faster and far more accurate (docs/integration.md, "Fp4Linear"). ``Fp4Linear`` asks about ``fp4_mm``, ``Fp4Experts``
about ``fp4_grouped_mm``."""
from __future__ import annotations

import torch

from .api import get_dispatcher
from .backends.base import computes

__all__ = ["MODES", "native_fp4_backend"]

MODES = ("auto", "w4a4", "w4a16")

_NATIVE: dict[tuple, tuple[object, str | None]] = {}  # (device, op) -> (the dispatcher asked, its answer)


def native_fp4_backend(device: torch.device, op: str = "fp4_mm") -> str | None:
    """The first backend of the default dispatcher that computes ``op`` on FP4 tensor cores and is healthy on
    ``device`` (probing it once), or None: what ``mode="auto"`` goes by. Asked once per device, op and dispatcher, not
    per layer."""
    d = get_dispatcher()
    hit = _NATIVE.get((device, op))
    if hit is not None and hit[0] is d:
        return hit[1]
    ok = {r.name for r in d.report(device) if r.status == "ok"}
    name = next((b.name for b in d.backends if getattr(b, "fp4_tensor_cores", False) and b.name in ok
                 and computes(b, op)), None)
    _NATIVE[(device, op)] = (d, name)
    return name
