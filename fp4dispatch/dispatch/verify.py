"""Proof that a backend computed one problem right, on inputs the dispatcher made itself.

A check hands the backend fresh random operands that hold what real inputs may hold and benign ones do not: a
negative alpha, a zero, a subnormal and a NaN block scale. It then rejects, as data (never an exception):
  * an exception, or a result that differs from the exact reference (relative Frobenius error > 1e-2, all zeros,
    NaN/Inf where the reference is finite, a finite value where the reference is NaN: a NaN scale read as a number);
  * ``out`` replaced, resized or restrided (``out.set_``), and a write outside it: ``out`` is a view into a larger
    buffer whose rows before and after it hold a sentinel that must survive;
  * a change to any input (the backend would corrupt a user's weights): the inputs are compared with pristine
    copies afterwards, and restored for the next candidate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import describe_exception, out_of_memory
from ..format import BLOCK, swizzle_scales
from ..format_grouped import swizzle_expert_scales, swizzle_grouped_scales
from ..problem import GroupedOperands, Operands, Problem
from ..routing import check_routing

__all__ = ["check_output", "REL_TOL", "PROBE_MS", "PROBE_N", "PROBE_K", "poison", "random_operands",
           "random_activations", "random_grouped_operands", "CheckCase", "PROBE_E", "restore_inputs",
           "make_case", "check_run", "reset_cuda_error", "OUT_OF_MEMORY"]

REL_TOL = 1e-2
# check_run's kind (and the start of a trial's reason) for a run that wanted more device memory than was free: the
# process's state at the time, not the backend's fault, so it is never recorded against the backend
OUT_OF_MEMORY = "out of memory"
# Probe shapes: several M including non-powers of two; N and K fit every native kernel's alignment rules
# (N, K multiples of 64; M spans small-M tiles and several 128-row tiles).
PROBE_MS = (1, 3, 128, 300)
PROBE_N = 256
PROBE_K = 512
PROBE_E = 4  # experts of a grouped probe: with a check routing, one of them has no rows
# Guard rows around a checked out: exact in bf16, fp16 and fp32, and no result of the check inputs is exactly it
# by chance often enough to matter (a backend that writes there writes products, not this constant).
SENTINEL = -1021.0
_E4M3_NAN, _E4M3_SUBNORMAL = 0x7F, 0x01


def poison(out: torch.Tensor) -> None:
    """Fill out with NaN so that an element a backend does not write cannot pass the check."""
    out.fill_(float("nan"))


def random_operands(m: int, n: int, k: int, device: torch.device, seed: int, *, hostile: bool = False):
    """Random ``(a, b, a_scale, b_scale, alpha)``: codes of both signs, e4m3 scales in [2^-3, 2^3] (swizzled,
    zero-padded), alpha in [0.5, 1.5). ``hostile``: alpha negative, and block scales that are zero (a's row 0),
    subnormal (b's row 0) and NaN (b's last row, or a's last row when N = 1; none for a 1x1 output, where it would
    leave nothing finite to compare)."""
    dev = torch.device(device)
    # generate where the data will live: large weights made on the CPU and copied cost seconds when tuning
    g = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=g, device=dev)
    b = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g, device=dev)

    sa, sb = _random_scales(g, m, k), _random_scales(g, n, k)
    alpha = 0.5 + torch.rand(1, generator=g, device=dev, dtype=torch.float32)
    if hostile:
        alpha.neg_()
        sa.view(torch.uint8)[0, 0] = 0
        sb.view(torch.uint8)[0, -1] = _E4M3_SUBNORMAL
        if n > 1:
            sb.view(torch.uint8)[n - 1, 0] = _E4M3_NAN
        elif m > 1:
            sa.view(torch.uint8)[m - 1, 0] = _E4M3_NAN
    return a, b, swizzle_scales(sa), swizzle_scales(sb), alpha


def _random_scales(g: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """e4m3 block scales [rows, K/16] in [2^-3, 2^3] with every mantissa value."""
    exps = torch.randint(-3, 4, (rows, k // BLOCK), generator=g, device=g.device).float()
    mant = 1 + torch.randint(0, 8, (rows, k // BLOCK), generator=g, device=g.device).float() / 8
    return (mant * torch.exp2(exps)).to(torch.float8_e4m3fn)


def random_grouped_operands(t: int, e: int, n: int, k: int, device: torch.device, seed: int):
    """Hostile random ``(a, b, a_scale, b_scale, alpha, offs)`` of ``fp4_grouped_mm`` in its canonical layout: a
    check routing (``routing.check_routing``: an expert without rows, or all rows on one expert), a negative alpha
    per expert, a zero block scale (a's row 0), a subnormal one (every expert's row 0) and a NaN one (every expert's
    last row, unless N = 1)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    offs = check_routing(t, e, seed, dev)
    a = torch.randint(0, 256, (t, k // 2), dtype=torch.uint8, generator=g, device=dev)
    b = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g, device=dev)
    sa, sb = _random_scales(g, t, k), _random_scales(g, e * n, k).view(e, n, k // BLOCK)
    alpha = -(0.5 + torch.rand(e, generator=g, device=dev, dtype=torch.float32))
    if t:
        sa.view(torch.uint8)[0, 0] = 0
    sb.view(torch.uint8)[:, 0, -1] = _E4M3_SUBNORMAL
    if n > 1:
        sb.view(torch.uint8)[:, n - 1, 0] = _E4M3_NAN
    return a, b, swizzle_grouped_scales(sa, offs), swizzle_expert_scales(sb), alpha, offs


def random_activations(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """bf16/fp16 [M, K] activations for a ``w4a16`` check: normal values with every mantissa bit in use, each row
    scaled by its own power of two (2^-6..2^4: a kernel that loses range or mantissa bits shows), the first 16 of
    row 0 zero."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g, device=dev) * torch.exp2(torch.randint(-6, 5, (m, 1), generator=g, device=dev))
    x[0, :BLOCK] = 0
    return x.to(dtype)


def check_output(out: torch.Tensor, ref: torch.Tensor, problem: Problem) -> str | None:
    """None if ``out`` matches ``ref`` (float32), else the reason, e.g. ``all zeros at M=300``.

    Rules: no NaN/Inf where the reference is finite (this also catches unwritten elements of a NaN-poisoned out),
    NaN wherever the reference has NaN (a NaN block scale), not all zeros when the reference is not, relative
    Frobenius error <= 1e-2.
    """
    o = out.float()
    ref = ref.to(out.dtype).float()  # an overflow of the out dtype that the exact result also has is correct
    finite = torch.isfinite(ref)
    fin_o = torch.isfinite(o)
    at = f"at M={problem.m} (N={problem.n}, K={problem.k})"
    bad = ~fin_o & finite
    nbad = int(bad.sum())
    if nbad:
        rows = torch.nonzero(bad.any(dim=1)).flatten()[:5].tolist()
        return f"{nbad} NaN/Inf or unwritten elements where the reference is finite (rows {rows}...) {at}"
    r = ref[finite]
    x = o[finite]
    ref_norm = float(torch.linalg.vector_norm(r.double()))
    if ref_norm > 0 and not bool((x != 0).any()):
        return f"all zeros {at}"
    lost = fin_o & torch.isnan(ref)
    if bool(lost.any()):
        cols = torch.nonzero(lost.any(dim=0)).flatten()[:5].tolist()
        return (f"{int(lost.sum())} finite elements where the reference is NaN (columns {cols}...: a NaN block "
                f"scale read as a number?) {at}")
    err = float(torch.linalg.vector_norm((x - r).double()))
    rel = err / ref_norm if ref_norm > 0 else err
    if rel > REL_TOL:
        return f"relative error {rel:.3g} > {REL_TOL:g} {at}"
    return None


def reset_cuda_error(device: torch.device) -> None:
    """After a failed kernel: synchronize, which raises a pending error and so clears it (torch's error check reads
    the runtime's last error when it raises; ``torch.cuda.cudart()`` offers no ``cudaGetLastError`` to call). A
    sticky error (an illegal address) cannot be cleared at all: that is why risky probes run in worker processes."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - the error itself is what we are clearing
        pass


@dataclass
class CheckCase:
    """One problem's check inputs: ``ops`` go to backends (``ops.out`` is rows 1..M of ``frame``), ``pristine`` are
    copies no backend sees, ``ref`` the exact float32 result. ``restored``: each input that a run on the case was
    found to have changed, and that ``restore_inputs`` put back, in the order found (one name per finding)."""

    problem: Problem
    ops: Operands
    pristine: tuple[torch.Tensor, ...]
    frame: torch.Tensor
    ref: torch.Tensor
    restored: list[str] = field(default_factory=list)


_INPUTS = ("a", "b", "a_scale", "b_scale", "alpha")


def make_case(problem: Problem, seed: int, reference) -> CheckCase:
    """Hostile random inputs for ``problem`` and their exact result (``reference(problem, ops) -> float32``)."""
    m, n, k, dt, dev, adt, e = problem
    frame = torch.full((m + 2, n), SENTINEL, dtype=dt, device=dev)
    if e:
        a, b, sa, sb, alpha, offs = random_grouped_operands(m, e, n, k, dev, seed)
        if problem.op == "w4a16_grouped":
            a, sa = random_activations(m, k, adt, dev, seed), sa[:0]
        ops = GroupedOperands(a, b, sa, sb, alpha, frame[1:m + 1], offs)
    else:
        a, b, sa, sb, alpha = random_operands(m, n, k, dev, seed, hostile=True)
        if problem.op == "w4a16":
            a, sa = random_activations(m, k, adt, dev, seed), sa[:0]
        ops = Operands(a, b, sa, sb, alpha, frame[1:m + 1])
    pristine = tuple(t.clone() for _, t in _inputs(ops))
    return CheckCase(problem, ops, pristine, frame, reference(problem, ops))


def _inputs(ops) -> list[tuple[str, torch.Tensor]]:
    """What a backend reads and must leave as it was: the operands but out (and ``offs`` for a grouped call)."""
    named = list(zip(_INPUTS, ops[:5]))
    return named + [("offs", ops.offs)] if isinstance(ops, GroupedOperands) else named


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def restore_inputs(case: CheckCase) -> list[str]:
    """Put back every input of ``case`` that differs from its pristine copy; their names (also added to
    ``case.restored``)."""
    changed = [name for (name, t), p in zip(_inputs(case.ops), case.pristine) if not _same_bytes(t, p)]
    for (name, t), p in zip(_inputs(case.ops), case.pristine):
        if name in changed:
            t.copy_(p)
    case.restored += changed
    return changed


def _tampering(case: CheckCase, out_before: tuple) -> str | None:
    """What the last run did besides writing ``out``, restoring the inputs it changed; None if nothing."""
    out = case.ops.out
    if (out.data_ptr(), tuple(out.shape), out.stride()) != out_before:
        return (f"replaced or resized out (now shape {tuple(out.shape)}, strides {out.stride()}; expected "
                f"{out_before[1]}, {out_before[2]} in place)")
    guard = case.frame[[0, -1]]
    if not bool((guard == SENTINEL).all()):
        return "wrote outside out (into the rows just before or after it in the same buffer)"
    changed = restore_inputs(case)
    if changed:
        return f"modified its input{'s' if len(changed) > 1 else ''} {', '.join(changed)} (inputs must stay as given)"
    return None


def check_run(backend, case: CheckCase, config) -> tuple[str, str] | None:
    """Run ``backend`` once on ``case``; None when right, else ``(kind, reason)`` with kind ``"failed"`` (raised),
    ``OUT_OF_MEMORY`` (raised for want of device memory, in its run or in the check of its output: no verdict on the
    backend) or ``"incorrect"``. Never raises."""
    p = case.problem
    out = case.ops.out
    try:
        poison(out)
        case.frame[[0, -1]] = SENTINEL
        before = (out.data_ptr(), tuple(out.shape), out.stride())
        backend.run(p, case.ops, config)
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
    except Exception as e:  # noqa: BLE001 - failures are data
        reset_cuda_error(p.device)
        why = _tampering_after_error(case, out)
        kind = OUT_OF_MEMORY if out_of_memory(e) and not why else "failed"
        return kind, f"{describe_exception(e)} (at M={p.m})" + (f"; it also {why}" if why else "")
    try:
        why = _tampering(case, before)
        if why:
            _restore_out(case, out)
            return "incorrect", f"{why} at M={p.m}"
        bad = check_output(out, case.ref, p)
    except Exception as e:  # noqa: BLE001 - a check that cannot even read the output is a verdict too
        reset_cuda_error(p.device)
        if out_of_memory(e):  # the check's own temporaries did not fit: no verdict
            return OUT_OF_MEMORY, f"checking its output: {describe_exception(e)} (at M={p.m})"
        return "incorrect", f"its output could not be checked: {describe_exception(e)} (at M={p.m})"
    return ("incorrect", bad) if bad else None


def _restore_out(case: CheckCase, out: torch.Tensor) -> None:
    """Point a replaced ``out`` back at its frame rows, so that the next candidate is checked on the same case."""
    m, n = case.problem.m, case.problem.n
    out.set_(case.frame.untyped_storage(), case.frame.storage_offset() + n, (m, n), (n, 1))


def _tampering_after_error(case: CheckCase, out: torch.Tensor) -> str | None:
    try:
        why = _tampering(case, (case.frame[1:].data_ptr(), (case.problem.m, case.problem.n), (case.problem.n, 1)))
        _restore_out(case, out)
        return why
    except Exception:  # noqa: BLE001
        return None
