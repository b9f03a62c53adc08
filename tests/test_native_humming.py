"""``humming:w4a16`` on CPU against Humming's contract emulator (tests/_native_fakes.py, ``FakeHumming``): the adapter
must call Humming as its layer and tests do, its output (computed by the fake from those arguments) must equal
fp4dispatch's reference, Stream-K must stay off, the prepared weight is made once per weight, and deliberately wrong
adapters are caught. Also: availability reasons and per-problem rules. The real library runs on the GPU only."""
from __future__ import annotations

import json
import pickle
import sys

import pytest
import torch

import _native_fakes as fakes
import _native_helpers as helpers
from fp4dispatch.backends.humming import HummingBackend, HummingW4A4Backend
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.verify import check_output
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands

CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def humming(monkeypatch):
    def install(version: str = "0.1.20", drop: str | None = None, cc: int = 90) -> fakes.FakeHumming:
        fake = fakes.FakeHumming()
        mod = fake.module(version, cc)
        if drop:
            delattr(getattr(mod, drop.split(".")[0]), drop.split(".")[1])
        monkeypatch.setitem(sys.modules, "humming", mod)
        for sub in ("layer", "forward", "tune", "kernel"):
            monkeypatch.setitem(sys.modules, f"humming.{sub}", getattr(mod, sub))
        return fake
    return install


@pytest.mark.parametrize("m, n, k, dt", [(1, 128, 32, BF16), (5, 128, 512, BF16), (130, 384, 96, FP16),
                                         (300, 256, 256, BF16)])
def test_humming_adapter_matches_reference_with_stream_k_off(cc, humming, m, n, k, dt):
    cc(90)
    fake = humming()
    backend = HummingBackend()
    assert backend.unavailable(CPU) is None
    problem, ops, ref = helpers.run_backend(backend, m, n, k, dt, seed=m + n)
    helpers.assert_equals_reference(ops, ref, rtol=8e-3)  # the fake sums in another order: a rounding tie may flip
    tuning = fake.calls[-1]["tuning_config"]
    assert tuning and all(cfg["use_stream_k"] is False for _, _, cfg in tuning)  # determinism
    # made into JSON once per weight: humming_forward would serialize a list on every call
    assert fake.calls[-1]["tuning_as_json"]
    assert fake.heuristics[0][2]["use_stream_k"] is True  # Humming's cached heuristics were copied, not changed


def test_humming_prepares_each_weight_once_per_out_dtype_and_notices_changes(cc, humming):
    cc(90)
    humming()
    backend = HummingBackend()
    problem = Problem(3, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=1)
    for _ in range(3):
        backend.run(problem, ops, {})
    assert backend.prepared.misses == 1 and backend.prepared.hits == 2
    half = Problem(3, 128, 256, FP16, CPU)
    backend.run(half, ops._replace(out=torch.empty(3, 128, dtype=FP16)), {})
    assert backend.prepared.misses == 2  # Humming's layer has one dtype: one prepared form per out dtype
    ops.b.copy_(make_operands(problem, seed=2).b)  # an in-place change bumps the version: prepared again
    backend.run(problem, ops, {})
    assert backend.prepared.misses == 3
    helpers.assert_equals_reference(ops, reference_mm(problem, ops))


def test_hummings_table_is_searched_once_and_then_read_from_the_cache_dir(cc, humming, cache_dir):
    """Humming's heuristic search (seconds of Python for a grouped layer) runs once per layer config and GPU; the
    next process (here a new backend) reads its table from disk, with Stream-K off, and passes Humming the same
    JSON. A file that does not parse is searched again and rewritten; another layer config gets its own file."""
    from fp4dispatch.backends import humming_tables

    cc(90)
    fake = humming()
    problem = Problem(3, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=1)
    HummingBackend().run(problem, ops, {})
    files = list((cache_dir / "humming-tables").glob("*.json"))
    assert fake.searches == 1 and len(files) == 1
    assert json.loads(files[0].read_text()) == [[0, 1 << 30, {"block_m": 64, "use_stream_k": False}]]
    first = fake.calls[-1]["tuning_config"]
    HummingBackend().run(problem, ops, {})
    assert fake.searches == 1 and fake.calls[-1]["tuning_config"] == first
    files[0].write_text('[[0, 1, "not a config"]]')
    HummingBackend().run(problem, ops, {})
    assert fake.searches == 2 and json.loads(files[0].read_text())[0][2] == {"block_m": 64, "use_stream_k": False}
    other = Problem(3, 384, 256, BF16, CPU)
    HummingBackend().run(other, make_operands(other, seed=2), {})
    assert fake.searches == 3 and len(list((cache_dir / "humming-tables").glob("*.json"))) == 2
    assert not list((cache_dir / "humming-tables").glob("*.tmp"))
    lib = sys.modules["humming"]
    assert humming_tables.table_path(lib, {"n": 1}, "dense", CPU) != humming_tables.table_path(lib, {"n": 1},
                                                                                              "grouped_contiguous", CPU)


def test_hummings_table_still_serves_when_the_cache_dir_cannot_be_written(cc, humming, cache_dir):
    cc(90)
    fake = humming()
    (cache_dir / "humming-tables").parent.mkdir(parents=True, exist_ok=True)
    (cache_dir / "humming-tables").write_text("a file where the folder would go")
    problem = Problem(3, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=1)
    HummingBackend().run(problem, ops, {})
    helpers.assert_equals_reference(ops, reference_mm(problem, ops), rtol=8e-3)
    assert fake.searches == 1 and fake.calls[-1]["tuning_config"][0][2]["use_stream_k"] is False


def test_a_misaligned_alpha_is_copied_to_an_aligned_one(cc, humming):
    cc(90)
    humming()
    problem = Problem(2, 128, 64, BF16, CPU)
    ops = make_operands(problem, seed=3)
    alpha = torch.empty(5, dtype=FP32)[1:2].copy_(ops.alpha)
    assert alpha.data_ptr() % 16 != 0
    ops = ops._replace(alpha=alpha)
    HummingBackend().run(problem, ops, {})  # the emulator refuses a misaligned weight_scale_2
    helpers.assert_equals_reference(ops, reference_mm(problem, ops))


# ---------------------------------------------------------------------------------------------------------------
# deliberately wrong adapters are caught
# ---------------------------------------------------------------------------------------------------------------
class _TransposedWeight(HummingBackend):
    def weight_tensors(self, problem, ops):
        t = super().weight_tensors(problem, ops)
        return {**t, "weight": t["weight"].T.contiguous()}


class _SwizzledScales(HummingBackend):
    def weight_tensors(self, problem, ops):
        return {**super().weight_tensors(problem, ops), "weight_scale": ops.b_scale}


class _UintScales(HummingBackend):
    def weight_tensors(self, problem, ops):
        t = super().weight_tensors(problem, ops)
        return {**t, "weight_scale": t["weight_scale"].view(torch.uint8)}


class _NibblesSwapped(HummingBackend):
    def weight_tensors(self, problem, ops):
        t = super().weight_tensors(problem, ops)
        w = t["weight"]
        return {**t, "weight": ((w << 4) | (w >> 4)).to(torch.uint8)}


class _AlphaTwice(HummingBackend):
    def activations(self, problem, ops):
        return (super().activations(problem, ops).float() * ops.alpha).to(problem.out_dtype)


class _GlobalScaleInverted(HummingBackend):
    def epilogue_scale(self, problem, ops):
        return super().epilogue_scale(problem, ops.__class__(*ops[:4], 1.0 / ops.alpha, ops.out))


@pytest.mark.parametrize("cls, n, match", [
    pytest.param(_TransposedWeight, 192, r"size mismatch for weight", id="transposed-weight"),
    pytest.param(_SwizzledScales, 192, r"size mismatch for weight_scale", id="swizzled-scales-padded"),
    pytest.param(_UintScales, 128, r"weight_scale must be torch.float8_e4m3fn; got torch.uint8", id="uint8-scales"),
])
def test_wrong_humming_layouts_are_refused_by_the_emulator(cc, humming, cls, n, match):
    cc(90)
    humming()
    problem = Problem(3, n, 512, BF16, CPU)
    with pytest.raises(fakes.ContractError, match=match):
        cls().run(problem, make_operands(problem), {})


@pytest.mark.parametrize("cls", [_SwizzledScales, _NibblesSwapped, _AlphaTwice, _GlobalScaleInverted],
                         ids=["swizzled-scales-as-linear", "nibble-order", "alpha-twice", "global-scale-inverted"])
def test_wrong_humming_values_are_caught_by_comparing_with_the_reference(cc, humming, cls):
    """Shapes that fit every check (N % 128 == 0 and K/16 % 4 == 0: the swizzled scales have the linear shape):
    only the result shows the mistake."""
    cc(90)
    humming()
    problem = Problem(130, 256, 512, BF16, CPU)
    ops = make_operands(problem, seed=11)
    cls().run(problem, ops, {})
    bad = check_output(ops.out, reference_mm(problem, ops), problem)
    assert bad is not None and bad.startswith("relative error"), bad


def test_fp4_mm_runs_through_humming_end_to_end(cc, humming, tmp_path):
    cc(90)
    fake = humming()
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    problem = Problem(4, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=5)
    out = d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha)
    helpers.assert_equals_reference(ops._replace(out=out), reference_mm(problem, ops))
    assert {r.name: r.status for r in d.report(CPU)}["humming:w4a16"] == "ok" and fake.calls


# ---------------------------------------------------------------------------------------------------------------
# availability and per-problem rules
# ---------------------------------------------------------------------------------------------------------------
def test_humming_not_installed(cc, monkeypatch):
    cc(90)
    monkeypatch.setitem(sys.modules, "humming", None)  # import raises ModuleNotFoundError, as when not installed
    assert HummingBackend().unavailable(CPU) == "humming is not installed (pip install fp4dispatch[humming])"


def test_hummings_probe_worker_starts_before_this_process_imports_it(cc, humming, monkeypatch):
    """Importing Humming takes seconds (it imports torch._dynamo): on a GPU it can run on, with the library installed,
    its worker starts first and this process imports it meanwhile (health._starts_first); otherwise the reason known
    without the import is the verdict, and no worker starts."""
    from fp4dispatch.dispatch.health import _starts_first

    cc(90)
    humming()
    assert _starts_first(HummingBackend(), CPU) and not _starts_first(HummingW4A4Backend(), CPU)
    assert HummingW4A4Backend().unavailable_before_import(CPU).startswith("Humming's FP4 activations need")
    monkeypatch.setitem(sys.modules, "humming", None)
    assert not _starts_first(HummingBackend(), CPU)
    assert HummingBackend().unavailable_before_import(CPU) == ("humming is not installed "
                                                               "(pip install fp4dispatch[humming])")


@pytest.mark.parametrize("part", ["forward.humming_forward", "kernel.HummingKernel"])
def test_a_humming_without_a_part_the_adapter_calls_is_a_reason(cc, humming, part):
    cc(90)
    humming(version="0.1.0", drop=part)
    assert HummingBackend().unavailable(CPU) == (f"humming 0.1.0 lacks humming.{part} (fp4dispatch's "
                                                 "adapter is written against humming-kernels 0.1.20)")


@pytest.mark.parametrize("cap, want", [(None, "needs a CUDA GPU (Humming compiles CUDA kernels); got device type 'cpu'"),
                                       (70, "Humming needs compute capability >= 7.5; got 7.0")])
def test_humming_device_reasons(cc, humming, cap, want):
    cc(cap)
    humming()
    assert HummingBackend().unavailable(CPU) == want


@pytest.mark.parametrize("cap, n, k, dt, want", [
    (90, 128, 256, FP32, "Humming writes bfloat16/float16 only (its output dtype is the activations'); got "
                         "out_dtype=torch.float32"),
    (75, 128, 256, BF16, "Humming's bfloat16 activations need compute capability >= 8.0; use out_dtype=torch.float16"),
    (80, 96, 256, BF16, "Humming (its padded tile) needs N % 64 == 0 and K % 32 == 0; N=96 is not a multiple of 64 "
                        "(not padded: the triton/reference backends take any N, K multiple of 16)"),
    (80, 192, 96, BF16, None),
    (90, 192, 96, BF16, "Humming on SM90 (four 32-column warps along N) needs N % 128 == 0 and K % 32 == 0; N=192 is "
                        "not a multiple of 128 (not padded: the triton/reference backends take any N, K multiple of 16)"),
])
def test_humming_unsupported_rules(cc, cap, n, k, dt, want):
    cc(cap)
    assert HummingBackend().unsupported(Problem(3, n, k, dt, CPU)) == want


def test_humming_pickles_for_probe_workers_and_asks_for_time_to_compile(cc, humming):
    cc(90)
    humming()
    backend = HummingBackend()
    problem = Problem(2, 128, 64, BF16, CPU)
    ops = make_operands(problem)
    backend.run(problem, ops, {})
    clone = pickle.loads(pickle.dumps(backend))
    assert clone._lib is None and len(clone.prepared) == 0 and len(backend.prepared) == 1
    assert backend.risky and backend.probe_timeout_s >= 60


# ---------------------------------------------------------------------------------------------------------------
# humming:w4a4 (FP4 activations, SM100+)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k, dt", [(1, 128, 128, BF16), (7, 256, 512, FP16), (300, 128, 256, BF16)])
def test_humming_w4a4_adapter_matches_reference(cc, humming, m, n, k, dt):
    cc(100)
    fake = humming(cc=100)
    backend = HummingW4A4Backend()
    assert backend.unavailable(CPU) is None
    problem, ops, ref = helpers.run_backend(backend, m, n, k, dt, seed=3 * m + n)
    helpers.assert_equals_reference(ops, ref, rtol=8e-3)
    assert all(cfg["use_stream_k"] is False for _, _, cfg in fake.calls[-1]["tuning_config"])


def test_humming_w4a4_refuses_hopper_with_a_reason_and_humming_agrees(cc, humming):
    cc(90)
    humming(cc=90)
    assert HummingW4A4Backend().unavailable(CPU) == ("Humming's FP4 activations need block-scaled MMA (SM100+); got "
                                                     "compute capability 9.0 (humming:w4a16 runs there)")
    problem = Problem(2, 128, 128, BF16, CPU)
    with pytest.raises(AssertionError, match="requires block-scaled MMA"):  # what Humming itself raises there
        HummingW4A4Backend().run(problem, make_operands(problem), {})


class _A4SwizzledActivationScales(HummingW4A4Backend):
    def forward_inputs(self, problem, ops, layer_extra):
        return {**super().forward_inputs(problem, ops, layer_extra),
                "input_scale": ops.a_scale.view(torch.uint8).contiguous().view(torch.int32)}


class _A4AlphaTwice(HummingW4A4Backend):
    def forward_inputs(self, problem, ops, layer_extra):
        return {**super().forward_inputs(problem, ops, layer_extra), "input_scale_2": self.epilogue_scale(problem, ops)}


class _A4NibblesSwapped(HummingW4A4Backend):
    def forward_inputs(self, problem, ops, layer_extra):
        a = ops.a.view(torch.uint8)
        return {**super().forward_inputs(problem, ops, layer_extra), "inputs": ((a << 4) | (a >> 4)).to(torch.uint8)}


@pytest.mark.parametrize("cls", [_A4SwizzledActivationScales, _A4AlphaTwice, _A4NibblesSwapped],
                         ids=["swizzled-activation-scales", "alpha-twice", "activation-nibble-order"])
def test_wrong_humming_w4a4_adapters_are_caught(cc, humming, cls):
    """M = 128 and K/16 % 4 == 0: the swizzled activation scales have the row-major shape; only the result shows."""
    cc(100)
    humming(cc=100)
    problem = Problem(128, 256, 512, BF16, CPU)
    ops = make_operands(problem, seed=21)
    cls().run(problem, ops, {})
    bad = check_output(ops.out, reference_mm(problem, ops), problem)
    assert bad is not None and bad.startswith("relative error"), bad


def test_humming_w4a4_unsupported_rules(cc):
    cc(100)
    assert HummingW4A4Backend().unsupported(Problem(3, 128, 192, BF16, CPU)) == (
        "Humming's block-scaled tile needs N % 128 == 0 and K % 128 == 0; K=192 is not a multiple of 128 (not padded: "
        "the triton/reference backends take any N, K multiple of 16)")
    assert HummingW4A4Backend().unsupported(Problem(3, 128, 256, FP32, CPU)).startswith("Humming writes bfloat16")


@pytest.mark.parametrize("adt", [BF16, FP16])
def test_humming_serves_w4a16_with_the_activations_as_given(cc, humming, adt):
    from fp4dispatch.dispatch.verify import check_run, make_case

    cc(90)
    fake = humming()
    backend = HummingBackend()
    problem = Problem(7, 128, 256, adt, CPU, adt)
    case = make_case(problem, 5, reference_mm)  # the dispatcher's own check: hostile inputs, guard rows
    assert check_run(backend, case, {}) is None
    assert fake.calls and backend.activations(problem, case.ops) is case.ops.a  # no decode, no copy
    other = FP16 if adt is BF16 else BF16
    assert backend.unsupported(problem._replace(out_dtype=other)) == (
        f"Humming writes its activations' dtype: out_dtype must be a's dtype ({adt}); got {other}")
    assert HummingW4A4Backend.ops == ("fp4_mm",)


# ---------------------------------------------------------------------------------------------------------------
# humming:grouped (fp4_grouped_mm through Humming's MoE GEMM)
# ---------------------------------------------------------------------------------------------------------------
def _grouped_case(t, e, n, k, seed, dt=BF16):
    from fp4dispatch.dispatch.verify import make_case

    problem = Problem(t, n, k, dt, CPU, torch.uint8, e)
    return problem, make_case(problem, seed, reference_mm)


def _assert_grouped_matches(problem, out, ref):
    assert check_output(out, ref, problem) is None  # the dispatcher's own check: NaN where it belongs
    finite = torch.isfinite(ref)
    want = ref.to(problem.out_dtype).float()[finite]
    torch.testing.assert_close(out.float()[finite], want, rtol=2 ** -7, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("t, e, dt", [(1, 4, BF16), (37, 5, FP16), (300, 3, BF16)])
def test_humming_grouped_adapter_matches_reference_with_stream_k_off(cc, humming, t, e, dt, seed):
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    cc(90)
    fake = humming()
    backend = HummingGroupedBackend()
    problem, case = _grouped_case(t, e, 128, 96, seed, dt)
    assert backend.unavailable(CPU) is None and backend.unsupported(problem) is None
    backend.run(problem, case.ops, {})
    _assert_grouped_matches(problem, case.ops.out, case.ref)
    call = fake.calls[-1]
    assert call["expert_layout"] == [0] + case.ops.offs.tolist()
    assert all(cfg["use_stream_k"] is False for _, _, cfg in call["tuning_config"]) and call["tuning_as_json"]
    assert fake.heuristics[0][2]["use_stream_k"] is True  # Humming's cached heuristics were copied, not changed


def test_humming_grouped_spreads_one_alpha_and_prepares_the_experts_once(cc, humming):
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    cc(90)
    fake = humming()
    backend = HummingGroupedBackend()
    problem, case = _grouped_case(20, 4, 128, 64, 1)
    ops = case.ops._replace(alpha=case.ops.alpha[:1].clone())
    ref = reference_mm(problem, ops)
    for _ in range(2):
        backend.run(problem, ops, {})
        _assert_grouped_matches(problem, ops.out, ref)
    assert (backend.prepared.misses, backend.prepared.hits) == (1, 1) and len(fake.calls) == 2


def test_humming_grouped_clamps_a_wrong_routing_table_it_was_not_checked_against(cc, humming):
    """With check_offs=False (or in a replayed graph) offs is not read on the host: Humming gets it clamped to
    [0, T] and non-decreasing, never a table that sends it out of bounds."""
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    cc(90)
    fake = humming()
    problem, case = _grouped_case(10, 3, 128, 64, 0)
    bad = torch.tensor([6, 2, 99], dtype=torch.int32)
    HummingGroupedBackend().run(problem, case.ops._replace(offs=bad), {})
    assert fake.calls[-1]["expert_layout"] == [0, 6, 6, 10]


class _GroupedRawOffs(__import__("fp4dispatch.backends.humming_grouped", fromlist=["x"]).HummingGroupedBackend):
    def forward_inputs(self, problem, ops, layer_extra):
        return {**super().forward_inputs(problem, ops, layer_extra), "expert_layout": ops.offs}


class _GroupedOneAlpha(__import__("fp4dispatch.backends.humming_grouped", fromlist=["x"]).HummingGroupedBackend):
    def epilogue_scale(self, problem, ops):
        return ops.alpha[:1].clone()


class _GroupedSwizzledWeightScales(
        __import__("fp4dispatch.backends.humming_grouped", fromlist=["x"]).HummingGroupedBackend):
    def weight_tensors(self, problem, ops):
        return {**super().weight_tensors(problem, ops), "weight_scale": ops.b_scale}


class _GroupedTokensAsDense(__import__("fp4dispatch.backends.humming_grouped", fromlist=["x"]).HummingGroupedBackend):
    def forward_inputs(self, problem, ops, layer_extra):
        # the dense decode reads the scales as one swizzled matrix: wrong rows for every expert but the first
        from fp4dispatch.format import dequantize_nvfp4

        x = dequantize_nvfp4(ops.a, ops.a_scale[:-(-problem.m // 128) * 128], dtype=problem.out_dtype)
        return {**super().forward_inputs(problem, ops, layer_extra), "inputs": x}


@pytest.mark.parametrize("cls, match", [
    pytest.param(_GroupedRawOffs, r"expert_token_offset must be int32/int64 \[5\]", id="offs-without-leading-zero"),
    pytest.param(_GroupedOneAlpha, r"bs2 must be fp32 \[4\] \(one per expert\)", id="one-alpha-for-all"),
    pytest.param(_GroupedSwizzledWeightScales, r"size mismatch for weight_scale", id="swizzled-weight-scales"),
])
def test_wrong_humming_grouped_layouts_are_refused_by_the_emulator(cc, humming, cls, match):
    cc(90)
    humming()
    problem, case = _grouped_case(9, 4, 128, 96, 0)  # K/16 = 6: the swizzled scales' padded 8 columns differ
    with pytest.raises(fakes.ContractError, match=match):
        cls().run(problem, case.ops, {})


def test_wrong_humming_grouped_token_scales_are_caught_by_the_reference(cc, humming):
    """Experts 1.. start their scales at padded rows: reading them as one dense matrix is only seen in the result."""
    cc(90)
    humming()
    problem, case = _grouped_case(40, 3, 128, 64, 1)
    _GroupedTokensAsDense().run(problem, case.ops, {})
    bad = check_output(case.ops.out, case.ref, problem)
    assert bad is not None, "a wrong scale row must not pass"


def test_fp4_grouped_mm_runs_through_humming_end_to_end_and_its_reasons(cc, humming, tmp_path):
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    cc(90)
    fake = humming()
    d = Dispatcher([HummingGroupedBackend()], cache_dir=tmp_path)
    problem, case = _grouped_case(12, 4, 128, 64, 2)
    o = case.ops
    out = d.fp4_grouped_mm(o.a, o.b, o.a_scale, o.b_scale, o.alpha, o.offs)
    _assert_grouped_matches(problem, out, case.ref)
    assert fake.calls and fake.calls[-1]["expert_layout"][-1] == 12
    small = HummingGroupedBackend(max_bytes=1000)
    assert small.unsupported(problem) == (
        "Humming's repacked copy of these experts (0.00 GiB) exceeds its bound (0.00 GiB); construct "
        "HummingGroupedBackend(max_bytes=...) to allow it")
    assert HummingGroupedBackend().unsupported(problem._replace(out_dtype=FP32)) == \
        "Humming writes bfloat16/float16 only (its output dtype is the activations'); got out_dtype=torch.float32"
    assert "N=192 is not a multiple of 128" in HummingGroupedBackend().unsupported(problem._replace(n=192))
    assert pickle.loads(pickle.dumps(HummingGroupedBackend(max_bytes=5))).max_bytes == 5


@pytest.mark.parametrize("t, e, dt", [(1, 4, BF16), (37, 5, FP16)])
def test_humming_grouped_serves_w4a16_grouped_with_the_activations_as_given(cc, humming, t, e, dt):
    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    cc(90)
    fake = humming()
    backend = HummingGroupedBackend()
    problem = Problem(t, 128, 96, dt, CPU, dt, e)
    from fp4dispatch.dispatch.verify import make_case

    case = make_case(problem, 0, reference_mm)
    assert backend.unsupported(problem) is None
    backend.run(problem, case.ops, {})
    _assert_grouped_matches(problem, case.ops.out, case.ref)
    assert fake.calls[-1]["expert_layout"] == [0] + case.ops.offs.tolist()
    assert backend.unsupported(problem._replace(out_dtype=FP16 if dt == BF16 else BF16)).startswith(
        "Humming writes its activations' dtype: out_dtype must be a's dtype")


def _table(edges, tag="c"):
    """A Humming-like tuning table: entry i serves edges[i] < M <= edges[i+1]; the last reaches Humming's end."""
    ends = list(edges[1:]) + [1 << 30]
    return [[lo, hi, {tag: i}] for i, (lo, hi) in enumerate(zip(edges, ends))]


def _served(table, m):
    return next(cfg for lo, hi, cfg in table if lo < m <= hi)


@pytest.mark.parametrize("edges", [[0, 1, 8, 16, 24, 40, 120, 504, 1056, 4096], [0, 8192], [0, 2, 3, 4000, 5000]])
def test_bucket_entries_serve_every_m_of_the_bucket_as_the_whole_table(edges):
    """Humming compiles every entry of the table it is given: a key gets only its bucket's entries, and every M of
    the bucket (any M at all, for safety) must still run the config the whole table gives it there."""
    from fp4dispatch.backends.humming import bucket_entries
    from fp4dispatch.problem import M_BUCKETS, m_bucket

    table = _table(edges)
    for bucket in M_BUCKETS:
        part = bucket_entries(table, bucket)
        assert part[0][0] == 0 and part[-1][1] == 1 << 30  # widened: no M falls outside
        assert all(a[1] == b[0] for a, b in zip(part, part[1:]))
        assert len(part) <= len(table)
        for m in range(max(1, bucket // 2 - 2), min(bucket, 6000) + 3):
            if m_bucket(m) == bucket:
                assert _served(part, m) == _served(table, m), (bucket, m)
        assert table == _table(edges)  # the table itself is left as it was


def test_humming_gives_a_dense_key_its_bucket_entries_and_a_grouped_layer_the_whole_table(cc, humming):
    cc(90)
    fake = humming()
    fake.heuristics = _table([0, 8, 16, 24, 32, 64, 128])
    for cfg in (c for _, _, c in fake.heuristics):
        cfg["use_stream_k"] = True
    backend = HummingBackend()
    problem = Problem(20, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=3)
    backend.run(problem, ops, {})
    assert [cfg["c"] for _, _, cfg in fake.calls[-1]["tuning_config"]] == [2, 3]  # 16 < M <= 32: two entries
    assert all(cfg["use_stream_k"] is False for _, _, cfg in fake.calls[-1]["tuning_config"])
    backend.run(problem._replace(m=1), ops._replace(a=ops.a[:1], out=ops.out[:1]), {})
    assert [cfg["c"] for _, _, cfg in fake.calls[-1]["tuning_config"]] == [0]
    assert backend.prepared.misses == 1  # one prepared weight serves every bucket
    assert backend.first_run_unit(problem) != backend.first_run_unit(problem._replace(m=1))
    assert backend.first_run_unit(problem) == backend.first_run_unit(problem._replace(m=17))

    from fp4dispatch.backends.humming_grouped import HummingGroupedBackend

    grouped = HummingGroupedBackend()
    g = Problem(20, 128, 256, BF16, CPU, experts=4)
    assert grouped.first_run_unit(g) == grouped.first_run_unit(g._replace(m=1))
