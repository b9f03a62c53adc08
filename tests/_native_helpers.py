"""Helpers shared by the native-backend test files: run an adapter on fresh CPU operands and compare it with
fp4dispatch's reference. Kept apart from _native_fakes.py, whose math must not depend on fp4dispatch."""
from __future__ import annotations

import torch

from fp4dispatch.backends.reference import reference_mm
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands


def run_backend(backend, m, n, k, out_dtype, seed=0):
    """Run ``backend`` (its first config) on fresh CPU operands; returns (problem, ops, reference output)."""
    problem = Problem(m, n, k, out_dtype, torch.device("cpu"))
    ops = make_operands(problem, seed=seed)
    assert backend.unsupported(problem) is None
    backend.run(problem, ops, backend.configs(problem)[0])
    return problem, ops, reference_mm(problem, ops)


def assert_equals_reference(ops, ref, rtol=0.0):
    expected = ref.to(ops.out.dtype).float()
    torch.testing.assert_close(ops.out.float(), expected, rtol=rtol, atol=rtol * float(expected.abs().max()))
