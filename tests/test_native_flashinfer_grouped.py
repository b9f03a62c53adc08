"""``flashinfer:group_gemm`` (FlashInfer's SM120 NVFP4 grouped GEMM) on CPU tensors against its contract emulator
(tests/_flashinfer_grouped_fakes.py): the adapter's call is accepted and its result is the exact one on the
dispatcher's hostile inputs for every config and routing, wrong adapters are caught, and the reasons it gives."""
from __future__ import annotations

import sys

import pytest
import torch

import _flashinfer_grouped_fakes as gfakes
import _native_fakes as fakes
from fp4dispatch.backends import default_backends, names
from fp4dispatch.backends.flashinfer_grouped import (FlashInferGroupGemmBackend, flashinfer_layout,
                                                     flashinfer_scale_rows)
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.verify import check_output, make_case
from fp4dispatch.problem import Problem

CPU = torch.device("cpu")
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture
def group_gemm(monkeypatch, cc):
    """Install the emulator as ``flashinfer`` on a GPU of capability ``cap``; returns the list of its calls."""
    def install(cap: int = 120):
        calls: list = []
        monkeypatch.setitem(sys.modules, "flashinfer", gfakes.fake_flashinfer_with_group_gemm(calls))
        cc(cap)
        return calls
    return install


def _case(t: int, e: int, n: int, k: int, seed: int, dt=BF16):
    problem = Problem(t, n, k, dt, CPU, torch.uint8, e)
    return problem, make_case(problem, seed, reference_mm)


@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("t, e, dt", [(1, 4, BF16), (37, 5, FP16), (300, 3, BF16)])
def test_every_config_computes_the_hostile_case_exactly(group_gemm, t, e, dt, seed):
    calls = group_gemm(120)
    b = FlashInferGroupGemmBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    problem, case = _case(t, e, 64, 256, seed, dt)
    assert b.unsupported(problem) is None
    cfgs = b.configs(problem)
    assert {(c["tile_n"], c["tile_k"], c["swap_ab"]) for c in cfgs} == {
        (tn, tk, s) for tn in (64, 32) for tk in (128, 256) for s in (True, False)}
    for cfg in cfgs:
        case.ops.out.fill_(float("nan"))
        b.run(problem, case.ops, cfg)
        assert check_output(case.ops.out, case.ref, problem) is None, cfg
        finite = torch.isfinite(case.ref)
        torch.testing.assert_close(case.ops.out.float()[finite], case.ref.to(dt).float()[finite], rtol=2 ** -7,
                                   atol=1e-3 * float(case.ref[finite].abs().max()))
    assert [c["tile_n"] for c in calls] == [c["tile_n"] for c in cfgs]


def test_the_padded_layout_follows_flashinfers_rule():
    offs = torch.tensor([5, 5, 9, 140], dtype=torch.int32)  # rows 5, 0, 4, 131
    indptr, row_map, rows = flashinfer_layout(offs, 140, 4)
    assert indptr.tolist() == [0, 8, 8, 12, 144] and rows == 152
    assert row_map[:5].tolist() == [0, 1, 2, 3, 4] and row_map[5:9].tolist() == [8, 9, 10, 11]
    assert row_map[9:].tolist() == list(range(12, 143))
    src, valid = flashinfer_scale_rows(offs, indptr, 768)
    # fp4dispatch's blocks start at 0, 128, 128, 256 (128 rows each but the last: 256); FlashInfer's at
    # (indptr[i] + 127 i) // 128 * 128 = 0, 128, 256, 384
    got = {int(i): int(s) for i, s in zip(torch.nonzero(valid).flatten(), src[valid])}
    want = {**{i: i for i in range(128)}, **{256 + j: 128 + j for j in range(128)},
            **{384 + j: 256 + j for j in range(256)}}
    assert got == want


class _Unpadded(FlashInferGroupGemmBackend):
    """Passes fp4dispatch's offs as m_indptr, as if FlashInfer took unpadded rows."""

    def run(self, problem, ops, config):
        fn = self._function(self._lib or self._load())
        indptr = torch.cat((ops.offs.new_zeros(1), ops.offs))
        fn(ops.a, ops.b, ops.a_scale.view(torch.uint8), ops.b_scale.view(torch.uint8).reshape(problem.experts, -1,
           problem.k // 16), indptr, ops.alpha.expand(problem.experts).contiguous(), out=ops.out,
           out_dtype=problem.out_dtype)


class _ScalesUnmoved(FlashInferGroupGemmBackend):
    """Pads the rows but leaves the activation scale blocks where fp4dispatch keeps them."""

    def run(self, problem, ops, config):
        fn = self._function(self._lib or self._load())
        indptr, row_map, rows = flashinfer_layout(ops.offs, problem.m, problem.experts)
        a = ops.a.new_zeros((rows, problem.k // 2)).index_copy_(0, row_map, ops.a)
        sa = torch.cat((ops.a_scale.view(torch.uint8), ops.a_scale.view(torch.uint8).new_zeros(1024, problem.k // 16)))
        out = torch.empty((rows, problem.n), dtype=problem.out_dtype)
        fn(a, ops.b, sa, ops.b_scale.view(torch.uint8).reshape(problem.experts, -1, problem.k // 16), indptr,
           ops.alpha.expand(problem.experts).contiguous(), out=out, out_dtype=problem.out_dtype)
        torch.index_select(out, 0, row_map, out=ops.out)


class _ScalarAlpha(FlashInferGroupGemmBackend):
    """Passes alpha as given (one element) instead of one per group."""

    @staticmethod
    def _alpha(ops, e):
        return ops.alpha[:1]


class _E4m3Scales(FlashInferGroupGemmBackend):
    """Passes the weight scales as float8_e4m3fn (FlashInfer takes their bytes as uint8)."""

    def run(self, problem, ops, config):
        fn = self._function(self._lib or self._load())
        indptr, row_map, rows = flashinfer_layout(ops.offs, problem.m, problem.experts)
        a = ops.a.new_zeros((rows, problem.k // 2)).index_copy_(0, row_map, ops.a)
        fn(a, ops.b, ops.a_scale.view(torch.uint8), ops.b_scale.reshape(problem.experts, -1, problem.k // 16),
           indptr, ops.alpha.expand(problem.experts).contiguous(), out_dtype=problem.out_dtype)


def test_wrong_adapters_are_caught(group_gemm):
    group_gemm(120)
    problem, case = _case(37, 5, 64, 256, 0)
    cfg = {"tile_n": 64, "tile_k": 128, "swap_ab": True}
    with pytest.raises(fakes.ContractError, match="each m_indptr value must be a multiple of 4"):
        _Unpadded().run(problem, case.ops, cfg)
    with pytest.raises(fakes.ContractError, match=r"alpha must be a empty or have shape \(5,\)"):
        _ScalarAlpha().run(problem, case.ops, cfg)
    with pytest.raises(fakes.ContractError, match="b_scale must be a uint8 tensor"):
        _E4m3Scales().run(problem, case.ops, cfg)
    case.ops.out.fill_(float("nan"))
    _ScalesUnmoved().run(problem, case.ops, cfg)  # accepted, but every expert after the first reads other scales
    assert check_output(case.ops.out, case.ref, problem) is not None


def test_reasons(group_gemm, monkeypatch, cc):
    b = FlashInferGroupGemmBackend()
    assert b.unavailable(CPU) == "needs CUDA (FlashInfer's NVFP4 grouped GEMM runs on NVIDIA GPUs only)"
    group_gemm(90)
    assert b.unavailable(torch.device("cuda", 0)) == "FlashInfer's NVFP4 grouped GEMM runs on SM120/SM121 only; " \
                                                      "this is SM90"
    fi = gfakes.fake_flashinfer_with_group_gemm([], version="0.2.0")
    del fi.gemm.group_gemm_nvfp4_nt_groupwise
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    cc(120)
    assert b.unavailable(torch.device("cuda", 0)) == ("flashinfer 0.2.0 has no gemm.group_gemm_nvfp4_nt_groupwise "
                                                      "(upgrade flashinfer)")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert b.unavailable(torch.device("cuda", 0)).startswith("flashinfer import failed") or \
        "not installed" in b.unavailable(torch.device("cuda", 0))
    assert b.unsupported(Problem(4, 64, 256, torch.float32, CPU, torch.uint8, 2)) == (
        "FlashInfer's NVFP4 grouped GEMM writes bfloat16/float16 only; got out_dtype=torch.float32")
    assert b.unsupported(Problem(4, 60, 192, BF16, CPU, torch.uint8, 2)) == (
        "FlashInfer's NVFP4 grouped GEMM needs N % 8 == 0 and K % 128 == 0; got N=60, K=192")


def test_it_is_registered_for_fp4_grouped_mm_only_and_runs_on_fp4_tensor_cores():
    assert "flashinfer:group_gemm" in names()
    b = next(b for b in default_backends() if b.name == "flashinfer:group_gemm")
    assert b.ops == ("grouped",) and b.fp4_tensor_cores and b.risky


# ---------------------------------------------------------------------------------------------------------------
# flashinfer:cudnn_grouped (grouped_mm_fp4, cuDNN)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def cudnn_grouped(monkeypatch, cc):
    def install(cap: int = 100, cudnn_error: str | None = None):
        calls: list = []
        for name, mod in gfakes.fake_flashinfer_with_grouped_mm(calls, cudnn_error).items():
            monkeypatch.setitem(sys.modules, name, mod)
        cc(cap)
        return calls
    return install


@pytest.mark.parametrize("one_alpha", [False, True], ids=["alpha-per-expert", "one-alpha"])
@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("t, e, dt", [(1, 4, BF16), (37, 5, FP16), (300, 3, torch.float32)])
def test_cudnn_grouped_computes_the_hostile_case_exactly(cudnn_grouped, t, e, dt, seed, one_alpha):
    from fp4dispatch.backends.flashinfer_cudnn_grouped import FlashInferCudnnGroupedBackend
    from fp4dispatch.problem import GroupedOperands

    calls = cudnn_grouped(120)
    b = FlashInferCudnnGroupedBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    problem, case = _case(t, e, 128, 256, seed, dt)
    assert b.unsupported(problem) is None
    ops = case.ops
    if one_alpha:  # the reference of one alpha for every expert
        ops = GroupedOperands(*ops[:4], ops.alpha[:1].clone(), ops.out, ops.offs)
        case.ref = reference_mm(problem, ops)
    b.run(problem, ops, {})
    assert check_output(ops.out, case.ref, problem) is None
    finite = torch.isfinite(case.ref)
    torch.testing.assert_close(ops.out.float()[finite], case.ref.to(dt).float()[finite], rtol=2 ** -7,
                               atol=1e-3 * float(case.ref[finite].abs().max()))
    assert calls == [{"alpha": (1,), "out_dtype": dt} if one_alpha else {"alpha": None, "out_dtype": torch.float32}]


def test_cudnn_grouped_reasons(cudnn_grouped, monkeypatch, cc):
    from fp4dispatch.backends.flashinfer_cudnn_grouped import FlashInferCudnnGroupedBackend

    b = FlashInferCudnnGroupedBackend()
    assert b.unavailable(CPU) == "needs CUDA (cuDNN's grouped GEMM runs on NVIDIA GPUs only)"
    cudnn_grouped(90)
    assert b.unavailable(torch.device("cuda", 0)) == "FlashInfer's grouped_mm_fp4 (cuDNN) does not support SM90"
    cudnn_grouped(120, cudnn_error="cuDNN grouped_mm_fp4 requires backend version >= 92200, found 91000.")
    assert b.unavailable(torch.device("cuda", 0)) == ("cudnn: RuntimeError: cuDNN grouped_mm_fp4 requires backend "
                                                      "version >= 92200, found 91000.")
    assert b.unsupported(Problem(4, 128, 192, BF16, CPU, torch.uint8, 2)) == (
        "cuDNN's grouped GEMM (whole 128-row scale tiles) needs N % 128 == 0 and K % 128 == 0; K=192 is not a "
        "multiple of 128 (not padded: the triton/reference backends take any N, K multiple of 16)")
    assert "flashinfer:cudnn_grouped" in names()


def test_cudnn_grouped_wrong_adapters_are_caught(cudnn_grouped):
    from fp4dispatch.backends.flashinfer_cudnn_grouped import FlashInferCudnnGroupedBackend
    from fp4dispatch.format_grouped import grouped_scale_rows

    class Unaligned(FlashInferCudnnGroupedBackend):
        """Passes the rows as they are, with offs as the segment table."""

        def run(self, problem, ops, config):
            fn = self._function(self._lib or self._load())
            rows = grouped_scale_rows(problem.m, problem.experts)
            a = ops.a.new_zeros((rows, problem.k // 2))
            a[:problem.m] = ops.a
            fn(a, ops.b, ops.a_scale[:rows], ops.b_scale.reshape(problem.experts, -1, problem.k // 16),
               torch.cat((ops.offs.new_zeros(1), ops.offs)), alpha=ops.alpha[:1], out_dtype=problem.out_dtype)

    class AlphaPerExpert(FlashInferCudnnGroupedBackend):
        """Passes the per-expert alpha to a call that takes one."""

        def run(self, problem, ops, config):
            from fp4dispatch.format_grouped import padded_rows, scale_starts

            fn = self._function(self._lib or self._load())
            rows = grouped_scale_rows(problem.m, problem.experts)
            a = ops.a.new_zeros((rows, problem.k // 2)).index_copy_(0, padded_rows(ops.offs, problem.m), ops.a)
            fn(a, ops.b, ops.a_scale[:rows], ops.b_scale.reshape(problem.experts, -1, problem.k // 16),
               scale_starts(ops.offs).to(torch.int32), alpha=ops.alpha, out_dtype=problem.out_dtype)

    cudnn_grouped(100)
    problem, case = _case(37, 5, 128, 256, 0)
    with pytest.raises(fakes.ContractError, match="segments must be multiples of 128 rows"):
        Unaligned().run(problem, case.ops, {})
    with pytest.raises(fakes.ContractError, match=r"alpha must be a scalar, got \(5,\)"):
        AlphaPerExpert().run(problem, case.ops, {})
