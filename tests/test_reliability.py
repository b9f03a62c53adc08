"""The fourteen reliability defects found by adversarial testing, one test each (CPU, fake backends, a fake timer,
each test with its own cache dir). Each test starts with the defect's reproducer. Items 1-6: wrong results and backends that break things;
test_reliability_cache.py: 7-12, the cache; test_reliability_inputs.py: 13-14 and the rest."""
from __future__ import annotations


import pytest
import torch

from _reliability_helpers import CPU, blacklist, disp, problem, right
from fp4dispatch import NoUsableBackendError, InvalidInputError, swizzle_scales, unswizzle_scales
from fp4dispatch.testing import FakeBackend, make_nvfp4_inputs


# -- 1. wrong inside an M bucket ----------------------------------------------------------------------------------
def test_01_a_decision_is_proven_at_every_m_it_serves(tmp_path):
    d = disp([FakeBackend("m3bad", cost=1e-8, wrong_for_m=(3,)), FakeBackend("good", cost=1e-3)], tmp_path)
    assert right(d, 4) and right(d, 3)  # was: M=4 picks m3bad for the bucket, then M=3 returned zeros
    # kept out by its probe (M=3 is a probe M) from the bucket holding 3, still used elsewhere
    assert {r.name: r.wins for r in d.report(CPU)}["m3bad"] == []
    assert "incorrect at M=3 when probed" in blacklist(d)["m4-n48-k64-float32"]["m3bad"]
    assert right(d, 8)
    assert d.choose(problem(8)).backend.name == "m3bad"


def test_01_wrong_at_m_no_probe_covers_is_caught_by_proving_that_m(tmp_path):
    bad, good = FakeBackend("m567bad", cost=1e-8, wrong_for_m=(5, 6, 7)), FakeBackend("good", cost=1e-3)
    d = disp([bad, good], tmp_path)
    assert right(d, 8)  # decided at M=8: m567bad wins
    assert d.choose(problem(8)).backend.name == "m567bad"
    assert [right(d, m, seed=m) for m in (5, 6, 7)] == [True, True, True]  # was 3/3 wrong
    assert "when proven at M=5: all zeros" in blacklist(d)["m8-n48-k64-float32"]["m567bad"]
    # remembered on disk: a warm start proves nothing again and runs only the pick
    d.cache_for(CPU).flush()  # what its process does at exit: proven M are written lazily
    bad2, good2 = FakeBackend("m567bad", cost=1e-8, wrong_for_m=(5, 6, 7)), FakeBackend("good", cost=1e-3)
    d2 = disp([bad2, good2], tmp_path)
    assert right(d2, 6) and right(d2, 8)
    assert bad2.calls == 0 and good2.calls == 2


# -- 2. input-dependent wrongness -------------------------------------------------------------------------------
@pytest.mark.parametrize("result, reason", [("abs_alpha", "relative error"),
                                            ("nan_scale_as_zero", "a NaN block scale read as a number")])
def test_02_verification_uses_negative_alpha_and_nan_zero_subnormal_scales(tmp_path, result, reason):
    bad = FakeBackend("bad", cost=1e-8, result=result)
    d = disp([bad, FakeBackend("good", cost=1e-3)], tmp_path)
    assert right(d, 4, alpha=-0.75)
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
    d = disp([FakeBackend("mutator", cost=1e-8, mutates="b_scale"), FakeBackend("good", cost=1e-3)], tmp_path)
    a, b, sa, sb, al = make_nvfp4_inputs(4, 48, 64)
    keep = sb.clone()
    d.fp4_mm(a, b, sa, sb, al)
    assert torch.equal(sb.view(torch.uint8), keep.view(torch.uint8))  # the user's weights are untouched
    st = {r.name: (r.status, r.reason) for r in d.report(CPU)}
    assert st["mutator"][0] == "incorrect" and "modified its input b_scale" in st["mutator"][1]
    assert st["good"] == ("ok", "") and blacklist(d) == {}  # and the correct backend was not blamed


# -- 4. an invalid call must not poison the shape ------------------------------------------------------------------
def test_04_an_invalid_call_is_an_input_error_and_records_nothing(tmp_path):
    d = disp([FakeBackend("a1"), FakeBackend("a2", cost=1e-3)], tmp_path)
    a, b, sa, sb, al = make_nvfp4_inputs(5, 48, 64)
    with pytest.raises(InvalidInputError, match=r"out must not require grad .* Pass out.detach\(\)"):
        d.fp4_mm(a, b, sa, sb, al, out=torch.zeros(5, 48, requires_grad=True), out_dtype=torch.float32)
    assert right(d, 5) and blacklist(d) == {}
    assert right(disp([FakeBackend("a1"), FakeBackend("a2", cost=1e-3)], tmp_path), 5)  # a new process too


def test_04_a_call_every_backend_raises_on_is_not_recorded_against_them(tmp_path):
    x, y = FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)
    d = disp([x, y], tmp_path)
    assert right(d, 5)
    x.fail_after, y.fail_after = x.successes, y.successes  # whatever this call is, nothing can run it
    with pytest.raises(NoUsableBackendError, match=r"(?s)every backend raised on this call.*x: RuntimeError.*"
                                                   r"y: RuntimeError.*Nothing was recorded against them"):
        right(d, 5)
    x.fail_after = y.fail_after = None
    assert right(d, 5) and d.choose(problem(5)).backend.name == "x"
    assert blacklist(d) == {} and d.cache_for(CPU).faults == {}


# -- 5. transient runtime faults --------------------------------------------------------------------------------
def test_05_transient_faults_are_retried_not_permanent(tmp_path):
    x, y = FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)
    d = disp([x, y], tmp_path)
    assert right(d, 5)
    x.fail_after = x.successes  # one out-of-memory from x: y serves the call, x is benched for the key
    assert right(d, 5, seed=1) and d.choose(problem(5)).backend.name == "y"
    x.fail_after, y.fail_after = None, y.successes  # then one from y: x is tried again
    assert right(d, 5, seed=2) and d.choose(problem(5)).backend.name == "x"
    faults = d.cache_for(CPU).faults["m8-n48-k64-float32"]
    assert {n: f["count"] for n, f in faults.items()} == {"x": 1, "y": 1}
    fresh = disp([FakeBackend("x", cost=1e-6), FakeBackend("y", cost=1e-3)], tmp_path)
    assert right(fresh, 5)  # was: NoUsableBackendError in every later process
    assert fresh.choose(problem(5)).backend.name == "x" and blacklist(fresh) == {}


# -- 6. one bad backend must not break every call -----------------------------------------------------------------
@pytest.mark.parametrize("fault, reason", [("resize", "replaced or resized out"),
                                           ("past_end", "wrote outside out"),
                                           ("transposed_strides", "replaced or resized out")])
def test_06_a_backend_that_breaks_out_is_rejected_and_nothing_raises(tmp_path, fault, reason):
    d = disp([FakeBackend("breaker", cost=1e-8, out_fault=fault), FakeBackend("good", cost=1e-3)], tmp_path)
    assert right(d, 5) and right(d, 300)
    st = {r.name: (r.status, r.reason) for r in d.report(CPU)}
    assert st["breaker"][0] == "incorrect" and reason in st["breaker"][1], st["breaker"]
    assert "no report is printable" not in str(d.report(CPU))
