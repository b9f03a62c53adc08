"""Native backends on CPU, against contract emulators (tests/_native_fakes.py): each adapter must call its library
exactly as the library's own tests do, and its output (computed by the fake from those arguments) must equal
fp4dispatch's reference. Deliberately wrong adapters must be caught. Also: availability reasons, per-problem rules,
trtllm's prepared-weight cache, and the CPU report."""
from __future__ import annotations

import logging
import pickle
import sys

import pytest
import torch

import _native_fakes as fakes
import _native_helpers as helpers
from fp4dispatch.backends import default_backends
from fp4dispatch.backends.flashinfer import BACKENDS, FlashInferBackend
from fp4dispatch.backends.flashinfer_trtllm import FlashInferTrtllmBackend
from fp4dispatch.backends.reference import ReferenceBackend, reference_mm
from fp4dispatch.backends.sgl_kernel import SglKernelBackend
from fp4dispatch.backends.torch_scaled_mm import TorchScaledMmBackend
from fp4dispatch.settings import Settings
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.probe import probe_backend
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands
from fp4dispatch.dispatch.verify import check_output

CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NATIVE = [f"flashinfer:{b}" for b in BACKENDS] + ["sgl_kernel:cutlass", "torch:scaled_mm"]


@pytest.fixture
def flashinfer(monkeypatch):
    def install(cap: int, **kw):
        mod = fakes.fake_flashinfer(cap, **kw)
        monkeypatch.setitem(sys.modules, "flashinfer", mod)
        monkeypatch.setitem(sys.modules, "flashinfer.utils", mod.utils)
        return mod
    return install


def _backend(name: str) -> FlashInferBackend:
    return next(b for b in default_backends() if getattr(b, "backend", None) == name)


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer: the right call, the right result
# ---------------------------------------------------------------------------------------------------------------
FI_CASES = [  # backend, capability, M, N, K, out dtype
    ("cudnn", 100, 3, 256, 512, BF16), ("cudnn", 120, 130, 96, 160, FP16),
    ("cutlass", 100, 1, 256, 512, FP16), ("cutlass", 120, 300, 64, 96, BF16),
    ("b12x", 120, 17, 128, 96, BF16),
    ("cute-dsl", 100, 48, 32, 128, FP16), ("cute-dsl", 120, 3, 128, 512, BF16),
    ("cutedsl_low_latency", 103, 7, 256, 192, BF16),
    ("trtllm", 100, 7, 128, 256, BF16), ("trtllm", 100, 300, 256, 512, BF16),
    ("cake", 100, 5, 64, 512, FP16),
]


@pytest.mark.parametrize("name, cap, m, n, k, dt", FI_CASES, ids=[f"{c[0]}-sm{c[1]}-m{c[2]}" for c in FI_CASES])
def test_flashinfer_adapter_matches_reference(cc, flashinfer, name, cap, m, n, k, dt):
    cc(cap)
    fi = flashinfer(cap)
    b = _backend(name)
    assert b.unavailable(torch.device("cuda", 0)) is None
    _, ops, ref = helpers.run_backend(b, m, n, k, dt)
    helpers.assert_equals_reference(ops, ref)
    assert fi.mm_fp4.calls == [{"backend": name, "skip_check": False}]
    b.run(Problem(m, n, k, dt, CPU), ops, {})  # same shape class: FlashInfer's checks are skipped the second time
    assert fi.mm_fp4.calls[-1] == {"backend": name, "skip_check": True}
    helpers.assert_equals_reference(ops, ref)


@pytest.mark.parametrize("name", ["cutlass", "cutedsl_low_latency", "trtllm", "cake"])
def test_flashinfer_probe_passes_through_the_emulator(cc, flashinfer, name):
    cap = 120 if name == "b12x" else 100
    cc(cap)
    flashinfer(cap)
    v = probe_backend(_backend(name), CPU)
    assert (v.status, v.reason) == ("ok", "")


def test_fp4_mm_runs_through_flashinfer_end_to_end(cc, flashinfer, tmp_path):
    cc(120)
    fi = flashinfer(120)
    d = Dispatcher(backends=[_backend("cutlass"), ReferenceBackend()], cache_dir=tmp_path,
                   settings=Settings(tune=False))
    problem = Problem(37, 96, 256, BF16, CPU)
    ops = make_operands(problem, seed=5)
    out = d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha)
    assert d.choose(problem).backend.name == "flashinfer:cutlass"
    assert fi.mm_fp4.calls and {c["backend"] for c in fi.mm_fp4.calls} == {"cutlass"}
    torch.testing.assert_close(out.float(), reference_mm(problem, ops).to(BF16).float(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# deliberately wrong adapters are caught
# ---------------------------------------------------------------------------------------------------------------
class _PassesB(FlashInferBackend):
    def operands(self, problem, ops):
        a, _, sa, sb, alpha = super().operands(problem, ops)
        return a, ops.b, sa, sb, alpha


class _RowMajorBT(FlashInferBackend):
    def operands(self, problem, ops):
        a, b, sa, sb, alpha = super().operands(problem, ops)
        return a, b.contiguous(), sa, sb, alpha


class _UntransposedScale(FlashInferBackend):
    def operands(self, problem, ops):
        a, b, sa, _, alpha = super().operands(problem, ops)
        return a, b, sa, ops.b_scale.view(torch.uint8), alpha


class _FloatAlpha(FlashInferBackend):
    def operands(self, problem, ops):
        a, b, sa, sb, alpha = super().operands(problem, ops)
        return a, b, sa, sb, float(alpha)


@pytest.mark.parametrize("cls, match", [
    pytest.param(_PassesB, r"K dimension mismatch in mm_fp4", id="b-instead-of-b.T"),
    pytest.param(_RowMajorBT, r"column-major \[K/2, N\] view", id="b.T-made-contiguous"),
    pytest.param(_UntransposedScale, r"b_descale must be b_sf.T", id="b_scale-not-transposed"),
    pytest.param(_FloatAlpha, r"alpha must be a float tensor", id="python-float-alpha"),
])
def test_wrong_flashinfer_layout_is_rejected_by_the_emulator(cc, flashinfer, cls, match):
    cc(120)
    flashinfer(120)
    problem = Problem(3, 128, 512, BF16, CPU)
    with pytest.raises(fakes.ContractError, match=match):
        cls("cutlass").run(problem, make_operands(problem), {})


class _LinearScales(FlashInferBackend):
    """Passes zero-padded *linear* scales of the right shape: no check can see it, the result must."""

    def operands(self, problem, ops):
        a, b, _, _, alpha = super().operands(problem, ops)
        from fp4dispatch.format import unswizzle_scales

        def linear_padded(s, rows):
            lin = unswizzle_scales(s, rows, problem.k // 16).view(torch.uint8)
            pad = torch.zeros(s.shape, dtype=torch.uint8)
            pad[:rows, : problem.k // 16] = lin
            return pad

        return a, b, linear_padded(ops.a_scale, problem.m), linear_padded(ops.b_scale, problem.n).T, alpha


class _UnshuffledTrtllm(FlashInferTrtllmBackend):
    """trtllm fed the canonical weight: shapes are right (N % 128 == 0), the values are not."""

    def operands(self, problem, ops):
        return FlashInferBackend.operands(self, problem, ops)


@pytest.mark.parametrize("make, cap", [(lambda: _LinearScales("cudnn"), 120), (_UnshuffledTrtllm, 100)],
                         ids=["linear-scales", "trtllm-unshuffled"])
def test_wrong_values_are_caught_by_comparing_with_the_reference(cc, flashinfer, make, cap):
    cc(cap)
    flashinfer(cap)
    problem = Problem(130, 256, 512, BF16, CPU)
    ops = make_operands(problem, seed=11)
    backend = make()
    if isinstance(backend, _UnshuffledTrtllm):
        backend._reset_transient()
    backend.run(problem, ops, {})
    bad = check_output(ops.out, reference_mm(problem, ops), problem)
    assert bad is not None and bad.startswith("relative error"), bad


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer: availability reasons and per-problem rules
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BACKENDS)
def test_flashinfer_refuses_sm90_with_its_own_reason(cc, flashinfer, name):
    cc(90)
    flashinfer(90)
    assert _backend(name).unavailable(torch.device("cuda", 0)) == \
        f"BackendSupportedError: mm_fp4 does not support backend '{name}' with capability 90"


def test_flashinfer_not_installed(cc, monkeypatch):
    cc(100)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert _backend("cudnn").unavailable(torch.device("cuda", 0)) == \
        "flashinfer is not installed (pip install fp4dispatch[flashinfer])"


def test_flashinfer_import_failure_is_a_reason(cc, monkeypatch, tmp_path):
    cc(100)
    pkg = tmp_path / "flashinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('flashinfer was built for torch 2.9')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert _backend("cutlass").unavailable(torch.device("cuda", 0)) == \
        "flashinfer import failed: RuntimeError: flashinfer was built for torch 2.9"


def test_old_flashinfer_without_the_backend(cc, flashinfer):
    cc(100)
    flashinfer(100, backends=("cudnn", "cutlass", "trtllm", "cute-dsl", "b12x"), version="0.6.13")
    assert _backend("cake").unavailable(torch.device("cuda", 0)) == \
        "flashinfer 0.6.13: mm_fp4 has no backend 'cake' (added in flashinfer 0.7.4)"


def test_flashinfer_cute_dsl_gate(cc, flashinfer, monkeypatch):
    cc(100)
    flashinfer(100)
    import types

    gb = types.ModuleType("flashinfer.gemm.gemm_base")

    def no_dsl():
        raise ValueError("CuTe DSL is not available.")

    gb._check_cute_dsl_availability = no_dsl
    monkeypatch.setitem(sys.modules, "flashinfer.gemm.gemm_base", gb)
    assert _backend("cute-dsl").unavailable(torch.device("cuda", 0)) == \
        "ValueError: CuTe DSL is not available. (pip install nvidia-cutlass-dsl)"
    assert _backend("cutlass").unavailable(torch.device("cuda", 0)) is None


@pytest.mark.parametrize("name, cap, m, n, k, dt, match", [
    ("cudnn", 100, 4, 256, 512, FP32, r"writes bfloat16/float16 only"),
    ("cutlass", 120, 4, 80, 512, BF16, r"N % 32 == 0 and K % 32 == 0; N=80 is not a multiple of 32"),
    ("b12x", 120, 4, 256, 112, BF16, r"K=112 is not a multiple of 32"),
    ("cute-dsl", 120, 4, 96, 512, BF16, r"cute-dsl on SM120 needs N % 64 == 0 and K % 64 == 0; N=96"),
    ("cute-dsl", 120, 4, 128, 512, FP16, r"cute-dsl on SM120 writes bfloat16 only"),
    ("cutedsl_low_latency", 100, 9, 256, 512, BF16, r"serves M <= 8 only; got M=9"),
    ("trtllm", 100, 4, 256, 512, FP16, r"trtllm writes bfloat16 only"),
    ("trtllm", 100, 4, 96, 512, BF16, r"N % 128 == 0 and K % 64 == 0; N=96"),
    ("cake", 100, 4, 256, 384, BF16, r"K % 256 == 0; K=384"),
])
def test_flashinfer_unsupported_rules(cc, name, cap, m, n, k, dt, match):
    cc(cap)
    why = _backend(name).unsupported(Problem(m, n, k, dt, CPU))
    assert why is not None
    with pytest.raises(AssertionError, match=match):
        raise AssertionError(why)


def test_cute_dsl_sm100_takes_n_multiple_of_32(cc):
    cc(100)
    assert _backend("cute-dsl").unsupported(Problem(4, 96, 512, BF16, CPU)) is None


# ---------------------------------------------------------------------------------------------------------------
# trtllm: the shuffled weight is prepared once per weight, and never served stale
# ---------------------------------------------------------------------------------------------------------------
def test_trtllm_prepares_each_weight_once_and_notices_changes(cc, flashinfer):
    cc(100)
    flashinfer(100)
    b = _backend("trtllm")
    problem = Problem(5, 128, 256, BF16, CPU)
    ops = make_operands(problem, seed=1)
    for _ in range(3):
        b.run(problem, ops, {})
    assert (b.prepared.misses, b.prepared.hits, len(b.prepared)) == (1, 2, 1)
    helpers.assert_equals_reference(ops, reference_mm(problem, ops))

    ops.b[:7] ^= 0x11  # in-place change of the weight: the version counter moves
    b.run(problem, ops, {})
    assert b.prepared.misses == 2
    helpers.assert_equals_reference(ops, reference_mm(problem, ops))

    ops.b_scale.view(torch.uint8)[0, :4] = 0x38  # the scale alone changes (1.0 in e4m3)
    b.run(problem, ops, {})
    assert b.prepared.misses == 3
    helpers.assert_equals_reference(ops, reference_mm(problem, ops))


def test_trtllm_cache_is_bounded_and_drops_freed_weights(cc, flashinfer, caplog):
    cc(100)
    flashinfer(100)
    b = FlashInferTrtllmBackend(max_entries=2)
    problem = Problem(2, 128, 256, BF16, CPU)
    weights = [make_operands(problem, seed=s) for s in range(3)]
    for ops in weights:
        b.run(problem, ops, {})
        helpers.assert_equals_reference(ops, reference_mm(problem, ops))
    assert len(b.prepared) == 2
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        b.run(problem, weights[0], {})  # evicted earlier: the working set is larger than the cache
    assert "flashinfer:trtllm prepares weights again on every call" in caplog.text
    del weights, ops
    import gc

    gc.collect()
    assert len(b.prepared) == 0 and b.prepared.nbytes == 0


def test_trtllm_byte_limit(cc, flashinfer):
    cc(100)
    flashinfer(100)
    problem = Problem(2, 128, 256, BF16, CPU)
    one = 128 * 128 + 128 * 16  # shuffled bytes + shuffled scales of one weight
    b = FlashInferTrtllmBackend(max_bytes=one)
    keep = [make_operands(problem, seed=s) for s in range(2)]
    for ops in keep:
        b.run(problem, ops, {})
    assert (len(b.prepared), b.prepared.nbytes) == (1, one)


def test_native_backends_pickle_for_probe_workers(cc, flashinfer):
    cc(100)
    flashinfer(100)
    b = _backend("trtllm")
    problem = Problem(2, 128, 256, BF16, CPU)
    b.run(problem, make_operands(problem), {})
    clone = pickle.loads(pickle.dumps(b))
    assert clone.name == "flashinfer:trtllm" and len(clone.prepared) == 0 and clone._lib is None
    for other in (SglKernelBackend(), TorchScaledMmBackend()):
        assert pickle.loads(pickle.dumps(other)).name == other.name
