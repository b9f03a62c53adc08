"""The fourteen reliability defects found by adversarial testing, one test each (CPU, fake backends, a fake timer,
each test with its own cache dir). Each test starts with the defect's reproducer."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from fp4dispatch import (InvalidInputError, NoUsableBackendError, dequantize_nvfp4, fp4_mm, quantize_nvfp4,
                         swizzle_scales, unswizzle_scales)
from fp4dispatch.settings import read_settings
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs

CPU = torch.device("cpu")


def _disp(backends, tmp_path, **kw):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench, **kw)


def _exact(a, b, sa, sb, alpha):
    return (dequantize_nvfp4(a, sa).double() @ dequantize_nvfp4(b, sb).double().T * float(alpha)).float()


def _right(d, m, n=48, k=64, seed=0, alpha=None):
    a, b, sa, sb, al = make_nvfp4_inputs(m, n, k, seed=seed)
    al = al if alpha is None else torch.tensor([alpha], dtype=torch.float32)
    out = d.fp4_mm(a, b, sa, sb, al, out_dtype=torch.float32)
    ref = _exact(a, b, sa, sb, al)
    return bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()), equal_nan=True))


def _blacklist(d):
    return d.cache_for(CPU).shape_blacklist


# -- 1. wrong inside an M bucket ----------------------------------------------------------------------------------
def test_01_a_decision_is_proven_at_every_m_it_serves(tmp_path):
    d = _disp([FakeBackend("m3bad", cost=1e-8, wrong_for_m=(3,)), FakeBackend("good", cost=1e-3)], tmp_path)
    assert _right(d, 4) and _right(d, 3)  # was: M=4 picks m3bad for the bucket, then M=3 returned zeros
    # kept out by its probe (M=3 is a probe M) from the bucket holding 3, still used elsewhere
    assert {r.name: r.wins for r in d.report(CPU)}["m3bad"] == []
    assert "incorrect at M=3 when probed" in _blacklist(d)["m4-n48-k64-float32"]["m3bad"]
    assert _right(d, 8)
    assert d.choose(d_problem(8)).backend.name == "m3bad"


def d_problem(m, n=48, k=64):
    from fp4dispatch.problem import Problem

    return Problem(m, n, k, torch.float32, CPU)


def test_01_wrong_at_m_no_probe_covers_is_caught_by_proving_that_m(tmp_path):
    bad, good = FakeBackend("m567bad", cost=1e-8, wrong_for_m=(5, 6, 7)), FakeBackend("good", cost=1e-3)
    d = _disp([bad, good], tmp_path)
    assert _right(d, 8)  # decided at M=8: m567bad wins
    assert d.choose(d_problem(8)).backend.name == "m567bad"
    assert [_right(d, m, seed=m) for m in (5, 6, 7)] == [True, True, True]  # was 3/3 wrong
    assert "when proven at M=5: all zeros" in _blacklist(d)["m8-n48-k64-float32"]["m567bad"]
    # remembered on disk: a warm start proves nothing again and runs only the pick
    bad2, good2 = FakeBackend("m567bad", cost=1e-8, wrong_for_m=(5, 6, 7)), FakeBackend("good", cost=1e-3)
    d2 = _disp([bad2, good2], tmp_path)
    assert _right(d2, 6) and _right(d2, 8)
    assert bad2.calls == 0 and good2.calls == 2


# -- 2. input-dependent wrongness -------------------------------------------------------------------------------
@pytest.mark.parametrize("result, reason", [("abs_alpha", "relative error"),
                                            ("nan_scale_as_zero", "a NaN block scale read as a number")])
def test_02_verification_uses_negative_alpha_and_nan_zero_subnormal_scales(tmp_path, result, reason):
    bad = FakeBackend("bad", cost=1e-8, result=result)
    d = _disp([bad, FakeBackend("good", cost=1e-3)], tmp_path)
    assert _right(d, 4, alpha=-0.75)
    a, b, sa, sb, al = make_nvfp4_inputs(4, 48, 64, seed=1)
    lin = unswizzle_scales(sb, 48, 4)
    lin.view(torch.uint8)[5, 0] = 0x7F  # a NaN block scale: NaN in that output column, as on hardware
    sb = swizzle_scales(lin)
    out = d.fp4_mm(a, b, sa, sb, al, out_dtype=torch.float32)
    assert bool(torch.isnan(out[:, 5]).all()) and bool(torch.isfinite(out[:, :5]).all())
    status, why = next((r.status, r.reason) for r in d.report(CPU) if r.name == "bad")
    assert status == "incorrect" and reason in why


# -- 3. a backend that mutates its inputs -------------------------------------------------------------------------
def test_03_a_backend_that_changes_its_inputs_is_rejected(tmp_path):
    d = _disp([FakeBackend("mutator", cost=1e-8, mutates="b_scale"), FakeBackend("good", cost=1e-3)], tmp_path)
    a, b, sa, sb, al = make_nvfp4_inputs(4, 48, 64)
    keep = sb.clone()
    d.fp4_mm(a, b, sa, sb, al)
    assert torch.equal(sb.view(torch.uint8), keep.view(torch.uint8))  # the user's weights are untouched
    st = {r.name: (r.status, r.reason) for r in d.report(CPU)}
    assert st["mutator"][0] == "incorrect" and "modified its input b_scale" in st["mutator"][1]
    assert st["good"] == ("ok", "") and _blacklist(d) == {}  # and the correct backend was not blamed


# -- 4. an invalid call must not poison the shape ------------------------------------------------------------------
def test_04_an_invalid_call_is_an_input_error_and_records_nothing(tmp_path):
    d = _disp([FakeBackend("a1"), FakeBackend("a2", cost=1e-3)], tmp_path)
    a, b, sa, sb, al = make_nvfp4_inputs(5, 48, 64)
    with pytest.raises(InvalidInputError, match=r"out must not require grad .* Pass out.detach\(\)"):
        d.fp4_mm(a, b, sa, sb, al, out=torch.zeros(5, 48, requires_grad=True), out_dtype=torch.float32)
    assert _right(d, 5) and _blacklist(d) == {}
    assert _right(_disp([FakeBackend("a1"), FakeBackend("a2", cost=1e-3)], tmp_path), 5)  # a new process too


def test_04_a_call_every_backend_raises_on_is_not_recorded_against_them(tmp_path):
    x, y = FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)
    d = _disp([x, y], tmp_path)
    assert _right(d, 5)
    x.fail_after, y.fail_after = x.successes, y.successes  # whatever this call is, nothing can run it
    with pytest.raises(NoUsableBackendError, match=r"(?s)every backend raised on this call.*x: RuntimeError.*"
                                                   r"y: RuntimeError.*Nothing was recorded against them"):
        _right(d, 5)
    x.fail_after = y.fail_after = None
    assert _right(d, 5) and d.choose(d_problem(5)).backend.name == "x"
    assert _blacklist(d) == {} and d.cache_for(CPU).faults == {}


# -- 5. transient runtime faults --------------------------------------------------------------------------------
def test_05_transient_faults_are_retried_not_permanent(tmp_path):
    x, y = FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)
    d = _disp([x, y], tmp_path)
    assert _right(d, 5)
    x.fail_after = x.successes  # one out-of-memory from x: y serves the call, x is benched for the key
    assert _right(d, 5, seed=1) and d.choose(d_problem(5)).backend.name == "y"
    x.fail_after, y.fail_after = None, y.successes  # then one from y: x is tried again
    assert _right(d, 5, seed=2) and d.choose(d_problem(5)).backend.name == "x"
    faults = d.cache_for(CPU).faults["m8-n48-k64-float32"]
    assert {n: f["count"] for n, f in faults.items()} == {"x": 1, "y": 1}
    fresh = _disp([FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)], tmp_path)
    assert _right(fresh, 5)  # was: NoUsableBackendError in every later process
    assert fresh.choose(d_problem(5)).backend.name == "x" and _blacklist(fresh) == {}


# -- 6. one bad backend must not break every call -----------------------------------------------------------------
@pytest.mark.parametrize("fault, reason", [("resize", "replaced or resized out"),
                                           ("past_end", "wrote outside out"),
                                           ("transposed_strides", "replaced or resized out")])
def test_06_a_backend_that_breaks_out_is_rejected_and_nothing_raises(tmp_path, fault, reason):
    d = _disp([FakeBackend("breaker", cost=1e-8, out_fault=fault), FakeBackend("good", cost=1e-3)], tmp_path)
    assert _right(d, 5) and _right(d, 300)
    st = {r.name: (r.status, r.reason) for r in d.report(CPU)}
    assert st["breaker"][0] == "incorrect" and reason in st["breaker"][1], st["breaker"]
    assert "no report is printable" not in str(d.report(CPU))


# -- 7. cache content never raises ------------------------------------------------------------------------------
KEY = "m4-n48-k64-float32"


def _set(path, value):
    """A mutation that sets data[path[0]][path[1]]... = value."""
    def mutate(data):
        node = data
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return json.dumps(data).encode()
    return mutate


HOSTILE = {
    "decision-is-a-string": _set(["decisions", KEY], "good"),
    "decision-is-a-list": _set(["decisions", KEY], ["good"]),
    "ranking-is-a-string": _set(["decisions", KEY, "ranking"], "abc"),
    "config-is-a-string": _set(["decisions", KEY, "config"], "xyz"),
    "time-is-a-string": _set(["decisions", KEY, "time_us"], "fast"),
    "tuned-at-negative": _set(["decisions", KEY, "tuned_at_m"], -1),
    "bad-key": _set(["decisions", "m4-n48-k64-bfloat16-extra"], {"backend": "good"}),
    "other-key-bad-entry": _set(["decisions", "m8-n48-k64-float32"], {"backend": 5}),
    "seconds-is-a-string": _set(["health", "good", "seconds"], "abc"),
    "seconds-is-null": _set(["health", "good", "seconds"], None),
    "status-is-a-list": _set(["health", "good", "status"], ["ok"]),
    "status-upper-case": _set(["health", "good", "status"], "OK"),
    "blacklist-is-a-number": _set(["shape_blacklist", KEY], 5),
    "verified-not-a-list": _set(["verified", KEY], {"good|default": "x"}),
    "fault-count-a-string": _set(["faults", KEY], {"good": {"count": "many", "last": 1.0, "reason": ""}}),
    "section-is-a-list": _set(["decisions"], []),
    "not-utf8": lambda data: b"\xff\xfe\x00{garbage",
    "deep-nesting": lambda data: b"[" * 200000,
    "truncated": lambda data: json.dumps(data).encode()[:40],
}


@pytest.mark.parametrize("mutation", list(HOSTILE))
def test_07_hostile_cache_content_is_dropped_with_one_warning(tmp_path, mutation, caplog):
    d = _disp([FakeBackend("good")], tmp_path)
    assert _right(d, 4) and _right(d, 8)
    path = d.cache_for(CPU).path
    path.write_bytes(HOSTILE[mutation](json.loads(path.read_text())))
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        fresh = _disp([FakeBackend("good")], tmp_path)  # a new process: was a crash on every call
        assert _right(fresh, 4) and _right(fresh, 8, seed=1)
        recs = fresh.report(CPU)
        assert "good" in str(recs) and recs[0].status == "ok"
    cache_warnings = [r for r in caplog.records if "cache file" in r.getMessage()]
    assert len(cache_warnings) == 1, [r.getMessage() for r in caplog.records]


def test_07_import_refuses_a_profile_with_a_malformed_entry(tmp_path, capsys):
    from fp4dispatch.tune import main

    d = Dispatcher(cache_dir=tmp_path / "c")  # the built-in backends, so the profile matches this device
    a, b, sa, sb, al = make_nvfp4_inputs(4, 48, 64)
    d.fp4_mm(a, b, sa, sb, al)
    assert main(["export", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "c")]) == 0
    prof = json.loads((tmp_path / "p.json").read_text())
    prof["decisions"]["m4-n48-k64-bfloat16"] = "reference"  # was accepted, then fp4_mm raised AttributeError
    (tmp_path / "p.json").write_text(json.dumps(prof))
    capsys.readouterr()
    assert main(["import", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "1 malformed entries, so nothing was imported" in err and "decisions['m4-n48-k64-bfloat16']" in err
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").glob("decisions-*.json"))


# -- 8. a peer holding the lock must not stall calls -------------------------------------------------------------
def test_08_a_held_lock_costs_a_call_at_most_the_short_wait(tmp_path):
    from filelock import FileLock

    d = _disp([FakeBackend("good")], tmp_path)
    cache = d.cache_for(CPU)
    peer = FileLock(str(cache.path) + ".lock")  # another process's lock, in effect (flock is per open file)
    peer.acquire()
    try:
        import time

        t0 = time.perf_counter()
        assert _right(d, 4) and _right(d, 16)  # was 120.8 s for the first call and 60 s per new key
        waited = time.perf_counter() - t0
        assert waited < 30, waited  # a hang guard, not a timing goal: each write waits LOCK_TIMEOUT_S (1 s) once
        assert not cache.path.exists() or "m16-n48-k64-float32" not in cache.path.read_text()
    finally:
        peer.release()
    assert _right(d, 2)  # the next write takes the free lock and writes everything kept in memory
    on_disk = json.loads(cache.path.read_text())["decisions"]
    assert {"m4-n48-k64-float32", "m16-n48-k64-float32", "m2-n48-k64-float32"} <= set(on_disk)


# -- 9. scaling -------------------------------------------------------------------------------------------------
def test_09_an_oversized_file_is_not_read_and_sections_are_bounded(tmp_path, monkeypatch, caplog):
    from fp4dispatch.dispatch import cache as cache_mod

    d = _disp([FakeBackend("good")], tmp_path)
    assert _right(d, 4)
    path = d.cache_for(CPU).path
    data = json.loads(path.read_text())
    data["decisions"].update({f"m1-n{n}-k64-float32": data["decisions"][KEY] for n in range(1, 3000)})
    path.write_text(json.dumps(data))  # a valid file of ~1 MB: was re-read and rewritten whole on every write
    monkeypatch.setattr(cache_mod, "MAX_FILE_BYTES", 64 << 10)
    monkeypatch.setattr(cache_mod, "MAX_KEYS", 8)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        fresh = _disp([FakeBackend("good")], tmp_path)
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            assert _right(fresh, m, seed=m)
    assert any("over the 65536-byte bound" in r.getMessage() for r in caplog.records)
    data = json.loads(path.read_text())
    assert path.stat().st_size < 64 << 10
    assert all(len(data[s]) <= 8 for s in ("decisions", "verified", "health"))


# -- 10. leftovers ----------------------------------------------------------------------------------------------
def test_10_temp_files_of_killed_writers_and_lock_files_are_cleaned(tmp_path, capsys):
    from fp4dispatch.tune import main

    d = _disp([FakeBackend("good")], tmp_path)
    assert _right(d, 4)
    path = d.cache_for(CPU).path
    stale = [path.parent / f".{path.name}.abc{i}.tmp" for i in range(3)]
    other = path.parent / ".decisions-0123456789abcdef.json.xyz.tmp"
    for p in stale + [other]:
        p.write_text("{half a fi")
    _disp([FakeBackend("good")], tmp_path).cache_for(CPU)  # opening cleans this fingerprint's leftovers
    assert not any(p.exists() for p in stale) and other.exists()
    (path.parent / "decisions-0123456789abcdef.json.lock").write_text("")
    assert main(["clear", "--all", "--cache-dir", str(path.parent)]) == 0
    assert sorted(p.name for p in path.parent.iterdir()) == []


def _kill_writer(cache_dir: str) -> None:
    from fp4dispatch.dispatch.cache import DecisionCache

    c = DecisionCache(cache_dir, {"device_type": "cpu", "libs": {}})
    i = 0
    while True:
        i += 1
        c.update("decisions", {f"m1-n{i}-k64-float32": {"backend": "x", "config": {}, "time_us": 1.0,
                                                       "ranking": [{"backend": "x", "pad": "y" * 4000}] * 16}})


def test_10_kill_9_mid_write_never_corrupts_nor_sticks(tmp_path):
    import multiprocessing as mp
    import os
    import signal
    import time

    from fp4dispatch.dispatch.cache import DecisionCache

    ctx = mp.get_context("fork")  # the writer needs no fresh interpreter; fork keeps each round short
    for i in range(10):
        p = ctx.Process(target=_kill_writer, args=(str(tmp_path),))
        p.start()
        time.sleep(0.2 + 0.05 * i)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        c = DecisionCache(tmp_path, {"device_type": "cpu", "libs": {}})  # parses, cleans leftovers
        assert c.flush() and c.update("health", {"x": {"status": "ok", "reason": "", "seconds": 0.0}})
        assert not list(tmp_path.glob(".decisions-*.tmp"))
    assert json.loads(c.path.read_text())["decisions"]  # entries the killed writers completed are all there


# -- 11. sharing a cache across users ---------------------------------------------------------------------------
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_11_files_get_the_umask_mode(tmp_path, umask, mode):
    import os

    from fp4dispatch.dispatch import cache as cache_mod

    old = os.umask(umask)
    cache_mod._umask.cache_clear()
    try:
        d = _disp([FakeBackend("good")], tmp_path)
        assert _right(d, 4)
        path = d.cache_for(CPU).path
        assert path.stat().st_mode & 0o777 == mode  # was 0600 (mkstemp): no other user could read it
    finally:
        os.umask(old)
        cache_mod._umask.cache_clear()


# -- 12. an unwritable cache is reported, once ------------------------------------------------------------------
def test_12_unwritable_cache_fails_tune_and_import_and_warns_once(tmp_path, capsys, caplog):
    from fp4dispatch.tune import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad_dir = str(blocker / "cache")  # below a regular file: cannot be created, even by root
    code = main(["--shape", "4,48,64", "--cache-dir", bad_dir], backends=[FakeBackend("good")],
                do_bench=fake_do_bench)
    out = capsys.readouterr().out
    assert code == 1 and "could not write the cache" in out and "lost when this process ends" in out
    good = tmp_path / "good"
    assert main(["--shape", "4,48,64", "--cache-dir", str(good)]) == 0
    assert f"cache: {good}" in capsys.readouterr().out  # tune says where it wrote
    assert main(["export", str(tmp_path / "p.json"), "--cache-dir", str(good)]) == 0
    capsys.readouterr()
    assert main(["import", str(tmp_path / "p.json"), "--cache-dir", bad_dir]) == 1  # was "imported ..." and 0
    assert "nothing was written" in capsys.readouterr().err
    d = Dispatcher([FakeBackend("good")], cache_dir=bad_dir, do_bench=fake_do_bench)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        for m in range(1, 21):
            assert _right(d, m, seed=m)
    assert sum("could not write the cache" in r.getMessage() for r in caplog.records) == 1  # was 18 in 20 calls


# -- 13. input errors name the argument -------------------------------------------------------------------------
def _args(**kw):
    a, b, sa, sb, al = make_nvfp4_inputs(5, 48, 64)
    args = dict(a=a, b=b, a_scale=sa, b_scale=sb, alpha=al)
    args.update(kw)
    return args


INPUT_ERRORS = [
    ("alpha-1e300", lambda: fp4_mm(**_args(alpha=1e300)), r"alpha=1e\+300 does not fit in float32"),
    ("alpha-10**40", lambda: fp4_mm(**_args(alpha=10 ** 40)), r"alpha=10000000000000000000\.\.\. does not fit"),
    ("alpha-array", lambda: fp4_mm(**_args(alpha=np.array([1.0, 2.0]))),
     r"alpha must be a float32 1-element tensor, a Python or NumPy float, or None; got numpy\.ndarray"),
    ("meta", lambda: fp4_mm(**{k: v.to("meta") for k, v in _args().items()}),
     r"tensors must hold data on a CPU or CUDA device; got device meta"),
    ("n-equals-k-half", lambda: fp4_mm(**_args(b=torch.zeros(32, 40, dtype=torch.uint8))),
     r"b.shape\[1\] \(K/2\) must equal a.shape\[1\]=32: a and b disagree on K; got a.shape=\(5, 32\), "
     r"b.shape=\(32, 40\) \(if b is a transposed"),
    ("transposed-view", lambda: fp4_mm(**_args(b=torch.zeros(48, 32, dtype=torch.uint8).T)),
     r"the transposed view \[K/2, N\] = FlashInfer's b.T"),
]


@pytest.mark.parametrize("case", [c[1:] for c in INPUT_ERRORS], ids=[c[0] for c in INPUT_ERRORS])
def test_13_input_errors_are_invalid_input_errors_with_the_argument(case):
    call, message = case
    with pytest.raises(InvalidInputError, match=message):
        call()


def test_13_numpy_alpha_and_empty_quantize_work():
    args = _args(alpha=np.float32(-0.5))  # was: "...; got float32"
    out = fp4_mm(**args, out_dtype=torch.float32)
    ref = _exact(args["a"], args["b"], args["a_scale"], args["b_scale"], -0.5)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    q, s, g = quantize_nvfp4(torch.randn(0, 64))  # was: raw "amax(): Expected reduction dim"
    assert q.shape == (0, 32) and s.shape == (0, 4) and float(g) == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_13_cuda_asked_for_without_cuda(tmp_path):
    d = _disp([FakeBackend("good")], tmp_path)
    for call in (lambda: d.warmup([(4, 48, 64)], device="cuda"), lambda: d.report("cuda")):
        with pytest.raises(InvalidInputError, match=r"device cuda was asked for, but CUDA is not available here"):
            call()
    with pytest.raises(ValueError, match=r"device='cuda', but CUDA is not available here"):
        make_nvfp4_inputs(4, 48, 64, device="cuda")


# -- 14. environment values --------------------------------------------------------------------------------------
ENV_ERRORS = [
    ("FP4DISPATCH_PROBE_TIMEOUT", "abc", r"FP4DISPATCH_PROBE_TIMEOUT='abc' is not valid; accepted: a positive number"),
    ("FP4DISPATCH_LOG", "LOUD", r"FP4DISPATCH_LOG='LOUD' is not valid; accepted: DEBUG, INFO, WARNING"),
    ("FP4DISPATCH_TUNE", "maybe", r"FP4DISPATCH_TUNE='maybe' is not valid; accepted: 1/true/yes/on or 0/false"),
    ("FP4DISPATCH_ISOLATE", "sometimes", r"FP4DISPATCH_ISOLATE='sometimes' is not valid"),
    ("FP4DISPATCH_GUARD", "2", r"FP4DISPATCH_GUARD='2' is not valid"),
]


@pytest.mark.parametrize("name, value, message", ENV_ERRORS, ids=[e[0] for e in ENV_ERRORS])
def test_14_bad_environment_values_name_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidInputError, match=message):
        read_settings()


def test_14_backend_and_disable_typos_name_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "flashinfer:cutlas")
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_DISABLE='flashinfer:cutlas' names no backend "
                                                r"\['flashinfer:cutlas'\]; accepted names: .*'flashinfer:cutlass'"):
        Dispatcher(cache_dir=tmp_path)
    monkeypatch.delenv("FP4DISPATCH_DISABLE")
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "garbage")
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_BACKEND must be one of \['good'\]; got 'garbage'. "
                                                r"Fix or unset the variable"):
        _right(_disp([FakeBackend("good")], tmp_path), 4)


# -- also: readable report, cheap and load-proof CPU decisions --------------------------------------------------
def test_report_prints_a_table_and_keeps_its_records(tmp_path):
    d = _disp([FakeBackend("fast", cost=1e-6), FakeBackend("zeros", result="zeros")], tmp_path)
    assert _right(d, 4)
    rep = d.report(CPU)
    assert [r.name for r in rep] == ["fast", "zeros"] and rep[0].wins == [KEY]
    lines = str(rep).splitlines()
    assert lines[0].split() == ["backend", "status", "wins", "reason"]
    assert lines[1].split()[:4] == ["fast", "ok", "1", "-"] and lines[2].split()[:2] == ["zeros", "incorrect"]


def test_cpu_decisions_are_not_timed(tmp_path):
    slow_first, fast = FakeBackend("first", cost=1.0), FakeBackend("second", cost=1e-9)
    d = Dispatcher([slow_first, fast], cache_dir=tmp_path / "c")  # no do_bench: the CPU default
    assert _right(d, 4)
    entry = d.cache_for(CPU).decisions[KEY]
    assert entry["backend"] == "first" and entry["mode"] == "priority"  # priority order, whatever the load
