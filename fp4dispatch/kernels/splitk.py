"""Host side of the split-K epilogue (``tiles.store_out``): the fp32 partial-sum workspace and the per-tile arrival
counters, so that a split-K launch needs no memset and no finalize launch.

The kernels leave every counter at zero when they finish, so a counter buffer is zeroed once, when it is created,
and reused by every later launch on its stream (launches on one stream never overlap). There is one buffer per
(device, stream), so split-K launches on two streams may run at the same time.

CUDA graphs: a capture reuses the buffer of its capturing stream when one exists (``prepare_capture`` makes it for
``torch.cuda.graph``'s default capture stream; ``fp4dispatch.warmup`` calls it). Without one, the launch gets a fresh
buffer whose zero-fill is captured with it: always correct, one small memset node per replay. A buffer first zeroed
inside one graph is never reused by another, which could be replayed before it. Graphs captured on one stream share
its buffer, so they must not be replayed concurrently (as with graphs sharing a memory pool).
"""
from __future__ import annotations

import logging

import torch

from .runtime import cuda_index

__all__ = ["buffers", "prepare", "prepare_capture"]

log = logging.getLogger("fp4dispatch")

MIN_COUNTERS = 1 << 14  # 64 KB per (device, stream): >= the tiles of any split-K config at the M it is offered for
_COUNTERS: dict[tuple, torch.Tensor] = {}


def _key(device: torch.device, stream: torch.cuda.Stream | None) -> tuple:
    if device.type != "cuda":
        return (str(device), 0)
    idx = cuda_index(device)  # "cuda" and "cuda:0" alike
    s = stream if stream is not None else torch.cuda.current_stream(idx)
    return (f"cuda:{idx}", s.cuda_stream)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def prepare(device: torch.device, stream: torch.cuda.Stream | None = None, tiles: int = MIN_COUNTERS) -> None:
    """Create (zeroed) the counter buffer of ``stream`` (default: the current one) with room for ``tiles``; call it
    outside capture, e.g. for a stream that will capture a graph."""
    key = _key(device, stream)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < tiles:
        n = max(MIN_COUNTERS, tiles)
        if device.type == "cuda" and stream is not None:
            with torch.cuda.stream(stream):
                _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
            torch.cuda.current_stream(device).wait_stream(stream)
        else:
            _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)


def prepare_capture(device: torch.device) -> None:
    """Create the counters of ``torch.cuda.graph``'s default capture stream, so that split-K launches captured there
    need no memset node. If no graph has made that stream yet, it is made here the way torch makes it (on the current
    device, so only when ``device`` is the current one: torch would capture on it for every later graph)."""
    if device.type != "cuda":
        return
    idx = cuda_index(device)
    if torch.cuda.graph.default_capture_stream is None and idx == torch.cuda.current_device():
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    stream = torch.cuda.graph.default_capture_stream
    if stream is not None and stream.device.index == idx:
        prepare(torch.device("cuda", idx), stream)


def buffers(m: int, n: int, split: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace fp32 [split, m, n], int32 counters with >= ``tiles`` zeros) for one split-K launch."""
    ws = torch.empty((split, m, n), dtype=torch.float32, device=device)
    key = _key(device, None)
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= tiles:
        return ws, have
    if _capturing(device):
        log.debug("fp4dispatch: split-K counters zeroed inside the CUDA graph (no prepared buffer for this stream)")
        return ws, torch.zeros(tiles, dtype=torch.int32, device=device)
    prepare(device, None, tiles)
    return ws, _COUNTERS[key]
