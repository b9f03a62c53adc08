"""Repeat calls (fp4dispatch/dispatch/call_memo.py): a repeated canonical call skips validation and the key lookup,
and never accepts what validation refuses, however its tensors changed since (in place, by ``.data =``, or new ones
at a freed one's address); a ban or a clear is seen at once; no tensor is kept alive."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fp4dispatch
import fp4dispatch.api as api
from fp4dispatch import InvalidInputError
from fp4dispatch.backends.reference import ReferenceBackend
from fp4dispatch.dispatch import call_memo
from fp4dispatch.dispatch import dispatcher as dispatcher_module
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs
from fp4dispatch.validate import check_fp4_mm_args, check_w4a16_mm_args

pytestmark = pytest.mark.skipif(call_memo.TensorGuards is None, reason="this torch has no dynamo TensorGuards")

N, K = 64, 128


def _inputs(m, seed=0):
    a, b, sa, sb, alpha = make_nvfp4_inputs(m, N, K, seed=seed)
    return a, b, sa, sb, alpha, torch.empty(m, N, dtype=torch.float32)


def _exact(a, b, sa, sb, alpha):
    return fp4dispatch.dequantize_nvfp4(a, sa) @ fp4dispatch.dequantize_nvfp4(b, sb).T * float(alpha)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The process-wide dispatcher (reference backend) and a counter of the validations ``fp4_mm`` runs."""
    fp4dispatch.set_dispatcher(Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c"))
    calls = []

    def counting(*args):
        calls.append(args)
        return check_fp4_mm_args(*args)
    monkeypatch.setattr(api, "check_fp4_mm_args", counting)
    return calls


def test_a_repeated_call_skips_validation_and_a_new_m_or_weight_does_not(counted):
    a, b, sa, sb, alpha, out = _inputs(5)
    for _ in range(3):
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert len(counted) == 1
    assert torch.equal(out, _exact(a, b, sa, sb, alpha))
    a2, _, sa2, _, _, out2 = _inputs(7, seed=1)  # a new M of the same weight: validated once, then remembered
    for _ in range(2):
        fp4dispatch.fp4_mm(a2, b, sa2, sb, alpha, out_dtype=torch.float32, out=out2)
    assert len(counted) == 2 and torch.equal(out2, _exact(a2, b, sa2, sb, alpha))
    fresh = [t.clone() for t in (a, b, sa, sb, alpha, out)]  # the same metadata in new tensors: a new weight id
    fp4dispatch.fp4_mm(*fresh[:5], out_dtype=torch.float32, out=fresh[5])
    assert len(counted) == 3 and torch.equal(fresh[5], out)


def test_a_call_without_out_is_remembered_and_gets_a_new_out_each_time(counted):
    a, b, sa, sb, alpha, _ = _inputs(3)
    first = fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    second = fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32)
    assert len(counted) == 1 and second is not first and torch.equal(first, second)


def _rebind(t, new):
    t.data = new
    return t


# (what changed since a remembered call, how) -> the call's args; each must raise validation's own message
CHANGES = {
    "b of another K by .data": lambda a, b, sa, sb, al, o: (a, _rebind(b, torch.zeros(N, K // 4, dtype=torch.uint8)),
                                                             sa, sb, al, o),
    "b int16 by .data": lambda a, b, sa, sb, al, o: (a, _rebind(b, torch.zeros(N, K // 4, dtype=torch.int16)), sa,
                                                     sb, al, o),
    "b_scale resized in place": lambda a, b, sa, sb, al, o: (a, b, sa, sb.resize_(2 * sb.shape[0], sb.shape[1]), al,
                                                             o),
    "alpha of 2 elements by .data": lambda a, b, sa, sb, al, o: (a, b, sa, sb, _rebind(al, torch.ones(2)), o),
    "alpha float64 by .data": lambda a, b, sa, sb, al, o: (a, b, sa, sb, _rebind(al, torch.ones(1).double()), o),
    "a transposed view": lambda a, b, sa, sb, al, o: (a.t().contiguous().t(), b, sa, sb, al, o),
    "a_scale of another M": lambda a, b, sa, sb, al, o: (a, b, _inputs(200)[2], sb, al, o),
    "out of M+1 rows": lambda a, b, sa, sb, al, o: (a, b, sa, sb, al, torch.empty(a.shape[0] + 1, N)),
    "out requires grad": lambda a, b, sa, sb, al, o: (a, b, sa, sb, al, o.requires_grad_()),
    "out bf16": lambda a, b, sa, sb, al, o: (a, b, sa, sb, al, o.to(torch.bfloat16)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_remembered_call_changed_afterwards_gets_validations_own_error(change, counted):
    a, b, sa, sb, alpha, out = _inputs(4)
    fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert len(counted) == 1  # remembered
    args = CHANGES[change](a, b, sa, sb, alpha, out)
    with pytest.raises(InvalidInputError) as direct:
        check_fp4_mm_args(*args[:5], torch.float32, args[5], "swizzled")
    with pytest.raises(InvalidInputError) as through:
        fp4dispatch.fp4_mm(*args[:5], out_dtype=torch.float32, out=args[5])
    assert str(through.value) == str(direct.value)


def test_the_linear_layout_named_on_remembered_tensors_still_gets_its_error(counted):
    a, b, sa, sb, alpha, out = _inputs(4)
    fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    with pytest.raises(InvalidInputError, match="scale_layout='linear' must have shape"):
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out, scale_layout="linear")


def test_contiguous_at_m_1_with_other_strides_is_never_taken_for_contiguous_at_larger_m(counted):
    """A [1, K/2] row of a wider buffer is contiguous (a size-1 dim's stride does not count); the same strides at
    M = 4 are not. A guard built from the first call's strides would pass the second."""
    wide = torch.randint(0, 256, (4, K), dtype=torch.uint8)  # rows of K bytes: a's rows are the first K/2 of each
    _, b, _, sb, alpha, _ = _inputs(1)
    sa1, sa4 = _inputs(1)[2], _inputs(4)[2]
    for _ in range(2):
        fp4dispatch.fp4_mm(wide[:1, :K // 2], b, sa1, sb, alpha, out_dtype=torch.float32)
    assert len(counted) == 2  # such a call is validated every time
    with pytest.raises(InvalidInputError, match="a must be contiguous"):
        fp4dispatch.fp4_mm(wide[:, :K // 2], b, sa4, sb, alpha, out_dtype=torch.float32)


def test_a_ban_or_a_clear_is_seen_by_the_next_repeated_call(tmp_path):
    bad = FakeBackend("bad", cost=1e-6)  # the faster: chosen, then goes wrong in service
    good = FakeBackend("good", cost=1e-3)
    d = Dispatcher([bad, good], cache_dir=tmp_path / "c", do_bench=fake_do_bench)
    a, b, sa, sb, alpha, out = _inputs(4)
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    runs = bad.calls
    problem, _ = check_fp4_mm_args(a, b, sa, sb, alpha, torch.float32, out, "swizzled")
    d.blacklist(d.choose(problem), problem, "wrong in service (test)")
    before = good.calls
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert bad.calls == runs and good.calls == before + 1
    assert torch.equal(out, _exact(a, b, sa, sb, alpha))


def test_no_tensor_of_a_remembered_call_is_kept_alive(tmp_path):
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    a, b, sa, sb, alpha, out = _inputs(4)
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    refs = [weakref.ref(t) for t in (a, b, sa, sb, alpha, out)]
    del a, b, sa, sb, alpha, out
    gc.collect()
    assert [r() for r in refs] == [None] * 6


def test_past_max_calls_everything_is_forgotten_and_relearned(counted, monkeypatch):
    monkeypatch.setattr(call_memo, "MAX_CALLS", 2)
    a, b, sa, sb, alpha, _ = _inputs(1)
    ms = (1, 2, 3, 1)
    for m in ms:
        x, _, sx, _, _, _ = _inputs(m)
        fp4dispatch.fp4_mm(x, b, sx, sb, alpha, out_dtype=torch.float32)
    assert len(counted) == 4  # M = 3 cleared M = 1 (and 2) away: the second M = 1 is validated again
    memo = fp4dispatch.get_dispatcher().memo
    assert sum(len(w.by_m) for w in memo._weights.values()) == 2


def test_past_max_weights_everything_is_forgotten(tmp_path, monkeypatch):
    monkeypatch.setattr(call_memo, "MAX_WEIGHTS", 2)
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    calls = [_inputs(4, seed=seed) for seed in range(3)]  # three weights alive at once (three ids)
    for i, (a, b, sa, sb, alpha, out) in enumerate(calls):
        d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
        assert torch.equal(out, _exact(a, b, sa, sb, alpha))
        assert len(d.memo._weights) == (1, 2, 1)[i]  # the third cleared the two before it


def test_without_tensor_guards_nothing_is_remembered(monkeypatch, tmp_path):
    monkeypatch.setattr(call_memo, "TensorGuards", None)
    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    assert d.memo.disabled == "torch has no torch._C._dynamo.guards.TensorGuards"
    a, b, sa, sb, alpha, out = _inputs(4)
    for _ in range(2):
        d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert not d.memo._weights and torch.equal(out, _exact(a, b, sa, sb, alpha))


def test_a_tensor_guards_of_another_signature_turns_the_memo_off_and_calls_stay_right(counted, monkeypatch):
    def other_signature(*tensors, **kw):
        raise TypeError("TensorGuards() got an unexpected keyword argument 'dynamic_dims_sizes'")
    monkeypatch.setattr(call_memo, "TensorGuards", other_signature)
    a, b, sa, sb, alpha, out = _inputs(4)
    for _ in range(3):
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert len(counted) == 3 and torch.equal(out, _exact(a, b, sa, sb, alpha))
    assert fp4dispatch.get_dispatcher().memo.disabled == (
        "TensorGuards refused its arguments: TypeError: TensorGuards() got an unexpected keyword argument "
        "'dynamic_dims_sizes'")


def test_a_named_backend_or_a_made_alpha_is_validated_every_call(counted):
    a, b, sa, sb, alpha, out = _inputs(4)
    for _ in range(2):
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out, backend="reference")
        fp4dispatch.fp4_mm(a, b, sa, sb, float(alpha), out_dtype=torch.float32, out=out)
    assert len(counted) == 4


def test_inference_mode_calls_are_remembered_apart_and_stay_right(counted):
    a, b, sa, sb, alpha, out = _inputs(4)
    fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    with torch.inference_mode():
        x, w, sx, sw, al, o = _inputs(4)
        for _ in range(2):
            fp4dispatch.fp4_mm(x, w, sx, sw, al, out_dtype=torch.float32, out=o)
    assert len(counted) == 2 and torch.equal(o, _exact(a, b, sa, sb, alpha))


def test_a_weight_called_in_and_out_of_inference_mode_by_turns_stops_rebuilding_its_guard(counted, monkeypatch):
    """Inference mode changes a tensor's dispatch keys as the guard sees them: one guard cannot hold both states, so
    calls that alternate would rebuild it on every call. After MAX_REBUILDS the weight is left to the ordinary path."""
    builds = []
    real = call_memo._guard
    monkeypatch.setattr(call_memo, "_guard", lambda *args: builds.append(1) or real(*args))
    a, b, sa, sb, alpha, out = _inputs(4)
    for i in range(20):
        with torch.inference_mode(i % 2 == 1):
            fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
        assert torch.equal(out, _exact(a, b, sa, sb, alpha))
    assert len(builds) == call_memo.MAX_REBUILDS + 1
    assert len(counted) == 20  # every call missed, and each was validated


def test_w4a16_repeats_skip_validation_and_a_changed_weight_gets_its_error(monkeypatch, tmp_path):
    fp4dispatch.set_dispatcher(Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c"))
    calls = []
    # the W4A16 call validates in its Dispatcher method (api.w4a16_mm calls it)
    monkeypatch.setattr(dispatcher_module, "check_w4a16_mm_args",
                        lambda *args: calls.append(args) or check_w4a16_mm_args(*args))
    _, b, _, sb, alpha, _ = _inputs(3)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    first = fp4dispatch.w4a16_mm(x, b, sb, alpha)
    second = fp4dispatch.w4a16_mm(x, b, sb, alpha)
    assert len(calls) == 1 and torch.equal(first, second) and second.dtype == torch.bfloat16
    b.data = torch.zeros(N, K // 4, dtype=torch.uint8)
    with pytest.raises(InvalidInputError) as direct:
        check_w4a16_mm_args(x, b, sb, alpha, None, None, "swizzled")
    with pytest.raises(InvalidInputError) as through:
        fp4dispatch.w4a16_mm(x, b, sb, alpha)
    assert str(through.value) == str(direct.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA tensors and graph capture")
def test_gpu_a_remembered_call_is_refused_once_its_weight_moves_and_replays_its_bits_in_a_graph(tmp_path):
    fp4dispatch.set_dispatcher(Dispatcher(cache_dir=tmp_path / "c"))
    a, b, sa, sb, alpha, _ = (t.cuda() for t in _inputs(16))
    out = torch.empty(16, N, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):  # decided, then remembered, then a repeat
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out=out)
    eager = out.clone()
    out.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    b.data = b.data.cpu()
    with pytest.raises(InvalidInputError) as direct:
        check_fp4_mm_args(a, b, sa, sb, alpha, torch.bfloat16, out, "swizzled")
    with pytest.raises(InvalidInputError) as through:
        fp4dispatch.fp4_mm(a, b, sa, sb, alpha, out=out)
    assert str(through.value) == str(direct.value) and "device" in str(direct.value)


def _grouped(counts=(0, 3, 2, 0), seed=0):
    """A grouped call's (a, b, a_scale, b_scale, alpha, offs): a_scale with room for any routing of its T rows, as a
    call that does not let validate read offs needs."""
    from fp4dispatch.format_grouped import grouped_scale_rows, swizzle_expert_scales, swizzle_grouped_scales
    from fp4dispatch.routing import offs_from_counts

    g = torch.Generator().manual_seed(seed)
    offs = offs_from_counts(torch.tensor(counts))
    t, e = int(offs[-1]), len(counts)
    a = torch.randint(0, 256, (t, K // 2), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (e, N, K // 2), dtype=torch.uint8, generator=g)
    sa = torch.rand(t, K // 16, generator=g).add(0.5).to(torch.float8_e4m3fn)
    sb = torch.rand(e, N, K // 16, generator=g).add(0.5).to(torch.float8_e4m3fn)
    sa = swizzle_grouped_scales(sa, offs)
    room = torch.zeros(grouped_scale_rows(t, e) - sa.shape[0], sa.shape[1], dtype=sa.dtype)
    return a, b, torch.cat([sa, room]), swizzle_expert_scales(sb), torch.rand(e, generator=g) + 0.5, offs


@pytest.fixture
def counted_grouped(monkeypatch, tmp_path):
    """The process-wide dispatcher (reference backend) and a counter of ``fp4_grouped_mm``'s validations."""
    from fp4dispatch.validate_grouped import check_fp4_grouped_mm_args

    fp4dispatch.set_dispatcher(Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c"))
    calls = []
    monkeypatch.setattr(dispatcher_module, "check_fp4_grouped_mm_args",
                        lambda *args: calls.append(args) or check_fp4_grouped_mm_args(*args))
    return calls


def test_a_grouped_call_that_leaves_offs_unread_is_remembered_and_one_that_reads_it_never(counted_grouped):
    a, b, sa, sb, alpha, offs = _grouped()
    checked = fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=torch.float32)
    firsts = [fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=torch.float32, check_offs=False)
              for _ in range(3)]
    assert len(counted_grouped) == 2  # the checked call, then the first unchecked one
    assert all(torch.equal(x, checked) for x in firsts)
    fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=torch.float32)
    assert len(counted_grouped) == 3  # a call that reads offs is validated every time


GROUPED_CHANGES = {
    "a_scale without room for any routing": lambda a, b, sa, sb, al, offs: (a, b, sa[:128], sb, al, offs),
    "offs int64 by .data": lambda a, b, sa, sb, al, offs: (a, b, sa, sb, al, _rebind(offs, offs.long())),
    "b_scale resized in place": lambda a, b, sa, sb, al, offs: (a, b, sa, sb.resize_(sb.shape[0], 8, 8), al, offs),
    "alpha of E+1 by .data": lambda a, b, sa, sb, al, offs: (a, b, sa, sb, _rebind(al, torch.ones(5)), offs),
}


@pytest.mark.parametrize("change", list(GROUPED_CHANGES))
def test_a_remembered_grouped_call_changed_afterwards_gets_validations_own_error(change, counted_grouped):
    from fp4dispatch.validate_grouped import check_fp4_grouped_mm_args

    a, b, sa, sb, alpha, offs = _grouped()
    for _ in range(2):
        fp4dispatch.fp4_grouped_mm(a, b, sa, sb, alpha, offs, out_dtype=torch.float32, check_offs=False)
    assert len(counted_grouped) == 1
    args = GROUPED_CHANGES[change](a, b, sa, sb, alpha, offs)
    with pytest.raises(InvalidInputError) as direct:
        check_fp4_grouped_mm_args(*args, torch.float32, None, "swizzled", False)
    with pytest.raises(InvalidInputError) as through:
        fp4dispatch.fp4_grouped_mm(*args, out_dtype=torch.float32, check_offs=False)
    assert str(through.value) == str(direct.value)


def test_w4a16_grouped_repeats_are_remembered_with_their_out_dtype(tmp_path, monkeypatch):
    from fp4dispatch.validate_grouped import check_w4a16_grouped_mm_args

    d = Dispatcher([ReferenceBackend()], cache_dir=tmp_path / "c")
    calls = []
    monkeypatch.setattr("fp4dispatch.dispatch.dispatcher.check_w4a16_grouped_mm_args",
                        lambda *args: calls.append(args) or check_w4a16_grouped_mm_args(*args))
    _, b, _, sb, alpha, offs = _grouped()
    x = torch.randn(int(offs[-1]), K, dtype=torch.bfloat16)
    outs = [d.w4a16_grouped_mm(x, b, sb, alpha, offs, check_offs=False) for _ in range(3)]
    assert len(calls) == 1 and all(o.dtype == torch.bfloat16 and torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], d.w4a16_grouped_mm(x, b, sb, alpha, offs))


def test_guard_mode_checks_remembered_calls_and_its_ban_is_seen_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4DISPATCH_GUARD_EVERY", "1")
    bad = FakeBackend("bad", cost=1e-6)
    good = FakeBackend("good", cost=1e-5)
    d = Dispatcher([bad, good], cache_dir=tmp_path / "c", do_bench=fake_do_bench, guard=True)
    a, b, sa, sb, alpha, out = _inputs(6)
    for _ in range(2):  # decided on "bad" (right so far, fastest), then a remembered repeat
        d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert d.memo.fp4_mm(a, b, sa, sb, alpha, torch.float32, out, "swizzled", None)[0].backend is bad
    bad.nan_rows_after = bad.calls  # it goes bad while serving
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)  # a remembered call: the guard still checks it
    assert torch.equal(out, _exact(a, b, sa, sb, alpha))
    runs = bad.calls
    d.fp4_mm(a, b, sa, sb, alpha, out_dtype=torch.float32, out=out)
    assert bad.calls == runs and torch.equal(out, _exact(a, b, sa, sb, alpha))
