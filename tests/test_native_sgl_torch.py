"""sgl-kernel and torch._scaled_mm backends on CPU against their contract emulators (tests/_native_fakes.py), and the
CPU report of every native backend. FlashInfer's adapters: test_native_backends.py."""
from __future__ import annotations

import sys

import pytest
import torch

import _native_fakes as fakes
import _native_helpers as helpers
from fp4dispatch.backends import names
from fp4dispatch.backends.flashinfer import BACKENDS
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.backends.sgl_kernel import SglKernelBackend
from fp4dispatch.backends.torch_scaled_grouped_mm import TorchScaledGroupedMmBackend
from fp4dispatch.backends.torch_scaled_mm import TorchScaledMmBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands

CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NATIVE = [f"flashinfer:{b}" for b in BACKENDS] + ["sgl_kernel:cutlass", "torch:scaled_mm", "torch:scaled_grouped_mm"]


# ---------------------------------------------------------------------------------------------------------------
# sgl-kernel
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cap, dt", [(100, BF16), (100, FP32), (120, FP16), (120, BF16)])
def test_sgl_kernel_adapter_matches_reference(cc, monkeypatch, cap, dt):
    cc(cap)
    sk = fakes.fake_sgl_kernel(cap)
    monkeypatch.setitem(sys.modules, "sgl_kernel", sk)
    b = SglKernelBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    _, ops, ref = helpers.run_backend(b, 130, 96, 160, dt)
    helpers.assert_equals_reference(ops, ref)
    assert sk.calls == [dt]


@pytest.mark.parametrize("wrong_b, match", [
    pytest.param(lambda b: b.T, r"a and b must be contiguous", id="b.T-view"),
    pytest.param(lambda b: b.T.contiguous(), r"b must be \[N, K/2\] \(not transposed\)", id="b.T-copied"),
])
def test_sgl_kernel_wrong_layout_is_rejected(cc, monkeypatch, wrong_b, match):
    class PassesBT(SglKernelBackend):
        def run(self, problem, ops, config):
            sk = self._lib or self._load()
            ops.out.copy_(sk.cutlass_scaled_fp4_mm(ops.a, wrong_b(ops.b), ops.a_scale, ops.b_scale, ops.alpha,
                                                   problem.out_dtype))

    cc(100)
    monkeypatch.setitem(sys.modules, "sgl_kernel", fakes.fake_sgl_kernel(100))
    problem = Problem(3, 128, 512, BF16, CPU)
    with pytest.raises(fakes.ContractError, match=match):
        PassesBT().run(problem, make_operands(problem), {})


def test_sgl_kernel_reasons(cc, monkeypatch, tmp_path):
    b = SglKernelBackend()
    cuda = torch.device("cuda", 0)
    assert b.unavailable(CPU) == "needs CUDA (sgl-kernel's CUTLASS FP4 GEMM runs on SM100/SM120 GPUs only)"
    cc(120)
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)
    assert b.unavailable(cuda) == ("sgl_kernel is not installed (pip install fp4dispatch[sgl], i.e. "
                                   "sgl-kernel==0.3.21, which needs torch==2.9.1)")
    # a wheel built against another torch: the import itself fails with an undefined symbol
    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise OSError('common_ops.abi3.so: undefined symbol: _ZNK2at10TensorBase14const_data_ptrIiTnNSt9enable_ifIXntsr3stdE10is_const_vIT_EEiE4typeELi0EEEPKS3_v')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sgl_kernel")
    why = b.unavailable(cuda)
    assert why.startswith("sgl_kernel import failed: OSError: common_ops.abi3.so: undefined symbol: _ZNK2at10Tensor")
    assert why.endswith(f"(sgl-kernel wheels are built against one torch; this is torch {torch.__version__})")
    # sglang-kernel >= 0.4.1 imports fine but has no fp4 GEMM
    import types

    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    assert b.unavailable(cuda).startswith("sgl_kernel has no cutlass_scaled_fp4_mm (")
    assert b.unavailable(cuda).endswith("sglang-kernel >= 0.4.1 dropped it; only sgl-kernel==0.3.21 has it)")
    monkeypatch.setitem(sys.modules, "sgl_kernel", fakes.fake_sgl_kernel(103))
    cc(103)
    assert b.unavailable(cuda) == "sgl_kernel's cutlass_scaled_fp4_mm ships sm_100a/sm_120a kernels only; this is SM103"
    cc(120)
    assert b.unsupported(Problem(4, 256, 512, FP32, CPU)) == \
        "sgl_kernel writes float32 only on SM100 (SM120 kernels: bf16/fp16); this is SM120"
    assert "K=48 is not a multiple of 32" in b.unsupported(Problem(4, 256, 48, BF16, CPU))


# ---------------------------------------------------------------------------------------------------------------
# torch._scaled_mm / F.scaled_mm
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def scaled_mm_fakes(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch, "_scaled_mm", fakes.fake_scaled_mm(calls))
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", fakes.fake_f_scaled_mm(calls))
    return calls


@pytest.mark.parametrize("dt", [BF16, FP16, FP32])
@pytest.mark.parametrize("api", ["_scaled_mm", "scaled_mm_v2"])
def test_torch_scaled_mm_adapter_matches_reference(cc, scaled_mm_fakes, api, dt):
    cc(100)
    b = TorchScaledMmBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    problem = Problem(130, 96, 160, dt, CPU)
    assert [c["api"] for c in b.configs(problem)] == ["_scaled_mm", "scaled_mm_v2"]
    ops = make_operands(problem, seed=2)
    b.run(problem, ops, {"api": api})
    # _scaled_mm rounds the unscaled product to bf16 before alpha: one extra bf16 rounding
    helpers.assert_equals_reference(ops, reference_mm(problem, ops), rtol=0 if api == "scaled_mm_v2" else 2 ** -7)
    assert scaled_mm_fakes == [api]


def test_torch_scaled_mm_wrong_layout_is_rejected(cc, scaled_mm_fakes):
    class NoTranspose(TorchScaledMmBackend):
        def run(self, problem, ops, config):
            fp4 = torch.float4_e2m1fn_x2
            torch._scaled_mm(ops.a.view(fp4), ops.b.view(fp4), ops.a_scale.reshape(-1), ops.b_scale.reshape(-1),
                             out_dtype=BF16)

    cc(120)
    problem = Problem(3, 256, 512, BF16, CPU)
    with pytest.raises(fakes.ContractError, match=r"mat_b must be B.t\(\), the column-major"):
        NoTranspose().run(problem, make_operands(problem), {"api": "_scaled_mm"})


def test_torch_scaled_mm_reasons(cc):
    b = TorchScaledMmBackend()
    assert b.unavailable(CPU) == "needs CUDA (torch._scaled_mm has no CPU kernel for FP4)"
    cc(90)
    assert b.unavailable(torch.device("cuda", 0)) == \
        "torch._scaled_mm fp4 needs SM100/SM120 (cuBLASLt block-scaled FP4); this is SM90"
    assert "N=48 is not a multiple of 32" in b.unsupported(Problem(4, 48, 512, BF16, CPU))


# ---------------------------------------------------------------------------------------------------------------
# F.scaled_grouped_mm (fp4_grouped_mm)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 3], ids=["empty-expert", "one-expert"])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_torch_scaled_grouped_mm_adapter_matches_reference(cc, monkeypatch, t, seed):
    from fp4dispatch.dispatch.verify import check_output, make_case

    calls: list[str] = []
    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", fakes.fake_f_scaled_grouped_mm(calls))
    cc(100)
    b = TorchScaledGroupedMmBackend()
    assert b.unavailable(torch.device("cuda", 0)) is None
    problem = Problem(t, 96, 160, BF16, CPU, torch.uint8, 5)
    assert b.unsupported(problem) is None
    case = make_case(problem, seed, reference_mm)  # hostile: negative alpha per expert, NaN/zero/subnormal scales
    b.run(problem, case.ops, {})
    assert check_output(case.ops.out, case.ref, problem) is None  # the dispatcher's own check: NaN where it belongs
    finite = torch.isfinite(case.ref)
    assert torch.equal(finite, torch.isfinite(case.ops.out))
    want = case.ref.to(BF16).float()[finite]
    torch.testing.assert_close(case.ops.out.float()[finite], want, rtol=2 ** -7, atol=1e-3 * float(want.abs().max()))
    assert calls == ["scaled_grouped_mm"]


def test_torch_scaled_grouped_mm_wrong_layout_is_rejected(cc, monkeypatch):
    from fp4dispatch.dispatch.verify import make_case

    class Untransposed(TorchScaledGroupedMmBackend):
        def run(self, problem, ops, config):
            F, fp4 = torch.nn.functional, torch.float4_e2m1fn_x2
            st, sw = F.ScalingType, F.SwizzleType
            F.scaled_grouped_mm(ops.a.view(fp4), ops.b.view(fp4), scale_a=[ops.a_scale, ops.alpha],
                                scale_recipe_a=[st.BlockWise1x16, st.TensorWise], scale_b=[ops.b_scale, ops.alpha],
                                scale_recipe_b=[st.BlockWise1x16, st.TensorWise],
                                swizzle_a=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE],
                                swizzle_b=[sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE], offs=ops.offs)

    monkeypatch.setattr(torch.nn.functional, "scaled_grouped_mm", fakes.fake_f_scaled_grouped_mm([]))
    cc(100)
    problem = Problem(9, 96, 160, BF16, CPU, torch.uint8, 4)
    with pytest.raises(fakes.ContractError, match=r"mat_b must be the transposed \[G, K/2, N\] view"):
        Untransposed().run(problem, make_case(problem, 1, reference_mm).ops, {})


def test_torch_scaled_grouped_mm_reasons(cc):
    b = TorchScaledGroupedMmBackend()
    assert b.unavailable(CPU) == "needs CUDA (torch's NVFP4 grouped GEMM has no CPU kernel)"
    cc(120)
    assert b.unavailable(torch.device("cuda", 0)) == ("torch's NVFP4 grouped GEMM (FBGEMM/MSLK f4f4bf16_grouped_mm) "
                                                      "runs on SM100 only; this is SM120")
    assert b.unsupported(Problem(4, 48, 512, FP16, CPU, torch.uint8, 2)) == \
        "torch's NVFP4 grouped GEMM writes bfloat16 only; got out_dtype=torch.float16"
    assert "N=40 is not a multiple of 16" in b.unsupported(Problem(4, 40, 512, BF16, CPU, torch.uint8, 2))


# ---------------------------------------------------------------------------------------------------------------
# the report on a CPU box
# ---------------------------------------------------------------------------------------------------------------
def test_cpu_report_lists_every_backend_with_a_reason(tmp_path):
    recs = {r.name: r for r in Dispatcher(cache_dir=tmp_path).report(CPU)}
    expected = NATIVE + ["reference"] + [n for n in ("triton:fused", "triton:dequant+matmul") if n in names()]
    assert set(expected) <= set(recs)
    assert recs["reference"].status == "ok"
    for name in NATIVE:
        assert recs[name].status == "unavailable" and recs[name].reason.startswith("needs CUDA"), recs[name]
    for r in recs.values():
        assert r.status == "ok" or r.reason.strip(), r
    assert list(recs).index("flashinfer:cake") > list(recs).index("torch:scaled_mm")  # experimental: last native
