"""Every test gets its own cache dir and a fresh process-wide dispatcher; env knobs are cleared."""
from __future__ import annotations

import pytest

import fp4dispatch

_KNOBS = ("FP4DISPATCH_BACKEND", "FP4DISPATCH_DISABLE", "FP4DISPATCH_TUNE", "FP4DISPATCH_ISOLATE",
          "FP4DISPATCH_GUARD", "FP4DISPATCH_GUARD_EVERY", "FP4DISPATCH_LOG", "FP4DISPATCH_TIMER",
          "FP4DISPATCH_PROBE_TIMEOUT", "FP4DISPATCH_COMPILE_WORKERS", "FP4DISPATCH_BACKGROUND_COMPILE")


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    for k in _KNOBS:
        monkeypatch.delenv(k, raising=False)
    cache = tmp_path / "fp4cache"
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", str(cache))
    fp4dispatch.set_dispatcher(None)
    yield cache
    fp4dispatch.set_dispatcher(None)


@pytest.fixture
def cache_dir(_fresh_cache):
    """The per-test cache directory (also in FP4DISPATCH_CACHE_DIR)."""
    return _fresh_cache


@pytest.fixture
def cc(monkeypatch):
    """Make every native backend see a GPU of the given compute capability while running on CPU tensors."""
    from fp4dispatch.backends import _native

    def set_cc(value: int | None) -> None:
        monkeypatch.setattr(_native.NativeBackend, "device_capability", lambda self, device: value)
    return set_cc
