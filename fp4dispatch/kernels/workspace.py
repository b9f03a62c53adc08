"""Scratch memory of the kernels, kept per (device, stream, thread) so that an eager call allocates nothing: the
pre-decoded operand and the split-K fp32 partials (``scratch``), and the split-K arrival counters (``counters``).

Buffers: one per (device, stream, thread, purpose), grown (never shrunk) when a call needs more. Reuse is safe
because one thread queues a call's launches before the next call's, and launches on one stream run in that order, so
a call's kernels finish with a buffer before the next call's start (two threads queueing on one stream could
interleave their calls' launches: each has its own buffers, dropped when the thread ends); a buffer replaced by a
larger one is freed to torch's caching allocator, which reuses its memory only in that stream's order.
A request above ``MAX_KEPT_BYTES`` gets its own tensor instead: at those sizes the kernels run for far longer than an
allocation takes, and the memory goes back to the allocator after the call.

Counters: the kernels leave every counter at zero when they finish, so a counter buffer is zeroed once, when it is
created, and reused by every later launch on its stream.

CUDA graphs: a call captured in a graph never uses a kept scratch buffer (a later eager call could grow it, freeing
the memory the graph still points to); it allocates its scratch during capture, from the graph's private memory pool,
which the graph keeps for as long as it lives. Counters: a capture reuses the counters of its capturing stream when
they exist (``prepare_capture`` makes them for ``torch.cuda.graph``'s default capture stream; ``fp4dispatch.warmup``
calls it); without them the launch gets fresh counters whose zero-fill is captured with it: always correct, one small
memset node per replay. Counters first zeroed inside one graph are never reused by another, which could be replayed
before it. Graphs captured on one stream share its counters, so they must not be replayed concurrently (as with
graphs sharing a memory pool).

Every buffer handed out is also reported to ``runtime.note_buffer``, so that a launch plan (``plan.py``) that
records a call knows which of its kernel arguments are scratch and how to get them again.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..devices import resolve_device
from ..errors import InvalidInputError
from .runtime import capturing, cuda_index, note_buffer, raw_stream

__all__ = ["scratch", "counters", "address", "buffers", "prepare", "prepare_capture", "thread_key", "MAX_KEPT_BYTES"]

log = logging.getLogger("fp4dispatch")

MIN_COUNTERS = 1 << 14  # 64 KB per (device, stream): >= the tiles of any split-K config at the M it is offered for
MAX_KEPT_BYTES = 64 << 20  # larger scratch is allocated per call (see the module docstring)
_COUNTERS: dict[tuple, torch.Tensor] = {}
_SCRATCH: dict[tuple, torch.Tensor] = {}
generation = 0  # bumped whenever a kept buffer is made or replaced: an address read earlier may be stale


def _key(device: torch.device, stream: torch.cuda.Stream | None) -> tuple:
    if device.type != "cuda":
        return (str(device), 0)
    idx = cuda_index(device)  # "cuda" and "cuda:0" alike
    s = stream.cuda_stream if stream is not None else raw_stream(idx)
    return (idx, s)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and capturing()


def _scratch_at(purpose: str, nbytes: int, device: torch.device, stream: int, capturing: bool
                ) -> tuple[torch.Tensor, bool]:
    """(a uint8 tensor of at least ``nbytes`` for ``purpose`` on ``stream``, whether it is a kept buffer)."""
    if nbytes > MAX_KEPT_BYTES or capturing:
        return torch.empty(nbytes, dtype=torch.uint8, device=device), False
    key = (device.index if device.type == "cuda" else str(device), stream, thread_key(), purpose)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < nbytes:
        # grow by half again, so that a slowly rising M does not reallocate on every call
        size = min(max(nbytes, 0 if buf is None else buf.numel() * 3 // 2), MAX_KEPT_BYTES)
        buf = _SCRATCH[key] = torch.empty(max(size, nbytes), dtype=torch.uint8, device=device)
        _bump()
    return buf, True


def _bump() -> None:
    global generation
    generation += 1


class _ThreadEnd:
    """Lives in a thread's local storage: when the thread ends, its kept buffers are dropped (a server that starts a
    thread per request must not keep scratch for each), and ``generation`` moves on, so that an address read by that
    thread is never served to a later thread that gets the same identifier."""
    __slots__ = ("ident",)

    def __init__(self, ident: int):
        self.ident = ident

    def __del__(self):
        try:
            for key in list(_SCRATCH):
                if key[2] == self.ident:
                    _SCRATCH.pop(key, None)
            _bump()
        except (TypeError, NameError):  # at interpreter exit the module's globals may be gone already
            pass


_local = threading.local()


def thread_key() -> int:
    """The current thread's part of a kept buffer's key (its identifier, watched by ``_ThreadEnd``)."""
    end = getattr(_local, "end", None)
    if end is None:
        end = _local.end = _ThreadEnd(threading.get_ident())
    return end.ident


def scratch(purpose: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized scratch of ``shape`` and ``dtype`` for ``purpose`` ("predecode", "splitk", ...), valid until the
    next call on the current stream that asks for the same purpose."""
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    buf, _ = _scratch_at(purpose, nbytes, device, _key(device, None)[1], _capturing(device))
    t = buf[:nbytes].view(dtype).view(shape)
    note_buffer(t, ("scratch", purpose, nbytes))
    return t


def address(need: tuple, device: torch.device, stream: int, capturing: bool, keep: list) -> int:
    """The address of what ``need`` asked for (``("scratch", purpose, nbytes)`` or ``("counters", tiles)``, as
    ``runtime.note_buffer`` reported it) on ``stream`` of ``device`` (an indexed device), without building a view: a
    launch plan needs only the address. A tensor made for this call alone is appended to ``keep``, which must outlive
    the launches; a kept buffer stays where it is until ``generation`` changes."""
    t, kept = (_scratch_at(need[1], need[2], device, stream, capturing) if need[0] == "scratch"
               else _counters(need[1], device))
    if not kept:
        keep.append(t)
    return t.data_ptr()


def prepare(device: torch.device, stream: torch.cuda.Stream | None = None, tiles: int = MIN_COUNTERS) -> None:
    """Create (zeroed) the counter buffer of ``stream`` (default: the current one) with room for ``tiles``; call it
    outside capture, e.g. for a stream that will capture a graph. ``device``: a torch.device or what it takes
    ('cuda:0'); InvalidInputError for one that cannot hold data here, or a ``stream`` that is not a CUDA stream."""
    device = resolve_device(device, "workspace.prepare")
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise InvalidInputError(f"workspace.prepare: stream must be None (the current stream) or a torch.cuda.Stream; "
                                f"got {stream!r}. Pass the stream the graph will be captured on")
    _prepare(device, stream, tiles)


def _prepare(device: torch.device, stream: torch.cuda.Stream | None, tiles: int) -> None:
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
        _bump()


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


def _counters(tiles: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(int32 counters of the current stream, >= ``tiles`` of them at zero; whether they are the kept ones)."""
    key = _key(device, None)
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= tiles:
        return have, True
    if _capturing(device):
        log.debug("fp4dispatch: split-K counters zeroed inside the CUDA graph (no prepared buffer for this stream)")
        return torch.zeros(tiles, dtype=torch.int32, device=device), False
    _prepare(device, None, tiles)
    return _COUNTERS[key], True


def counters(tiles: int, device: torch.device) -> torch.Tensor:
    """int32 counters, >= ``tiles`` of them at zero, for one split-K launch on the current stream."""
    t, _ = _counters(tiles, device)
    note_buffer(t, ("counters", tiles))
    return t


def buffers(m: int, n: int, split: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials [split, m, n], counters with >= ``tiles`` zeros) for one split-K launch."""
    return scratch("splitk", (split, m, n), torch.float32, device), counters(tiles, device)
