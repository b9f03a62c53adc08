"""Cold-start cuts of the tuner (issue 34), on the CPU with fake backends and fake timers: the screen that keeps only
the few candidates worth a full timing, the phase seconds of each tuned key, the neighbour shortcut for a new M bucket
next to tuned ones, and the compile-ahead switch of the kernel launcher."""
from __future__ import annotations

import math

import pytest
import torch

from fp4dispatch.backends.base import config_id
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.neighbours import neighbour_keys, neighbour_picks
from fp4dispatch.dispatch.records import key_str
from fp4dispatch.dispatch.tuner import COMPILE_PARTS, FULL, PHASES, Search, tune
from fp4dispatch.errors import InvalidInputError
from fp4dispatch.kernels import runtime
from fp4dispatch.problem import Problem
from fp4dispatch.settings import RELEVANT_ENV, read_settings
from fp4dispatch.testing import FakeBackend, fake_do_bench

CPU = torch.device("cpu")


def problem(m: int, n: int = 32, k: int = 64) -> Problem:
    return Problem(m, n, k, torch.float32, CPU)


def configs(*factors: float) -> list[dict]:
    return [{"cost_factor": f} for f in factors]


class CountingBench:
    """fake_do_bench that counts the candidates it times."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn) -> float:
        self.calls += 1
        return fake_do_bench(fn)


def test_search_is_validated_when_built():
    with pytest.raises(InvalidInputError, match=r"Search: keep must be an int >= 0 \(0: time every candidate\); "
                                                r"got -1"):
        Search(keep=-1)
    with pytest.raises(InvalidInputError, match=r"Search: margin must be a finite number >= 0 .*; got inf"):
        Search(margin=float("inf"))


def test_the_screen_sends_only_the_best_few_to_the_full_timer():
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 1.1, 1.2, 3.0, 4.0))
    full, screen = CountingBench(), CountingBench()
    tuning = tune(problem(4), [b], full, screen=screen, search=Search(keep=3, margin=0.25))
    assert screen.calls == 5  # every correct candidate, briefly
    assert full.calls == 3  # the three fastest, all within 25 % of the fastest
    factors = [t.config["cost_factor"] for t in tuning.trials]
    assert factors == [1.0, 1.1, 1.2, 3.0, 4.0]
    assert [t.to_json().get("timed") for t in tuning.trials] == [None, None, None, "screen", "screen"]
    assert set(tuning.seconds) == {*PHASES, *COMPILE_PARTS} and all(v >= 0 for v in tuning.seconds.values())


def test_the_margin_drops_a_kept_candidate_that_is_far_behind():
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 2.0, 2.5))
    full = CountingBench()
    tune(problem(4), [b], full, screen=fake_do_bench, search=Search(keep=3, margin=0.5))
    assert full.calls == 1


def test_full_search_times_every_correct_candidate_and_failures_stay_last():
    ok = FakeBackend("ok", cost=1e-5, configs=configs(1.0, 2.0, 3.0, 4.0))
    bad = FakeBackend("bad", cost=1e-9, result="zeros")
    full = CountingBench()
    tuning = tune(problem(4), [bad, ok], full, screen=fake_do_bench, search=FULL)
    assert full.calls == 4
    assert [t.backend for t in tuning.trials] == ["ok"] * 4 + ["bad"]
    assert tuning.trials[-1].reason.startswith("incorrect")


@pytest.mark.parametrize("ms, said", [(-1.0, "timer returned a negative time (-1.0 ms)"),
                                       (float("nan"), "timer returned a non-finite time")])
def test_a_time_the_timer_cannot_have_measured_is_no_time(ms, said):
    """A negative time won the key, and its decision was dropped as malformed each time the cache file was read: the
    key was tuned again in every process."""
    tuning = tune(problem(4), [FakeBackend("f", cost=1e-5)], lambda fn: ms, search=FULL)
    assert [(t.time_ms, t.reason) for t in tuning.trials] == [(math.inf, said)]


def test_a_screened_out_candidate_ranks_behind_every_fully_timed_one():
    # the screen and the full timer disagree: the screened-out config is not ranked by a time of another timer
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 5.0))
    tuning = tune(problem(4), [b], lambda fn: 100 * fake_do_bench(fn), screen=fake_do_bench,
                  search=Search(keep=1))
    assert [t.config["cost_factor"] for t in tuning.trials] == [1.0, 5.0]
    assert tuning.trials[0].time_ms > tuning.trials[1].time_ms and tuning.trials[1].screened


def test_the_dispatcher_screens_with_its_screen_timer_and_records_the_phase_seconds(tmp_path):
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 1.1, 2.0, 3.0))
    full = CountingBench()
    d = Dispatcher([b], cache_dir=tmp_path, do_bench=full, screen_bench=fake_do_bench)
    d.choose(problem(16))
    entry = d.cache_for(CPU).decisions["m16-n32-k64-float32"]
    assert full.calls == 2 and entry["mode"] == "tuned"
    assert set(entry["tune_s"]) == {*PHASES, *COMPILE_PARTS}
    assert [t.get("timed") for t in entry["ranking"]] == [None, None, "screen", "screen"]


def test_a_given_do_bench_times_every_candidate_unless_a_screen_is_given(tmp_path):
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 1.1, 2.0, 3.0))
    full = CountingBench()
    Dispatcher([b], cache_dir=tmp_path, do_bench=full).choose(problem(16))
    assert full.calls == 4


def test_fp4dispatch_search_is_read_and_validated(monkeypatch, tmp_path):
    assert "FP4DISPATCH_SEARCH" not in RELEVANT_ENV  # both searches time alike: their decisions are interchangeable
    monkeypatch.setenv("FP4DISPATCH_SEARCH", "Full")
    assert read_settings().search == "full"
    b = FakeBackend("fake", cost=1e-5, configs=configs(1.0, 1.1, 2.0, 3.0))
    full = CountingBench()
    d = Dispatcher([b], cache_dir=tmp_path, do_bench=full, screen_bench=fake_do_bench)
    d.choose(problem(16))
    d.choose(problem(8))  # next to a tuned bucket, but a full search tunes in full
    assert full.calls == 8
    assert d.cache_for(CPU).decisions["m8-n32-k64-float32"]["mode"] == "tuned"
    monkeypatch.setenv("FP4DISPATCH_SEARCH", "quick")
    with pytest.raises(InvalidInputError, match=r"FP4DISPATCH_SEARCH='quick' is not valid; accepted: fast or full\. "
                                                r"Unset it for the default 'fast'"):
        read_settings()


def test_neighbour_keys_are_the_buckets_below_and_above():
    key = problem(16).key
    assert [k[1] for k in neighbour_keys(key)] == [8, 32]
    assert [k[1] for k in neighbour_keys(problem(1).key)] == [2]
    assert [k[1] for k in neighbour_keys(problem(9000).key)] == [4096]


def test_a_bucket_next_to_a_tuned_one_tries_that_ones_best_configs_only(tmp_path):
    fast = FakeBackend("fast", cost=1e-5, configs=configs(1.0, 1.2, 1.5, 2.0, 3.0))
    other = FakeBackend("other", cost=5e-5, configs=configs(1.0, 2.0, 3.0))
    full = CountingBench()
    d = Dispatcher([fast, other], cache_dir=tmp_path, do_bench=full)
    d.choose(problem(16))
    assert full.calls == 8
    c = d.choose(problem(8))
    entry = d.cache_for(CPU).decisions["m8-n32-k64-float32"]
    assert entry["mode"] == "neighbours" and entry["from"] == ["m16-n32-k64-float32"]
    tried = [(t["backend"], t["config"]["cost_factor"]) for t in entry["ranking"]]
    assert sorted(tried) == [("fast", 1.0), ("fast", 1.2), ("other", 1.0), ("other", 2.0)]  # two each
    assert full.calls == 12 and (c.backend.name, c.config["cost_factor"]) == ("fast", 1.0)
    assert 8 in c.verified  # tuned at this M: proven there
    # a neighbours entry is no neighbour itself: bucket 4 (next to 8 only) is tuned in full
    d.choose(problem(4))
    assert d.cache_for(CPU).decisions["m4-n32-k64-float32"]["mode"] == "tuned"


def test_a_backend_that_did_not_run_right_next_door_has_every_config_tried():
    offered = {"a": configs(1.0, 2.0, 3.0), "b": configs(1.0, 2.0, 3.0)}
    key = problem(8).key
    ranking = [{"backend": "a", "config": {"cost_factor": 2.0}, "time_us": 1.0},
               {"backend": "a", "config": {"cost_factor": 3.0}, "time_us": 2.0},
               {"backend": "a", "config": {"cost_factor": 1.0}, "time_us": 3.0},
               {"backend": "b", "config": {}, "time_us": None, "reason": "incorrect: zeros"}]
    decisions = {key_str(problem(16).key): {"mode": "tuned", "ranking": ranking}}
    only, sources = neighbour_picks(key, decisions, offered)
    ids = {n: sorted(c for b, c in only if b == n) for n in offered}
    assert ids["a"] == sorted(config_id(c) for c in configs(2.0, 3.0))
    assert ids["b"] == sorted(config_id(c) for c in offered["b"])
    assert sources == [key_str(problem(16).key)]
    # a neighbour that is not a full tune, or none at all: no shortcut
    assert neighbour_picks(key, {key_str(problem(16).key): {"mode": "neighbours", "ranking": ranking}},
                           offered) == (set(), [])


def test_a_neighbours_pick_that_fails_at_the_new_m_sends_the_key_to_a_full_tune(tmp_path):
    b = FakeBackend("b", cost=1e-5, configs=configs(1.0, 2.0, 3.0, 4.0), wrong_for_m=(7,))
    good = FakeBackend("good", cost=1e-3)
    d = Dispatcher([b, good], cache_dir=tmp_path, do_bench=fake_do_bench)
    d.choose(problem(16))
    c = d.choose(problem(7))
    entry = d.cache_for(CPU).decisions["m8-n32-k64-float32"]
    assert entry["mode"] == "tuned" and "from" not in entry
    assert c.backend.name == "good"


def test_launch_inside_compiles_ahead_only_starts_the_compile(monkeypatch):
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)
    monkeypatch.setattr(runtime.torch.cuda, "current_device", lambda: 0)  # part of the compiled-kernel key
    calls = []

    class FakeKernel:
        def warmup(self, *args, grid, **kwargs):
            calls.append(("warmup", args, grid, kwargs))

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(("launch", a, grid, k))

    assert not runtime.compiling_ahead()
    with runtime.compiles_ahead(2) as ctx:
        assert ctx.active and runtime.compiling_ahead()
        runtime.launch(FakeKernel(), (3,), 1, 2, BLOCK=16)
    assert not runtime.compiling_ahead()
    assert calls == [("warmup", (1, 2), (3, 1, 1), {"BLOCK": 16})]


def test_compiles_ahead_does_nothing_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: True)
    with runtime.compiles_ahead(2) as ctx:
        assert not ctx.active and not runtime.compiling_ahead()


def test_compile_keys_does_nothing_without_cuda_and_decides_nothing(tmp_path):
    b = FakeBackend("fake", cost=1e-5)
    d = Dispatcher([b], cache_dir=tmp_path, do_bench=fake_do_bench)
    d.compile_keys([problem(1), problem(16)])
    assert b.calls == 0 and not d._choices
    assert set(d.warmup([(1, 32, 64), (16, 32, 64)], out_dtype=torch.float32)) == {(1, 32, 64), (16, 32, 64)}


def test_precompile_splits_compile_ahead_configs_from_one_first_run_per_library():
    from fp4dispatch.dispatch.precompile import split_pairs

    class Ahead(FakeBackend):
        compiles_ahead = True

    class FirstRun(FakeBackend):
        compiles_on_first_run = True

    a, f, plain = Ahead("a"), FirstRun("f"), FakeBackend("plain")
    ahead, first = split_pairs([(a, {"x": 1}), (a, {"x": 2}), (f, {"y": 1}), (f, {"y": 2}), (plain, {})])
    assert ahead == [(a, {"x": 1}), (a, {"x": 2})] and first == [(f, {"y": 1})]


def test_a_keys_compile_phase_says_how_long_its_first_runs_took_beside_the_triton_compiles(caplog):
    """``tune_s`` splits the compile phase (COMPILE_PARTS): until the Triton configs were compiled, and until the
    first runs of a library that compiles on its first run were over; they overlap, so each is its own wall time.
    Each first run's seconds are logged too (DEBUG)."""
    import logging
    import re
    import time

    from fp4dispatch.dispatch.precompile import compile_together

    class SlowFirstRun(FakeBackend):
        compiles_on_first_run = True

        def run(self, problem, ops, config):
            time.sleep(0.2)

    seconds: dict = {}
    b = SlowFirstRun("first-run")
    with caplog.at_level(logging.DEBUG, logger="fp4dispatch"):
        compile_together([], [(problem(1), lambda: None, (b, {}))], seconds=seconds)
    assert set(seconds) == {"triton", "first_runs"} and seconds["first_runs"] >= 0.2 and seconds["triton"] >= 0
    line = re.search(r"first run of first-run for .*: operands (\S+) s, run (\S+) s", caplog.text)
    assert line and float(line[2]) >= 0.2, caplog.text


class _GatedFirstRun(FakeBackend):
    """A library that compiles on its first run: that run waits for ``gate`` (set once the other candidates have
    been checked and screened), or ``mutates`` an input, in the first run only."""

    compiles_on_first_run = True

    def __init__(self, name, order, gate=None, mutate_first=None, **kw):
        super().__init__(name, **kw)
        self.order, self.gate, self.mutate_first, self.first_done = order, gate, mutate_first, False

    def run(self, problem, ops, config):
        if not self.first_done:
            self.first_done = True
            self.order.append("first run starts")
            if self.gate is not None:
                self.gate.wait(10)
            self.order.append("first run ends")
            if self.mutate_first:
                getattr(ops, self.mutate_first).zero_()
            return
        self.order.append(f"{self.name} runs")
        super().run(problem, ops, config)


class _Recording(FakeBackend):
    def __init__(self, name, order, **kw):
        super().__init__(name, **kw)
        self.order = order

    def run(self, problem, ops, config):
        self.order.append(f"{self.name} runs")
        super().run(problem, ops, config)


def test_a_keys_other_candidates_are_checked_and_screened_while_a_library_compiles_on_its_first_run():
    """A library's first run at a new shape is mostly its compiler: the tuner checks and screens the key's other
    candidates meanwhile, and checks the library once that run is over. The first run has an ``out`` of its own, so
    the checks beside it see only their own writes; the phases still add up to the key's wall time."""
    import threading

    order, gate = [], threading.Event()
    lib = _GatedFirstRun("lib", order, gate, cost=2e-5)
    other = _Recording("other", order, cost=1e-5, configs=[{"c": 1}, {"c": 2}])

    def screen(fn):
        order.append("screen")
        gate.set()
        return fake_do_bench(fn)

    tuning = tune(problem(5), [lib, other], fake_do_bench, screen=screen, search=Search(keep=2, margin=1.0))
    assert [t.backend for t in tuning.trials if t.ok] == ["other", "other", "lib"]
    end = order.index("first run ends")  # its thread may start after the checks began: only its end is ordered
    assert order[:end].count("other runs") >= 2 and "screen" in order[:end]  # both checks and a screen before it
    assert order.index("lib runs") > end  # its check waited for its first run
    assert set(tuning.seconds) >= set(PHASES) and tuning.seconds["compile_first_runs"] > 0


def test_an_eager_screen_waits_until_the_keys_first_runs_are_over(monkeypatch, tmp_path):
    """An eager timer measures host time too, which compile threads and a library's compiler processes slow down:
    with ``screen_beside_compiles=False`` the candidates are still checked beside a first run, but screened only once
    it is over. The dispatcher asks for that under ``FP4DISPATCH_TIMER=eager``."""
    import threading

    from fp4dispatch.dispatch import key_tuning

    order, gate = [], threading.Event()
    lib = _GatedFirstRun("lib", order, gate, cost=2e-5)

    class Opening(_Recording):  # the check of its second config lets the first run end
        def run(self, problem, ops, config):
            super().run(problem, ops, config)
            if config == {"c": 2}:
                gate.set()

    other = Opening("other", order, cost=1e-5, configs=[{"c": 1}, {"c": 2}])

    def screen(fn):
        order.append("screen")
        return fake_do_bench(fn)

    tuning = tune(problem(5), [lib, other], fake_do_bench, screen=screen, search=Search(keep=2, margin=1.0),
                  screen_beside_compiles=False)
    assert [t.backend for t in tuning.trials if t.ok] == ["other", "other", "lib"]
    end = order.index("first run ends")
    assert "screen" not in order[:end] and order.count("screen") == 3 and "other runs" in order[:end]
    asked = []
    monkeypatch.setattr(key_tuning, "tune", lambda *a, **k: asked.append(k["screen_beside_compiles"]) or tune(*a, **k))
    for timer in ("eager", "graph"):
        monkeypatch.setenv("FP4DISPATCH_TIMER", timer)
        Dispatcher([FakeBackend("fake", cost=1e-5)], cache_dir=tmp_path / timer, do_bench=fake_do_bench,
                   screen_bench=fake_do_bench).choose(problem(16))
    assert asked == [False, True]


def test_a_first_run_that_changes_an_input_voids_the_checks_made_beside_it():
    """A first run that writes an input the other candidates were checked on meanwhile: the input is put back and
    they are checked again (each once in the outcome), so that the library's fault is not blamed on them, whether
    the change was found after the first run or by a check beside it (which puts the input back itself)."""
    order: list = []
    lib = _GatedFirstRun("lib", order, mutate_first="b")
    other = _Recording("other", order)
    tuning = tune(problem(5), [lib, other], fake_do_bench)
    assert sorted(t.backend for t in tuning.trials) == ["lib", "other"]
    assert all(t.ok for t in tuning.trials), [t.reason for t in tuning.trials]
    assert order.count("other runs") >= 3  # checked twice (before and after the input was put back), then timed


def test_a_check_records_each_input_it_put_back_on_the_case():
    """What the tuner reads to learn that a run beside the first runs changed an input: ``case.restored``, one name
    per finding, not the wording of the check's reason."""
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.dispatch.verify import check_run, make_case

    case = make_case(problem(5), 3, reference_mm)
    assert case.restored == [] and check_run(FakeBackend("good"), case, {}) is None and case.restored == []
    for expected in (["b"], ["b", "b"]):
        kind, reason = check_run(FakeBackend("bad", mutates="b"), case, {})
        assert kind == "incorrect" and reason.startswith("modified its input b ") and case.restored == expected
        assert torch.equal(case.ops.b, case.pristine[1])  # put back for the next candidate


def test_a_candidate_that_changes_its_own_input_is_checked_once_when_no_first_run_ran_beside_it(caplog):
    import logging

    bad, good = FakeBackend("bad", mutates="b"), FakeBackend("good")
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        tuning = tune(problem(5), [bad, good], fake_do_bench)
    reasons = {t.backend: t.reason for t in tuning.trials}
    assert reasons["bad"].startswith("incorrect: modified its input b") and reasons["good"] == ""
    assert bad.calls == 1 and "first run" not in caplog.text


def test_compile_keys_counts_the_new_keys_it_compiled_for(tmp_path, monkeypatch):
    from fp4dispatch.dispatch import warmup

    seen = []
    monkeypatch.setattr(warmup, "compile_keys_ahead", lambda jobs, processes=None: seen.append([p.m for p, _ in jobs]))
    d = Dispatcher([FakeBackend("fake", cost=1e-5)], cache_dir=tmp_path, do_bench=fake_do_bench)
    state = d._state(CPU, "fp4_mm")  # this machine's verdicts stand in for a GPU's: only the bookkeeping is tested
    monkeypatch.setattr(d, "_state", lambda dev, *ops, **kw: d._states.setdefault(dev, state))
    gpu = [p._replace(device=torch.device("cuda", 0)) for p in (problem(1), problem(16), problem(16))]
    assert d.compile_keys(gpu) == 2 and seen == [[1, 16]]  # one job per key, not per problem


def test_a_call_probes_only_the_backends_of_its_op(tmp_path):
    """A probe compiles and runs a backend's kernels: a process that only calls fp4_mm never probes a W4A16-only or
    grouped backend. The first w4a16_mm call probes those of its op; report() with every op (its default) the rest;
    a later process reads every verdict from the cache."""
    from fp4dispatch.testing import make_operands

    dense, w4, moe = FakeBackend("dense"), FakeBackend("w4", ops=("w4a16",)), FakeBackend("moe", ops=("grouped",))
    d = Dispatcher([dense, w4, moe], cache_dir=tmp_path, do_bench=fake_do_bench)
    ops = make_operands(problem(3))
    d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, out_dtype=torch.float32)
    assert dense.calls > 0 and w4.calls == moe.calls == 0 and set(d.cache_for(CPU).health) == {"dense"}
    rec = {r.name: r for r in d.report(CPU, ("fp4_mm",))}
    assert (rec["dense"].status, rec["w4"].status, rec["moe"].status) == ("ok", "not probed", "not probed")
    assert rec["w4"].reason == ("no w4a16 call has needed it yet (report() with every op, or tune --self-test, "
                                "probes it)")
    assert w4.calls == moe.calls == 0
    for bad in (("fp4mm",), "fp4_mm"):  # a misspelt op, a bare string: said, never an empty probe
        with pytest.raises(InvalidInputError, match=r"^report: ops must be a tuple of op names from \('fp4_mm', "
                                                    r"'w4a16', 'grouped', 'w4a16_grouped'\); got .*\. Pass e\.g\. "
                                                    r"ops=\('fp4_mm',\), or leave it out to probe every op$"):
            d.report(CPU, bad)
    a16 = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    d.w4a16_mm(a16, ops.b, ops.b_scale, ops.alpha, out_dtype=torch.float32)
    assert w4.calls > 0 and moe.calls == 0
    assert [r.status for r in d.report(CPU)] == ["ok"] * 3 and moe.calls > 0
    again = [FakeBackend("dense"), FakeBackend("w4", ops=("w4a16",)), FakeBackend("moe", ops=("grouped",))]
    assert [r.status for r in Dispatcher(again, cache_dir=tmp_path).report(CPU)] == ["ok"] * 3
    assert [b.calls for b in again] == [0, 0, 0]


def test_an_interrupted_probe_is_probed_again_by_the_next_call(tmp_path):
    """Ctrl-C during the probe of an op's backends leaves that op unprobed, not half-probed for the process."""
    from fp4dispatch.testing import make_operands

    class Interrupted(FakeBackend):
        def unavailable(self, device):
            if not self.calls:
                self.calls += 1
                raise KeyboardInterrupt
            return None

    b = Interrupted("ctrl-c")
    d = Dispatcher([b], cache_dir=tmp_path, do_bench=fake_do_bench)
    ops = make_operands(problem(3))
    with pytest.raises(KeyboardInterrupt):
        d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, out_dtype=torch.float32)
    d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, out_dtype=torch.float32)
    assert [r.status for r in d.report(CPU, ("fp4_mm",))] == ["ok"]


def test_compile_keys_runs_a_first_run_library_once_per_its_unit(monkeypatch):
    """A library that compiles on its first run is run once per ``first_run_unit``: once per shape by default,
    once per M bucket for one whose kernels depend on the bucket (Humming's dense layers)."""
    from fp4dispatch.dispatch import precompile

    class Shape(FakeBackend):
        compiles_on_first_run = True

    class Bucket(Shape):
        def first_run_unit(self, problem):
            return super().first_run_unit(problem) + (problem.bucket,)

    runs = []
    monkeypatch.setattr(precompile, "scratch_ops", lambda p, seed=0: None)
    monkeypatch.setattr(precompile, "compile_together", lambda ahead, first, **kw: runs.extend(
        (b.name, p.m) for p, _, (b, _) in first))
    monkeypatch.setattr(precompile, "reset_cuda_error", lambda dev: None)
    gpu = torch.device("cuda", 0)
    shape, bucket = Shape("shape"), Bucket("bucket")
    jobs = [(problem(m)._replace(device=gpu), [shape, bucket]) for m in (20, 1, 17, 128)]
    precompile.compile_keys_ahead(jobs)
    assert sorted(runs) == [("bucket", 1), ("bucket", 17), ("bucket", 128), ("shape", 1)]  # smallest M of each


def test_first_runs_make_their_operands_in_their_threads_and_survive_a_failed_one(monkeypatch):
    """A first run's scratch operands are made when it starts, in its thread (a large shape's are big: only the units
    running hold theirs), and one whose operands cannot be made (out of memory, say) leaves the others to run."""
    import threading
    from contextlib import nullcontext

    from fp4dispatch.dispatch import precompile

    class Library(FakeBackend):
        compiles_on_first_run = True

        def first_run_unit(self, problem):
            return super().first_run_unit(problem) + (problem.bucket,)

        def run(self, problem, ops, config):
            ran.append(problem.m)

    made, ran = [], []

    def scratch(p, seed=0):
        made.append(threading.current_thread().name)
        if p.m == 16:
            raise RuntimeError("CUDA out of memory")
        return ()

    monkeypatch.setattr(precompile, "scratch_ops", scratch)
    monkeypatch.setattr(precompile, "reset_cuda_error", lambda dev: None)
    monkeypatch.setattr(precompile, "on_device", lambda dev: nullcontext())  # no CUDA device to make current here
    gpu = torch.device("cuda", 0)
    lib = Library("lib")
    precompile.compile_keys_ahead([(problem(m)._replace(device=gpu), [lib]) for m in (1, 16, 128)])
    assert sorted(ran) == [1, 128] and len(made) == 3
    assert all(name.startswith("fp4dispatch-first-run") for name in made), made


def test_a_probe_compiles_a_first_run_library_once_per_unit_before_it_runs(monkeypatch):
    from fp4dispatch.dispatch import probe
    from fp4dispatch.dispatch.verify import PROBE_MS

    class Bucket(FakeBackend):
        compiles_on_first_run = True

        def first_run_unit(self, problem):
            return super().first_run_unit(problem) + (problem.bucket,)

    seen = []
    monkeypatch.setattr(probe, "scratch_ops", lambda p, seed=0: None)
    monkeypatch.setattr(probe, "compile_together", lambda ahead, first: seen.append(
        (len(ahead), sorted(p.m for p, _, _ in first))))
    monkeypatch.setattr(probe, "reset_cuda_error", lambda dev: None)
    probe._compile_ahead(Bucket("b"), torch.device("cuda", 0), 0)
    assert seen == [(0, sorted(PROBE_MS))]  # every probe M is its own bucket: all compiled together
    probe._compile_ahead(FakeBackend("plain"), torch.device("cuda", 0), 0)
    assert len(seen) == 1  # a backend that compiles neither way is left alone
    gpu = torch.device("cuda", 0)
    upcoming = [problem(m)._replace(device=gpu, n=4096) for m in (3, 4, 300)]  # M 3 and 4: one unit
    probe._compile_ahead(Bucket("b"), gpu, 0, upcoming)
    assert seen[-1] == (0, sorted(PROBE_MS + (3, 300)))  # the upcoming units join the probe's own


def test_first_run_jobs_give_one_run_per_unit_at_its_smallest_m_and_skip_refused_problems():
    from fp4dispatch.dispatch.precompile import first_run_jobs

    class Bucket(FakeBackend):
        def first_run_unit(self, problem):
            return super().first_run_unit(problem) + (problem.bucket,)

        def unsupported(self, problem):
            return "too many rows" if problem.m > 1024 else None

    # M 900 is refused through its bucket's largest M (1024 is served, 2048 is not: bucket 1024 holds 513..1024)
    jobs = first_run_jobs(Bucket("b"), [problem(m) for m in (20, 17, 3, 4, 1500, 900)])
    assert [p.m for p, _ in jobs] == [3, 17, 900]
    assert first_run_jobs(Bucket("b"), [problem(m) for m in (1500,)]) == []


def test_compile_keys_compiles_the_safe_backends_while_the_probe_workers_work(tmp_path, monkeypatch):
    """The safe backends' kernels compile while the probe workers still run, and the worker of a first-run library
    is handed the new keys' first runs (one per unit; its timeout grows with them). The (fake) worker answers only
    once the safe backend's compile has started: one after the other, it would give up and fail the library."""
    import threading

    from fp4dispatch.dispatch import dispatcher as dispatcher_mod, health as health_mod, warmup
    from fp4dispatch.dispatch.records import Verdict
    from fp4dispatch.settings import Settings

    class Library(FakeBackend):
        compiles_on_first_run = True

        def first_run_unit(self, problem):
            return super().first_run_unit(problem) + (problem.bucket,)

    compiling, compiled, handed = threading.Event(), [], {}

    def fake_worker(backend, device, timeout_s, upcoming=(), cancel=None, check_here=False):
        handed[backend.name] = ([p.m for p in upcoming], timeout_s)
        return Verdict("ok") if compiling.wait(30) else Verdict("failed", "nothing compiled beside the worker")

    def fake_compile(jobs, processes=None):
        compiled.append(sorted((p.m, b.name) for p, bs in jobs for b in bs))
        compiling.set()

    monkeypatch.setattr(health_mod, "probe_isolated", fake_worker)
    monkeypatch.setattr(health_mod, "probe_backend", lambda b, dev: Verdict("ok"))
    monkeypatch.setattr(dispatcher_mod, "check_device", lambda dev: None)
    monkeypatch.setattr(dispatcher_mod, "device_fingerprint", lambda dev: {"device_type": "fake gpu"})
    monkeypatch.setattr(warmup, "compile_keys_ahead", fake_compile)
    d = Dispatcher([Library("lib", risky=True), FakeBackend("safe")], cache_dir=tmp_path, do_bench=fake_do_bench,
                   settings=Settings(isolate=True, probe_timeout_s=30.0))
    gpu = torch.device("cuda", 0)
    stages: dict = {}
    assert d.compile_keys([problem(m)._replace(device=gpu) for m in (1, 16, 20, 17)], stages=stages) == 3
    assert compiled == [[(1, "safe"), (16, "safe"), (20, "safe")], [(1, "lib"), (16, "lib"), (20, "lib")]]
    assert handed == {"lib": ([1, 16, 20], 30.0 + 3 * health_mod.UPCOMING_RUN_S)}  # a key: its first problem
    assert set(stages) == {"probe", "compile"} and [v.status for v in d._states[gpu][1].values()] == ["ok", "ok"]
    # the verdicts cached: no worker to wait for, so every new key compiles after the probe (its "compile" stage),
    # outside the dispatcher's lock
    monkeypatch.setattr(health_mod, "probe_isolated", lambda *a, **kw: pytest.fail("probed again"))
    compiled.clear()
    again = Dispatcher([Library("lib", risky=True), FakeBackend("safe")], cache_dir=tmp_path, do_bench=fake_do_bench,
                       settings=Settings(isolate=True, probe_timeout_s=30.0))
    locked = []
    monkeypatch.setattr(warmup, "compile_keys_ahead", lambda jobs, processes=None: (fake_compile(jobs), locked.append(
        again._lock._is_owned())))
    assert again.compile_keys([problem(m)._replace(device=gpu) for m in (1, 16)]) == 2
    assert compiled == [[(1, "lib"), (1, "safe"), (16, "lib"), (16, "safe")]] and locked == [False]


def test_a_failed_compile_beside_the_probe_workers_is_logged_and_the_probe_goes_on(tmp_path, monkeypatch, caplog):
    from fp4dispatch.dispatch import dispatcher as dispatcher_mod, health as health_mod, warmup
    from fp4dispatch.dispatch.records import Verdict
    from fp4dispatch.settings import Settings

    calls = []

    def fake_compile(jobs, processes=None):
        calls.append(sorted(b.name for _, bs in jobs for b in bs))
        if len(calls) == 1:
            raise RuntimeError("a compile went wrong")

    monkeypatch.setattr(health_mod, "probe_isolated", lambda b, dev, t, *a, **kw: Verdict("ok"))
    monkeypatch.setattr(health_mod, "probe_backend", lambda b, dev: Verdict("ok"))
    monkeypatch.setattr(dispatcher_mod, "check_device", lambda dev: None)
    monkeypatch.setattr(dispatcher_mod, "device_fingerprint", lambda dev: {"device_type": "fake gpu"})
    monkeypatch.setattr(warmup, "compile_keys_ahead", fake_compile)
    d = Dispatcher([FakeBackend("native", risky=True), FakeBackend("safe")], cache_dir=tmp_path,
                   do_bench=fake_do_bench, settings=Settings(isolate=True))
    gpu = torch.device("cuda", 0)
    assert d.compile_keys([problem(1)._replace(device=gpu)]) == 1
    assert calls == [["safe"], ["native"]] and "compiling beside the probe workers failed" in caplog.text
    assert sorted(d._states[gpu][0].health) == ["native", "safe"]  # both verdicts written, the probe not lost


def _pending(d: Dispatcher, name: str):
    """Probe ``d``'s backends on the CPU, then take ``name``'s verdict out again: as while its worker still runs."""
    d._state(CPU, "fp4_mm")
    return d._states[CPU][1].pop(name)


def test_keys_are_searched_among_the_probed_backends_first_and_recorded_only_with_every_verdict(tmp_path):
    safe = FakeBackend("safe", cost=3e-5, configs=configs(1.0, 2.0, 3.0))
    late = FakeBackend("late", cost=1e-5, configs=configs(1.0, 1.5, 4.0))
    d = Dispatcher([safe, late], cache_dir=tmp_path, do_bench=fake_do_bench)
    verdict = _pending(d, "late")
    cache = d.cache_for(CPU)
    rounds: dict = {}
    d.decide_beside([problem(16), problem(8), problem(16)], rounds)
    assert list(rounds) == [problem(16).key, problem(8).key] and all(r.pending == {"late"} for r in rounds.values())
    assert {t.backend for r in rounds.values() for t in r.tuning.trials} == {"safe"}
    # nothing recorded or served yet: a key is never decided without all of its candidates
    assert cache.decisions == {} and d._choices == {}
    # the second key's first round drew on the first's (its neighbour bucket): the two best configs only
    assert rounds[problem(8).key].sources == (key_str(problem(16).key),)
    assert sorted(t.config["cost_factor"] for t in rounds[problem(8).key].tuning.trials) == [1.0, 2.0]
    d._states[CPU][1]["late"] = verdict  # the worker's verdict is in
    assert d.finish_beside(rounds) == 2
    e16, e8 = (cache.decisions[key_str(problem(m).key)] for m in (16, 8))
    assert (e16["backend"], e16["config"]["cost_factor"]) == ("late", 1.0)  # the faster, found in the second round
    # the first key's late backend is tried in full (no recorded neighbour then); the second's next to the first
    assert sorted(t["config"]["cost_factor"] for t in e16["ranking"] if t["backend"] == "late") == [1.0, 1.5, 4.0]
    assert sorted(t["config"]["cost_factor"] for t in e8["ranking"] if t["backend"] == "late") == [1.0, 1.5]
    assert e8["mode"] == "neighbours" and e8["from"] == [key_str(problem(16).key)]
    assert [t["time_us"] for t in e16["ranking"]] == sorted(t["time_us"] for t in e16["ranking"])
    c = d.choose(problem(16))
    assert c is d._choices[problem(16).key] and c.backend is late and 16 in c.verified
    assert [b.name for b, _ in c.fallbacks] == ["safe"]
    assert set(e16["tune_s"]) == {*PHASES, *COMPILE_PARTS}


def test_a_pending_backend_that_fails_its_probe_leaves_the_first_round_as_the_decision(tmp_path):
    from fp4dispatch.dispatch.records import Verdict

    d = Dispatcher([FakeBackend("safe"), FakeBackend("late", cost=1e-6)], cache_dir=tmp_path,
                   do_bench=fake_do_bench)
    _pending(d, "late")
    rounds: dict = {}
    d.decide_beside([problem(4)], rounds)
    d._states[CPU][1]["late"] = Verdict("failed", "its worker died")
    assert d.finish_beside(rounds) == 1
    entry = d.cache_for(CPU).decisions[key_str(problem(4).key)]
    assert entry["backend"] == "safe" and {t["backend"] for t in entry["ranking"]} == {"safe"}


def test_nothing_is_searched_beside_the_probe_without_a_pending_backend_or_a_timer(tmp_path):
    d = Dispatcher([FakeBackend("safe"), FakeBackend("late")], cache_dir=tmp_path, do_bench=fake_do_bench)
    d._state(CPU, "fp4_mm")
    rounds: dict = {}
    d.decide_beside([problem(1)], rounds)
    assert rounds == {}  # every verdict in: decided the usual way
    untimed = Dispatcher([FakeBackend("safe"), FakeBackend("late")], cache_dir=tmp_path / "u")
    _pending(untimed, "late")
    untimed.decide_beside([problem(1)], rounds)
    assert rounds == {}  # priority order needs every backend's place


def test_the_merged_ranking_keeps_ahead_only_what_one_screened_search_would():
    """Round 1 screened three configs and timed the best in full; the late backend, alone, was timed in full. Merged,
    the late backend is far behind the best: it ranks with the screened-out ones, by time, as one search would
    have ranked it."""
    from fp4dispatch.dispatch.tuner import Trial, Tuning, merge_tunings

    first = Tuning([Trial("safe", {"c": 1}, 0.010), Trial("safe", {"c": 2}, 0.015, screened=True),
                    Trial("safe", {"c": 3}, 0.020, screened=True), Trial("bad", {}, reason="failed: x")],
                   dict.fromkeys(PHASES, 1.0))
    second = Tuning([Trial("late", {}, 0.050)], dict.fromkeys(PHASES, 0.5))
    merged = merge_tunings(first, second, Search())
    assert [(t.backend, t.time_ms, t.screened) for t in merged.trials] == [
        ("safe", 0.010, False), ("safe", 0.015, True), ("safe", 0.020, True), ("late", 0.050, True),
        ("bad", float("inf"), False)]
    assert merged.seconds == dict.fromkeys(PHASES, 1.5)
    close = merge_tunings(first, Tuning([Trial("late", {}, 0.011)], {}), Search())
    assert [(t.backend, t.screened) for t in close.trials[:2]] == [("safe", False), ("late", False)]
    # without a screen nothing is put behind: a full search's ranking is by time alone
    assert [t.backend for t in merge_tunings(first, second).trials][:2] == ["safe", "safe"]


def test_a_first_round_trial_that_raised_bans_nothing_and_a_failing_second_round_leaves_the_key_alone(tmp_path,
                                                                                                     caplog):
    flaky = FakeBackend("flaky", cost=1e-6)
    d = Dispatcher([flaky, FakeBackend("safe"), FakeBackend("late")], cache_dir=tmp_path, do_bench=fake_do_bench)
    verdict = _pending(d, "late")
    flaky.raises = RuntimeError("out of memory while the workers held it")
    rounds: dict = {}
    d.decide_beside([problem(2), problem(64)], rounds)
    flaky.raises = None
    d._states[CPU][1]["late"] = verdict
    d._search = lambda key, p, cands, decisions: (_ for _ in ()).throw(RuntimeError("boom")) \
        if p.m == 64 else Dispatcher._search(d, key, p, cands, decisions)
    assert d.finish_beside(rounds) == 1 and "not decided after the probe workers (RuntimeError: boom)" in caplog.text
    cache = d.cache_for(CPU)
    entry = cache.decisions[key_str(problem(2).key)]
    # flaky's raise beside the workers dropped, not banned: flaky searched again in the second round, and it wins
    assert [t["backend"] for t in entry["ranking"]][0] == "flaky"
    assert {t["backend"] for t in entry["ranking"]} == {"flaky", "safe", "late"}
    assert key_str(problem(2).key) not in cache.shape_blacklist
    assert key_str(problem(64).key) not in cache.decisions and problem(64).key not in d._choices
    del d._search
    assert d.choose(problem(64)).backend is flaky  # decided alone, every backend tried again


def test_a_tune_run_decides_its_keys_in_two_rounds_around_the_probe_worker(tmp_path, monkeypatch, capsys):
    """The whole path on the CPU (warmup's CUDA-only gate opened): the tune CLI probes a risky backend in a (fake)
    worker, which answers only once the first rounds ran; the keys are then recorded with both backends, reported
    as tuned by this run, and the stages say how long deciding beside the worker took."""
    import json
    import threading

    from fp4dispatch.cli.tune import main
    from fp4dispatch.dispatch import health as health_mod, warmup
    from fp4dispatch.dispatch.records import Verdict

    first_rounds = threading.Event()
    real = Dispatcher.decide_beside

    def beside(self, problems, rounds, wait):
        real(self, problems, rounds, wait)
        first_rounds.set()

    monkeypatch.setattr(Dispatcher, "decide_beside", beside)
    monkeypatch.setattr(health_mod, "probe_isolated", lambda b, dev, t, *a, **kw: Verdict("ok")
                        if first_rounds.wait(30) else Verdict("failed", "no first round beside the worker"))
    monkeypatch.setattr(warmup, "_compiles", lambda dev: True)
    monkeypatch.setattr(warmup, "compile_keys_ahead", lambda jobs, processes=None: None)
    backends = [FakeBackend("safe", cost=3e-5, configs=configs(1.0, 2.0)),
                FakeBackend("late", cost=1e-5, risky=True)]
    code = main(["--shape", "1,16,32,64", "--json", "--isolate", "--cache-dir", str(tmp_path)], backends=backends,
                do_bench=fake_do_bench)
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and [(r["m"], r["source"], r["winner"]) for r in data["shapes"]] == [(1, "tuned", "late"),
                                                                                        (16, "tuned", "late")]
    assert all({t["backend"] for t in r["tried"]} == {"safe", "late"} for r in data["shapes"])
    # "late" took part only because the worker's verdict waited for the first rounds; their time is part of the probe
    seconds = data["seconds"]
    assert seconds["probe"] + 0.02 >= seconds["beside"] + seconds["hand_out"] and seconds["beside"] >= 0  # rounded


class _Recorded:
    """Stands in for ``runtime.compiles_ahead``: records entering and leaving, and in which thread."""

    def __init__(self, events: list, workers: int):
        self.events, self.active = events, workers > 0

    def __enter__(self):
        import threading

        self.events.append(("enter", threading.current_thread().name))
        return self

    def collect(self) -> list:
        self.events.append(("collect", ""))
        return [("handed", len(self.events))]

    def __exit__(self, *exc):
        import threading

        self.events.append(("exit", threading.current_thread().name))


def _compiling_setup(monkeypatch, events: list) -> list:
    """Jobs for ``precompile.compiling_keys`` on two fake GPUs: a compile-ahead backend and a first-run library whose
    runs record their thread."""
    import threading
    from contextlib import contextmanager

    from fp4dispatch.dispatch import precompile

    def note(what):
        return lambda self, problem, ops, config: events.append((what, threading.current_thread().name))

    Ahead = type("Ahead", (FakeBackend,), {"compiles_ahead": True, "run": note("run")})
    Library = type("Library", (FakeBackend,), {"compiles_on_first_run": True, "run": note("first run")})
    monkeypatch.setattr(runtime, "compiles_ahead", lambda workers, processes=None: _Recorded(events, workers))
    monkeypatch.setattr(runtime, "finish", lambda handed: events.append(("finish", handed[0][1])))
    monkeypatch.setattr(precompile, "scratch_ops", lambda p, seed=0: None)
    monkeypatch.setattr(precompile, "reset_cuda_error", lambda dev: events.append(("sync", dev.type)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)

    @contextmanager
    def on(device):  # precompile.on_device: the worker thread makes each problem's device current
        events.append(("device", str(device)))
        yield

    monkeypatch.setattr(precompile, "on_device", on)
    return [(problem(m)._replace(device=torch.device("cuda", i)), [Ahead("a", configs=configs(1.0, 2.0)),
                                                                   Library("lib")])
            for i, m in enumerate((1, 16))]


def _worker_alive() -> bool:
    import threading

    return any(t.name == "fp4dispatch-compile-keys" for t in threading.enumerate())


def test_compiling_keys_runs_its_body_while_the_handed_out_compiles_are_waited_for_key_by_key(monkeypatch, caplog):
    """The compiles of many keys are handed out on a thread of their own, and every CUDA call of that thread (runs
    on scratch operands, first runs, the synchronize after them) is over before the body starts; the thread then
    waits for the compiles key by key, in the order handed out, and ``wait(key)`` in the body returns once that
    key's are in (finish called on its collected compiles)."""
    import threading

    from fp4dispatch.dispatch.precompile import compiling_keys

    events: list = []
    jobs = _compiling_setup(monkeypatch, events)
    caplog.set_level("INFO", logger="fp4dispatch")
    with compiling_keys(jobs) as compiles:
        events.append(("body", threading.current_thread().name))
        for p, _ in jobs:
            compiles.wait(p.key)
            events.append(("decide", p.m))
        compiles.wait(problem(99).key)  # a key it was not given: at once
    kinds = [k for k, _ in events]
    assert kinds.count("run") == 4 and kinds.count("first run") == 1  # 2 configs x 2 keys; one unit (one shape)
    assert kinds.index("sync") < kinds.index("body") and kinds.index("enter") < kinds.index("collect")
    # no CUDA call of the worker once the body runs (it may capture a CUDA graph)
    assert max(i for i, k in enumerate(kinds) if k in ("run", "first run", "sync")) < kinds.index("body")
    devices = [e[1] for e in events if e[0] == "device"]
    assert sorted(devices) == ["cuda:0", "cuda:0", "cuda:1"]  # each key's runs, and the first run, on its GPU
    finishes = [(i, e[1]) for i, e in enumerate(events) if e[0] == "finish"]
    collects = [i for i, e in enumerate(events) if e[0] == "collect"]
    assert [h for _, h in finishes] == [c + 1 for c in collects]  # each key's own compiles, in the order handed out
    decides = {e[1]: i for i, e in enumerate(events) if e[0] == "decide"}
    assert finishes[0][0] < decides[1] and finishes[1][0] < decides[16]  # a key decided only after its finish
    assert "handed out the compiles of 4 configs of 2 keys and made 1 first runs in" in caplog.text
    assert events[kinds.index("body")][1] == threading.main_thread().name
    assert {t for k, t in events if k in ("enter", "run", "exit")} == {"fp4dispatch-compile-keys"}
    assert not _worker_alive()


def test_compiling_keys_raises_a_failed_hand_out_in_the_caller_and_skips_the_body(monkeypatch):
    from fp4dispatch.dispatch import precompile

    events: list = []
    jobs = _compiling_setup(monkeypatch, events)

    def broken(ahead, first, *, handed_out=None, compiled=None, processes=None):
        raise RuntimeError("scratch operands: out of memory")

    monkeypatch.setattr(precompile, "compile_together", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        with precompile.compiling_keys(jobs):
            events.append(("body", ""))
    assert ("body", "") not in events and not _worker_alive()


def test_compiling_keys_never_leaves_a_wait_hanging(monkeypatch):
    """A compile wait that raises in the handing-out thread, after the body started: every ``wait`` returns, and the
    error is raised when the body is left."""
    import threading

    from fp4dispatch.dispatch import precompile

    events: list = []
    jobs = _compiling_setup(monkeypatch, events)

    in_body = threading.Event()

    def fails_after_handing_out(ahead, first, *, handed_out=None, compiled=None, processes=None):
        handed_out()
        in_body.wait(30)
        raise RuntimeError("a compile pool broke")

    monkeypatch.setattr(precompile, "compile_together", fails_after_handing_out)
    with pytest.raises(RuntimeError, match="a compile pool broke"):
        with precompile.compiling_keys(jobs) as compiles:
            in_body.set()
            for p, _ in jobs:
                compiles.wait(p.key)
            events.append(("body", ""))
    assert ("body", "") in events and not _worker_alive()


def test_compiling_keys_lets_the_compiles_finish_when_its_body_raises(monkeypatch):
    from fp4dispatch.dispatch.precompile import compiling_keys

    events: list = []
    jobs = _compiling_setup(monkeypatch, events)
    with pytest.raises(ValueError, match="a decision failed"):
        with compiling_keys(jobs):
            raise ValueError("a decision failed")
    assert [k for k, _ in events][-1] == "exit" and not _worker_alive()


def test_compile_keys_decides_every_key_while_the_compiles_still_run(tmp_path, monkeypatch):
    """With ``decide`` and no probe worker (every verdict cached), each new key is decided inside
    ``compiling_keys``, after waiting for its own compiles; a key no backend can serve is left to the caller's
    ``choose``, which raises with the reason."""
    from contextlib import contextmanager

    from fp4dispatch.dispatch import warmup
    from fp4dispatch.errors import NoUsableBackendError

    class NotN48(FakeBackend):
        def unsupported(self, problem):
            return "N = 48 is not served" if problem.n == 48 else None

    events = []

    class Compiles:
        def wait(self, key):
            events.append(("wait", key_str(key)))

    @contextmanager
    def compiling(jobs, processes=None):
        events.append(("compiling", sorted(p.m for p, _ in jobs)))
        yield Compiles()
        events.append(("compiled", sorted(key_str(k) for k in d._choices)))

    monkeypatch.setattr(warmup, "_compiles", lambda dev: True)
    monkeypatch.setattr(warmup, "compiling_keys", compiling)
    d = Dispatcher([NotN48("fake", configs=configs(1.0, 2.0))], cache_dir=tmp_path, do_bench=fake_do_bench)
    probs = [problem(1), problem(16), problem(1, n=48)]
    stages: dict = {}
    assert d.compile_keys(probs, stages=stages, decide=True) == 2  # the N = 48 key has no candidate to compile
    assert events == [("compiling", [1, 16]), *[("wait", key_str(p.key)) for p in probs],
                      ("compiled", sorted(key_str(p.key) for p in probs[:2]))]
    assert set(stages) == {"probe", "compile", "beside", "hand_out", "decide"}
    with pytest.raises(NoUsableBackendError, match="N = 48 is not served"):
        d.choose(probs[2])


def test_compiling_keys_releases_a_key_with_nothing_to_compile_ahead_at_once(monkeypatch):
    """A key whose candidates only compile on their first run (done before the body) is not held until every other
    key's compiles are over."""
    import threading

    from fp4dispatch.dispatch.precompile import compiling_keys

    events: list = []
    jobs = _compiling_setup(monkeypatch, events)
    only_library = (problem(128)._replace(device=torch.device("cuda", 0)), [jobs[0][1][1]])
    release = threading.Event()
    finish = runtime.finish
    monkeypatch.setattr(runtime, "finish", lambda handed: (release.wait(30), finish(handed)))
    with compiling_keys([jobs[0], only_library]) as compiles:
        compiles.wait(only_library[0].key)  # while the other key's compiles are held back
        events.append(("library key decided", ""))
        release.set()
    kinds = [k for k, _ in events]
    assert kinds.index("library key decided") < kinds.index("finish")


def test_launch_inside_compiles_ahead_collects_what_it_hands_out_and_finish_waits_for_it(monkeypatch):
    """``runtime.launch`` in a thread inside ``compiles_ahead`` hands the compile out (Triton's ``warmup``) and keeps
    Triton's placeholder in the list ``collect`` returned; a kernel compiled before is not kept; ``finish`` waits for
    each placeholder, ignoring a failed compile (the first real launch raises it)."""
    finished = []

    class Placeholder:
        def result(self, ignore_errors=False):
            finished.append((self, ignore_errors))

    class Jit:  # what launch calls of a Triton JITFunction in this mode
        def __init__(self, gives):
            self.gives = gives

        def warmup(self, *args, grid, **kwargs):
            return self.gives

    monkeypatch.setattr(runtime, "_fast", False)
    monkeypatch.setattr(runtime._tls, "ahead", True, raising=False)
    monkeypatch.setattr(runtime._tls, "handed", None, raising=False)
    handed = runtime.compiles_ahead(1).collect()
    p = Placeholder()
    for gives in (p, object(), None):  # a compile handed out; a kernel compiled before; a compile a hook skipped
        runtime.launch(Jit(gives), (1,), 0)
    assert handed == [p]
    runtime.finish(handed)
    assert finished == [(p, True)]


def test_a_keys_candidates_come_back_in_the_order_their_compiles_end_and_launch_in_this_thread(monkeypatch):
    """``TritonCompiles`` hands every config's compile out at once, then gives the configs back as their compiles
    end (the tuner checks and screens each while the others still compile): a config compiled first comes first
    whatever its place in the list, the next waits for its compile, and each is put in Triton's cache (``finish``)
    before it is given. Meanwhile launches in this thread run again (a kernel still compiling would be waited for)."""
    import threading
    import time
    from concurrent.futures import Future

    from fp4dispatch.dispatch.key_compiles import TritonCompiles

    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)
    monkeypatch.setattr(runtime, "can_hand_out", lambda: True)
    monkeypatch.setattr(runtime, "_fast", False)
    finished = []

    class Placeholder:  # Triton's placeholder of a compile handed out: its future, result() waits for it
        def __init__(self):
            self.future = Future()

        def result(self, ignore_errors=False):
            finished.append(self)
            return self.future.result()

    class Jit:
        def __init__(self):
            self.placeholder, self.launched = Placeholder(), 0

        def warmup(self, *args, grid, **kwargs):
            return self.placeholder

        def __getitem__(self, grid):
            return lambda *a, **k: setattr(self, "launched", self.launched + 1)

    class Ahead(FakeBackend):
        compiles_ahead = True

        def run(self, problem, ops, config):
            runtime.launch(config["kernel"], (1,), 0)

    ka, kb = Jit(), Jit()
    a = Ahead("a", configs=[{"kernel": ka}, {"kernel": kb}])
    p = problem(1)
    pairs = [(a, {"kernel": ka}), (a, {"kernel": kb})]
    compiles = TritonCompiles([(p, lambda: None, pairs)])
    try:
        assert not runtime.compiling_ahead() and ka.launched == kb.launched == 0 and not finished
        kb.placeholder.future.set_result("kernel b")
        given = compiles.in_order(p, pairs)
        assert next(given) is pairs[1] and finished == [kb.placeholder]
        set_at = []

        def compile_a():
            time.sleep(0.05)
            set_at.append(time.perf_counter())
            ka.placeholder.future.set_result("kernel a")

        threading.Thread(target=compile_a).start()
        assert next(given) is pairs[0] and time.perf_counter() >= set_at[0] and finished[-1] is ka.placeholder
        assert list(given) == [] and compiles.compiled_s is not None
        runtime.launch(ka, (1,), 0)  # this thread launches again
        assert ka.launched == 1
        with runtime.compiles_ahead(2) as inner:  # a probe inside a check: launches as the outer one's do
            assert not inner.active and not runtime.compiling_ahead()
            runtime.launch(kb, (1,), 0)
        assert kb.launched == 1
    finally:
        compiles.close()


def test_the_expert_loops_dense_kernels_compile_ahead_before_its_keys_own_once_across_keys(monkeypatch):
    """The per-expert loop decides each expert's dense call by priority (the first config of each backend), one new
    M bucket after another inside its check: those configs are compiled ahead with the other candidates' kernels,
    at every M bucket up to T's, each (problem, config) once however many keys' loops meet it, and each key's own
    come after its loop's (a key waits for its compiles in that order)."""
    from fp4dispatch.backends.expert_loop import ExpertLoopBackend
    from fp4dispatch.dispatch import precompile

    class Ahead(FakeBackend):
        compiles_ahead = True

        def configs(self, problem):
            return [{"m": problem.bucket}, {"m": -problem.bucket}]

    dense, other = Ahead("dense"), FakeBackend("plain")
    inner = Dispatcher([dense, other], cache_dir=None, do_bench=fake_do_bench)
    loop, grouped = ExpertLoopBackend(inner), Ahead("grouped")
    handed = []
    monkeypatch.setattr(precompile, "scratch_ops", lambda p, seed=0: None)
    monkeypatch.setattr(precompile, "compile_together", lambda ahead, first, **kw: handed.extend(
        (p.op, p.m, [(b.name, c) for b, c in pairs]) for p, _, pairs in ahead))
    monkeypatch.setattr(precompile, "reset_cuda_error", lambda dev: None)
    gpu = torch.device("cuda", 0)
    t = [Problem(m, 32, 64, torch.bfloat16, gpu, torch.uint8, 4) for m in (3, 10)]
    precompile.compile_keys_ahead([(p, [loop, grouped]) for p in t])
    assert handed == [("fp4_mm", 1, [("dense", {"m": 1})]), ("fp4_mm", 2, [("dense", {"m": 2})]),
                      ("fp4_mm", 4, [("dense", {"m": 4})]),
                      ("grouped", 3, [("grouped", {"m": 4}), ("grouped", {"m": -4})]),
                      ("fp4_mm", 8, [("dense", {"m": 8})]), ("fp4_mm", 16, [("dense", {"m": 16})]),
                      ("grouped", 10, [("grouped", {"m": 16}), ("grouped", {"m": -16})])]
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "dense")
    assert precompile.inner_jobs([ExpertLoopBackend(Dispatcher([dense], cache_dir=None))], t[0]) == []


@pytest.mark.parametrize("alpha", ["epilogue", "fold"])
def test_dequant_matmul_hands_its_dequantize_out_inside_compiles_ahead(monkeypatch, alpha):
    """triton:dequant+matmul compiles ahead with the other candidates (its dequantize once compiled serially in its
    check, the first key's slowest check on the H200): inside ``compiles_ahead`` its run hands both dequantizes out
    (A's with alpha folded in where asked) and launches none, and its GEMM runs on the scratch. Its weight-keeping
    form does not: that run would keep a copy the dequantize never wrote."""
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.dispatch.precompile import split_pairs
    from fp4dispatch.kernels import _dequant
    from fp4dispatch.problem import Operands
    from fp4dispatch.testing import make_nvfp4_inputs

    handed = []
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)  # a launch would compile for a GPU: it must not
    monkeypatch.setattr(runtime, "settle", lambda fn: None)
    monkeypatch.setattr(runtime, "_hand_out", lambda fn, grid, args, kwargs: handed.append((fn, kwargs["HAS_F"])))
    monkeypatch.setattr(runtime._tls, "ahead", True, raising=False)
    monkeypatch.setattr(runtime.torch.cuda, "current_device", lambda: 0)
    a, b, sa, sb, al = make_nvfp4_inputs(4, 64, 128)
    p = Problem(4, 64, 128, torch.bfloat16, CPU)
    backend, kept = TritonDequantBackend(), TritonDequantBackend(cache_weight=True)
    backend.run(p, Operands(a, b, sa, sb, al, torch.empty(4, 64, dtype=torch.bfloat16)), {"alpha": alpha})
    assert handed == [(_dequant.dequant_kernel, alpha == "fold"), (_dequant.dequant_kernel, False)]
    ahead, first = split_pairs([(backend, {"alpha": alpha}), (kept, {"alpha": "epilogue"})])
    assert ahead == [(backend, {"alpha": alpha})] and first == []
