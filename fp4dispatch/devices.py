"""Device arguments: which device a call, a warmup or a report means, and whether it can hold data here. The
dispatcher, the kernels' workspace and the test helpers all ask here (it imports nothing of fp4dispatch but
``errors``)."""
from __future__ import annotations

import torch

from .errors import InvalidInputError

__all__ = ["check_device", "resolve_device", "check_not_traced"]


def check_device(device: torch.device, who: str = "fp4_mm") -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"{who}: device {device} was asked for, but CUDA is not available here "
                                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use CPU tensors")
    if device.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"{who}: tensors must hold data on a CPU or CUDA device; got device {device}. "
                                "Meta and fake tensors go through torch.compile (the custom op), not a direct call")


def resolve_device(device, who: str = "fp4_mm") -> torch.device:
    """``device`` as a concrete torch.device (None: the current CUDA device, else the CPU); InvalidInputError
    (its message begins ``who``) when it is not a device or cannot hold data here."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        d = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise InvalidInputError(f"{who}: device must be None, a torch.device, a string like 'cuda:0' or 'cpu', or a "
                                f"CUDA index; got {device!r}") from None
    check_device(d, who)
    if d.type == "cpu":  # CPU tensors' device is "cpu", never "cpu:0": a key decided for "cpu:0" no call would use
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def check_not_traced(who: str = "fp4_mm") -> None:
    """Refuse a direct call under FakeTensorMode or make_fx: the dispatcher would probe, time and check backends on
    tensors without data, and record what that gives against them. torch.compile and torch.export trace the custom
    op instead (its fake implementation gives the output's shape). Called where a call is decided or recovered from
    a fault, never on the decided path."""
    from torch._C import _get_dispatch_mode, _TorchDispatchModeKey

    if _get_dispatch_mode(_TorchDispatchModeKey.FAKE) is not None:
        mode = "FakeTensorMode"
    elif _get_dispatch_mode(_TorchDispatchModeKey.PROXY) is not None:
        mode = "make_fx (a proxy tensor mode)"
    else:
        return
    raise InvalidInputError(f"{who}: called directly under {mode}, whose tensors hold no data to choose a backend "
                            f"with. Trace it with torch.compile or torch.export, or call torch.ops.fp4dispatch."
                            f"{who} (the custom op: its fake implementation gives the output's shape)")
