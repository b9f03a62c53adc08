"""The dispatcher with fake backends and a fake timer: probing, blacklisting, tuning, caching, faults, env knobs."""
from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

from fp4dispatch import BackendError, InvalidInputError, NoUsableBackendError
from fp4dispatch.backends.reference import ReferenceBackend
from fp4dispatch.settings import Settings, read_settings
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs


def _call(d: Dispatcher, m: int, n: int = 64, k: int = 128, seed: int = 0, **kw):
    a, b, sa, sb, alpha = make_nvfp4_inputs(m, n, k, seed=seed)
    out = d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, **kw)
    ref = d_ref(a, b, sa, sb, alpha)
    return out, ref


def d_ref(a, b, sa, sb, alpha):
    from fp4dispatch import dequantize_nvfp4

    return (dequantize_nvfp4(a, sa).double() @ dequantize_nvfp4(b, sb).double().T * float(alpha)).float()


def _close(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-5


def _disp(backends, tmp_path, **kw):
    return Dispatcher(backends, cache_dir=tmp_path / "c", do_bench=fake_do_bench, **kw)


def _status(d, dev="cpu"):
    return {r.name: (r.status, r.reason) for r in d.report(dev)}


FAILURE_MODES = [
    (dict(result="zeros"), "incorrect", "all zeros"),
    (dict(result="nan"), "incorrect", "NaN/Inf or unwritten"),
    (dict(result="transposed"), "incorrect", "relative error"),
    (dict(result="scaled"), "incorrect", "relative error"),
    (dict(raises=RuntimeError("CUTLASS error: Error Internal")), "failed",
     "RuntimeError: CUTLASS error: Error Internal"),
    (dict(unavailable="needs SM100"), "unavailable", "needs SM100"),
    (dict(unsupported="K must be a multiple of 4096"), "unsupported", "K must be a multiple of 4096"),
]


@pytest.mark.parametrize("kw,status,reason", FAILURE_MODES, ids=[f[1] + ":" + f[2][:12] for f in FAILURE_MODES])
def test_every_failure_mode_is_detected_and_never_chosen(tmp_path, kw, status, reason):
    bad = FakeBackend("bad", cost=1e-6, **kw)  # faster than the good one: only correctness keeps it out
    good = FakeBackend("good", cost=1e-3)
    d = _disp([bad, good], tmp_path)
    for m in (1, 5, 300):
        out, ref = _call(d, m, seed=m)
        assert _close(out, ref)
    st = _status(d)
    assert st["bad"][0] == status and reason in st["bad"][1]
    assert st["good"] == ("ok", "")
    before = bad.calls
    _call(d, 7, seed=9)
    assert bad.calls == before  # never run once blacklisted


def test_different_winners_at_different_m(tmp_path):
    small = FakeBackend("small-m", cost=lambda m, n, k: 1e-6 * (1 + m))
    large = FakeBackend("large-m", cost=lambda m, n, k: 1e-4 + 1e-8 * m)
    d = _disp([small, large], tmp_path)
    assert d.warmup([(1, 64, 128), (16, 64, 128), (1024, 64, 128), (4096, 64, 128)], out_dtype=torch.float32)
    wins = {r.name: sorted(r.wins) for r in d.report("cpu")}
    assert wins["small-m"] == ["m1-n64-k128-float32", "m16-n64-k128-float32"]
    assert wins["large-m"] == ["m1024-n64-k128-float32", "m4096-n64-k128-float32"]
    losses = {r.name: r.losses for r in d.report("cpu")}
    assert "slower" in losses["large-m"]["m1-n64-k128-float32"]


def test_backend_wrong_at_one_m_used_elsewhere(tmp_path):
    flaky = FakeBackend("flaky", cost=1e-6, wrong_for_m=(300,))  # like FlashInfer #3398 at M=3072
    safe = FakeBackend("safe", cost=1e-3)
    d = _disp([flaky, safe], tmp_path)
    out, ref = _call(d, 300)
    assert _close(out, ref)
    out, ref = _call(d, 64)
    assert _close(out, ref)
    st = _status(d)
    assert st["flaky"][0] == "ok" and "all zeros at M=300" in st["flaky"][1]
    rec = {r.name: r for r in d.report("cpu")}
    assert rec["flaky"].wins == ["m64-n64-k128-float32"]
    assert "incorrect at M=300 when probed" in rec["flaky"].losses["m512-n64-k128-float32"]
    assert "all zeros at M=300" in rec["flaky"].losses["m512-n64-k128-float32"]
    assert rec["safe"].wins == ["m512-n64-k128-float32"]


def test_warm_cache_runs_no_probe_and_no_tuning(tmp_path):
    d1 = _disp([FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)], tmp_path)
    for m in (16, 9, 10, 11):
        _call(d1, m)  # tunes the bucket at 16, proves the pick at 9, 10 and 11
    d1.cache_for("cpu").flush()  # what its process does at exit: proven M are written lazily
    fast, slow = FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)
    d2 = _disp([fast, slow], tmp_path)  # a new process, in effect: same cache dir, fresh objects
    for i in range(3):
        out, ref = _call(d2, 9 + i, seed=i)  # same bucket (16), M proven on disk
        assert _close(out, ref)
    assert fast.calls == 3 and slow.calls == 0
    _call(d2, 12)  # a new M of the bucket is proven once (one extra run), then served
    _call(d2, 12, seed=1)
    assert fast.calls == 6 and slow.calls == 0


def test_fingerprint_change_reprobes(tmp_path, monkeypatch):
    _call(_disp([FakeBackend("x")], tmp_path), 4)
    again = FakeBackend("x")
    _call(_disp([again], tmp_path), 4)
    assert again.calls == 1
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "12.0f")  # part of the fingerprint
    fresh = FakeBackend("x")
    _call(_disp([fresh], tmp_path), 4)
    assert fresh.calls > 1  # probed and tuned again
    assert len(list((tmp_path / "c").glob("decisions-*.json"))) == 2


def test_changed_library_source_retunes(tmp_path, monkeypatch):
    """A new kernel or config list in fp4dispatch itself (same version string) starts a new cache file, so keys decided
    before are tuned again with the new candidates."""
    from fp4dispatch.dispatch import fingerprint

    _call(_disp([FakeBackend("x")], tmp_path), 4)
    monkeypatch.setattr(fingerprint, "source_hash", lambda root=None: "0123456789abcdef")
    fresh = FakeBackend("x")
    _call(_disp([fresh], tmp_path), 4)
    assert fresh.calls > 1  # probed and tuned again
    assert len(list((tmp_path / "c").glob("decisions-*.json"))) == 2


def test_runtime_fault_falls_back_benches_and_retries_in_a_new_process(tmp_path, caplog):
    flaky = FakeBackend("flaky", cost=1e-6)
    safe = FakeBackend("safe", cost=1e-3)
    d = _disp([flaky, safe], tmp_path)
    _call(d, 8)
    flaky.fail_after = flaky.successes  # it raises from now on
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        for i in range(6):
            out, ref = _call(d, 8, seed=i)
            assert _close(out, ref)
    warnings = [r for r in caplog.records if "flaky raised" in r.getMessage()]
    assert len(warnings) == 1 and "fault 1 of 3" in warnings[0].getMessage()
    assert flaky.calls == flaky.successes + 1  # benched for this key after its one fault
    rec = {r.name: r for r in d.report("cpu")}
    assert "raised at runtime on 1 call(s), last: RuntimeError" in rec["flaky"].losses["m8-n64-k128-float32"]
    fault = d.cache_for("cpu").faults["m8-n64-k128-float32"]["flaky"]
    assert fault["count"] == 1 and fault["reason"].startswith("RuntimeError: flaky: failing after")
    # a new process tries it again (a fault may be transient) ...
    flaky2, safe2 = FakeBackend("flaky", cost=1e-6), FakeBackend("safe", cost=1e-3)
    _call(_disp([flaky2, safe2], tmp_path), 8)
    assert flaky2.calls == 1 and safe2.calls == 0
    # ... until it has faulted FAULT_LIMIT times: then it is banned from the key
    for _ in range(2):  # warm processes: no probe, no proving; the user's call is its first run, and it raises
        bad, ok = FakeBackend("flaky", cost=1e-6, fail_after=0), FakeBackend("safe", cost=1e-3)
        out, ref = _call(_disp([bad, ok], tmp_path), 8)
        assert _close(out, ref) and bad.calls == 1
    last, ok = FakeBackend("flaky", cost=1e-6), FakeBackend("safe", cost=1e-3)
    d = _disp([last, ok], tmp_path)
    _call(d, 8)
    assert last.calls == 0
    assert "failed at runtime on 3 calls" in d.cache_for("cpu").shape_blacklist["m8-n64-k128-float32"]["flaky"]


def test_no_usable_backend_lists_every_reason(tmp_path):
    d = _disp([FakeBackend("z", result="zeros"), FakeBackend("u", unavailable="library missing"),
               FakeBackend("s", unsupported="N must be a multiple of 64")], tmp_path)
    with pytest.raises(NoUsableBackendError, match=r"(?s)z: incorrect: .*u: unavailable: library missing.*"
                                                   r"s: unsupported: N must be a multiple of 64") as ei:
        _call(d, 4)
    assert set(ei.value.reasons) == {"z", "u", "s"}


def test_forced_backend_env_and_per_call(tmp_path, monkeypatch):
    fast, slow = FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "slow")
    d = _disp([fast, slow], tmp_path)
    out, ref = _call(d, 4)
    assert _close(out, ref)
    calls = fast.calls
    _call(d, 4)
    assert fast.calls == calls  # forced: the other backend is never timed or run for calls
    out, ref = _call(d, 4, backend="fast")  # per-call backend= overrides the env
    assert _close(out, ref) and fast.calls == calls + 1


def test_forced_backend_env_is_stripped_like_the_other_knobs(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_BACKEND", " slow ")  # was refused: no backend named ' slow '
    assert read_settings().forced_backend == "slow"
    fast, slow = FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)
    d = _disp([fast, slow], tmp_path)
    out, ref = _call(d, 4)
    calls = fast.calls, slow.calls
    assert _close(out, ref) and _close(*_call(d, 4)) and (fast.calls, slow.calls) == (calls[0], calls[1] + 1)
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "  ")
    assert read_settings().forced_backend is None


def test_a_cached_decision_naming_another_ops_backend_is_ignored_with_a_warning(tmp_path, caplog):
    from fp4dispatch.problem import Problem

    class GroupedOnly(FakeBackend):  # as loop:fp4_mm, which reads ops.offs
        def run(self, problem, ops, config):
            if not problem.experts:
                raise AttributeError("'Operands' object has no attribute 'offs'")
            super().run(problem, ops, config)

    d = _disp([FakeBackend("dense", cost=2e-5), GroupedOnly("moe", cost=1e-6, ops=("grouped",))], tmp_path)
    d.report("cpu")  # both probed: "moe" is healthy, for its own op
    _call(d, 4)
    path = d.cache_for("cpu").path
    data = json.loads(path.read_text())
    (ks,) = data["decisions"]
    entry = data["decisions"][ks]
    data["decisions"][ks] = {**entry, "backend": "moe", "ranking": [{**entry, "backend": "moe"}] + entry["ranking"]}
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        fresh = _disp([FakeBackend("dense", cost=2e-5), GroupedOnly("moe", cost=1e-6, ops=("grouped",))], tmp_path)
        fresh.report("cpu")  # the grouped op's verdicts in this process too: "moe" is healthy here
        out, ref = _call(fresh, 4)
    assert _close(out, ref)
    assert fresh.choose(Problem(4, 64, 128, torch.float32, torch.device("cpu"))).backend.name == "dense"
    assert fresh.cache_for("cpu").shape_blacklist == {}  # was a ban of "moe" after its proof raised
    assert [r.getMessage() for r in caplog.records] == [
        f"fp4dispatch: ignoring moe in the cached decision of {ks}: it does not compute fp4_mm"]


def test_forced_unhealthy_backend_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "broken")
    d = _disp([FakeBackend("broken", result="zeros"), FakeBackend("ok")], tmp_path)
    with pytest.raises(BackendError, match=r"backend 'broken' was requested but is incorrect on cpu: all zeros"):
        _call(d, 4)
    monkeypatch.delenv("FP4DISPATCH_BACKEND")
    d2 = _disp([FakeBackend("picky", unsupported="M must be <= 8")], tmp_path)
    with pytest.raises(BackendError, match=r"'picky' was requested but is unsupported on cpu: M must be <= 8"):
        _call(d2, 4, backend="picky")
    with pytest.raises(InvalidInputError, match=r"backend must be one of \['broken', 'ok'\]; got 'nope'"):
        _call(d, 4, backend="nope")


def test_a_forced_backend_known_wrong_on_the_shape_is_refused(tmp_path, monkeypatch):
    """A forced call is not proven: a backend banned from the shape, or found wrong at a probe M of its bucket,
    returned what it had been found wrong with (zeros), without a word."""
    bad, good = FakeBackend("bad", cost=1e-6, wrong_for_m=(5,)), FakeBackend("good", cost=1e-3)
    d = _disp([bad, good], tmp_path)
    _call(d, 8)
    _call(d, 5)  # proven at M=5: wrong, banned from the key
    with pytest.raises(BackendError, match=r"^fp4_mm: backend 'bad' was requested but is banned from "
                                           r"m8-n64-k128-float32 on cpu: incorrect when proven at M=5: all zeros at "
                                           r"M=5 \(N=64, K=128\)\. Call without backend=, or clear the cache \(python "
                                           r"-m fp4dispatch.tune clear\) if its library was fixed$"):
        _call(d, 5, backend="bad")
    monkeypatch.setenv("FP4DISPATCH_BACKEND", "bad")  # a later process, forced by the variable
    with pytest.raises(BackendError, match=r"'bad' was requested but is banned from m8-n64-k128-float32"):
        _call(_disp([FakeBackend("bad", wrong_for_m=(5,)), FakeBackend("good")], tmp_path), 6)
    monkeypatch.delenv("FP4DISPATCH_BACKEND")
    probe_wrong = FakeBackend("pw", wrong_for_m=(3,))  # wrong at probe M 3 only: kept out of bucket 4's keys
    with pytest.raises(BackendError, match=r"'pw' was requested but is banned from m4-n64-k128-float32 on cpu: "
                                           r"incorrect at M=3 when probed \(M bucket 4 holds it\)"):
        _call(_disp([probe_wrong, FakeBackend("good")], tmp_path / "2"), 4, backend="pw")
    out, ref = _call(d, 5, backend="good")
    assert _close(out, ref)


def test_disable_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "fast, triton:fused")  # built-in names are accepted too
    fast, slow = FakeBackend("fast", cost=1e-6), FakeBackend("slow", cost=1e-3)
    d = _disp([fast, slow], tmp_path)
    _call(d, 4)
    assert fast.calls == 0
    assert _status(d)["fast"] == ("unavailable", "disabled by FP4DISPATCH_DISABLE")


def test_tune_off_uses_priority_order_without_timing(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_TUNE", "0")
    timed = []
    first = FakeBackend("first", cost=1e-3, wrong_for_m=(4,))
    second, third = FakeBackend("second", cost=1e-3), FakeBackend("third", cost=1e-9)
    d = Dispatcher([first, second, third], cache_dir=tmp_path / "c", do_bench=lambda fn: timed.append(fn) or 1.0)
    out, ref = _call(d, 4)
    assert _close(out, ref) and not timed
    assert [r.wins for r in d.report("cpu")] == [[], ["m4-n64-k128-float32"], []]  # first is wrong at M=4


def test_hot_path_runs_only_the_chosen_backend(tmp_path):
    win, lose = FakeBackend("win", cost=1e-6), FakeBackend("lose", cost=1e-3)
    d = _disp([win, lose], tmp_path)
    _call(d, 32)
    _call(d, 17)  # proves the pick at M=17: one more run of it
    w, l = win.calls, lose.calls
    for i in range(5):
        _call(d, 32 if i % 2 else 17, seed=i)
    assert win.calls == w + 5 and lose.calls == l


def test_concurrent_threads_decide_once(tmp_path):
    win, lose = FakeBackend("win", cost=1e-6), FakeBackend("lose", cost=1e-3)
    d = _disp([win, lose], tmp_path)
    a, b, sa, sb, alpha = make_nvfp4_inputs(8, 64, 128)
    ref = d_ref(a, b, sa, sb, alpha)
    results, errors = [], []

    def worker():
        try:
            results.append(d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8 and all(_close(r, ref) for r in results)
    probe_and_tune = lose.calls
    assert probe_and_tune == 6  # 4 probes + 1 verification + 1 timed run: tuned once, not per thread


def test_report_fields(tmp_path):
    d = _disp([FakeBackend("a"), FakeBackend("b", unavailable="no library")], tmp_path)
    recs = d.report("cpu")
    assert [(r.name, r.status) for r in recs] == [("a", "ok"), ("b", "unavailable")]
    assert all(r.reason for r in recs if r.status != "ok")


def test_report_credits_the_backend_that_serves_a_key_after_its_winner_was_banned(tmp_path):
    """The decision's winner kept its win after a ban at a new M; the one serving the key was shown as losing to it."""
    d = _disp([FakeBackend("bad", cost=1e-6, wrong_for_m=(5,)), FakeBackend("good", cost=1e-5)], tmp_path)
    _call(d, 8)
    _call(d, 5)
    recs = {r.name: r for r in d.report("cpu")}
    assert recs["good"].wins == ["m8-n64-k128-float32"] and recs["good"].losses == {}
    assert recs["bad"].wins == [] and recs["bad"].losses == {
        "m8-n64-k128-float32": "incorrect when proven at M=5: all zeros at M=5 (N=64, K=128)"}


@pytest.mark.parametrize("field, value, want", [
    ("probe_timeout_s", -5, "a positive finite number of seconds"),  # timed every probe out at once
    ("probe_timeout_s", "30", "a positive finite number of seconds"),  # a TypeError from inside fp4_mm
    ("tune", "0", "True or False"),  # a non-empty string: true
    ("disabled", {"a"}, "a frozenset of backend names"),
    ("guard_every", 0, "a positive int (calls between guard checks)"),
    ("timer", "cuda", "'graph' or 'eager'"),
    ("compile_workers", -1, "None or an int >= 0"),
])
def test_settings_made_in_code_are_checked_when_built(field, value, want):
    with pytest.raises(InvalidInputError, match=rf"^Settings: {field} must be {re.escape(want)}; got "
                                                rf"{re.escape(repr(value))}\. Build it with dataclasses\.replace"):
        Settings(**{field: value})


def test_settings_read_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4DISPATCH_TUNE", "off")
    monkeypatch.setenv("FP4DISPATCH_ISOLATE", "1")
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "a,b")
    s = read_settings()
    assert s == Settings(forced_backend=None, disabled=frozenset({"a", "b"}), cache_dir=s.cache_dir, tune=False,
                         isolate=True, probe_timeout_s=30.0, guard=False)


@pytest.mark.parametrize("raw, want", [("  ", None), ("", None), (" /tmp/fp4c ", "/tmp/fp4c"), ("~/fp4c", "HOME/fp4c")])
def test_cache_dir_variable_is_stripped_and_expanded(monkeypatch, tmp_path, raw, want):
    """A blank FP4DISPATCH_CACHE_DIR was a directory named by its spaces, and "~" a directory of that name in the
    working directory; blank is unset, and ~ is the home directory."""
    from fp4dispatch.settings import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FP4DISPATCH_CACHE_DIR", raw)
    got = read_settings().cache_dir
    assert got == (None if want is None else Path(want.replace("HOME", str(tmp_path))))
    if got is None:
        assert "fp4dispatch" in default_cache_dir().parts  # platformdirs' user cache dir
    else:
        assert default_cache_dir() == got


def test_timer_knob(monkeypatch):
    from fp4dispatch.dispatch.timer import cuda_graph_do_bench, default_do_bench, for_device

    assert read_settings().timer == "graph"
    assert for_device(torch.device("cuda", 0)) is cuda_graph_do_bench
    assert for_device(torch.device("cuda", 0), "eager") is default_do_bench
    assert for_device(torch.device("cpu")) not in (cuda_graph_do_bench, default_do_bench)
    monkeypatch.setenv("FP4DISPATCH_TIMER", "wallclock")
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_TIMER='wallclock' is not valid; accepted: graph or eager"):
        read_settings()


def test_a_call_that_cannot_be_captured_is_timed_eagerly(monkeypatch):
    """A candidate whose capture is refused (the per-expert loop reads its routing on the host) gets its eager time,
    not a failure: the fallback once called a function torch does not have (``cudart().cudaGetLastError``)."""
    from fp4dispatch.dispatch import timer
    from fp4dispatch.kernels import workspace

    def refuse(fn, rep):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager = []
    monkeypatch.setattr(workspace, "prepare_capture", lambda device: None)
    monkeypatch.setattr(timer, "_graph_replays", refuse)
    monkeypatch.setattr(timer, "default_do_bench", lambda fn, rep: eager.append(rep) or 0.25)
    assert timer.cuda_graph_do_bench(lambda: None) == 0.25
    assert eager == [timer.EAGER_REP_MS]
    assert timer.cuda_graph_do_bench(lambda: None, rep=timer.SCREEN_REP_MS) == 0.25
    assert eager == [timer.EAGER_REP_MS, timer.SCREEN_REP_MS]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cyclic_collector_is_paused_while_capturing_and_runs_after_a_refusal(monkeypatch, enabled):
    """torch.cuda.graph no longer collects before capturing, so a collection inside one could destroy a dead graph
    (its reset is forbidden during a capture) and void it: the timer pauses the collector around its capture, leaves
    it as the caller had it, and after a refused capture collects at once (the refused graph may be cyclic garbage,
    which would otherwise be freed inside a later capture)."""
    import gc

    from fp4dispatch.dispatch import timer
    from fp4dispatch.kernels import workspace

    seen, collected = [], []

    def capture(fn, rep, refuse=False):
        seen.append(gc.isenabled())
        if refuse:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 0.5
    monkeypatch.setattr(workspace, "prepare_capture", lambda device: None)
    monkeypatch.setattr(timer, "default_do_bench", lambda fn, rep: 0.25)
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        monkeypatch.setattr(timer, "_graph_replays", capture)
        assert timer.cuda_graph_do_bench(lambda: None) == 0.5 and collected == []
        assert gc.isenabled() is enabled
        monkeypatch.setattr(timer, "_graph_replays", lambda *a, **k: capture(*a, **k, refuse=True))
        assert timer.cuda_graph_do_bench(lambda: None) == 0.25 and collected == [(1,)]
        assert gc.isenabled() is enabled and seen == [False, False]
    finally:
        (gc.enable if was else gc.disable)()


def test_reference_is_the_default_fallback_on_cpu(tmp_path):
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    out, ref = _call(d, 3)
    assert _close(out, ref)
    data = json.loads(next((tmp_path / "c").glob("decisions-*.json")).read_text())
    assert data["decisions"]["m4-n64-k128-float32"]["backend"] == "reference"
    assert data["health"]["reference"]["status"] == "ok"


class _FirstConfigBroken(FakeBackend):
    """Config 'a' raises everywhere, config 'b' works: the backend is healthy through 'b'."""

    def run(self, problem, ops, config):
        if config.get("variant") == "a":
            self.calls += 1
            raise RuntimeError("variant a is not built for this GPU")
        super().run(problem, ops, config)


def test_probe_falls_back_to_a_working_config(tmp_path):
    b = _FirstConfigBroken("two-configs", configs=[{"variant": "a"}, {"variant": "b"}])
    d = _disp([b], tmp_path)
    out, ref = _call(d, 5)
    assert _close(out, ref) and _status(d)["two-configs"] == ("ok", "")
    entry = d.cache_for("cpu").decisions["m8-n64-k128-float32"]
    assert entry["config"] == {"variant": "b"}
    assert any("variant a is not built" in t["reason"] for t in entry["ranking"])


class _SmallMOnly(FakeBackend):
    def unsupported(self, problem):
        return None if problem.m <= 6 else "M must be <= 6"


def test_backend_must_accept_the_whole_bucket(tmp_path):
    small, general = _SmallMOnly("small-only", cost=1e-9), FakeBackend("general", cost=1e-3)
    d = _disp([small, general], tmp_path)
    _call(d, 5)  # bucket 8 = M 5..8: small-only refuses M=8, so it must not own the bucket
    assert {r.name: r.wins for r in d.report("cpu")}["general"] == ["m8-n64-k128-float32"]
    out, ref = _call(d, 8)
    assert _close(out, ref)


def test_a_cached_config_no_longer_offered_is_tuned_again(tmp_path, caplog):
    """A cache written by an older layout (config names that changed) is re-tuned cleanly: a warning, no crash, and
    the pick is one of today's configs."""
    old = FakeBackend("k", configs=[{"kernel": "gvws", "R": 16}, {"kernel": "wmma", "BM": 16}])
    _call(_disp([old], tmp_path), 4)
    new = FakeBackend("k", configs=[{"family": "tma_gemv", "rows": 16}, {"family": "register_a", "block_m": 16}])
    d = _disp([new], tmp_path)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        out, ref = _call(d, 4)
    assert _close(out, ref)
    assert any("is no longer offered; tuning the key again" in r.getMessage() for r in caplog.records)
    assert d.choose(d_problem4()).config in new.configs(None)
    assert d.cache_for("cpu").decisions["m4-n64-k128-float32"]["config"]["family"] in ("tma_gemv", "register_a")


def d_problem4():
    from fp4dispatch.problem import Problem

    return Problem(4, 64, 128, torch.float32, torch.device("cpu"))


def test_proving_a_new_m_does_not_rewrite_the_cache_file(tmp_path):
    d = _disp([FakeBackend("x")], tmp_path)
    _call(d, 16)
    path = d.cache_for("cpu").path
    before = path.read_bytes()
    for m in (9, 10, 11, 12):
        out, ref = _call(d, m, seed=m)  # each first call at an M proves the pick there
        assert _close(out, ref)
    assert path.read_bytes() == before  # no write per new M (a prefill of every length would rewrite it each time)
    d.cache_for("cpu").flush()
    proven = json.loads(path.read_text())["verified"]["m16-n64-k128-float32"]["x|default"]
    assert sorted(proven) == [9, 10, 11, 12, 16]



def test_two_backends_of_one_name_are_refused_at_construction(tmp_path):
    """A backend is probed, banned and cached by name: the second of a name would be judged by the first one's
    verdicts (here the correct one was refused as 'incorrect: all zeros')."""
    with pytest.raises(InvalidInputError, match=r"^Dispatcher: backends must have distinct names \(.*\); got 'x' at "
                                                r"positions 0 and 2\. Give each backend a name of its own"):
        _disp([FakeBackend("x"), ReferenceBackend(), FakeBackend("x", result="zeros")], tmp_path)


@pytest.mark.parametrize("backends, said", [
    pytest.param(ReferenceBackend(), r"backends must be a list of backend objects in priority order, or None for "
                 r"every built-in one; got <backend reference>\. Pass e\.g\. \[ReferenceBackend\(\)\]", id="one"),
    pytest.param("reference", r"backends must be a list of backend objects .*; got 'reference'\.", id="str"),
    pytest.param(["reference"], r"backends\[0\] must be a backend \(an object with a non-empty str name and a run "
                 r"method, .*\); got 'reference'\. Pass backend objects, .* To leave built-in backends out by name, "
                 r"set FP4DISPATCH_DISABLE$", id="names"),
    pytest.param([ReferenceBackend(), None], r"backends\[1\] must be a backend .*; got None\. Pass backend objects",
                 id="none-item"),
])
def test_backends_that_are_not_a_list_of_backends_are_refused_at_construction(tmp_path, backends, said):
    with pytest.raises(InvalidInputError, match=r"^Dispatcher: " + said):
        _disp(backends, tmp_path)


@pytest.mark.parametrize("which", ["do_bench", "screen_bench"])
def test_a_timer_that_is_not_callable_is_refused_before_it_bans_every_backend_on_disk(tmp_path, which):
    """Taken as given, every timing run raised TypeError and each backend was banned from the key in the cache file,
    where the next dispatcher, with a right timer, still found no usable backend."""
    kw = {"do_bench": fake_do_bench, which: 5}
    with pytest.raises(InvalidInputError, match=rf"^Dispatcher: {which} must be None \(the default timer\) or a "
                                                r"callable that takes a function and returns its time in "
                                                r"milliseconds; got 5\. Pass e\.g\. triton\.testing\.do_bench"):
        Dispatcher([FakeBackend("f"), FakeBackend("g")], cache_dir=tmp_path / "c", **kw)
    out, ref = _call(_disp([FakeBackend("f"), FakeBackend("g")], tmp_path), 4)
    assert _close(out, ref)


@pytest.mark.parametrize("kw, said", [
    pytest.param({"cache_dir": 5}, r"cache_dir must be None \(FP4DISPATCH_CACHE_DIR, else the user cache dir\), a str "
                 r"or a path; got 5\. Pass e\.g\. cache_dir=", id="cache_dir"),
    pytest.param({"settings": {"tune": False}}, r"settings must be None \(read from the FP4DISPATCH_\* variables\) or "
                 r"a fp4dispatch\.settings\.Settings; got dict \{'tune': False\}\. Pass e\.g\. dataclasses\.replace",
                 id="settings"),
    pytest.param({"guard": "0"}, r"guard must be None \(FP4DISPATCH_GUARD\), True or False; got '0'\. Pass guard=True",
                 id="guard"),
])
def test_options_of_the_wrong_type_are_refused_at_construction(tmp_path, kw, said):
    with pytest.raises(InvalidInputError, match=r"^Dispatcher: " + said):
        Dispatcher([ReferenceBackend()], **{"cache_dir": tmp_path / "c", **kw})
