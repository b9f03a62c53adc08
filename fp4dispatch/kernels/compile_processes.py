"""Triton compiles in worker processes, for compiling many keys' kernels at once (``precompile.compile_keys_ahead``).

Triton's async compile mode runs each compile on an executor. On a thread pool the compiles share this process's
GIL, which much of a compile holds (the Python front end that walks the kernel's AST), so many compiles at once
starve each other and the thread that checks and times the keys meanwhile (docs/tuning.md, "Compile workers").
``CompileExecutor`` hands each compile to a worker process first (compile_worker.py), which compiles it into
Triton's disk cache, and then runs Triton's own compile in a thread here, where it is a cache hit (reading files).
A compile the workers cannot take (its kernel is not a module-level name, an argument does not pickle, a Triton
whose compile closure holds other names) or that failed there compiles in the thread as before: a kernel never
depends on the workers, only how soon it is ready.

The workers are plain subprocesses that run this process's fp4dispatch (fp4dispatch/worker_process.py says why).
Each worker imports fp4dispatch (and torch) once, then compiles job after job; they start when a
``CompileWorkers`` is made and stop when it is closed (or when this process exits: their stdin closes).
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import subprocess
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from .. import worker_process

__all__ = ["CompileWorkers", "CompileExecutor", "WorkerGone", "compile_job", "worker_count"]

log = logging.getLogger("fp4dispatch")
_JOB_NAMES = ("src", "target", "options")  # what Triton's async compile closure must hold for a job
CLOSE_WAIT_S = 2.0  # how long closing waits for a busy worker before killing it
READY_WAIT_S = 60.0  # a worker's start (an import of torch on a loaded machine); one not ready by then is given up
ANSWER_WAIT_S = 600.0  # one compile; a worker silent for longer is given up (its compile then happens here)
READY = "ready"  # a worker's first answer, once it can take jobs


class WorkerGone(RuntimeError):
    """No compile worker is left to take a job (each exited or could not start)."""


def worker_count(processes: int | None = None) -> int:
    """Workers for one of ``processes`` processes that compile on this machine at once (default: torchrun's
    ``LOCAL_WORLD_SIZE``, else 1): their share of every core but two (this process and a probe worker keep working
    meanwhile), at least 1 and at most 14."""
    if processes is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        processes = int(raw) if raw.isdigit() else 1
    return max(1, min(((os.cpu_count() or 1) - 2) // max(processes, 1), 14))


def compile_job(compile_fn) -> tuple | None:
    """The picklable job of Triton's async compile function ``compile_fn`` (a closure over the kernel's ``src``,
    ``target``, ``options`` and ``env_vars``; compile_worker.py's ``compile_one`` runs it), or None where it cannot
    be one."""
    code, cells = getattr(compile_fn, "__code__", None), getattr(compile_fn, "__closure__", None) or ()
    try:
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}
    except ValueError:  # a cell not filled yet
        return None
    if not all(n in free for n in _JOB_NAMES):
        return None
    src, options = free["src"], free["options"]
    py = getattr(getattr(src, "fn", None), "fn", None)  # the JITFunction's Python function
    module, name = getattr(py, "__module__", None), getattr(py, "__qualname__", "")
    if not module or not name or "<locals>" in name:
        return None
    job = (module, name, type(src).__module__, type(src).__qualname__, src.signature, src.constants, src.attrs,
           free["target"], dict(getattr(options, "__dict__", options)), free.get("env_vars"))
    try:
        pickle.dumps(job)
    except Exception:  # noqa: BLE001 - a constexpr that does not pickle: compiled in a thread
        return None
    return job


class CompileWorkers:
    """``count`` compile worker processes fed from one queue, each by a thread of this process; ``submit(job)``
    returns a future of None (compiled into the disk cache), or of the worker's error."""

    def __init__(self, count: int, command: list[str] | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive, self._threads, self._procs = 0, [], []
        command = command or worker_process.command("fp4dispatch.kernels.compile_worker")
        for i in range(count):
            try:
                proc, answers = worker_process.start(command)
            except OSError as e:
                log.debug("fp4dispatch: a compile worker did not start (%s)", e)
                continue
            self._alive += 1
            self._procs.append(proc)
            t = threading.Thread(target=self._feed, args=(proc, answers), name=f"fp4dispatch-compile-worker-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, job: tuple) -> Future:
        f: Future = Future()
        with self._lock:
            if self._alive:
                self._jobs.put((job, f))
                return f
        f.set_exception(WorkerGone("no compile worker is running"))
        return f

    def _feed(self, proc: subprocess.Popen, answers) -> None:
        try:
            try:
                if worker_process.read_answer(answers, READY_WAIT_S) != READY:
                    raise ValueError("not a compile worker")
            except Exception as e:  # noqa: BLE001 - it exited, hung or is something else: the others take its jobs
                log.debug("fp4dispatch: a compile worker did not start (%s)", e)
                return
            while (item := self._jobs.get()) is not None:
                job, f = item
                if not f.set_running_or_notify_cancel():
                    continue
                try:
                    worker_process.write_frame(proc.stdin, pickle.dumps(job))
                    answer = worker_process.read_answer(answers, ANSWER_WAIT_S)
                except Exception as e:  # noqa: BLE001 - EOF, a broken pipe or a timeout: the worker is lost
                    f.set_exception(WorkerGone(f"a compile worker was lost ({type(e).__name__}, code {proc.poll()})"))
                    return
                if answer is None:
                    f.set_result(None)
                else:
                    f.set_exception(RuntimeError(answer))
        finally:
            self._gone(proc)
            answers.close()

    def _gone(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._alive -= 1
            last = self._alive == 0
        while last:  # no one else will take what is queued
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(WorkerGone("no compile worker is running"))
        try:  # an idle worker exits at once on EOF; one still starting (importing torch) or compiling is killed
            proc.stdin.close()
            proc.wait(timeout=0.5)
        except Exception:  # noqa: BLE001 - a broken pipe, or a timeout: it holds nothing of ours
            worker_process.kill(proc)

    def close(self) -> None:
        """Stop the workers; a job still queued (the caller was interrupted) is cancelled, so its compile happens in
        this process. Returns when the workers have exited."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=CLOSE_WAIT_S)
        for proc in self._procs:  # still busy with a compile no one waits for now, or stuck
            if proc.poll() is None:
                worker_process.kill(proc)
        for t in self._threads:
            t.join()


class CompileExecutor(Executor):
    """The executor of Triton's ``AsyncCompileMode`` in ``runtime.compiles_ahead``: each compile first in one of
    ``workers`` (then a cache hit here), on one of ``threads`` threads of this process; without ``workers``, or for
    a compile they cannot take, on those threads only."""

    def __init__(self, threads: int, workers: CompileWorkers | None = None):
        self._threads = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fp4dispatch-compile")
        self._workers = workers

    def submit(self, fn, /, *args, **kwargs) -> Future:
        job = compile_job(fn) if self._workers is not None else None
        if job is None:
            if self._workers is not None:
                log.debug("fp4dispatch: a compile the workers cannot take (%s) is compiled in this process",
                          getattr(getattr(fn, "__code__", None), "co_freevars", None))
            return self._threads.submit(fn, *args, **kwargs)
        return self._threads.submit(_after, self._workers.submit(job), fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._threads.shutdown(wait=wait, cancel_futures=cancel_futures)


def _after(remote: Future, fn, args: tuple, kwargs: dict):
    try:
        remote.result()
    except Exception as e:  # noqa: BLE001 - compiled here instead; this compile raises the real error, if any
        log.debug("fp4dispatch: a compile worker did not compile a kernel (%s); compiling it here", e)
    return fn(*args, **kwargs)
