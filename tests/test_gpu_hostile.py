"""GPU: every config the Triton backends offer passes the dispatcher's own check (fp4dispatch/dispatch/verify.py):
hostile inputs (negative alpha; a zero, a subnormal and a NaN block scale), NaN-poisoned out inside a guarded
buffer, inputs unchanged. A config that failed it would be rejected when tuning: a silent loss of speed, so each
must pass here. Also: the same call gives the same bits twice (determinism is part of the contract)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the Triton kernels are compiled for the device")

SHAPES = [(m, n, k) for m in (1, 2, 3, 16, 100, 128, 300, 1024) for n, k in ((256, 512), (1000, 2064), (768, 6144))]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_every_triton_config_passes_the_hostile_check(m, n, k):
    from fp4dispatch.backends.reference import reference_mm
    from fp4dispatch.backends.triton_dequant import TritonDequantBackend
    from fp4dispatch.backends.triton_fused import TritonFusedBackend
    from fp4dispatch.backends.base import config_id
    from fp4dispatch.dispatch.verify import check_run, make_case
    from fp4dispatch.problem import Problem

    failed = []
    for out_dtype in (torch.bfloat16, torch.float32):
        problem = Problem(m, n, k, out_dtype, torch.device("cuda"))
        case = make_case(problem, 11 * m + n, reference_mm)
        for backend in (TritonFusedBackend(), TritonDequantBackend()):
            if backend.unavailable(problem.device) or backend.unsupported(problem):
                continue
            for cfg in backend.configs(problem):
                outcome = check_run(backend, case, cfg)
                if outcome is not None:
                    failed.append(f"{backend.name}[{config_id(cfg)}] {out_dtype}: {outcome}")
                    continue
                first = case.ops.out.clone()
                assert check_run(backend, case, cfg) is None
                if not torch.equal(first.view(torch.uint8), case.ops.out.view(torch.uint8)):
                    failed.append(f"{backend.name}[{config_id(cfg)}] {out_dtype}: two runs gave different bits")
    assert not failed, "\n".join(failed)
