"""Repeat calls: a call that repeats a validated, decided one (same weight, M, dtypes, devices, layouts) skips the
argument checks and the key lookup.

An eager call's host time is the product's latency at decode sizes, and reading a tensor attribute from Python costs
about 0.1 us: the ~25 reads of ``validate``'s fast path cost more than the rest of the dispatcher. Here one C++
check of all the call's tensors (torch's ``TensorGuards``, the check torch.compile runs before reusing a compiled
graph: Python type, dispatch keys incl. device type, device index, dtype, requires_grad, sizes, strides) stands for
them. What it is checked against is what ``validate`` accepted, so it never accepts a call ``validate`` would refuse:

* the guard is built from a canonical call only: the tensors ``validate`` returned are the ones passed, or views of
  them with the same dtype, shape and strides (no reshape, swizzle or alpha tensor made for the call),
  scale_layout is "swizzled", no backend is forced, and the choice was proven at that M;
* every size is fixed but the M rows of ``a``, ``a_scale`` and ``out``, which are read and checked against M as
  validate does; every stride is the contiguous one (a tensor that is contiguous with other strides, possible where
  a dim is 1, takes the ordinary path each time);
* the grouped calls (``fp4_grouped_mm``, ``w4a16_grouped_mm``) only with ``check_offs=False`` (as ``Fp4MoeExperts``
  calls them): with the check, validate reads offs' values on every call;
* the guard holds no tensor: a weight reassigned in place (``.data =``, ``set_``, ``resize_``, ``model.to``) fails it
  and is checked afresh; a freed weight's id reused by another tensor can only match what was validated.

The decision part: the remembered Choice is used only while it is still the dispatcher's choice for its key (a ban,
a fault or a ``clear`` replaces it). Without ``TensorGuards`` (a torch without dynamo), or with one that refuses the
arguments it is built with here (another torch's signature), nothing is remembered: every call takes the ordinary
path, and ``CallMemo.disabled`` says why. Nor is a weight whose calls keep failing its guard (``MAX_REBUILDS``).
"""
from __future__ import annotations

import logging

import torch

from ..errors import describe_exception
from ..format_grouped import grouped_scale_rows
from ..problem import GroupedOperands, Operands, Problem
from ..validate import same_start

__all__ = ["CallMemo", "MAX_CALLS", "MAX_WEIGHTS", "MAX_REBUILDS"]

log = logging.getLogger("fp4dispatch")

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # a torch build without dynamo: every call takes the ordinary path
    TensorGuards = None

# bounds per dispatcher, past which everything is forgotten and relearned (a weight's guard is about 1 KB, an M of
# it a few hundred bytes): a process that keeps making new weights or new M cannot grow the memo without end
MAX_CALLS = 1 << 16  # remembered (weight, M) pairs
MAX_WEIGHTS = 1 << 13  # remembered weights (per op, out dtype and out mode)
# a weight whose guard had to be rebuilt this often is left to the ordinary path: its calls alternate between states
# one guard cannot hold (inside and outside torch.inference_mode, say, whose dispatch keys differ), and a rebuild
# per call would cost more than the checks it saves
MAX_REBUILDS = 4

_new = tuple.__new__
# per op (``Problem.op``): the positions, in the call's tensors (out last), of those whose dim 0 is the call's M
_M_FREE = {"fp4_mm": (0, 2, 5), "w4a16": (0, 4), "grouped": (0, 2, 6), "w4a16_grouped": (0, 5)}


class _Weight:
    """One weight's calls of one op, out dtype and out mode: the guard of their tensors (M free) and, per M, what
    the ordinary path returned."""

    __slots__ = ("guard", "by_m", "extra", "rebuilds")

    def __init__(self, guard, extra, rebuilds: int = 0):
        self.guard, self.by_m, self.extra = guard, {}, extra  # extra: w4a16's empty a_scale
        self.rebuilds = rebuilds  # guards this key had before this one


def _contiguous(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _guard(tensors: tuple, m_free: tuple[int, ...]):
    """A TensorGuards of ``tensors`` with the sizes and contiguous strides they have now, dim 0 free in those at
    ``m_free``; None where they do not have those strides (contiguous with others: they would fail it each call)."""
    shapes = [t.shape for t in tensors]
    strides = [_contiguous(s) for s in shapes]
    if any(list(t.stride()) != s for t, s in zip(tensors, strides)):
        return None
    sizes = [[None if i in m_free and d == 0 else s for d, s in enumerate(shape)] for i, shape in enumerate(shapes)]
    return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


class CallMemo:
    """What the dispatcher's ordinary path returned for canonical calls, looked up per weight and M.

    ``choices`` is the dispatcher's own key -> Choice dict (read, never written)."""

    def __init__(self, choices: dict):
        self._choices = choices
        self._weights: dict[tuple, _Weight] = {}
        self._unstable: set[tuple] = set()  # keys past MAX_REBUILDS: not remembered
        self._calls = 0
        self.disabled = None if TensorGuards is not None else "torch has no torch._C._dynamo.guards.TensorGuards"

    def fp4_mm(self, a, b, a_scale, b_scale, alpha, out_dtype, out, scale_layout, backend):
        """(choice, problem, ops) of a repeated canonical ``fp4_mm`` call, else None."""
        w = self._weights.get((id(b), out_dtype, out is None, "fp4_mm"))
        if w is None or backend is not None or scale_layout != "swizzled":
            return None
        if out is None:
            if not w.guard.check(a, b, a_scale, b_scale, alpha):
                return None
        elif not w.guard.check(a, b, a_scale, b_scale, alpha, out):
            return None
        m = a.shape[0]
        hit = w.by_m.get(m)
        if (hit is None or self._choices.get(hit[0].key) is not hit[0] or a_scale.shape[0] != (m + 127) // 128 * 128
                or (out is not None and out.shape[0] != m)):
            return None
        if out is None:
            out = torch.empty((m, hit[1].n), dtype=out_dtype, device=hit[1].device)
        return hit[0], hit[1], _new(Operands, (a, b, a_scale, b_scale, alpha, out))

    def w4a16_mm(self, a, b, b_scale, alpha, out_dtype, out, scale_layout, backend):
        """(choice, problem, ops) of a repeated canonical ``w4a16_mm`` call, else None."""
        w = self._weights.get((id(b), out_dtype, out is None, "w4a16"))
        if w is None or backend is not None or scale_layout != "swizzled":
            return None
        if out is None:
            if not w.guard.check(a, b, b_scale, alpha):
                return None
        elif not w.guard.check(a, b, b_scale, alpha, out):
            return None
        m = a.shape[0]
        hit = w.by_m.get(m)
        # out=a (an in-place layer: N == K, one dtype) goes to validate's refusal; fp4_mm's uint8 a is no out
        if (hit is None or self._choices.get(hit[0].key) is not hit[0]
                or (out is not None and (out.shape[0] != m or same_start(out, a)))):
            return None
        if out is None:
            out = torch.empty((m, hit[1].n), dtype=hit[1].out_dtype, device=hit[1].device)
        return hit[0], hit[1], _new(Operands, (a, b, w.extra, b_scale, alpha, out))

    def grouped(self, a, b, a_scale, b_scale, alpha, offs, out_dtype, out, scale_layout, backend, check_offs):
        """(choice, problem, ops) of a repeated canonical ``fp4_grouped_mm`` (``a_scale`` given) or
        ``w4a16_grouped_mm`` (``a_scale`` None) call with ``check_offs=False``, else None: ``offs`` is then read by
        no check, so its metadata is all there is to validate (the call with the check reads its values each time)."""
        fp4 = a_scale is not None
        w = self._weights.get((id(b), out_dtype, out is None, "grouped" if fp4 else "w4a16_grouped"))
        if w is None or check_offs is not False or backend is not None or scale_layout != "swizzled":
            return None
        tensors = (a, b, a_scale, b_scale, alpha, offs) if fp4 else (a, b, b_scale, alpha, offs)
        if not (w.guard.check(*tensors) if out is None else w.guard.check(*tensors, out)):
            return None
        t = a.shape[0]
        hit = w.by_m.get(t)
        if (hit is None or self._choices.get(hit[0].key) is not hit[0]
                or (out is not None and (out.shape[0] != t or (not fp4 and same_start(out, a))))):
            return None
        choice, problem = hit
        if fp4:  # validate's rule for a_scale when offs is not read: room for any routing of T rows
            rows = a_scale.shape[0]
            if rows % 128 or rows < max((t + 127) // 128 * 128, grouped_scale_rows(t, problem.experts)):
                return None
        if out is None:
            out = torch.empty((t, problem.n), dtype=problem.out_dtype, device=problem.device)
        return choice, problem, GroupedOperands(a, b, a_scale if fp4 else w.extra, b_scale, alpha, out, offs)

    def remember(self, args: tuple, out_dtype, scale_layout: str, backend, choice, problem: Problem, ops,
                 check_offs: bool = False) -> None:
        """Remember a call the ordinary path validated and decided: ``args`` are the call's tensors as passed, out
        last: (a, b, a_scale, b_scale, alpha, out) for ``fp4_mm``, (a, b, b_scale, alpha, out) for ``w4a16_mm``,
        with offs before out for the grouped calls (remembered only with ``check_offs`` False)."""
        if (self.disabled or backend is not None or scale_layout != "swizzled" or check_offs is not False
                or choice.key is None or problem.m not in choice.verified):
            return
        op = problem.op
        out = args[-1]
        if not all(map(_same, args[:-1], _canonical(op, ops))) or (out is not None and out is not ops.out):
            return  # validate made a tensor for this call: the next one must be checked the same way
        tensors = args if out is not None else args[:-1]
        key = (id(args[1]), out_dtype, out is None, op)
        if key in self._unstable:
            return
        w = self._weights.get(key)
        rebuilds = 0
        if w is not None and not w.guard.check(*tensors):  # the weight changed, or its id is another tensor's now
            self._calls -= len(w.by_m)
            self._weights.pop(key, None)  # another thread's call may have dropped it already
            rebuilds, w = w.rebuilds + 1, None
            if rebuilds > MAX_REBUILDS:
                self._unstable.add(key)
                return
        if ((w is None or problem.m not in w.by_m) and self._calls >= MAX_CALLS
                or w is None and len(self._weights) + len(self._unstable) >= MAX_WEIGHTS):
            self._weights.clear()
            self._unstable.clear()
            self._calls, w = 0, None
        if w is None:
            try:
                guard = _guard(tensors, _M_FREE[op])
            except Exception as e:  # noqa: BLE001 - a TensorGuards of another signature: the ordinary path serves
                self.disabled = f"TensorGuards refused its arguments: {describe_exception(e)}"
                log.info("fp4dispatch: repeat calls are validated in full (%s)", self.disabled)
                return
            if guard is None:
                return
            w = self._weights[key] = _Weight(guard, ops.a_scale if op in ("w4a16", "w4a16_grouped") else None,
                                             rebuilds)
        if problem.m not in w.by_m:
            self._calls += 1
        w.by_m[problem.m] = (choice, problem)


def _canonical(op: str, ops) -> tuple:
    """The canonical operands that stand for a call's tensors, in the call's order, out left out."""
    if op == "fp4_mm":
        return ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha
    if op == "w4a16":
        return ops.a, ops.b, ops.b_scale, ops.alpha
    if op == "grouped":
        return ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha, ops.offs
    return ops.a, ops.b, ops.b_scale, ops.alpha, ops.offs


def _same(x, y) -> bool:
    """``x`` is ``y``, or a view of the same memory with the same dtype, shape and strides (validate's
    ``.view(float8_e4m3fn)`` of a scale that already is e4m3)."""
    return x is y or (isinstance(x, torch.Tensor) and x.dtype == y.dtype and x.data_ptr() == y.data_ptr()
                      and x.shape == y.shape and x.stride() == y.stride() and x.device == y.device)
