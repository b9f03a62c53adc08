"""Run a probe in a worker process with a timeout, so that a crash or a sticky CUDA error (illegal instruction, vLLM
#38423) cannot ruin the caller's process. A dead or hung worker is a ``failed`` verdict.

The worker is fp4dispatch/worker_process.py's (``main`` below), not a ``multiprocessing`` child, which would run the
caller's main script again first. It gets this process's module path and one job: the backend, the device and the
upcoming problems, pickled; it answers the verdict's JSON."""
from __future__ import annotations

import pickle
import select
import signal
import threading
import time

import torch

from .. import worker_process
from ..backends.base import Backend
from ..errors import out_of_memory
from .probe import Verdict, describe_exception, memory_verdict, unavailable_reason

__all__ = ["probe_isolated", "main"]

CANCEL_POLL_S = 0.25  # how often a waiting caller looks at its cancel event
# Ctrl-C in a terminal signals its whole process group, the workers too, while this process may go on (an
# application that handles SIGINT itself, or a probe run by another thread than the main one)
_INTERRUPTED = "probe worker interrupted by SIGINT (not cached: probed again by the next process)"
# signals that come from outside, not from a backend's fault: the kernel's out-of-memory killer and `kill -9` send
# SIGKILL, a job scheduler or a container's stop SIGTERM, a closed terminal SIGHUP. Cached as the backend's verdict,
# one such kill would have kept a healthy backend out of every later process.
_FROM_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGHUP)
# a worker that cannot take the job says nothing of the backend
_NO_WORKER = ("not cached: nothing was learned of the backend; define its class in a module a fresh process can "
              "import, or probe it in this process: FP4DISPATCH_ISOLATE=0")


def _verdict(backend: Backend, device_str: str, upcoming: tuple) -> dict:
    from .probe import probe_backend

    try:
        return probe_backend(backend, torch.device(device_str), upcoming=upcoming).to_json()
    except KeyboardInterrupt:
        # says nothing of the backend: the worker dies by SIGINT (worker_process), a transient verdict for the parent
        raise
    except BaseException as e:  # noqa: BLE001 - report anything, the parent decides
        if out_of_memory(e):  # its probe's inputs did not fit: no verdict on the backend
            return memory_verdict(describe_exception(e)).to_json()
        return {"status": "failed", "reason": describe_exception(e)}


def main() -> None:
    """A probe worker: one job on stdin, its verdict's JSON on the answer pipe."""
    worker_process.log_to_parent()
    worker_process.serve_job(_verdict, lambda why: {"status": "failed", "reason": f"{why} ({_NO_WORKER})",
                                                    "transient": True})


def _signal_name(code: int) -> str:
    try:
        return f"signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _wait(answers, proc, timeout_s: float, cancel: threading.Event | None) -> str:
    """What came first, looking in short steps: "answer" (the answer pipe is readable: the answer, or its end),
    "ended" (the worker exited and nothing came: a process it started holds the pipe open, so its end never comes),
    "cancel" (``cancel`` set) or "timeout" (``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if select.select([answers], [], [], max(0.0, min(left, CANCEL_POLL_S)))[0]:
            return "answer"
        if proc.poll() is not None:  # what it wrote before it exited is in the pipe by now
            return "answer" if select.select([answers], [], [], 0)[0] else "ended"
        if cancel is not None and cancel.is_set():
            return "cancel"
        if left <= 0:
            return "timeout"


def probe_isolated(backend: Backend, device: torch.device, timeout_s: float = 30.0, upcoming: tuple = (),
                   cancel: threading.Event | None = None, check_here: bool = False) -> Verdict:
    """``probe_backend`` in a fresh worker process; ``failed: worker died (...)`` / ``failed: timed out ...``.
    ``upcoming``: new keys' problems whose first runs the worker makes with the probe's (``probe_backend``), one per
    ``first_run_unit``; ``timeout_s`` must allow them.
    A worker that dies with upcoming runs is a transient verdict: the crash may be one key's shape, not the probe's.
    ``cancel`` set (the caller was interrupted): the worker is killed at once, a transient verdict.
    A worker interrupted by SIGINT or killed from outside (``_FROM_OUTSIDE``: not the backend's fault) is a transient
    verdict.
    ``check_here``: ``backend.unavailable`` runs in this process once the worker has started (its library's import
    overlaps the worker's start); a reason there kills the worker and is the verdict."""
    if type(backend).__module__ == "__main__":
        return Verdict("failed", f"{backend.name!r} cannot be probed in a worker process: its class is defined in the "
                       f"main script, which a worker does not run; define it in an importable module, or probe it "
                       f"in this process (FP4DISPATCH_ISOLATE=0)", transient=True)
    try:
        proc, answers = worker_process.start_job(__name__, pickle.dumps((backend, str(device), tuple(upcoming))))
    except Exception as e:  # noqa: BLE001 - it does not pickle, or this process cannot start one (its fds, say)
        return Verdict("failed", f"could not start a probe worker: {describe_exception(e)} ({_NO_WORKER})",
                       transient=True)
    try:
        if check_here and (why := unavailable_reason(backend, device)):
            return Verdict("unavailable", why)
        state = _wait(answers, proc, timeout_s, cancel)
        if state == "answer":
            try:
                return Verdict.from_json(worker_process.read_answer(answers, 0))
            except EOFError:
                pass  # the worker died before it could answer
        elif state == "cancel":
            return Verdict("failed", "probe interrupted (worker killed)", transient=True)
        elif state == "timeout":
            # transient: not cached, since a first-use JIT compile (FlashInfer cutlass/trtllm) can be that slow
            return Verdict("failed", f"timed out after {timeout_s:g} s (worker killed; not cached; "
                           "FP4DISPATCH_PROBE_TIMEOUT sets the limit)", timeout_s, transient=True)
        try:
            code = proc.wait(timeout_s)
        except Exception:  # noqa: BLE001 - closed its pipe but lives on: killed below
            code = None
        how = _signal_name(code) if code is not None and code < 0 else f"exit code {code}"
        if code == -signal.SIGINT:  # interrupted, wherever it was (worker_process: a worker dies by SIGINT)
            return Verdict("failed", f"{_INTERRUPTED} ({how})", transient=True)
        if code is not None and -code in _FROM_OUTSIDE:
            return Verdict("failed", f"probe worker killed from outside ({how}: the out-of-memory killer if the "
                           "host ran short of memory, else a kill, a scheduler's stop or a closed terminal); not "
                           "cached: probed again by the next process", transient=True)
        if upcoming:  # the probe or one of the keys' shapes: kept out of this process, probed again by the next
            return Verdict("failed", f"worker died ({how}) while probing and making the first runs of "
                           f"{len(upcoming)} new keys (not cached)", transient=True)
        return Verdict("failed", f"worker died ({how})")
    finally:
        answers.close()
        if proc.poll() is None:
            worker_process.kill(proc)  # and what it started: a JIT compile's compiler runs on otherwise
        try:
            proc.stdin.close()
            proc.wait(5)
        except Exception:  # noqa: BLE001 - a broken pipe, or a process the kernel has not reaped yet
            pass
