"""Run a probe in a spawned worker process with a timeout, so that a crash or a sticky CUDA error (illegal
instruction, vLLM #38423) cannot ruin the caller's process. A dead or hung worker is a ``failed`` verdict."""
from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time

import torch

from ..backends.base import Backend
from .probe import Verdict, describe_exception, unavailable_reason

__all__ = ["probe_isolated"]

CANCEL_POLL_S = 0.25  # how often a waiting caller looks at its cancel event


def _worker(conn, backend: Backend, device_str: str, upcoming: tuple) -> None:
    from .probe import probe_backend

    try:
        v = probe_backend(backend, torch.device(device_str), upcoming=upcoming)
        conn.send(v.to_json())
    except BaseException as e:  # noqa: BLE001 - report anything, the parent decides
        conn.send({"status": "failed", "reason": describe_exception(e)})
    finally:
        conn.close()


def _signal_name(code: int) -> str:
    try:
        return f"signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _wait(conn, timeout_s: float, cancel: threading.Event | None) -> bool:
    """``conn.poll(timeout_s)`` in short steps that give up once ``cancel`` is set."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if conn.poll(max(0.0, min(left, CANCEL_POLL_S) if cancel is not None else left)):
            return True
        if left <= 0 or (cancel is not None and cancel.is_set()):
            return False


def probe_isolated(backend: Backend, device: torch.device, timeout_s: float = 30.0, upcoming: tuple = (),
                   cancel: threading.Event | None = None, check_here: bool = False) -> Verdict:
    """``probe_backend`` in a fresh spawned process; ``failed: worker died (...)`` / ``failed: timed out ...``.
    ``upcoming``: new keys' problems whose first runs the worker makes with the probe's (``probe_backend``), one per
    ``first_run_unit``; ``timeout_s`` must allow them.
    A worker that dies with upcoming runs is a transient verdict: the crash may be one key's shape, not the probe's.
    ``cancel`` set (the caller was interrupted): the worker is killed at once, a transient verdict.
    ``check_here``: ``backend.unavailable`` runs in this process once the worker has started (its library's import
    overlaps the worker's start); a reason there kills the worker and is the verdict."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(child, backend, str(device), tuple(upcoming)), daemon=True)
    try:
        proc.start()
    except Exception as e:  # noqa: BLE001 - e.g. the backend does not pickle
        return Verdict("failed", f"could not start a probe worker: {describe_exception(e)}")
    child.close()
    try:
        if check_here and (why := unavailable_reason(backend, device)):
            proc.kill()
            proc.join(5)
            return Verdict("unavailable", why)
        if _wait(parent, timeout_s, cancel):
            try:
                return Verdict.from_json(parent.recv())
            except EOFError:
                pass  # the worker died before it could answer
        elif cancel is not None and cancel.is_set():
            proc.kill()
            proc.join(5)
            return Verdict("failed", "probe interrupted (worker killed)", transient=True)
        else:
            proc.kill()
            proc.join(5)
            # transient: not cached, since a first-use JIT compile (FlashInfer cutlass/trtllm) can be that slow
            return Verdict("failed", f"timed out after {timeout_s:g} s (worker killed)", timeout_s, transient=True)
        proc.join(timeout_s)
        code = proc.exitcode
        how = _signal_name(code) if code is not None and code < 0 else f"exit code {code}"
        if upcoming:  # the probe or one of the keys' shapes: kept out of this process, probed again by the next
            return Verdict("failed", f"worker died ({how}) while probing and making the first runs of "
                           f"{len(upcoming)} new keys (not cached)", transient=True)
        return Verdict("failed", f"worker died ({how})")
    finally:
        parent.close()
        if proc.is_alive():
            proc.kill()
            proc.join(5)
