"""Device fingerprint: everything that can change which backend works or wins, hashed into the cache key."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import lru_cache
from importlib import metadata

import torch

from .config import RELEVANT_ENV

__all__ = ["device_fingerprint", "fingerprint_hash", "fingerprint_diff"]

_LIBS = ("torch", "triton", "flashinfer-python", "sgl-kernel", "sglang-kernel", "nvidia-cudnn-frontend", "fp4dispatch")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=None)
def _driver_version() -> str | None:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return str(v.value)
    except OSError:
        pass
    return None


def device_fingerprint(device: torch.device) -> dict:
    """A JSON-able dict naming the device, its driver/CUDA, library versions and relevant env."""
    fp: dict = {"device_type": device.type}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        fp.update(
            gpu=p.name,
            cc=f"{p.major}.{p.minor}",
            sm_count=p.multi_processor_count,
            total_memory_gb=round(p.total_memory / 2**30),
            driver=_driver_version(),
            cuda=torch.version.cuda,
        )
    else:
        fp.update(cpu=platform.processor() or platform.machine())
    from . import __version__

    libs = {name: _version(name) for name in _LIBS}
    libs["fp4dispatch"] = __version__
    fp["libs"] = libs
    fp["env"] = {k: os.environ[k] for k in RELEVANT_ENV if k in os.environ}
    return fp


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(ours: dict, theirs: dict, prefix: str = "") -> list[str]:
    """Human-readable differences, e.g. ``libs.torch: 2.11.0 (here) vs 2.9.1 (file)``."""
    out = []
    for k in sorted(set(ours) | set(theirs)):
        a, b = ours.get(k), theirs.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a} (here) vs {b} (file)")
    return out
