"""Correctness check of a backend's output against the exact reference, and the probe problems."""
from __future__ import annotations

import torch

from .problem import Problem

__all__ = ["check_output", "REL_TOL", "PROBE_MS", "PROBE_N", "PROBE_K", "poison"]

REL_TOL = 1e-2
# Probe shapes: several M including non-powers of two; N and K fit every native kernel's alignment rules
# (N, K multiples of 64; M spans small-M tiles and several 128-row tiles).
PROBE_MS = (1, 3, 128, 300)
PROBE_N = 256
PROBE_K = 512


def poison(out: torch.Tensor) -> None:
    """Fill out with NaN so that an element a backend does not write cannot pass the check."""
    out.fill_(float("nan"))


def check_output(out: torch.Tensor, ref: torch.Tensor, problem: Problem) -> str | None:
    """None if ``out`` matches ``ref`` (float32), else the reason, e.g. ``all zeros at M=300``.

    Rules: no NaN/Inf where the reference is finite (this also catches unwritten elements of a NaN-poisoned out),
    not all zeros when the reference is not, relative Frobenius error <= 1e-2.
    """
    o = out.float()
    ref = ref.to(out.dtype).float()  # an overflow of the out dtype that the exact result also has is correct
    finite = torch.isfinite(ref)
    bad = (~torch.isfinite(o)) & finite
    nbad = int(bad.sum())
    at = f"at M={problem.m} (N={problem.n}, K={problem.k})"
    if nbad:
        rows = torch.nonzero(bad.any(dim=1)).flatten()[:5].tolist()
        return f"{nbad} NaN/Inf or unwritten elements where the reference is finite (rows {rows}...) {at}"
    r = ref[finite]
    x = o[finite]
    ref_norm = float(torch.linalg.vector_norm(r.double()))
    if ref_norm > 0 and not bool((x != 0).any()):
        return f"all zeros {at}"
    err = float(torch.linalg.vector_norm((x - r).double()))
    rel = err / ref_norm if ref_norm > 0 else err
    if rel > REL_TOL:
        return f"relative error {rel:.3g} > {REL_TOL:g} {at}"
    return None
