"""Threads and processes around one dispatcher: calls from many threads on new and decided keys give the exact
result, ``set_dispatcher`` may run while other threads call, and a fork child can decide a new key although a
thread of its parent held the dispatcher's lock at the fork. Synchronised by events and barriers, never by sleeps."""
from __future__ import annotations

import dis
import multiprocessing
import sys
import threading

import pytest
import torch

import fp4dispatch
import fp4dispatch.api as api
from fp4dispatch.backends.reference import ReferenceBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs

TIMEOUT_S = 120  # generous: a loaded 2-core machine


def _exact(a, b, sa, sb, alpha):
    return fp4dispatch.dequantize_nvfp4(a, sa) @ fp4dispatch.dequantize_nvfp4(b, sb).T * float(alpha)


def _in_threads(work, n):
    """Run ``work(i, barrier)`` in ``n`` threads; returns the errors (tracebacks) and the threads still alive."""
    import traceback

    errors, barrier = [], threading.Barrier(n)

    def run(i):
        try:
            work(i, barrier)
        except Exception:  # noqa: BLE001 - reported by the test
            errors.append(traceback.format_exc())
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    return errors, [t for t in threads if t.is_alive()]


def test_threads_on_new_and_decided_keys_get_the_exact_result_and_tune_each_key_once(tmp_path):
    fast, slow = FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)
    d = Dispatcher([fast, slow], cache_dir=tmp_path / "c", do_bench=fake_do_bench)
    shapes = [(m, 64, 128) for m in (1, 3, 17, 100)]
    inputs = {s: make_nvfp4_inputs(*s, seed=s[0]) for s in shapes}
    exact = {s: _exact(*inputs[s]) for s in shapes}
    wrong = []

    def work(i, barrier):
        barrier.wait(TIMEOUT_S)
        for it in range(12):
            s = shapes[(i + it) % len(shapes)]
            out = torch.empty(s[0], 64, dtype=torch.float32) if it % 2 else None
            r = d.fp4_mm(*inputs[s], out_dtype=torch.float32, out=out)
            if not torch.equal(r, exact[s]):
                wrong.append((i, s))
    errors, alive = _in_threads(work, 6)
    assert not alive and not errors and not wrong, (errors, wrong)
    decisions = d.cache_for("cpu").decisions
    assert len(decisions) == len(shapes) and {e["backend"] for e in decisions.values()} == {"fast"}


def test_set_dispatcher_none_between_a_calls_reads_of_the_default_does_not_break_the_call(tmp_path):
    """``fp4_mm`` read the process-wide dispatcher twice (``_default if _default is not None else ...``): another
    thread's ``set_dispatcher(None)`` between the two reads made it call ``None.memo`` (AttributeError). The swap is
    made there deterministically, by an opcode trace of the call's frame."""
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    fp4dispatch.set_dispatcher(d)
    args = make_nvfp4_inputs(4, 64, 128)
    code = api.fp4_mm.__code__
    first_read = next(i.offset for i in dis.get_instructions(code)
                      if i.opname == "LOAD_GLOBAL" and i.argval == "_default")
    swapped = []

    def local(frame, event, arg):
        if event == "opcode" and not swapped and frame.f_lasti > first_read:
            swapped.append(frame.f_lasti)
            fp4dispatch.set_dispatcher(None)  # as another thread would, right after the call read the default
        return local

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        return local
    sys.settrace(tracer)
    try:
        out = fp4dispatch.fp4_mm(*args, out_dtype=torch.float32)
    finally:
        sys.settrace(None)
    assert swapped, "the trace never reached the read of the default dispatcher"
    assert torch.equal(out, _exact(*args))
    assert d.cache_for("cpu").decisions  # the call was served by the dispatcher it read


def _child_decides_a_new_key(conn) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(TIMEOUT_S // 2, exit=True)  # a hang ends the child, with its stack
    torch.set_num_threads(1)  # torch's OpenMP pool is not fork-safe here; the dispatcher's lock is what is tested
    args = make_nvfp4_inputs(8, 32, 128, seed=3)
    out = fp4dispatch.fp4_mm(*args, out_dtype=torch.float32)
    conn.send(bool(torch.equal(out, _exact(*args))))


def _fork_child_decides(target) -> None:
    """Run ``target(conn)`` in a fork child, which must send True and exit 0 within TIMEOUT_S (1: it hung, its stack
    on stderr)."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(theirs,))
    child.start()
    child.join(TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"the fork child exited with {child.exitcode} (1: hung, its stack on stderr)"
    assert ours.recv() is True


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_a_fork_child_decides_a_new_key_while_a_parent_thread_held_the_dispatcher_lock(tmp_path):
    """A thread of the parent was tuning a key (holding the dispatcher's lock) when the process forked: the child,
    which has no such thread, waited for that lock forever at its first new key. The lock is made anew in the child."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(FakeBackend):  # blocks while tuning the N = 96 key, until released
        def run(self, problem, ops, config):
            if problem.n == 96:
                entered.set()
                release.wait(TIMEOUT_S)
            super().run(problem, ops, config)
    d = Dispatcher([Blocking("blocking"), ReferenceBackend()], cache_dir=tmp_path / "c")
    fp4dispatch.set_dispatcher(d)
    fp4dispatch.fp4_mm(*make_nvfp4_inputs(4, 64, 128), out_dtype=torch.float32)  # the device is probed
    tuner = threading.Thread(target=lambda: fp4dispatch.fp4_mm(*make_nvfp4_inputs(4, 96, 128),
                                                               out_dtype=torch.float32), daemon=True)
    tuner.start()
    try:
        assert entered.wait(TIMEOUT_S)
        _fork_child_decides(_child_decides_a_new_key)
    finally:
        release.set()
        tuner.join(TIMEOUT_S)
    assert not tuner.is_alive()


def test_two_threads_dropping_a_weights_failed_guard_at_once_do_not_raise(tmp_path, monkeypatch):
    """Two threads whose calls both fail a remembered weight's guard (here: inside inference mode, the guard made
    outside) each dropped it with ``del``: the second raised KeyError out of ``fp4_mm`` when the first had not put
    a new one back (past MAX_REBUILDS). Thread A is held inside its drop until thread B's call is over."""
    from fp4dispatch.dispatch import call_memo

    if call_memo.TensorGuards is None:
        pytest.skip("this torch has no dynamo TensorGuards: nothing is remembered")
    monkeypatch.setattr(call_memo, "MAX_REBUILDS", 0)
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    args = make_nvfp4_inputs(2, 64, 128)
    exact = _exact(*args)
    d.fp4_mm(*args, out_dtype=torch.float32)  # remembered, guard made outside inference mode
    (w,) = d.memo._weights.values()
    in_drop, b_done = threading.Event(), threading.Event()
    checks = {}

    class Held:  # the real guard; thread A's second check (remember's, before its drop) waits for thread B
        def __init__(self, guard):
            self.guard = guard

        def check(self, *tensors):
            name = threading.current_thread().name
            checks[name] = checks.get(name, 0) + 1
            if name == "A" and checks[name] == 2:
                in_drop.set()
                b_done.wait(TIMEOUT_S)
            return self.guard.check(*tensors)
    w.guard = Held(w.guard)
    results, errors = {}, []

    def call(name):
        try:
            if name == "B":
                in_drop.wait(TIMEOUT_S)
            with torch.inference_mode():
                results[name] = d.fp4_mm(*args, out_dtype=torch.float32).clone()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {e!r}")
        finally:
            if name == "B":
                b_done.set()
    threads = [threading.Thread(target=call, args=(n,), name=n, daemon=True) for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert checks.get("A") == 2 and all(torch.equal(results[n], exact) for n in ("A", "B"))


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_a_fork_child_probes_again_the_op_whose_probe_a_parent_thread_had_under_way(tmp_path):
    """A parent thread was probing the device (its op marked as probed, the verdicts not in yet) at the fork: the
    child found no verdict for any backend of the op and raised NoUsableBackendError ("unknown backend") at its first
    new key. The child probes that op again."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(FakeBackend):  # its first run, the probe's, blocks until released
        def run(self, problem, ops, config):
            if not entered.is_set():
                entered.set()
                release.wait(TIMEOUT_S)
            super().run(problem, ops, config)
    d = Dispatcher([ReferenceBackend(), Blocking("blocking")], cache_dir=tmp_path / "c")
    fp4dispatch.set_dispatcher(d)
    prober = threading.Thread(target=lambda: fp4dispatch.fp4_mm(*make_nvfp4_inputs(4, 96, 128),
                                                                out_dtype=torch.float32), daemon=True)
    prober.start()
    try:
        assert entered.wait(TIMEOUT_S)
        def child_main(conn):  # a fork child runs this closure as it is (nothing is pickled)
            release.set()  # the child's copy of the event: its own probe of the backend runs through
            _child_decides_a_new_key(conn)
        _fork_child_decides(child_main)
    finally:
        release.set()
        prober.join(TIMEOUT_S)
    assert not prober.is_alive()
