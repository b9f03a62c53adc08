"""``sgl_kernel:cutlass_group`` (sgl-kernel's CUTLASS NVFP4 grouped GEMM) on CPU tensors against its contract emulator
(tests/_sgl_grouped_fakes.py): both call forms, the exact result on the dispatcher's hostile inputs, wrong adapters
caught, and its reasons."""
from __future__ import annotations

import sys

import pytest
import torch

import _native_fakes as fakes
import _sgl_grouped_fakes as sfakes
from fp4dispatch.backends import names
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.backends.sgl_kernel_grouped import SglKernelGroupedBackend, group_params
from fp4dispatch.dispatch.verify import check_output, make_case
from fp4dispatch.problem import Problem

CPU = torch.device("cpu")
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture
def sgl(monkeypatch, cc):
    def install(cap: int = 100, with_device: bool = True):
        mod = sfakes.fake_sgl_kernel_grouped(with_device)
        monkeypatch.setitem(sys.modules, "sgl_kernel", mod)
        cc(cap)
        return mod
    return install


@pytest.mark.parametrize("with_device", [True, False], ids=["sgl-kernel-0.3.21", "sglang-jit"])
@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("t, e, dt", [(1, 4, BF16), (37, 5, FP16), (300, 3, BF16)])
def test_the_adapter_computes_the_hostile_case_exactly(sgl, t, e, dt, seed, with_device):
    mod = sgl(100, with_device)
    b = SglKernelGroupedBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    problem = Problem(t, 96, 160, dt, CPU, torch.uint8, e)
    assert b.unsupported(problem) is None
    case = make_case(problem, seed, reference_mm)
    b.run(problem, case.ops, {})
    assert check_output(case.ops.out, case.ref, problem) is None
    finite = torch.isfinite(case.ref)
    torch.testing.assert_close(case.ops.out.float()[finite], case.ref.to(dt).float()[finite], rtol=2 ** -7,
                               atol=1e-3 * float(case.ref[finite].abs().max()))
    assert mod.calls == [dt]


def test_group_params_follow_sglangs_test():
    p = group_params(torch.tensor([33, 50, 50, 127], dtype=torch.int32), 256, 128)
    assert p["expert_offsets"].tolist() == [0, 33, 50, 50]
    assert p["blockscale_offsets"].tolist() == [0, 128, 256, 256]
    assert p["problem_sizes"].tolist() == [[33, 256, 128], [17, 256, 128], [0, 256, 128], [77, 256, 128]]
    assert p["ab_strides"].tolist() == [128] * 4 and p["c_strides"].tolist() == [256] * 4
    assert p["problem_sizes"].dtype == torch.int32 and p["ab_strides"].dtype == torch.int64


class _PackedStrides(SglKernelGroupedBackend):
    """Gives K/2 (the packed row's bytes) as the A/B stride."""

    def run(self, problem, ops, config):
        fn = getattr(self._lib or self._load(), self.function)
        params = group_params(ops.offs, problem.n, problem.k)
        params["ab_strides"] = params["ab_strides"] // 2
        ops.out.copy_(fn(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha.expand(problem.experts).contiguous(),
                         problem.out_dtype, ops.a.device, params))


class _EndOffsets(SglKernelGroupedBackend):
    """Passes offs (end rows) as expert_offsets, which want each expert's first row."""

    def run(self, problem, ops, config):
        fn = getattr(self._lib or self._load(), self.function)
        params = group_params(ops.offs, problem.n, problem.k)
        params["expert_offsets"] = ops.offs.clone()
        ops.out.copy_(fn(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha.expand(problem.experts).contiguous(),
                         problem.out_dtype, ops.a.device, params))


def test_wrong_adapters_are_caught(sgl):
    sgl(100)
    problem = Problem(37, 96, 160, BF16, CPU, torch.uint8, 5)
    case = make_case(problem, 0, reference_mm)
    with pytest.raises(fakes.ContractError, match=r"ab_strides: int64 \[160\]\*E"):
        _PackedStrides().run(problem, case.ops, {})
    with pytest.raises(fakes.ContractError, match="run past a / a_blockscale"):
        _EndOffsets().run(problem, case.ops, {})


def test_reasons(sgl, monkeypatch, cc):
    b = SglKernelGroupedBackend()
    assert b.unavailable(CPU) == "needs CUDA (sgl-kernel's CUTLASS FP4 GEMM runs on SM100/SM120 GPUs only)"
    sgl(90)
    assert b.unavailable(torch.device("cuda", 0)) == ("sgl_kernel's cutlass_fp4_group_mm ships sm_100a/sm_120a "
                                                      "kernels only; this is SM90")
    mod = sfakes.fake_sgl_kernel_grouped()
    del mod.cutlass_fp4_group_mm
    monkeypatch.setitem(sys.modules, "sgl_kernel", mod)
    cc(100)
    assert b.unavailable(torch.device("cuda", 0)).startswith("sgl_kernel has no cutlass_fp4_group_mm (")
    assert b.unsupported(Problem(4, 96, 160, torch.float32, CPU, torch.uint8, 2)) == (
        "sgl_kernel's cutlass_fp4_group_mm writes bfloat16/float16 only; got out_dtype=torch.float32")
    assert "N=40 is not a multiple of 32" in b.unsupported(Problem(4, 40, 160, BF16, CPU, torch.uint8, 2))
    assert "sgl_kernel:cutlass_group" in names() and b.ops == ("grouped",)
