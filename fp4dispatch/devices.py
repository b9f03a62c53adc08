"""Device arguments: which device a call, a warmup or a report means, and whether it can hold data here. The
dispatcher, the kernels' workspace and the test helpers all ask here (it imports nothing of fp4dispatch but
``errors``)."""
from __future__ import annotations

import torch

from .errors import InvalidInputError

__all__ = ["check_device", "resolve_device"]


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
