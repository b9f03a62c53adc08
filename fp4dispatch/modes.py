"""The nn layers' choice between W4A4 and W4A16 (``mode="auto"``): W4A4 (activations quantized to NVFP4 per call)
pays only where a backend multiplies on FP4 tensor cores; everywhere else W4A16 (activations as they are) is both
faster and far more accurate (docs/integration.md, "Fp4Linear"). ``Fp4Linear`` asks about ``fp4_mm``, ``Fp4Experts``
about ``fp4_grouped_mm``."""
from __future__ import annotations

import torch

from .api import get_dispatcher
from .backends.base import computes
from .errors import InvalidInputError

__all__ = ["MODES", "native_fp4_backend", "ModeChoice"]

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
    ok = {r.name for r in d.report(device, (op,)) if r.status == "ok"}  # only that op's backends probed
    name = next((b.name for b in d.backends if getattr(b, "fp4_tensor_cores", False) and b.name in ok
                 and computes(b, op)), None)
    _NATIVE[(device, op)] = (d, name)
    return name


def _auto_mode(device: torch.device, op: str) -> str:
    """What "auto" resolves to on ``device``. Under torch.compile Dynamo runs this eagerly while tracing and keeps its
    answer as a constant: the dispatcher it asks holds a lock and probes backends, neither of which Dynamo can trace,
    so a layer whose first call is a compiled one (``fullgraph=True``) would otherwise fail. Outside a trace the mark
    changes nothing."""
    return "w4a4" if native_fp4_backend(device, op) else "w4a16"


# torch.compiler.assume_constant_result(_auto_mode), which sets only this attribute, would import torch._dynamo with
# fp4dispatch (seconds of a cold start, and the optional libraries its import looks for: tests/test_packaging.py);
# tests/test_integration.py's compiled first call fails if torch stops reading it
_auto_mode._dynamo_marked_constant = True  # type: ignore[attr-defined]


class ModeChoice:
    """What an nn layer with a ``mode`` shares: the check of the mode it is given and ``resolved_mode``, decided once
    per device. Subclasses name the op whose FP4 tensor-core backends make "auto" pick W4A4 (``mode_op``) and how
    their message says so (``mode_hint``)."""

    mode_op = "fp4_mm"
    mode_hint = "FP4 tensor cores serve it"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:  # layer.mode = "w4a16x" ran W4A4 silently (anything not "w4a16" did)
        self._set_mode(mode)

    def _set_mode(self, mode: str) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise InvalidInputError(f"{type(self).__name__}: mode must be one of {MODES}; got {mode!r}. 'auto' picks "
                                    f"W4A4 where {self.mode_hint}, else W4A16")
        self._mode = mode
        self._modes: dict[torch.device, str] = {}  # mode="auto": what it resolved to, per device

    def __setstate__(self, state: dict) -> None:
        if "mode" in state:  # pickled before mode was a property
            state["_mode"] = state.pop("mode")
        super().__setstate__(state)  # type: ignore[misc]

    def mode_repr(self) -> str:
        """``mode``, and what "auto" resolved to on each device asked so far (for ``repr``)."""
        return self.mode + "".join(f" ({m} on {d})" for d, m in self._modes.items())

    def resolved_mode(self, device: torch.device) -> str:
        """"w4a4" or "w4a16": ``mode`` itself, or what "auto" picks on ``device`` (decided once per device)."""
        if self._mode != "auto":
            return self._mode
        device = torch.device(device)  # "cpu" and torch.device("cpu") are one device (repr listed it twice)
        got = self._modes.get(device)
        if got is None:
            got = self._modes[device] = _auto_mode(device, self.mode_op)
        return got
