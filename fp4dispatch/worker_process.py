"""Worker processes that run this process's fp4dispatch: the compile workers (kernels/compile_processes.py), the
probe workers (dispatch/isolate.py) and ``tune --devices``' device processes (cli/distributed.py).

They are plain subprocesses, not ``multiprocessing``'s: a spawned ``multiprocessing`` child re-runs the caller's
main script (as ``__mp_main__``), which a user's script without an ``if __name__ == "__main__":`` guard does not
survive (its model load, or its whole run, happens again in each worker, and a worker it starts fails). Nor ``python
-m``, which puts the current directory first on the path: a directory holding another fp4dispatch (a checkout) would
run that one. A worker loads this process's fp4dispatch from its file, then runs ``main()`` of the module it is given.

A worker reads its jobs on stdin, each a frame (``write_frame``: an 8-byte little-endian length, then a pickle), and
answers each with a pickle on a pipe of its own (the last argument, ``answer_pipe()``), not on stdout, which may carry
whatever an import or a compiler prints. That stdout goes to this process's stderr: this process's stdout may be what
a caller parses (``tune --json``).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
from typing import BinaryIO, Callable

from .errors import describe_exception

__all__ = ["command", "start", "start_job", "serve_job", "write_frame", "read_frame", "read_answer", "answer_pipe",
           "log_to_parent", "kill"]

# argv: this process's fp4dispatch/__init__.py, the module whose main() to run, the module path as JSON (null: the
# environment's, without the current directory: its '' entries), then the answer pipe's fd (read by answer_pipe).
# A worker whose parent is gone (killed: no finally of its ran) exits: a hung probe or compile would run on forever.
# Ctrl-C signals the terminal's whole process group: a worker that SIGINT interrupts dies by it (the exit status its
# parent reads, dispatch/isolate.py) without a traceback each, which said nothing the parent does not say.
_START = ("import importlib, importlib.util, json, os, signal, sys, threading, time\n"
          "def orphaned(parent=int(os.environ.get('FP4DISPATCH_WORKER_PARENT') or 0)):\n"
          "    while parent and os.getppid() == parent:\n"
          "        time.sleep(1)\n"
          "    if parent:\n"
          "        os._exit(1)\n"
          "threading.Thread(target=orphaned, daemon=True).start()\n"
          "path = json.loads(sys.argv[3])\n"
          "sys.path[:] = [p for p in sys.path if p] if path is None else path\n"
          "try:\n"
          "    spec = importlib.util.spec_from_file_location('fp4dispatch', sys.argv[1])\n"
          "    sys.modules['fp4dispatch'] = package = importlib.util.module_from_spec(spec)\n"
          "    spec.loader.exec_module(package)\n"
          "    importlib.import_module(sys.argv[2]).main()\n"
          "except KeyboardInterrupt:\n"
          "    signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
          "    os.kill(os.getpid(), signal.SIGINT)\n")


def command(module: str, path: list[str] | None = None) -> list[str]:
    """The command line (less the answer pipe's fd, which ``start`` adds) of a worker running ``module.main()``.
    ``path``: its module path, e.g. this process's ``sys.path`` so that what it is sent unpickles (a class from the
    caller's own modules); None: the environment's."""
    package = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")
    return [sys.executable, "-c", _START, package, module, json.dumps(path)]


def _environment() -> dict:
    """A worker's environment: this one, with Triton's cache dir as this process uses it (it may have been set in
    code), and this process's pid, which the worker watches."""
    env = dict(os.environ)
    env["FP4DISPATCH_WORKER_PARENT"] = str(os.getpid())  # its parent-death watch (_START)
    try:
        from triton import knobs

        env["TRITON_CACHE_DIR"] = str(knobs.cache.dir)
    except Exception:  # noqa: BLE001 - no Triton, or one without knobs, which reads the variable itself
        pass
    return env


def _stderr_fd() -> int | None:
    """This process's stderr descriptor for a worker's stdout, or None (the worker inherits stdout) when it is
    closed."""
    try:
        os.fstat(2)
    except OSError:
        return None
    return 2


def start(cmd: list[str]) -> tuple[subprocess.Popen, BinaryIO]:
    """The worker ``cmd`` started, with a pipe for its jobs on stdin: (the process, its answers' reading end).
    Raises OSError when it cannot start."""
    read, write = os.pipe()
    try:
        proc = subprocess.Popen([*cmd, str(write)], stdin=subprocess.PIPE, stdout=_stderr_fd(), env=_environment(),
                                pass_fds=(write,))
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return proc, os.fdopen(read, "rb")


def kill(proc: subprocess.Popen) -> None:
    """Kill a worker and the processes it started (a JIT compile's compiler, say), which would run on as orphans:
    found while it lives, from /proc's children lists (Linux; elsewhere the worker alone)."""
    tree, todo = [], [proc.pid]
    while todo:
        for listing in glob.glob(f"/proc/{todo.pop()}/task/*/children"):  # each thread's children
            try:
                with open(listing) as f:
                    kids = [int(pid) for pid in f.read().split()]
            except (OSError, ValueError):  # gone meanwhile
                continue
            tree += kids
            todo += kids
    proc.kill()
    for pid in tree:  # reparented by now, still alive: their pids name them
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # exited meanwhile
            pass


def start_job(module: str, job: bytes) -> tuple[subprocess.Popen, BinaryIO]:
    """A worker running ``module.main()`` (which calls ``serve_job``) with this process's module path, sent ``job``
    (a pickle): (the process, its answers' reading end). A worker that dies before it reads the job is not an error
    here: its answer pipe ends, which the caller reads as EOFError."""
    proc, answers = start(command(module, list(sys.path)))
    try:
        write_frame(proc.stdin, job)
    except OSError:  # a broken pipe: it exited at once
        pass
    return proc, answers


def serve_job(run: Callable[..., object], failed: Callable[[str], object]) -> None:
    """In a worker started by ``start_job``: its one job from stdin, ``run(*job)``'s answer on the answer pipe; a job
    that does not unpickle here (a class this process cannot import) or a ``run`` that raises is answered
    ``failed(why)``."""
    answers = answer_pipe()
    try:
        job = pickle.loads(read_frame(sys.stdin.buffer) or b"")
    except Exception as e:  # noqa: BLE001
        answer = failed(f"the worker could not rebuild its job: {describe_exception(e)}")
    else:
        try:
            answer = run(*job)
        except Exception as e:  # noqa: BLE001 - the caller reports it
            answer = failed(describe_exception(e))
    pickle.dump(answer, answers)
    answers.flush()


def log_to_parent() -> None:
    """In a worker: its ``fp4dispatch`` log records, at ``FP4DISPATCH_LOG``'s level, go to stderr (this process's),
    each marked with the worker's pid. Without a handler, Python's last-resort one would drop those below WARNING."""
    from .settings import apply_log_level

    apply_log_level()
    logger = logging.getLogger("fp4dispatch")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[worker {os.getpid()}] %(message)s"))
        logger.addHandler(handler)


def write_frame(stream: BinaryIO, data: bytes) -> None:
    """``data`` (a pickle) as one frame, flushed."""
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's pickle, unread (a job that does not unpickle is still read whole); None at the end."""
    head = stream.read(8)
    return None if len(head) < 8 else stream.read(int.from_bytes(head, "little"))


def read_answer(answers: BinaryIO, wait: float | None):
    """The worker's next answer, waiting at most ``wait`` seconds for it to begin (TimeoutError; None: as long as it
    takes); EOFError when the worker closed its pipe (it exited) first."""
    if not select.select([answers], [], [], wait)[0]:
        raise TimeoutError(f"no answer in {wait:.0f} s")
    return pickle.load(answers)


def answer_pipe() -> BinaryIO:
    """In a worker: the pipe its answers go to."""
    return os.fdopen(int(sys.argv[-1]), "wb")
