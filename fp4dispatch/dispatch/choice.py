"""What a decided key runs (``Choice``), the merges of the cache sections the dispatcher writes, and device checks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, Config, config_id
from ..errors import InvalidInputError

__all__ = ["Choice", "ident", "add_proven", "add_faults", "check_device", "resolve_device"]


@dataclass(eq=False)
class Choice:
    backend: Backend
    config: Config
    fallbacks: tuple = ()  # ((backend, config), ...) verified on this key, best first
    key: tuple | None = None  # None for a forced backend: no fallback, errors surface
    verified: set = field(default_factory=set)  # the M at which this backend and config were proven right


def ident(backend: Backend, config: Config) -> str:
    return f"{backend.name}|{config_id(config)}"


def add_proven(old: dict, new: dict) -> dict:
    """Merge of the verified section: the union of the M proven per backend and config."""
    return {**old, **{who: sorted(set(old.get(who, [])) | set(ms)) for who, ms in new.items()}}


def add_faults(old: dict, new: dict) -> dict:
    """Merge of the faults section: counts add up, the newest time and reason win."""
    out = dict(old)
    for name, rec in new.items():
        prev = out.get(name)
        out[name] = {**rec, "count": prev["count"] + rec["count"]} if isinstance(prev, dict) else rec
    return out


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
