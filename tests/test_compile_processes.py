"""Triton compiles in worker processes (fp4dispatch/kernels/compile_processes.py): a job is taken from Triton's
own async-compile closure, a worker compiles it into the disk cache and this process then reads it from there; a
compile the workers cannot take, or that fails there, or a worker that exits, leaves the compile to a thread here."""
from __future__ import annotations

import os
import sys
import types

import pytest

triton = pytest.importorskip("triton")

from fp4dispatch.kernels import compile_processes as cp  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
# answers every job with an error on the answer pipe (its fd is the last argument), as a worker whose compile raised;
# it prints to stdout first, as an import may: the answers must not see that
FAILING_WORKER = ("import os, pickle, sys\nprint('noise on stdout', flush=True)\n"
                  "out = os.fdopen(int(sys.argv[-1]), 'wb')\npickle.dump('ready', out)\nout.flush()\nwhile True:\n"
                  "    head = sys.stdin.buffer.read(8)\n    if len(head) < 8:\n        break\n"
                  "    sys.stdin.buffer.read(int.from_bytes(head, 'little'))\n"
                  "    pickle.dump('ImportError: no such kernel', out)\n    out.flush()\n")


def _source():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from _compile_kernel import scale_kernel

    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr", "BLOCK": "constexpr"}
    return ASTSource(scale_kernel, sig, {"FACTOR": 3, "BLOCK": 128}, {}), GPUTarget("cuda", 90, 32)


def _like_tritons(src, target, options, env_vars=None):
    """A compile function shaped like the one Triton's ``JITFunction._do_compile`` hands its async compile mode."""
    def async_compile():
        return triton.compile(src, target=target, options=options.__dict__, _env_vars=env_vars)
    return async_compile


def test_tritons_async_compile_closure_holds_what_a_job_needs():
    """The job is read from the names Triton's closure holds; a Triton that renamed them compiles in threads."""
    from triton.runtime.jit import JITFunction

    nested = [c for c in JITFunction._do_compile.__code__.co_consts if getattr(c, "co_name", "") == "async_compile"]
    assert nested and set(cp._JOB_NAMES) <= set(nested[0].co_freevars), [c.co_freevars for c in nested]


def test_a_job_is_only_made_of_a_module_level_kernel_with_picklable_arguments():
    src, target = _source()
    options = types.SimpleNamespace(num_warps=4)
    job = cp.compile_job(_like_tritons(src, target, options))
    assert job is not None and job[:4] == ("_compile_kernel", "scale_kernel", "triton.compiler.compiler", "ASTSource")
    assert cp.compile_job(lambda: None) is None  # not Triton's closure
    local = types.SimpleNamespace(fn=types.SimpleNamespace(fn=lambda: None), signature={}, constants={}, attrs={})
    assert cp.compile_job(_like_tritons(local, target, options)) is None  # a kernel made inside a function
    src.constants[(3,)] = threading_lock = __import__("threading").Lock()  # does not pickle
    assert cp.compile_job(_like_tritons(src, target, options)) is None, threading_lock


@pytest.mark.skipif(sys.platform != "linux", reason="Triton compiles for CUDA targets on Linux only")
def test_a_worker_compiles_into_the_disk_cache_and_this_process_then_reads_it(tmp_path, monkeypatch):
    sys.path.insert(0, TESTS)
    from _sass_compile import nvidia_tools_missing

    if (why := nvidia_tools_missing()) is not None:
        pytest.skip(why)
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    src, target = _source()
    options = types.SimpleNamespace(num_warps=4, enable_fp_fusion=True)
    hits = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    workers = cp.CompileWorkers(1)
    pool = cp.CompileExecutor(1, workers)
    try:
        kernel = pool.submit(_like_tritons(src, target, options)).result(timeout=300)
    finally:
        pool.shutdown()
        workers.close()
    assert hits == [True], "the compile here was not a cache hit: the worker did not compile this kernel"
    assert "ld.global" in kernel.asm["ptx"] and kernel.metadata.num_warps == 4


def test_a_compile_the_workers_fail_or_cannot_take_runs_here():
    class NoJobs:
        def submit(self, job):
            raise AssertionError("a compile that is no job went to the workers")

    pool = cp.CompileExecutor(2, NoJobs())
    assert pool.submit(lambda x: x + 1, 41).result(timeout=60) == 42
    pool.shutdown()

    def compiled_here(src, target, options):  # Triton's closure, compiling nothing: says where it ran
        def async_compile():
            return ("compiled here", src, target, options)
        return async_compile

    src, target = _source()
    workers = cp.CompileWorkers(2, [sys.executable, "-c", FAILING_WORKER])
    pool = cp.CompileExecutor(2, workers)
    try:
        fn = compiled_here(src, target, types.SimpleNamespace(num_warps=4))
        assert cp.compile_job(fn) is not None
        with pytest.raises(RuntimeError, match="no such kernel"):
            workers.submit(cp.compile_job(fn)).result(timeout=60)
        assert pool.submit(fn).result(timeout=60)[0] == "compiled here"
    finally:
        pool.shutdown()
        workers.close()


def test_workers_that_exit_fail_their_jobs_at_once_and_never_leave_one_waiting():
    workers = cp.CompileWorkers(3, [sys.executable, "-c", "pass"])
    futures = [workers.submit(("job", i)) for i in range(20)]
    for f in futures:
        assert isinstance(f.exception(timeout=60), cp.WorkerGone)
    assert isinstance(workers.submit(("late",)).exception(timeout=60), cp.WorkerGone)
    workers.close()
    none = cp.CompileWorkers(2, [os.path.join(TESTS, "no-such-program")])
    assert isinstance(none.submit(("job",)).exception(timeout=60), cp.WorkerGone)
    none.close()


def test_the_compile_workers_knob(monkeypatch):
    from fp4dispatch.dispatch import warmup
    from fp4dispatch.errors import InvalidInputError
    from fp4dispatch.settings import read_settings

    assert read_settings().compile_workers is None and 1 <= cp.worker_count() <= 14
    monkeypatch.setenv("FP4DISPATCH_COMPILE_WORKERS", "0")
    assert read_settings().compile_workers == 0 and warmup._compile_processes(0) is None  # threads only
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("FP4DISPATCH_COMPILE_WORKERS", "16")
    assert read_settings().compile_workers == 16
    # a count past the cores: each worker imports torch; 100000 of them started processes until none could start
    for raw in ("-2", "17", "100000"):
        monkeypatch.setenv("FP4DISPATCH_COMPILE_WORKERS", raw)
        with pytest.raises(InvalidInputError, match=rf"^FP4DISPATCH_COMPILE_WORKERS='{raw}' is not valid; accepted: a "
                           r"whole number from 0 \(0: none\) to 16 \(this machine's cores\)\. Unset it for the "
                           r"default 'unset: a share of every core but two, 1 to 14'$"):
            read_settings()


def test_closing_stops_a_busy_worker_and_leaves_no_job_waiting():
    """An interrupted caller does not wait for a queue of worker compiles: closing cancels the queued jobs (the
    threads here compile them) and kills a worker still busy after ``CLOSE_WAIT_S``."""
    workers = cp.CompileWorkers(1, [sys.executable, "-c", "import sys; sys.stdin.read()"])  # never answers
    jobs = [workers.submit(("job", i)) for i in range(3)]
    workers.close()
    for f in jobs:
        assert f.done() and (f.cancelled() or isinstance(f.exception(), cp.WorkerGone))
    assert jobs[-1].cancelled()  # the worker takes one job at a time: the last was still queued


def test_processes_compiling_at_once_share_the_cores(monkeypatch):
    from fp4dispatch.cli import distributed

    monkeypatch.setattr(cp.os, "cpu_count", lambda: 128)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cp.worker_count() == 14 and cp.worker_count(8) == 14 and cp.worker_count(16) == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # torchrun's ranks on this node
    assert cp.worker_count() == 3
    monkeypatch.setattr(cp.os, "cpu_count", lambda: 2)
    assert cp.worker_count() == 1 and cp.worker_count(1) == 1
    monkeypatch.setattr(cp.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("FP4DISPATCH_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr(distributed.os, "environ", dict(os.environ))  # what a --devices process sets for itself
    distributed._child_env(4)
    assert distributed.os.environ["FP4DISPATCH_COMPILE_WORKERS"] == "3"
    # set but blank reads as unset (read_settings): before, it was kept, and each of the 4 processes took 14 workers
    monkeypatch.setattr(distributed.os, "environ", {**os.environ, "FP4DISPATCH_COMPILE_WORKERS": " "})
    distributed._child_env(4)
    assert distributed.os.environ["FP4DISPATCH_COMPILE_WORKERS"] == "3"
    monkeypatch.setattr(distributed.os, "environ", {**os.environ, "FP4DISPATCH_COMPILE_WORKERS": "2"})
    distributed._child_env(4)
    assert distributed.os.environ["FP4DISPATCH_COMPILE_WORKERS"] == "2"  # the user's own count stands


def test_a_job_the_worker_cannot_rebuild_is_answered_and_the_worker_goes_on(tmp_path, monkeypatch):
    """A job whose objects the worker cannot unpickle (a class only this process imports) gets an error answer;
    the worker stays for the next job."""
    (tmp_path / "only_here.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_here

    workers = cp.CompileWorkers(1)
    try:
        with pytest.raises(RuntimeError, match="the job did not unpickle: ModuleNotFoundError"):
            workers.submit(("a", only_here.Thing())).result(timeout=300)
        bad = ("no_such_module", "k", "triton.compiler.compiler", "ASTSource", {}, {}, {}, None, {}, None)
        with pytest.raises(RuntimeError, match="ModuleNotFoundError: No module named 'no_such_module'"):
            workers.submit(bad).result(timeout=300)
    finally:
        workers.close()


def test_a_worker_that_never_gets_ready_or_never_answers_is_given_up(monkeypatch):
    """A worker command that is no compile worker (it never says it is ready), or one that hangs on a job, cannot
    hold the compiles up: past the wait its jobs fail at once, and this process compiles them."""
    monkeypatch.setattr(cp, "READY_WAIT_S", 0.5)
    silent = cp.CompileWorkers(1, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    assert isinstance(silent.submit(("job",)).exception(timeout=60), cp.WorkerGone)
    silent.close()
    monkeypatch.setattr(cp, "ANSWER_WAIT_S", 0.5)
    ready_then_hangs = ("import os, pickle, sys\nout = os.fdopen(int(sys.argv[-1]), 'wb')\n"
                        "pickle.dump('ready', out)\nout.flush()\nsys.stdin.read()\n")
    hangs = cp.CompileWorkers(1, [sys.executable, "-c", ready_then_hangs])
    with pytest.raises(cp.WorkerGone, match="TimeoutError"):
        hangs.submit(("job",)).result(timeout=60)
    hangs.close()


def test_a_worker_runs_this_processs_fp4dispatch_whatever_the_current_directory_holds(tmp_path, monkeypatch):
    """Started in a directory with another fp4dispatch (a checkout), a worker still loads this one: ``python -m``
    would have imported that one (here it cannot even be imported) and compiled its kernels."""
    (tmp_path / "fp4dispatch").mkdir()
    (tmp_path / "fp4dispatch" / "__init__.py").write_text("raise ImportError('another fp4dispatch')\n")
    monkeypatch.chdir(tmp_path)
    workers = cp.CompileWorkers(1)
    try:
        bad = ("no_such_module", "k", "triton.compiler.compiler", "ASTSource", {}, {}, {}, None, {}, None)
        with pytest.raises(RuntimeError, match="ModuleNotFoundError: No module named 'no_such_module'"):
            workers.submit(bad).result(timeout=300)  # answered by a worker that started (not WorkerGone)
    finally:
        workers.close()
