"""Humming's kernels for a dense shape's other M buckets, compiled in the background without being loaded.

A dense layer's first run at a new M bucket compiles that bucket's kernels (``humming.bucket_entries``), and that
compile is most of a new key's first call (benchmarks/RESULTS.md, "Cold start"). When a key of a shape is tuned on
its first call, the rest of the shape's table is handed here (``compile_later``) once that key's first run has
prepared the layer, so that the shape's next keys find their kernels compiled.

How that stays off the CUDA driver (a thread of ours must make no CUDA call: the caller may be capturing a graph):
Humming compiles a kernel in a subprocess (NVRTC or nvcc) into its disk cache, one cubin per hash of the kernel's
source, flags and compiler, under a file lock (``humming/jit/compiler.py``); only ``HummingKernel.init_kernel``'s
last step, ``register_kernel``, loads the cubin into the driver. ``_compile_only_class`` is the kernel with that step
left out: the same source, so the same cubin, and no CUDA call (the checks before it read device attributes that
Humming has cached, and the compiler is another process). A later first run of the kernel finds the cubin, or waits
on the lock for the compile in flight, and only loads it. The kernels are built for the GPU the background thread
sees (device 0's architecture), so a shape on a device of another architecture is skipped.

The work runs on daemon threads: a process that exits does not wait for it (a compile cut short leaves no cubin,
and the next process compiles that kernel again).
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import threading

from ..errors import describe_exception

__all__ = ["compile_later", "wait_idle", "started", "failures"]

log = logging.getLogger("fp4dispatch")

_jobs: queue.Queue = queue.Queue()
_lock = threading.Lock()
_threads: list[threading.Thread] = []
_seen: set[str] = set()  # the kernel configs handed out in this process
_classes: dict[int, type] = {}  # id(HummingKernel) -> its compile-only subclass
_stopping = threading.Event()
started: list[str] = []  # the kernel configs whose compile began (tests read it)
failures: list[str] = []  # why a compile raised (its key's own first run raises it again and reports it)


NICE = 19  # the background's niceness: it compiles on the CPU time that the foreground leaves


def _workers(lib) -> int:
    """Compiles at once: as many as Humming's own parallel build runs (the CPUs this process may use, its cgroup
    quota included, capped by ``HUMMING_MAX_PARALLEL_BUILD_WORKERS``); at ``NICE`` they take no core from the
    foreground's compiles."""
    try:
        return max(1, int(lib.utils.cpu.get_parallel_build_workers()))
    except Exception:  # noqa: BLE001 - a release without it: the CPUs this process may run on
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _lower_priority() -> None:
    """This thread, and every compiler it starts (a child takes its niceness from the thread that starts it), yield
    the CPU to the rest of the process: a key being decided compiles its own kernels, and Triton's, first (Linux
    keeps a niceness per thread; elsewhere this does nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


def _compile_only_class(kernel_cls: type) -> type:
    with _lock:
        cls = _classes.get(id(kernel_cls))
        if cls is None:
            # register_kernel loads the cubin into the CUDA driver: the one step a background compile must not take
            cls = _classes[id(kernel_cls)] = type("CompileOnlyHummingKernel", (kernel_cls,),
                                                  {"register_kernel": lambda self: None})
    return cls


def _distance(entry: list, m: int) -> float:
    """How far, in powers of two, the M range of a table entry (``lo < M <= hi``) lies from ``m``."""
    lo, hi = entry[0], entry[1]
    if lo < m <= hi:
        return 0.0
    return math.log2(m / hi) if m > hi else math.log2((lo + 1) / m)


def compile_later(lib, layer_config, table: list, m: int, device_sm: int, own: list = ()) -> int:
    """Hand the kernels of ``table``'s entries (``[lo, hi, tuning config]``, Stream-K off) for the dense layer
    ``layer_config`` (its ``HummingLayer.humming_config``) to the background threads, those serving M nearest to
    ``m`` first; returns how many were new. ``own``: entries the caller compiles itself now (the first run of
    ``m``'s bucket), left out: a run waiting on the lock of a low-priority compile of its own kernel would wait
    longer. ``device_sm``: the layer's GPU (``major * 10 + minor``)."""
    layer = json.loads(layer_config.to_str())
    layer.pop("sublayer_name", None)  # as HummingKernel.prepare_kernels does
    layer["sm_version"] = layer_config.sm_version
    new = 0
    for entry in list(own) + sorted(table, key=lambda e: _distance(e, m)):
        config = {**layer, **entry[2]}
        config.pop("num_sms", None)  # a launch argument, not the kernel's (prepare_kernels pops it too)
        text = json.dumps(config, sort_keys=True)
        with _lock:
            if text in _seen:
                continue
            _seen.add(text)
        if entry in own:
            continue
        _jobs.put((lib, config, text, device_sm))
        new += 1
    if new:
        log.info("fp4dispatch: Humming compiles %d kernels of the %sx%s layer's table in the background", new,
                 layer.get("shape_n"), layer.get("shape_k"))
        _start(lib)
    return new


def _start(lib) -> None:
    with _lock:
        while len(_threads) < _workers(lib):
            t = threading.Thread(target=_work, name="fp4dispatch-humming-compile", daemon=True)
            t.start()
            _threads.append(t)


def _work() -> None:
    _lower_priority()
    while True:
        lib, config, text, device_sm = _jobs.get()
        try:
            if not _stopping.is_set():
                _compile(lib, config, text, device_sm)
        except Exception as e:  # noqa: BLE001 - this thread serves the next job; the key's first run reports it
            failures.append(f"{text}: {describe_exception(e)}")
            log.debug("fp4dispatch: Humming's background compile of %s failed: %s", text, describe_exception(e))
        finally:
            _jobs.task_done()


def _compile(lib, config: dict, text: str, device_sm: int) -> None:
    # the GPU Humming builds for in this thread; another architecture's cubin would serve nothing
    if lib.device.current_device.sm_version != device_sm:
        return
    started.append(text)
    kernel_cls = lib.kernel.HummingKernel
    cls = _compile_only_class(kernel_cls)
    kernel = cls(**config)  # compiles (or finds the cubin compiled); a failure is the caller's to record
    # Humming keeps every kernel object it made; this one's work is in its disk cache, so it is let go
    instances = getattr(kernel_cls, "_instances", {})
    for sig in [s for s, v in list(instances.items()) if v is kernel]:
        instances.pop(sig, None)


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until every kernel handed out has been compiled (tests); False if ``timeout`` ran out."""
    done = threading.Event()

    def join():
        _jobs.join()
        done.set()

    threading.Thread(target=join, daemon=True).start()
    return done.wait(timeout)


atexit.register(_stopping.set)  # a process that exits skips the compiles not begun (daemon threads end with it)
