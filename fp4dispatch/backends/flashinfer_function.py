"""The base of a backend that calls one FlashInfer function which answers for its own SMs: FlashInfer's
``backend_requirement`` gives it ``is_compute_capability_supported(cc)`` (the ``@supported_compute_capability`` of its
problem check), so the SM list is FlashInfer's, never copied here. Its availability: CUDA, FlashInfer importable, the
function present, the SM supported, then a subclass's own gate (a library version FlashInfer checks itself)."""
from __future__ import annotations

import importlib

import torch

from ..errors import describe_exception
from ._native import NativeBackend
from .flashinfer import INSTALL_HINT

__all__ = ["FlashInferFunctionBackend"]


class FlashInferFunctionBackend(NativeBackend):
    library, install_hint = "flashinfer", INSTALL_HINT
    function = ""  # its dotted path under flashinfer, as reasons name it: "gemm.group_gemm_nvfp4_nt_groupwise"
    kernel = ""  # what it runs, as reasons name it: "FlashInfer's NVFP4 grouped GEMM"
    _transient = ("_lib", "_fn")

    def __init__(self) -> None:
        super().__init__()
        self._fn = None  # the function, found once for run

    def _reset_transient(self) -> None:
        self._fn = None

    def _call(self):
        """The function ``run`` calls, looked up once (raises with the reason when FlashInfer cannot be imported)."""
        if self._fn is None:
            self._fn = self._function(self._lib or self._load())
        return self._fn

    def _function(self, fi):
        """The function in ``fi``, or None: its module as an attribute of ``fi``, else imported."""
        module, name = self.function.rsplit(".", 1)
        mod = getattr(fi, module, None)
        if mod is None:
            try:
                mod = importlib.import_module(f"{fi.__name__}.{module}")
            except Exception:  # noqa: BLE001 - an older FlashInfer without that module
                return None
        return getattr(mod, name, None)

    def unavailable(self, device: torch.device) -> str | None:
        cc = self.device_capability(device)
        if cc is None:
            return f"needs CUDA ({self.kernel} runs on NVIDIA GPUs only)"
        fi, why = self._import()
        if fi is None:
            return why
        fn = self._function(fi)
        if fn is None:
            return f"flashinfer {getattr(fi, '__version__', '?')} has no {self.function} (upgrade flashinfer)"
        check = getattr(fn, "is_compute_capability_supported", None)
        try:
            ok = check is None or check(cc)  # without the check the probe decides
        except Exception as e:  # noqa: BLE001 - a broken check is a reason, not a crash
            return f"flashinfer {self.function}.is_compute_capability_supported({cc}) raised {describe_exception(e)}"
        why = self._refused(cc) if not ok else self._gate(fi, cc)
        if why is None:
            self._lib = fi
        return why

    def _refused(self, cc: int) -> str:
        return f"{self.kernel} does not support SM{cc}"

    def _gate(self, fi, cc: int) -> str | None:
        """Why FlashInfer would refuse to run here beyond the SM (a library version), or None."""
        return None
