"""Guard mode (CPU, fake backends): a backend that turns finite inputs into NaN/Inf output is caught, blacklisted for
that key and the call recomputed; the check cadence (FP4DISPATCH_GUARD_EVERY) and its errors."""
from __future__ import annotations

import logging

import pytest
import torch

import fp4dispatch
from fp4dispatch import guard as guard_mod
from fp4dispatch.backends.reference import ReferenceBackend, reference_mm
from fp4dispatch.settings import read_settings
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.errors import InvalidInputError, NoUsableBackendError
from fp4dispatch.guard import Guard, nonfinite_from_finite
from fp4dispatch.problem import Operands, Problem
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs

CPU = torch.device("cpu")


def _guarded(tmp_path, *backends):
    return Dispatcher(list(backends), cache_dir=tmp_path / "c", do_bench=fake_do_bench, guard=True)


def _call(d, m, seed=0):
    a, b, sa, sb, alpha = make_nvfp4_inputs(m, 64, 128, seed=seed)
    y = d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    ref = reference_mm(Problem(m, 64, 128, torch.float32, CPU), Operands(a, b, sa, sb, alpha, y))
    return y, ref


def test_guard_every_call_blacklists_and_recomputes(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FP4DISPATCH_GUARD_EVERY", "1")
    bad = FakeBackend("bad", cost=1e-6)
    good = FakeBackend("good", cost=1e-5)
    d = _guarded(tmp_path, bad, good)
    assert d.guard.every == 1
    y, ref = _call(d, 6)  # tunes the M<=8 bucket at M=6, where "bad" is right and fastest
    torch.testing.assert_close(y, ref)
    _call(d, 5)  # proven right at M=5 too
    assert d.choose(Problem(6, 64, 128, torch.float32, CPU)).backend.name == "bad"
    bad.nan_rows_after = bad.calls  # it goes bad while serving (after every check it was given passed)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        y, ref = _call(d, 5, seed=1)  # "bad" writes NaN rows now
    torch.testing.assert_close(y, ref)  # recomputed with the next best
    assert "bad returned non-finite values from finite inputs" in caplog.text
    assert d.choose(Problem(5, 64, 128, torch.float32, CPU)).backend.name == "good"
    banned = d.cache_for(CPU).shape_blacklist["m8-n64-k128-float32"]
    assert "non-finite output from finite inputs" in banned["bad"]
    calls = bad.calls
    y, ref = _call(d, 5, seed=2)
    torch.testing.assert_close(y, ref)
    assert bad.calls == calls


def test_guard_checks_every_n_calls_without_sync_in_between(tmp_path, monkeypatch):
    bad = FakeBackend("bad", cost=1e-6)
    d = _guarded(tmp_path, bad, FakeBackend("good", cost=1e-5))
    d.guard = Guard(every=4)
    checks = []
    real = Guard._check
    monkeypatch.setattr(Guard, "_check", lambda self, *a, **k: checks.append(1) or real(self, *a, **k))
    _call(d, 6)
    d.choose(Problem(5, 64, 128, torch.float32, CPU))  # proves M=5 (no call, so no guard count)
    bad.nan_rows_after = bad.calls
    outs = [_call(d, 5, seed=i)[0] for i in range(2)]
    assert checks == []  # calls 1-3: flags accumulate on the device, nobody reads them
    assert all(bool(torch.isnan(o).any()) for o in outs)  # the documented lag: bad outputs until the check
    y, ref = _call(d, 5, seed=9)  # call 4: check, blacklist, recompute
    assert checks == [1]
    torch.testing.assert_close(y, ref)
    assert d.choose(Problem(5, 64, 128, torch.float32, CPU)).backend.name == "good"


def test_guard_check_on_demand_and_default_dispatcher_from_env(monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_GUARD", "1")
    bad = FakeBackend("bad", cost=1e-6)
    fp4dispatch.set_dispatcher(Dispatcher([bad, FakeBackend("good", cost=1e-5)], do_bench=fake_do_bench))
    d = fp4dispatch.get_dispatcher()
    assert isinstance(d.guard, Guard) and d.guard.every == guard_mod.DEFAULT_EVERY
    _call(d, 6)
    d.choose(Problem(5, 64, 128, torch.float32, CPU))
    bad.nan_rows_after = bad.calls
    y, _ = _call(d, 5)
    assert bool(torch.isnan(y).any())
    found = guard_mod.check()
    assert found == [guard_mod.Finding("m8-n64-k128-float32", "bad", "good")]
    y, ref = _call(d, 5, seed=3)
    torch.testing.assert_close(y, ref)
    assert guard_mod.check() == []


def test_guard_ignores_non_finite_inputs(tmp_path):
    d = _guarded(tmp_path, FakeBackend("ok"), ReferenceBackend())
    a, b, sa, sb, alpha = make_nvfp4_inputs(4, 64, 128)
    sa = sa.clone()
    sa[0, 0] = float("nan")  # a NaN block scale makes NaN outputs legitimately
    y = d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    assert bool(torch.isnan(y).any())
    assert d.guard.check(d) == []
    assert d.cache_for(CPU).shape_blacklist == {}


def test_guard_without_fallback_redecides_then_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_GUARD_EVERY", "1")
    bad = FakeBackend("bad")
    d = _guarded(tmp_path, bad)
    _call(d, 6)
    d.choose(Problem(5, 64, 128, torch.float32, CPU))
    bad.nan_rows_after = bad.calls
    with pytest.raises(NoUsableBackendError, match=r"bad: .*non-finite output from finite inputs"):
        _call(d, 5)


@pytest.mark.parametrize("dtype, value, flagged", [
    pytest.param(torch.bfloat16, float("nan"), True, id="bf16-nan"),
    pytest.param(torch.bfloat16, float("inf"), True, id="bf16-inf"),
    pytest.param(torch.float32, float("-inf"), True, id="fp32-ninf"),
    pytest.param(torch.float16, float("inf"), False, id="fp16-inf-is-overflow"),
    pytest.param(torch.float16, float("nan"), True, id="fp16-nan"),
    pytest.param(torch.float32, 3.0, False, id="finite"),
])
def test_nonfinite_from_finite(dtype, value, flagged):
    a, b, sa, sb, alpha = make_nvfp4_inputs(4, 32, 64)
    out = torch.ones((4, 32), dtype=dtype)
    out[2, 3] = value
    assert bool(nonfinite_from_finite(Operands(a, b, sa, sb, alpha, out), dtype)) is flagged
    bad_alpha = torch.tensor([float("inf")])
    assert not bool(nonfinite_from_finite(Operands(a, b, sa, sb, bad_alpha, out), dtype))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_guard_does_not_ban_a_right_result_that_overflows(tmp_path, monkeypatch, out_dtype):
    """A large finite alpha makes the exact product +-Inf (the reference's too): the guard banned every backend that
    computed it, on disk, so that the shape then failed in every process."""
    monkeypatch.setenv("FP4DISPATCH_GUARD_EVERY", "1")
    d = _guarded(tmp_path, FakeBackend("x"), FakeBackend("y"))
    a, b, sa, sb, _ = make_nvfp4_inputs(4, 64, 128)
    alpha = torch.tensor([3e36])
    for _ in range(3):
        y = d.fp4_mm(a, b, sa, sb, alpha, out_dtype=out_dtype)
    ref = reference_mm(Problem(4, 64, 128, out_dtype, CPU), Operands(a, b, sa, sb, alpha, torch.empty_like(y)))
    assert bool(torch.isinf(ref).any()) and torch.equal(y, ref.to(out_dtype))
    assert d.guard.check(d) == [] and d.cache_for(CPU).shape_blacklist == {}


@pytest.mark.parametrize("value", ["abc", "0", "-3"])
def test_guard_every_env_errors(monkeypatch, value):
    monkeypatch.setenv("FP4DISPATCH_GUARD_EVERY", value)
    with pytest.raises(InvalidInputError, match=rf"FP4DISPATCH_GUARD_EVERY='{value}' is not valid; accepted: a "
                                                rf"positive integer \(calls between guard checks\)\. Unset it for "
                                                rf"the default 64"):
        read_settings()


def test_guard_every_arg_error():
    with pytest.raises(InvalidInputError, match=r"Guard: every must be a positive int .*got 0"):
        Guard(every=0)


def test_guard_check_refuses_during_capture(monkeypatch, tmp_path):
    d = _guarded(tmp_path, ReferenceBackend())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(InvalidInputError, match=r"cannot run during CUDA graph capture .*between replays"):
        guard_mod.check(d)


def test_guard_check_is_empty_when_guard_is_off(tmp_path):
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    assert d.guard is None and guard_mod.check(d) == []


@pytest.mark.parametrize("out_value, a_value, flagged", [
    pytest.param(float("nan"), 1.0, True, id="nan-from-finite"),
    pytest.param(float("inf"), 1.0, True, id="inf-from-activations-too-small-to-overflow"),
    pytest.param(float("inf"), 3e38, False, id="inf-may-be-overflow-of-16-bit-activations"),
    pytest.param(float("nan"), 3e38, False, id="nan-may-be-inf-minus-inf"),
    pytest.param(float("nan"), float("nan"), False, id="nan-activation"),
    pytest.param(float("nan"), float("inf"), False, id="inf-activation"),
])
def test_nonfinite_from_finite_for_w4a16_reads_the_activations(out_value, a_value, flagged):
    _, b, _, sb, alpha = make_nvfp4_inputs(4, 32, 64)
    a = torch.ones(4, 64, dtype=torch.bfloat16)
    a[1, 5] = a_value
    out = torch.ones((4, 32), dtype=torch.bfloat16)
    out[2, 3] = out_value
    ops = Operands(a, b, torch.empty(0, dtype=torch.float8_e4m3fn), sb, alpha, out)
    assert bool(nonfinite_from_finite(ops, torch.bfloat16)) is flagged


def test_guard_judges_only_the_rows_a_valid_offs_table_routes():
    """check_offs=False leaves offs unread: rows past offs[-1] (a graph's padding) are never written, and a wrong
    table's result is undefined, never a backend's fault. Before, the guard read every row of out, and a NaN-filled
    out's unwritten rows banned a healthy grouped backend, in the cache file too."""
    from fp4dispatch.format_grouped import swizzle_expert_scales, swizzle_grouped_scales
    from fp4dispatch.problem import GroupedOperands

    g = torch.Generator().manual_seed(0)
    t, e, n, k = 10, 4, 32, 64
    offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)  # rows 8 and 9 not routed
    a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    sa = swizzle_grouped_scales(torch.ones(t, k // 16).to(torch.float8_e4m3fn), offs)
    sb = swizzle_expert_scales(torch.ones(e, n, k // 16).to(torch.float8_e4m3fn))

    def flagged(out, table):
        return bool(nonfinite_from_finite(GroupedOperands(a, b, sa, sb, torch.ones(e), out, table), torch.float32))

    out = torch.zeros(t, n)
    out[8:] = float("nan")
    assert not flagged(out, offs)
    assert not flagged(out, torch.tensor([2, 6, 4, 10], dtype=torch.int32))  # not non-decreasing: undefined
    assert not flagged(out, torch.tensor([2, 4, 6, 12], dtype=torch.int32))  # past T: undefined
    out[7, 3] = float("nan")  # a routed row
    assert flagged(out, offs)
    out[7, 3] = float("inf")
    assert flagged(out, offs)
    assert flagged(torch.full((t, n), float("-inf")), torch.tensor([0, 0, 0, 10], dtype=torch.int32))


def test_guard_does_not_judge_w4a16_sums_that_overflow_before_alpha():
    """Activations of 1e32 (finite bf16) against K = 4096: the fp32 sums overflow before alpha (~1.9e-5) scales them,
    so Inf is every backend's right answer. The bound had alpha in it, judged the call, and banned the exact
    reference on disk: every later call of the key failed, in every process."""
    a = torch.full((2, 4096), 1e32, dtype=torch.bfloat16)
    b = torch.full((8, 2048), 0x22, dtype=torch.uint8)  # every code 1.0
    sb = torch.ones(128, 256).to(torch.float8_e4m3fn)
    no_scale = torch.empty(0, dtype=torch.float8_e4m3fn)
    out = torch.full((2, 8), float("inf"), dtype=torch.bfloat16)
    ops = Operands(a, b, no_scale, sb, torch.tensor([1.86e-5]), out)
    assert not bool(nonfinite_from_finite(ops, torch.bfloat16))
    small = Operands(torch.ones(2, 4096, dtype=torch.bfloat16), b, no_scale, sb, torch.tensor([1.86e-5]), out)
    assert bool(nonfinite_from_finite(small, torch.bfloat16))  # still judged where nothing can overflow
