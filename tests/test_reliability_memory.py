"""Out of device memory is the process's state, not a backend's defect (docs/tuning.md, "Faults"): a probe, check,
timing or run that fails for want of memory bans nothing and writes no verdict to the cache (a decision made without
one names the backends it could not judge, and a process that can judge them decides the key again), and a call
that memory cannot serve raises DeviceMemoryError, which is a torch.OutOfMemoryError too (what frameworks catch to
retry with a smaller batch). Before, one out-of-memory in a key's check banned the backend from that shape on disk."""
from __future__ import annotations

import logging

import pytest
import torch

from _reliability_helpers import CPU, blacklist, disp, problem, right
from fp4dispatch import DeviceMemoryError, Dispatcher, FP4DispatchError
from fp4dispatch.dispatch import isolate
from fp4dispatch.dispatch.probe import memory_verdict
from fp4dispatch.dispatch.records import Verdict
from fp4dispatch.testing import FakeBackend, fake_do_bench

KEY = "m8-n48-k64-float32"  # the key of M = 5 and 6
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def short() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(OOM)


def pair() -> list[FakeBackend]:
    return [FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)]


def test_a_check_short_of_memory_bans_nothing_and_a_process_that_can_judge_decides_again(tmp_path, caplog):
    x, y = pair()
    d = disp([x, y], tmp_path)
    d.report()  # both probed: ok
    x.raises = short()
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        assert right(d, 5)
    assert d.choose(problem(5)).backend.name == "y"
    entry = d.cache_for(CPU).decisions[KEY]
    assert blacklist(d) == {} and (entry["backend"], entry["unjudged"]) == ("y", ["x"])
    assert (f"{KEY} decided (y) without a verdict on x (out of memory: OutOfMemoryError: {OOM} (at M=5)); a process "
            "that has one decides it again") in caplog.text
    fresh = disp(pair(), tmp_path)  # the next process, with memory to spare: x is judged, and wins
    assert right(fresh, 5) and fresh.choose(problem(5)).backend.name == "x"
    assert fresh.cache_for(CPU).decisions[KEY]["backend"] == "x" and "unjudged" not in fresh.cache_for(
        CPU).decisions[KEY]


def test_a_timing_short_of_memory_bans_nothing_and_a_process_that_can_judge_decides_again(tmp_path):
    x, y = pair()

    def timer(fn):  # the timer's own allocations fail while it times x
        before = x.calls
        ms = fake_do_bench(fn)
        if x.calls > before:
            raise short()
        return ms

    d = Dispatcher([x, y], cache_dir=tmp_path / "c", do_bench=timer)
    assert right(d, 5) and d.choose(problem(5)).backend.name == "y"
    assert blacklist(d) == {} and d.cache_for(CPU).decisions[KEY]["unjudged"] == ["x"]
    fresh = disp(pair(), tmp_path)
    assert right(fresh, 5) and fresh.choose(problem(5)).backend.name == "x"


def test_a_key_no_backend_has_the_memory_for_raises_device_memory_error_and_records_nothing(tmp_path):
    x, y = pair()
    d = disp([x, y], tmp_path)
    d.report()
    x.raises = y.raises = short()
    with pytest.raises(torch.OutOfMemoryError, match=(
            r"^fp4_mm: no backend served .*, and the device ran short of memory while they were probed, checked or "
            r"timed:\n  x: out of memory: OutOfMemoryError: CUDA out of memory\. Tried to allocate 2\.00 GiB "
            r"\(at M=5\)\n  y: out of memory: .*\nNothing was recorded against the backends: the call can be made "
            r"again once memory is free\. Decide and prove your shapes before the GPU fills up \(fp4dispatch\.warmup, "
            r"python -m fp4dispatch\.tune\), or leave more memory free$")) as e:
        right(d, 5)
    assert isinstance(e.value, DeviceMemoryError) and isinstance(e.value, FP4DispatchError)
    assert list(e.value.reasons) == ["x", "y"]
    assert blacklist(d) == {} and d.cache_for(CPU).decisions == {}
    x.raises = y.raises = None  # memory freed: the same dispatcher decides the key
    assert right(d, 5) and d.choose(problem(5)).backend.name == "x"
    assert d.cache_for(CPU).decisions[KEY]["backend"] == "x"


def test_proving_a_new_m_short_of_memory_raises_and_bans_nothing(tmp_path):
    x, y = pair()
    d = disp([x, y], tmp_path)
    assert right(d, 5) and d.choose(problem(5)).backend.name == "x"
    x.raises = short()
    with pytest.raises(DeviceMemoryError, match=(
            rf"^fp4_mm: the device ran out of memory while fp4dispatch proved x right at M=6, a new M of {KEY} \(each "
            r"backend is proven at every new M before it serves it\): OutOfMemoryError: CUDA out of memory\. Tried to "
            r"allocate 2\.00 GiB \(at M=6\)\. Nothing was recorded against the backends")):
        right(d, 6)
    assert blacklist(d) == {} and d.cache_for(CPU).faults == {}
    x.raises = None
    assert right(d, 6) and d.choose(problem(6)).backend.name == "x"


def test_a_probe_short_of_memory_is_not_cached_and_its_keys_are_decided_again_once_it_is_judged(tmp_path):
    x, y = pair()
    x.raises = short()
    d = disp([x, y], tmp_path)
    assert right(d, 5) and d.choose(problem(5)).backend.name == "y"
    rec = {r.name: r for r in d.report()}["x"]
    assert (rec.status, rec.reason) == ("failed", "out of memory in its probe (not cached: probed again by the next "
                                        f"process): OutOfMemoryError: {OOM} (at M=1)")
    cache = d.cache_for(CPU)
    assert "x" not in cache.health and "y" in cache.health and cache.decisions[KEY]["unjudged"] == ["x"]
    again = disp([FakeBackend("x", cost=1e-6, raises=short()), FakeBackend("y", cost=1e-3)], tmp_path)
    assert right(again, 5) and again.choose(problem(5)).backend.name == "y"  # still no verdict: the record serves
    fresh = disp(pair(), tmp_path)
    assert right(fresh, 5) and fresh.choose(problem(5)).backend.name == "x"


def test_a_probe_worker_short_of_memory_answers_a_transient_verdict():
    answer = isolate._verdict(FakeBackend("x", raises=short()), "cpu", ())
    v = Verdict.from_json(answer)
    assert v.transient and v.status == "failed" and v.reason.startswith("out of memory in its probe")
    assert "transient" not in Verdict("failed", "r").to_json()  # only a worker's answer carries it
    assert Verdict.from_json(memory_verdict("r").to_json()) == memory_verdict("r")


def test_a_call_short_of_memory_is_redone_and_not_recorded(tmp_path, caplog):
    x, y = pair()
    d = disp([x, y], tmp_path)
    assert right(d, 5)
    x.raises = short()
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        assert right(d, 5, seed=1)
    assert d.choose(problem(5)).backend.name == "y"  # benched for the key in this process
    assert d.cache_for(CPU).faults == {} and blacklist(d) == {}
    assert ("backend x ran short of device memory on" in caplog.text
            and "this call was redone on y, which serves the key for the rest of this process (not recorded)"
            in caplog.text)
    y.raises = short()
    with pytest.raises(DeviceMemoryError, match=(
            r"(?s)^fp4_mm: every backend raised on this call \(.*\), y, x for want of device memory:\n"
            r"  y: OutOfMemoryError: CUDA out of memory.*\n  x: OutOfMemoryError: .*\nNothing was recorded against "
            r"the backends")):
        right(d, 5, seed=2)
    assert d.cache_for(CPU).faults == {} and blacklist(d) == {}
    fresh = disp(pair(), tmp_path)
    assert right(fresh, 5) and fresh.choose(problem(5)).backend.name == "x"


def test_a_backend_banned_while_its_replacement_cannot_be_proven_serves_no_more(tmp_path):
    """The ban was written, but when the next backend's proof raised (here: short of memory) the banned one stayed
    the key's choice in memory and served the M it had been proven at."""
    bad, nxt = FakeBackend("bad", cost=1e-6, wrong_for_m=(6,)), FakeBackend("next", cost=1e-3)
    d = disp([bad, nxt], tmp_path)
    assert right(d, 8) and d.choose(problem(8)).backend is bad
    nxt.raises = short()
    with pytest.raises(DeviceMemoryError, match=r"proved next right at M=6"):
        right(d, 6)
    assert set(blacklist(d)[KEY]) == {"bad"}
    nxt.raises, before = None, bad.calls
    assert right(d, 8) and right(d, 6) and bad.calls == before
    assert d.choose(problem(8)).backend is nxt


def test_a_key_decided_while_a_probe_timed_out_is_decided_again_once_that_backend_is_judged(tmp_path, monkeypatch):
    """A timed-out (or interrupted) probe is transient, probed again by the next process; but the keys decided
    without that backend were recorded as final, so it could never win them (until tune clear)."""
    from fp4dispatch.dispatch import health
    from fp4dispatch.dispatch.records import Verdict

    real = health.probe_backend
    monkeypatch.setattr(health, "probe_backend", lambda b, dev, **kw: Verdict(
        "failed", "timed out after 30 s (worker killed)", 30.0, transient=True) if b.name == "x" else real(b, dev, **kw))
    d = disp(pair(), tmp_path)
    assert right(d, 5) and d.choose(problem(5)).backend.name == "y"
    assert d.cache_for(CPU).decisions[KEY]["unjudged"] == ["x"] and "x" not in d.cache_for(CPU).health
    monkeypatch.setattr(health, "probe_backend", real)
    fresh = disp(pair(), tmp_path)  # its probe of x answers: the key is decided again, among both
    assert right(fresh, 5) and fresh.choose(problem(5)).backend.name == "x"
