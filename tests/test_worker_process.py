"""Worker processes (fp4dispatch/worker_process.py): what a worker prints goes to this process's stderr, never to its
stdout (which ``tune --json`` writes), and its answers come back on their own pipe whatever it prints."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from fp4dispatch import worker_process

# prints on stdout, then echoes its one job back on the answer pipe (its fd is the last argument)
ECHO = ("import os, pickle, sys\nprint('noise from a worker', flush=True)\n"
        "out = os.fdopen(int(sys.argv[-1]), 'wb')\nhead = sys.stdin.buffer.read(8)\n"
        "pickle.dump(pickle.loads(sys.stdin.buffer.read(int.from_bytes(head, 'little'))), out)\nout.flush()\n")


def test_a_workers_prints_go_to_stderr_and_its_answer_to_its_pipe(capfd):
    proc, answers = worker_process.start([sys.executable, "-c", ECHO])
    try:
        worker_process.write_frame(proc.stdin, pickle.dumps({"job": 1}))
        assert worker_process.read_answer(answers, 120) == {"job": 1}
    finally:
        proc.stdin.close()
        answers.close()
        assert proc.wait(120) == 0
    out, err = capfd.readouterr()
    assert "noise from a worker" in err and "noise from a worker" not in out


def test_a_frame_is_read_whole_and_the_end_of_the_stream_is_none(tmp_path):
    path = tmp_path / "frames"
    with open(path, "wb") as f:
        worker_process.write_frame(f, pickle.dumps("first"))
        worker_process.write_frame(f, b"not a pickle")
    with open(path, "rb") as f:
        assert pickle.loads(worker_process.read_frame(f)) == "first"
        assert worker_process.read_frame(f) == b"not a pickle"
        assert worker_process.read_frame(f) is None


def test_a_job_the_worker_cannot_rebuild_is_answered_with_why(tmp_path, monkeypatch):
    """The job's class is importable here but gone by the time the worker unpickles it: the worker answers
    ``failed(why)`` instead of dying (here through the probe worker's ``main``)."""
    (tmp_path / "vanishing_backend.py").write_text("class Gone:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_backend

    job = pickle.dumps((vanishing_backend.Gone(), "cpu", ()))
    (tmp_path / "vanishing_backend.py").unlink()
    proc, answers = worker_process.start_job("fp4dispatch.dispatch.isolate", job)
    try:
        answer = worker_process.read_answer(answers, 300)
    finally:
        answers.close()
        proc.wait(120)
    # transient: the worker could not take the job, which says nothing of the backend (it was cached as failed)
    assert answer == {"status": "failed", "reason": "the worker could not rebuild its job: ModuleNotFoundError: No "
                                                    "module named 'vanishing_backend' (not cached: nothing was learned "
                                                    "of the backend; define its class in a module a fresh process can "
                                                    "import, or probe it in this process: FP4DISPATCH_ISOLATE=0)",
                      "transient": True}


def test_a_workers_log_records_reach_stderr_at_the_level_asked(tmp_path):
    """Without a handler Python's last resort drops records below WARNING: a worker's DEBUG lines (its first runs'
    seconds, say) would be lost whatever FP4DISPATCH_LOG says. Each line names the worker's pid."""
    import subprocess

    import os

    script = ("import logging, os\nfrom fp4dispatch import worker_process\nworker_process.log_to_parent()\n"
              "worker_process.log_to_parent()\n"  # a second call adds no second handler
              "logging.getLogger('fp4dispatch').debug('first run of %s', 'x')\nprint(os.getpid())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FP4DISPATCH_LOG": "debug"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"[worker {done.stdout.strip()}] first run of x\n"


def test_a_failure_is_described_with_its_causes_and_cut_in_the_middle():
    """A compiler's error may say only where (Triton's CompilationError: the source line); its cause says what."""
    from fp4dispatch.errors import describe_failure

    try:
        try:
            raise KeyError("the real reason")
        except KeyError as cause:
            raise RuntimeError("at 12:8:\n" + "source line\n" * 300) from cause
    except RuntimeError as e:
        text = describe_failure(e)
        assert len(text) == 2000 and " [...] " in text
        assert text.startswith("RuntimeError: at 12:8:\nsource line")
        assert text.endswith("source line\ncaused by KeyError: 'the real reason'")
        assert describe_failure(e, limit=100_000).count("source line") == 300


# a parent that starts a worker hanging in its main(), prints the worker's pid, and waits to be killed
_PARENT = ("import sys, time\nfrom fp4dispatch import worker_process\n"
           "proc, _ = worker_process.start(worker_process.command('hang_worker', [sys.argv[1], *sys.path]))\n"
           "print(proc.pid, flush=True)\ntime.sleep(600)\n")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited (nobody reaped it yet)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a process's state from /proc (Linux)")
def test_a_worker_whose_parent_is_killed_exits(tmp_path):
    """SIGKILL leaves a parent no finally to stop its workers: a worker hung in a probe or a compile ran on forever.
    It watches its parent and exits when it is gone."""
    (tmp_path / "hang_worker.py").write_text("import time\n\n\ndef main():\n    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _running(worker)
    finally:
        parent.kill()
        parent.wait(60)
    deadline = time.monotonic() + 60  # the watch looks every second; a loaded machine may take longer to run it
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _running(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive


def test_a_worker_that_sigint_interrupts_dies_by_it_without_a_traceback(tmp_path):
    """Ctrl-C signals the terminal's whole process group: each worker printed a KeyboardInterrupt traceback. It dies
    by SIGINT (the status dispatch/isolate.py reads as an interrupted probe), silently."""
    (tmp_path / "wait_worker.py").write_text(
        "import os, sys\n\n\ndef main():\n    out = os.fdopen(int(sys.argv[-1]), 'w')\n"
        "    out.write('ready\\n')\n    out.flush()\n    sys.stdin.buffer.read()\n")
    read, write = os.pipe()
    cmd = worker_process.command("wait_worker", [str(tmp_path), *sys.path])
    proc = subprocess.Popen([*cmd, str(write)], stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write,))
    os.close(write)
    try:
        with os.fdopen(read) as ready:
            assert ready.readline() == "ready\n"  # in main(), waiting on stdin
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode(errors="replace")
