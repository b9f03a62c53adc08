"""Device fingerprint: everything that can change which backend works or wins, hashed into the cache key."""
from __future__ import annotations

import hashlib
import json
import platform
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import torch

from ..settings import fingerprint_env
from ..version import __version__

__all__ = ["device_fingerprint", "fingerprint_hash", "fingerprint_diff", "source_hash"]

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


@lru_cache(maxsize=None)
def source_hash(root: str | None = None) -> str | None:
    """16 hex digits of sha256 over the package's Python sources (``root``: this package): its kernels, config lists
    and checks change which config works or wins, and the version string is not bumped for each change (a new
    candidate would otherwise never be tried on keys decided before it). None where no source file is found."""
    base = Path(root) if root else Path(__file__).resolve().parent
    files = sorted(base.rglob("*.py"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def device_fingerprint(device: torch.device) -> dict:
    """A JSON-able dict naming the device, its driver/CUDA, library versions, this package's source and relevant
    env."""
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
    libs = {name: _version(name) for name in _LIBS}
    libs["fp4dispatch"] = __version__
    fp["libs"] = libs
    fp["source"] = source_hash()
    fp["env"] = fingerprint_env()  # fp4dispatch's own knobs normalized: equivalent spellings share a file
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
