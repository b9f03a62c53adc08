"""``flashinfer:bf16_fp4`` (``w4a16_mm`` through FlashInfer's ``mm_bf16_fp4``) on CPU, against the contract emulator
(tests/_flashinfer_w4a16_fakes.py, ``FakeMmBf16Fp4``): the adapter must prepare the weight with FlashInfer's own
``prepare_bf16_fp4_weights`` once per weight and backend, call ``mm_bf16_fp4`` as FlashInfer's tests do, and pass the
dispatcher's own hostile check (``check_run``) on every backend and GPU family it offers. Deliberately wrong adapters
must be caught; availability and per-problem reasons are pinned. The real library runs on SM100+ GPUs only."""
from __future__ import annotations

import gc
import pickle
import re
import sys

import pytest
import torch

import _flashinfer_w4a16_fakes as fakes
import _native_fakes
from fp4dispatch.backends import default_backends, names
from fp4dispatch.backends.flashinfer_bf16_fp4 import MM_BACKENDS, FlashInferBf16Fp4Backend
from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.verify import check_output, check_run, make_case
from fp4dispatch.format import unswizzle_scales
from fp4dispatch.problem import Problem

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NOT_PADDED = " (not padded: the triton/reference backends take any N, K multiple of 16)"


@pytest.fixture
def fi(monkeypatch):
    def install(cap: int, **kw) -> fakes.FakeMmBf16Fp4:
        for name, mod in fakes.fake_flashinfer_bf16_fp4(cap, **kw).items():
            monkeypatch.setitem(sys.modules, name, mod)
        return sys.modules["flashinfer"].fake
    return install


def _ready(cc, fi, cap: int, **kw):
    cc(cap)
    fake = fi(cap, **kw)
    backend = FlashInferBf16Fp4Backend()
    assert backend.unavailable(CUDA) is None
    return backend, fake


# ---------------------------------------------------------------------------------------------------------------
# the right call, the right result: the dispatcher's own check (hostile alpha, zero / subnormal / NaN scales)
# ---------------------------------------------------------------------------------------------------------------
CASES = [  # capability, FlashInfer backend, M, N, K, out dtype
    (100, "cudnn", 3, 256, 512, BF16), (120, "cudnn", 130, 96, 160, FP16), (110, "cudnn", 1, 32, 32, BF16),
    (100, "cute-dsl", 48, 40, 96, BF16),  # N % 8 only: out (rows 1..M of the check's frame) is not 32-byte aligned
    (103, "cute-dsl", 1, 256, 512, BF16), (107, "cute-dsl", 300, 136, 288, BF16),
    (120, "cute-dsl", 3, 128, 512, BF16), (121, "cute-dsl", 300, 192, 320, BF16),
]


@pytest.mark.parametrize("cap, name, m, n, k, dt", CASES, ids=[f"{c[1]}-sm{c[0]}-m{c[2]}" for c in CASES])
def test_adapter_passes_the_dispatchers_check(cc, fi, cap, name, m, n, k, dt):
    backend, fake = _ready(cc, fi, cap)
    problem = Problem(m, n, k, dt, CPU, BF16)
    assert backend.unsupported(problem) is None and {"backend": name} in backend.configs(problem)
    case = make_case(problem, m + n, reference_mm)
    assert check_run(backend, case, {"backend": name}) is None
    assert fake.calls == [{"backend": name, "skip_check": False}] and fake.prepares == [name]
    # the same shape class again: FlashInfer's decorator checks are skipped, the weight is not prepared again
    assert check_run(backend, case, {"backend": name}) is None
    assert fake.calls[-1] == {"backend": name, "skip_check": True} and fake.prepares == [name]


def test_configs_are_the_flashinfer_backends_that_take_the_problem(cc, fi):
    backend, _ = _ready(cc, fi, 100)
    assert backend.configs(Problem(7, 256, 512, BF16, CPU, BF16)) == [{"backend": b} for b in MM_BACKENDS]
    assert backend.configs(Problem(7, 256, 512, FP16, CPU, BF16)) == [{"backend": "cudnn"}]  # SM100 cute-dsl: bf16
    assert backend.configs(Problem(7, 40, 96, BF16, CPU, BF16)) == [{"backend": "cute-dsl"}]  # N % 8 only
    backend, _ = _ready(cc, fi, 120)
    assert backend.configs(Problem(7, 128, 96, BF16, CPU, BF16)) == [{"backend": "cudnn"}]  # SM12x cute-dsl: K % 64


def test_fp16_activations_are_refused_as_flashinfer_refuses_them(cc, fi):
    """mm_bf16_fp4 takes bf16 activations only; an adapter that ignored its own rule would fail FlashInfer's check."""
    backend, _ = _ready(cc, fi, 100)
    problem = Problem(4, 256, 512, FP16, CPU, FP16)
    assert backend.unsupported(problem) == (
        "FlashInfer mm_bf16_fp4 takes bfloat16 activations only (fp16 is not implemented: its common check raises "
        "TypeError); got a_dtype=torch.float16")
    kind, why = check_run(backend, make_case(problem, 1, reference_mm), {"backend": "cudnn"})
    assert kind == "failed" and why.startswith("ContractTypeError: a must be bfloat16; got torch.float16."), why


def test_a_misaligned_alpha_is_copied_for_the_sm100_kernel(cc, fi):
    backend, _ = _ready(cc, fi, 100)
    problem = Problem(5, 256, 512, BF16, CPU, BF16)
    case = make_case(problem, 2, reference_mm)
    alpha = torch.empty(5, dtype=FP32)[1:2].copy_(case.ops.alpha)
    assert alpha.data_ptr() % 16 != 0
    case.ops = case.ops._replace(alpha=alpha)
    assert check_run(backend, case, {"backend": "cute-dsl"}) is None

    class KeepsAlpha(FlashInferBf16Fp4Backend):
        def epilogue_alpha(self, ops, align):
            return ops.alpha

    kind, why = check_run(KeepsAlpha(), case, {"backend": "cute-dsl"})
    assert kind == "failed" and "requires a 16-byte aligned alpha" in why


def test_a_misaligned_out_goes_through_an_aligned_copy(cc, fi, monkeypatch):
    """N = 40: rows 1..M of the check's frame start 80 bytes in, off the SM100 kernel's 32-byte alignment."""
    import fp4dispatch.backends.flashinfer_bf16_fp4 as mod

    backend, _ = _ready(cc, fi, 100)
    case = make_case(Problem(48, 40, 96, BF16, CPU, BF16), 8, reference_mm)
    assert case.ops.out.data_ptr() % 32 != 0
    assert check_run(backend, case, {"backend": "cute-dsl"}) is None
    monkeypatch.setattr(mod, "_alignments", lambda backend, cc: (1, 1, 1))  # an adapter that ignores alignment
    kind, why = check_run(backend, case, {"backend": "cute-dsl"})
    assert kind == "failed" and "requires a 32-byte aligned out" in why


def test_w4a16_mm_runs_through_flashinfer_end_to_end(cc, fi, tmp_path):
    _, fake = _ready(cc, fi, 120)
    d = Dispatcher([FlashInferBf16Fp4Backend()], cache_dir=tmp_path)
    problem = Problem(4, 128, 256, BF16, CPU, BF16)
    case = make_case(problem, 5, reference_mm)
    out = d.w4a16_mm(case.ops.a, case.ops.b, case.ops.b_scale, case.ops.alpha)
    assert check_output(out, case.ref, problem) is None
    assert {r.name: r.status for r in d.report(CPU)}["flashinfer:bf16_fp4"] == "ok" and fake.calls


# ---------------------------------------------------------------------------------------------------------------
# the weight is prepared once per weight and backend, never served stale, never kept alive by the cache
# ---------------------------------------------------------------------------------------------------------------
def test_each_weight_is_prepared_once_per_backend_and_notices_changes(cc, fi):
    backend, fake = _ready(cc, fi, 100)
    problem = Problem(5, 256, 512, BF16, CPU, BF16)
    case = make_case(problem, 3, reference_mm)
    for _ in range(3):
        assert check_run(backend, case, {"backend": "cudnn"}) is None
    assert (backend.prepared.misses, backend.prepared.hits, fake.prepares) == (1, 2, ["cudnn"])
    assert check_run(backend, case, {"backend": "cute-dsl"}) is None
    assert (backend.prepared.misses, len(backend.prepared)) == (2, 2)
    # cudnn's prepared b and SM100 cute-dsl's scale view alias the caller's tensors: only their view is kept
    assert backend.prepared.nbytes == 256 * 32  # the unswizzled cudnn scales, nothing else
    ops = case.ops
    ops.b[:7] ^= 0x11  # an in-place change: the version counter moves, the weight is prepared again
    backend.run(problem, ops, {"backend": "cudnn"})
    assert backend.prepared.misses == 3
    assert check_output(ops.out, reference_mm(problem, ops), problem) is None


@pytest.mark.parametrize("cap, name", [(100, "cudnn"), (103, "cute-dsl"), (120, "cute-dsl")])
def test_a_freed_weight_drops_its_prepared_copy(cc, fi, cap, name):
    backend, _ = _ready(cc, fi, cap)
    case = make_case(Problem(3, 128, 256, BF16, CPU, BF16), 4, reference_mm)
    assert check_run(backend, case, {"backend": name}) is None and len(backend.prepared) == 1
    del case
    gc.collect()
    assert len(backend.prepared) == 0 and backend.prepared.nbytes == 0


def test_the_backend_pickles_for_probe_workers(cc, fi):
    backend, _ = _ready(cc, fi, 120)
    case = make_case(Problem(2, 128, 256, BF16, CPU, BF16), 0, reference_mm)
    assert check_run(backend, case, {"backend": "cudnn"}) is None
    clone = pickle.loads(pickle.dumps(backend))
    assert clone._lib is None and len(clone.prepared) == 0 and not clone._checked and len(backend.prepared) == 1
    assert clone.unavailable(CUDA) is None and check_run(clone, case, {"backend": "cute-dsl"}) is None


# ---------------------------------------------------------------------------------------------------------------
# deliberately wrong adapters are caught
# ---------------------------------------------------------------------------------------------------------------
class _TransposedWeight(FlashInferBf16Fp4Backend):
    def weight(self, ops):
        return super().weight(ops).T.contiguous()  # [K/2, N]: the same shape when N == K/2


class _NibblesSwapped(FlashInferBf16Fp4Backend):
    def weight(self, ops):
        w = super().weight(ops)
        return ((w << 4) | (w >> 4)).to(torch.uint8)


class _LinearScalesAsSwizzled(FlashInferBf16Fp4Backend):
    def weight_scale(self, ops):  # unswizzled first: FlashInfer unswizzles again
        return unswizzle_scales(ops.b_scale, ops.b.shape[0], ops.b.shape[1] // 8).contiguous()


class _SwizzledAsLinear(FlashInferBf16Fp4Backend):
    def prepare(self, ops, backend):  # cudnn wants row-major scales: the swizzled ones skip FlashInfer's unswizzle
        return super().prepare(ops, backend)[0], ops.b_scale


class _TransposedScales(FlashInferBf16Fp4Backend):
    def prepare(self, ops, backend):
        b_p, sf_p = super().prepare(ops, backend)
        return b_p, sf_p.T.contiguous()


class _AlphaTwice(FlashInferBf16Fp4Backend):
    def activations(self, problem, ops):
        return (ops.a.float() * ops.alpha.float()).to(ops.a.dtype)


class _AlphaInverted(FlashInferBf16Fp4Backend):
    def epilogue_alpha(self, ops, align):
        return 1.0 / super().epilogue_alpha(ops, align)


class _FlatScalesOnSm100(FlashInferBf16Fp4Backend):
    def prepare(self, ops, backend):  # the 2-D swizzled buffer instead of the 6-D MMA view
        return super().prepare(ops, backend)[0], ops.b_scale


class _UnpreparedOnSm12x(FlashInferBf16Fp4Backend):
    def prepare(self, ops, backend):
        return ops.b, ops.b_scale


WRONG = [  # adapter, capability, backend, verdict, reason (regex) or None for any wrong value
    (_TransposedWeight, 100, "cudnn", "incorrect", None),
    (_TransposedWeight, 120, "cute-dsl", "incorrect", None),
    (_NibblesSwapped, 103, "cute-dsl", "incorrect", None),
    (_LinearScalesAsSwizzled, 100, "cudnn", "incorrect", None),
    (_SwizzledAsLinear, 100, "cudnn", "incorrect", None),
    (_TransposedScales, 120, "cudnn", "failed", r"b_descale must be the row-major e4m3 \(N, K/16\)"),
    (_AlphaTwice, 100, "cudnn", "incorrect", None),
    (_AlphaInverted, 121, "cute-dsl", "incorrect", None),
    (_FlatScalesOnSm100, 100, "cute-dsl", "failed", r"b_descale must be the 6-D MMA view"),
    (_UnpreparedOnSm12x, 120, "cute-dsl", "failed", r"cute-dsl bf16 x fp4 on SM120 expects the torch.int32 weight"),
]


@pytest.mark.parametrize("cls, cap, name, verdict, match", WRONG,
                         ids=[f"{w[0].__name__.strip('_')}-{w[2]}-sm{w[1]}" for w in WRONG])
def test_wrong_adapters_are_caught(cc, fi, cls, cap, name, verdict, match):
    """N = K/2 = 256 and N % 128 == K/16 % 4 == 0: a transposed weight and swizzled scales have the shapes of the
    right ones, so for most mistakes only the result shows; |alpha| is far from 1, so an inverted alpha shows too."""
    cc(cap)
    fi(cap)
    problem = Problem(130, 256, 512, BF16, CPU, BF16)
    case = make_case(problem, 11, reference_mm)
    assert abs(abs(float(case.ops.alpha)) - 1) > 0.05
    backend = cls()
    assert backend.unavailable(CUDA) is None
    got = check_run(backend, case, {"backend": name})
    assert got is not None and got[0] == verdict, got
    if match:
        assert re.search(match, got[1]), got


# ---------------------------------------------------------------------------------------------------------------
# availability and per-problem reasons
# ---------------------------------------------------------------------------------------------------------------
def test_needs_cuda(cc):
    cc(None)
    assert FlashInferBf16Fp4Backend().unavailable(CPU) == "needs CUDA (FlashInfer mm_bf16_fp4 runs on NVIDIA GPUs only)"


def test_flashinfer_not_installed(cc, monkeypatch):
    cc(100)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert FlashInferBf16Fp4Backend().unavailable(CUDA) == \
        "flashinfer is not installed (pip install fp4dispatch[flashinfer])"


def test_a_flashinfer_without_mm_bf16_fp4(cc, monkeypatch):
    cc(100)
    # mm_fp4 only
    monkeypatch.setitem(sys.modules, "flashinfer", _native_fakes.fake_flashinfer(100, version="0.6.13"))
    assert FlashInferBf16Fp4Backend().unavailable(CUDA) == (
        "flashinfer 0.6.13 has no mm_bf16_fp4/prepare_bf16_fp4_weights (fp4dispatch's flashinfer:bf16_fp4 is written "
        "against flashinfer 0.7.4)")


def test_sm90_is_refused_in_flashinfers_words(cc, fi):
    cc(90)
    fake = fi(90)
    assert FlashInferBf16Fp4Backend().unavailable(CUDA) == \
        "BackendSupportedError: mm_bf16_fp4 does not support backend 'cudnn' or 'cute-dsl' with capability 90"
    a = torch.zeros(1, 32, dtype=BF16)
    for name in MM_BACKENDS:  # what FlashInfer itself raises there
        with pytest.raises(fakes.BackendSupportedError, match=f"does not support backend '{name}' with capability 90"):
            fake(a, torch.zeros(32, 16, dtype=torch.uint8), torch.zeros(128, 4), backend=name)


def test_sm110_without_a_recent_cudnn_has_no_backend(cc, fi):
    cc(110)
    fake = fi(110, cudnn_backend=91002)
    assert FlashInferBf16Fp4Backend().unavailable(CUDA) == (
        "cudnn: mm_bf16_fp4 needs cuDNN backend version >= 92301; found 91002; cute-dsl: prepare_bf16_fp4_weights has "
        "no cute-dsl layout for SM110 (NotImplementedError: SM100/103/107 and SM12x only)")
    with pytest.raises(NotImplementedError, match="only supports SM100/103/107 and SM12x; got 11.0"):
        fake.prepare(torch.zeros(128, 64, dtype=torch.uint8), torch.zeros(128, 8), backend="cute-dsl")


def test_a_missing_library_part_leaves_the_other_backend(cc, fi):
    cc(120)
    fi(120, dsl_error="CuTe DSL is not available.")
    backend = FlashInferBf16Fp4Backend()
    assert backend.unavailable(CUDA) is None
    assert backend.configs(Problem(3, 128, 512, BF16, CPU, BF16)) == [{"backend": "cudnn"}]
    cc(100)
    fi(100, cudnn_error="cuDNN is not available. Please install cuDNN", dsl_error="CuTe DSL is not available.")
    assert FlashInferBf16Fp4Backend().unavailable(CUDA) == (
        "cudnn: RuntimeError: cuDNN is not available. Please install cuDNN; cute-dsl: ValueError: CuTe DSL is not "
        "available. (pip install nvidia-cutlass-dsl)")


@pytest.mark.parametrize("cap, problem, want", [
    (100, Problem(4, 256, 512, FP32, CPU, BF16),
     "FlashInfer mm_bf16_fp4 writes bfloat16/float16 only; got out_dtype=torch.float32"),
    (100, Problem(4, 256, 512, BF16, CPU),
     "FlashInfer mm_bf16_fp4 serves w4a16_mm only (16-bit activations); got fp4_mm"),
    (100, Problem(4, 40, 96, FP16, CPU, BF16),
     "cudnn (fp4dispatch's FP4 rule) needs N % 32 == 0 and K % 32 == 0; N=40 is not a multiple of 32" + NOT_PADDED
     + "; cute-dsl on SM100 writes bfloat16 only; got out_dtype=torch.float16"),
    (120, Problem(4, 192, 80, BF16, CPU, BF16),
     "cudnn (fp4dispatch's FP4 rule) needs N % 32 == 0 and K % 32 == 0; K=80 is not a multiple of 32" + NOT_PADDED
     + "; cute-dsl on SM120 (64-column weight tiles) needs N % 64 == 0 and K % 64 == 0; K=80 is not a multiple of 64"
     + NOT_PADDED),
    (103, Problem(4, 36, 64, BF16, CPU, BF16),
     "cudnn (fp4dispatch's FP4 rule) needs N % 32 == 0 and K % 32 == 0; N=36 is not a multiple of 32" + NOT_PADDED
     + "; cute-dsl on SM103 (its kernel's can_implement) needs N % 8 == 0 and K % 32 == 0; N=36 is not a multiple "
     "of 8" + NOT_PADDED),
], ids=["fp32-out", "fp4_mm", "sm100-n40-fp16", "sm120-k80", "sm103-n36"])
def test_unsupported_reasons(cc, fi, cap, problem, want):
    cc(cap)
    fi(cap)
    backend = FlashInferBf16Fp4Backend()
    assert backend.unavailable(CUDA) is None
    assert backend.unsupported(problem) == want


# ---------------------------------------------------------------------------------------------------------------
# the registry, and the emulator's own layouts
# ---------------------------------------------------------------------------------------------------------------
def test_registered_after_the_experimental_flashinfer_backend():
    order = names()
    assert order.index("flashinfer:bf16_fp4") == order.index("flashinfer:cake") + 1
    b = next(b for b in default_backends() if b.name == "flashinfer:bf16_fp4")
    assert isinstance(b, FlashInferBf16Fp4Backend)
    assert (b.ops, b.fp4_tensor_cores, b.risky) == (("w4a16",), False, True) and b.probe_timeout_s >= 60


def test_the_emulators_layouts_round_trip():
    """The SM12x weight repack is a permutation FlashInfer's reference inverts, and S0E5M3 holds every
    non-negative e4m3 scale (NaN included) exactly: the emulator decodes what FlashInfer's preparation made."""
    b = torch.randint(0, 256, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = fakes.pack_sm12x(b)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (8, 256)
    assert torch.equal(fakes.unpack_sm12x(packed), b) and not torch.equal(packed.view(torch.uint8).reshape(-1),
                                                                         b.T.contiguous().reshape(-1))
    e4m3 = torch.arange(128, dtype=torch.uint8)
    want = e4m3.view(torch.float8_e4m3fn).double()
    got = fakes.from_s0e5m3(fakes.to_s0e5m3(e4m3))
    assert torch.equal(got[:-1], want[:-1]) and bool(got[-1].isnan()) and bool(want[-1].isnan())
