"""Crash isolation (CPU): a risky backend that exits, segfaults or hangs is probed in a spawned worker; the verdict is
``failed`` with the reason, the test process survives, and fp4_mm still answers right through another backend."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.settings import Settings
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.isolate import probe_isolated
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import FakeBackend, make_nvfp4_inputs

CPU = torch.device("cpu")
# Only the hang needs a short timeout: it is the expected outcome there. A worker that exits or segfaults is
# waited for as long as a loaded 2-core machine may need to start it (a spawned worker imports torch), so its
# verdict never depends on the load (a 3 s timeout made the SIGSEGV case flaky at load ~14).
TIMEOUT_S = {"exit": 120.0, "segv": 120.0, "hang": 3.0}

CRASHES = [
    pytest.param("exit", r"^worker died \(exit code 3\)$", id="os._exit"),
    pytest.param("segv", rf"^worker died \(signal {int(signal.SIGSEGV)}, SIGSEGV\)$", id="SIGSEGV"),
    pytest.param("hang", r"^timed out after 3 s \(worker killed; not cached; FP4DISPATCH_PROBE_TIMEOUT sets the "
                         r"limit\)$", id="hang"),
]


@pytest.mark.parametrize("crash, reason", CRASHES)
def test_probe_isolated_turns_a_dead_or_hung_worker_into_a_failed_verdict(crash, reason):
    pid = os.getpid()
    v = probe_isolated(FakeBackend(f"crasher-{crash}", crash=crash, risky=True), CPU, TIMEOUT_S[crash])
    assert v.status == "failed"
    assert re.match(reason, v.reason), v.reason
    assert os.getpid() == pid  # still the same, living process


def _worker_backend(tmp_path, monkeypatch, module: str, run: list[str]):
    """A risky FakeBackend whose run() is ``run``'s lines, defined in a module a worker process can import."""
    body = "".join(f"        {line}\n" for line in run)
    (tmp_path / f"{module}.py").write_text("import os, subprocess, time\n"
                                           "from fp4dispatch.testing import FakeBackend\n\n\n"
                                           "class Scripted(FakeBackend):\n"
                                           "    def run(self, problem, ops, config):\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return __import__(module).Scripted(module, risky=True)


def test_a_worker_that_dies_while_a_process_it_started_holds_its_pipe_is_a_dead_worker(tmp_path, monkeypatch):
    """The answer pipe's end never came (the process it started held it open), so the full timeout was waited and the
    crash reported as a timeout, transient: every process waited it again."""
    pidfile = tmp_path / "helper.pid"
    spawner = _worker_backend(tmp_path, monkeypatch, "spawns_then_dies", [
        f"os.system('sleep 60 & echo $! > {pidfile}')  # a shell: it keeps every fd, the pipe's too", "os._exit(3)"])
    t0 = time.monotonic()
    try:
        v = probe_isolated(spawner, CPU, 50.0)
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert (v.status, v.reason, v.transient) == ("failed", "worker died (exit code 3)", False)
    assert time.monotonic() - t0 < 45


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # a zombie is dead, waiting to be reaped
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="the worker's children are found from /proc's children lists (Linux)")
def test_a_killed_worker_takes_the_processes_it_started_with_it(tmp_path, monkeypatch):
    """A worker killed at its timeout left what it had started (a JIT compile's compiler, here a sleep) running."""
    pidfile = tmp_path / "child.pid"
    starter = _worker_backend(tmp_path, monkeypatch, "starts_then_hangs", [
        "child = subprocess.Popen(['sleep', '120'])", f"open({str(pidfile)!r}, 'w').write(str(child.pid))",
        "time.sleep(3600)"])
    v = probe_isolated(starter, CPU, 20.0)  # a loaded machine starts its worker in seconds
    assert v.status == "failed" and v.reason.startswith("timed out after 20 s") and pidfile.exists()
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker's child outlived it")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_worker_killed_from_outside_is_not_cached_as_the_backends_verdict(tmp_path, monkeypatch, sig):
    """Before: the out-of-memory killer's SIGKILL (or a scheduler's SIGTERM) was 'worker died (signal 9, SIGKILL)',
    cached: a healthy backend stayed out of every later process. Here the worker's probe sends it to itself, as the
    kernel would (the signal is the same; who sends it is not seen by the parent)."""
    victim = _worker_backend(tmp_path, monkeypatch, f"killed_by_{sig.name.lower()}",
                             [f"os.kill(os.getpid(), {int(sig)})", "time.sleep(60)"])
    v = probe_isolated(victim, CPU, 120.0)
    assert (v.status, v.transient) == ("failed", True)
    assert v.reason == (f"probe worker killed from outside (signal {int(sig)}, {sig.name}: the out-of-memory killer "
                        "if the host ran short of memory, else a kill, a scheduler's stop or a closed terminal); "
                        "not cached: probed again by the next process")


def test_a_worker_that_dies_making_the_new_keys_first_runs_is_not_cached_as_the_devices_verdict():
    """The crash may come from one of the keys' shapes, not the probe's: the backend stays out of this process (failed)
    and the next process probes it again (transient, not cached)."""
    upcoming = (Problem(64, 4096, 4096, torch.bfloat16, CPU),)
    v = probe_isolated(FakeBackend("crasher-keys", crash="exit", risky=True), CPU, TIMEOUT_S["exit"], upcoming)
    assert (v.status, v.transient) == ("failed", True)
    assert v.reason == "worker died (exit code 3) while probing and making the first runs of 1 new keys (not cached)"


def test_the_worker_hands_its_upcoming_first_runs_to_the_probe(monkeypatch):
    """What the parent sends is what the probe gets (the worker's function, run here rather than in a worker)."""
    from fp4dispatch.dispatch import isolate, probe
    from fp4dispatch.dispatch.records import Verdict

    got = []
    monkeypatch.setattr(probe, "probe_backend", lambda b, dev, upcoming=(): got.append(upcoming) or Verdict("ok"))
    upcoming = (Problem(64, 4096, 4096, torch.bfloat16, CPU), Problem(8, 1024, 512, torch.float16, CPU))
    assert isolate._verdict(FakeBackend("lib", risky=True), "cpu", upcoming)["status"] == "ok"
    assert got == [upcoming]


# A user's script without a main guard that probes a backend in a worker. A multiprocessing child would run it
# again (the marker file would get two lines, and the child's own probe would fail to start a process).
UNGUARDED = """import sys
import torch
from fp4dispatch.dispatch.isolate import probe_isolated
from fp4dispatch.testing import FakeBackend
with open(sys.argv[1], "a") as f:
    print("ran", file=f)
v = probe_isolated(FakeBackend("native", risky=True), torch.device("cpu"), 120.0)
print(v.status, v.reason)
"""


def test_a_probe_worker_does_not_run_the_callers_unguarded_script_again(tmp_path):
    import subprocess
    import sys

    script, marker = tmp_path / "infer.py", tmp_path / "ran.txt"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
    assert marker.read_text() == "ran\n"


class DefinedInMain(FakeBackend):
    pass


def test_a_backend_defined_in_the_main_script_is_not_sent_to_a_worker_and_the_verdict_says_how_to_fix_it(
        monkeypatch):
    monkeypatch.setattr(DefinedInMain, "__module__", "__main__")
    v = probe_isolated(DefinedInMain("mine", risky=True), CPU, 60.0)
    assert (v.status, v.transient) == ("failed", True)
    assert v.reason == ("'mine' cannot be probed in a worker process: its class is defined in the main script, which "
                        "a worker does not run; define it in an importable module, or probe it in this process "
                        "(FP4DISPATCH_ISOLATE=0)")


def test_an_interrupted_probe_kills_its_workers_instead_of_waiting_for_their_timeouts(tmp_path):
    """Ctrl-C while this process probes: a hanging worker is killed at once, not waited for (its timeout may be minutes
    when it makes the first runs of a model's keys), and the interrupt goes on to the caller."""
    import time

    class Interrupted(FakeBackend):
        def unavailable(self, device):
            raise KeyboardInterrupt

    d = Dispatcher([FakeBackend("hanger", crash="hang", risky=True), Interrupted("safe")], cache_dir=tmp_path,
                   settings=Settings(isolate=True, probe_timeout_s=600.0))
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        d.report(CPU)
    assert time.monotonic() - t0 < 300  # the worker's timeout is 600 s; a kill takes well under a second


class MissingHere(FakeBackend):
    """Unavailable in the process that made it (its library is not there), available in a worker, where it hangs."""

    def __init__(self, name: str):
        super().__init__(name, crash="hang", risky=True)
        self.maker = os.getpid()

    def unavailable(self, device):
        return "no library in this process" if os.getpid() == self.maker else None


def test_a_check_made_here_once_the_worker_started_kills_the_worker_and_is_the_verdict():
    """``check_here``: the library's availability is checked in this process while the worker starts; a reason there
    ends the probe at once (without the check, the worker would run until its timeout)."""
    v = probe_isolated(MissingHere("missing"), CPU, 600.0, check_here=True)
    assert (v.status, v.reason) == ("unavailable", "no library in this process")


def test_probe_isolated_reports_a_healthy_backend_ok():
    v = probe_isolated(FakeBackend("healthy", risky=True), CPU, 60.0)
    assert (v.status, v.reason) == ("ok", "")


def test_probe_isolated_reports_a_wrong_backend_incorrect():
    v = probe_isolated(FakeBackend("zeros", result="zeros", risky=True), CPU, 60.0)
    assert v.status == "incorrect"
    assert "all zeros" in v.reason


@pytest.mark.parametrize("crash, reason", CRASHES)
def test_dispatcher_survives_a_crashing_backend_and_answers_through_the_next(tmp_path, crash, reason):
    crasher = FakeBackend(f"native-{crash}", crash=crash, risky=True, cost=1e-6)
    good = FakeBackend("safe", cost=1e-3)
    d = Dispatcher(backends=[crasher, good], cache_dir=tmp_path, settings=Settings(isolate=True,
                                                                                   probe_timeout_s=TIMEOUT_S[crash]))
    a, b, sa, sb, alpha = make_nvfp4_inputs(5, 64, 128, seed=3)
    out = d.fp4_mm(a, b, sa, sb, alpha)

    problem = Problem(5, 64, 128, torch.bfloat16, CPU)
    ref = reference_mm(problem, Operands(a, b, sa, sb, alpha, out))
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert crasher.calls == 0  # it only ever ran in the worker

    rec = {r.name: r for r in d.report(CPU)}
    assert rec[crasher.name].status == "failed"
    assert re.match(reason, rec[crasher.name].reason), rec[crasher.name].reason
    assert rec["safe"].status == "ok"
    assert rec["safe"].wins  # the decided key went to the surviving backend


def test_isolation_off_probes_in_process(tmp_path):
    """Without isolation a risky backend's exception is still a verdict (the crash cases need the worker)."""
    bad = FakeBackend("native-raises", raises=RuntimeError("illegal instruction"), risky=True)
    d = Dispatcher(backends=[bad, FakeBackend("safe")], cache_dir=tmp_path, settings=Settings(isolate=False))
    rec = {r.name: r for r in d.report(CPU)}
    assert rec["native-raises"].status == "failed"
    assert rec["native-raises"].reason.startswith("RuntimeError: illegal instruction (at M=1)")
    assert bad.calls == 1


def test_timeout_verdict_is_not_cached(tmp_path):
    """A hang may be a one-off first-use JIT compile: the next process must probe again, not inherit 'failed'."""
    import json

    import torch

    from fp4dispatch.settings import Settings
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.testing import FakeBackend, fake_do_bench

    d = Dispatcher([FakeBackend("slowjit", crash="hang", risky=True), FakeBackend("ok")], cache_dir=tmp_path,
                   do_bench=fake_do_bench, settings=Settings(isolate=True, probe_timeout_s=2))
    recs = {r.name: r for r in d.report("cpu")}
    assert recs["slowjit"].status == "failed" and "timed out after 2 s" in recs["slowjit"].reason
    health = json.loads(next(tmp_path.glob("decisions-*.json")).read_text())["health"]
    assert "slowjit" not in health and health["ok"]["status"] == "ok"
    assert torch.device("cpu") in d._states


def test_isolated_probes_run_concurrently(tmp_path):
    """Native backends are probed in parallel workers: three hangs cost one timeout, not three."""
    import time

    from fp4dispatch.settings import Settings
    from fp4dispatch.dispatch.dispatcher import Dispatcher
    from fp4dispatch.testing import FakeBackend, fake_do_bench

    hangs = [FakeBackend(f"hang{i}", crash="hang", risky=True) for i in range(3)]
    d = Dispatcher([*hangs, FakeBackend("ok")], cache_dir=tmp_path, do_bench=fake_do_bench,
                   settings=Settings(isolate=True, probe_timeout_s=8))
    t0 = time.monotonic()
    recs = {r.name: r for r in d.report("cpu")}
    elapsed = time.monotonic() - t0
    assert all(recs[f"hang{i}"].status == "failed" for i in range(3)) and recs["ok"].status == "ok"
    # one after another they take >= 24 s whatever the load; together ~8 s plus the workers' start
    assert elapsed < 20, f"probes ran one after another ({elapsed:.1f} s for three 8 s timeouts)"


def test_isolated_probes_overlap_the_in_process_ones(tmp_path, monkeypatch):
    """The workers are started before this process probes the safe backends, so a worker's start-up and a library's
    first compile run beside those probes. The safe backend's probe waits for the (fake) worker to have started:
    probed one after the other, it would give up and say so in its verdict."""
    import threading

    from fp4dispatch.dispatch import health as health_mod
    from fp4dispatch.dispatch.records import Verdict
    from fp4dispatch.testing import fake_do_bench

    started = threading.Event()

    class Safe(FakeBackend):
        def unavailable(self, device):
            return None if started.wait(30) else "the probe workers had not started"

    def fake_worker(backend, device, timeout_s, upcoming=(), cancel=None, check_here=False):
        started.set()
        return Verdict("ok")

    monkeypatch.setattr(health_mod, "probe_isolated", fake_worker)
    d = Dispatcher([FakeBackend("native", risky=True), Safe("safe")], cache_dir=tmp_path, do_bench=fake_do_bench,
                   settings=Settings(isolate=True))
    recs = {r.name: r for r in d.report(CPU)}
    assert (recs["safe"].status, recs["safe"].reason) == ("ok", "")
    assert recs["native"].status == "ok"


class InterruptedThere(FakeBackend):
    """SIGINT reaches its probe worker (Ctrl-C signals a terminal's whole process group) while this process goes on,
    as an application that handles SIGINT itself does. ``die``: the worker has SIGINT's default action (killed by
    it, as an uncaught KeyboardInterrupt ends Python); else the probe sees a KeyboardInterrupt."""

    def __init__(self, name: str, die: bool):
        super().__init__(name, risky=True)
        self.maker, self.die = os.getpid(), die

    def run(self, problem, ops, config):
        if os.getpid() != self.maker:
            if self.die:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.raise_signal(signal.SIGINT)
        super().run(problem, ops, config)


@pytest.mark.parametrize("die", [False, True], ids=["keyboard-interrupt", "killed-by-sigint"])
def test_a_probe_worker_interrupted_by_sigint_is_not_cached_as_the_backends_verdict(tmp_path, die):
    """Before: 'failed: KeyboardInterrupt' (or 'worker died (signal 2, SIGINT)') went to the cache file, and a healthy
    backend stayed failed on this device until ``tune clear``."""
    d = Dispatcher([InterruptedThere("healthy", die), FakeBackend("safe")], cache_dir=tmp_path,
                   settings=Settings(isolate=True, probe_timeout_s=120.0))
    status = {r.name: (r.status, r.reason) for r in d.report(CPU)}
    assert status["healthy"][0] == "failed"
    # either way the worker dies by SIGINT (worker_process), and the exit status says so
    assert re.match(r"^probe worker interrupted by SIGINT \(not cached: probed again by the next process\)"
                    + rf" \(signal {int(signal.SIGINT)}, SIGINT\)$", status["healthy"][1])
    assert "healthy" not in d.cache_for(CPU).health and "safe" in d.cache_for(CPU).health
