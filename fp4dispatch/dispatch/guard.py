"""Guard mode: catch a backend that returns NaN/Inf from finite inputs, without a host sync per call.

Opt-in (``FP4DISPATCH_GUARD=1`` or ``Dispatcher(guard=True)``). After every guarded call a few tiny device kernels
fold "this output is non-finite although its inputs are finite" into a per-(key, backend) device flag. Every
``FP4DISPATCH_GUARD_EVERY`` calls (default 64), or on demand (``fp4dispatch.guard.check()``), the flags are read in
one host sync; a flagged backend is banned from that key through ``Dispatcher.blacklist`` (memory and disk, like a
backend found wrong), a warning is logged, and the current call is recomputed with the next best backend. Calls made
before a check keep their bad outputs: guard mode bounds how long a bad backend stays in use, it does not make every
output right.

"Finite inputs": e2m1 codes are always finite, so this means no NaN e4m3 block scale (0x7F/0xFF), a finite
alpha, and inputs too small for the product to overflow: ``max|a| * 2688 * K`` (the fp32 partial sums, before
alpha) and ``|alpha|`` times it (the result) below bfloat16's largest finite value (an e2m1 x e4m3 value is at most
6 * 448 = 2688; ``max|a|`` is that for NVFP4 activations, their own amax for 16-bit ones), so that no fp32 partial
sum and no bf16 or fp32 result can be Inf (or, through Inf - Inf, NaN).
A product that may overflow is not judged. For float16 outputs only NaN counts, since a finite fp16 product may
legitimately overflow to Inf.

Under CUDA-graph capture the flag update is captured (every replay feeds the flag) and nothing syncs; a key whose
flag does not exist yet (not warmed up, see :func:`fp4dispatch.graphs.warmup`) is not guarded inside the graph.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError, NoUsableBackendError
from .records import key_str

__all__ = ["Guard", "Finding", "DEFAULT_EVERY", "nonfinite_from_finite"]

log = logging.getLogger("fp4dispatch")

DEFAULT_EVERY = 64
_NAN_E4M3 = 0x7F  # e4m3fn has no Inf; its NaN is S.1111.111
_FP4_MAX = 6.0 * 448.0  # the largest |e2m1 x e4m3| value
_NO_OVERFLOW = torch.finfo(torch.bfloat16).max  # below it, no fp32 sum and no bf16 or fp32 result is Inf


@dataclass(frozen=True)
class Finding:
    """One blacklisting made by a guard check."""

    key: str
    backend: str
    replaced_by: str | None  # the next best backend for that key; None when none is known yet


@dataclass
class _Watch:
    flag: torch.Tensor  # 0-d bool on the device
    choice: object  # the latest dispatcher Choice that ran this backend on this key
    problem: object  # the latest Problem seen (device, N, K; M is the last one)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _has_nan_scale(s: torch.Tensor) -> torch.Tensor:
    return ((s.view(torch.uint8) & 0x7F) == _NAN_E4M3).any()


def nonfinite_from_finite(ops, out_dtype: torch.dtype) -> torch.Tensor:
    """0-d bool device tensor: ``ops.out`` has a non-finite value while every input is finite and too small for the
    product to overflow (the module's docstring). No host sync."""
    offs = getattr(ops, "offs", None)
    if offs is None:
        mn, mx = torch.aminmax(ops.out)  # one pass: NaN propagates into both, +-Inf shows in one of them
    else:
        # grouped: only rows an offs table routes, and only a table that is valid (check_offs=False leaves it unread:
        # rows past offs[-1] (a graph's padding) are never written, and a wrong table's result is undefined, never a
        # backend's fault)
        o = offs.long()
        t = ops.out.shape[0]
        valid = (o[0] >= 0) & (o[-1] <= t) & (o[1:] >= o[:-1]).all()
        routed = (torch.arange(t, device=o.device) < o[-1]) & valid
        rmn, rmx = torch.aminmax(ops.out, dim=1)
        mn, mx = torch.where(routed, rmn, 0).amin(), torch.where(routed, rmx, 0).amax()
    w4a16 = ops.a.dtype != torch.uint8  # w4a16_mm: a holds the caller's 16-bit activations, not NVFP4 codes
    if out_dtype == torch.float16:  # a finite fp32 result may overflow fp16: only NaN is a fault
        bad = torch.isnan(mx)
    else:
        bad = ~(torch.isfinite(mn) & torch.isfinite(mx))
    # the largest |result| the inputs allow, NaN where one is NaN (amax keeps it): every finite one bounds it
    a_max = ops.a.abs().amax().float() if w4a16 else _FP4_MAX
    sums = a_max * (_FP4_MAX * ops.b.shape[-1] * 2)  # before alpha: the fp32 partial sums (alpha < 1 shrinks only
    bound = ops.alpha.abs().amax() * sums  # the result; huge 16-bit activations overflow the sums themselves)
    inputs_ok = ((sums < _NO_OVERFLOW) & (bound < _NO_OVERFLOW) & ~_has_nan_scale(ops.a_scale)
                 & ~_has_nan_scale(ops.b_scale))
    return bad & inputs_ok


class Guard:
    """Per-dispatcher guard state.

    Args:
        every: calls between two checks (host syncs); the dispatcher passes ``FP4DISPATCH_GUARD_EVERY`` (default 64).
    """

    def __init__(self, every: int | None = None):
        if every is None:
            every = DEFAULT_EVERY
        elif not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidInputError(f"Guard: every must be a positive int (calls between checks); got {every!r}")
        self.every = every
        self._watches: dict[tuple, _Watch] = {}
        self._calls = 0
        self._lock = threading.Lock()
        self._unguarded: set[tuple] = set()

    def renew_lock(self) -> None:
        """In a fork child: a parent thread may have held the lock at the fork; it would never be released here."""
        self._lock = threading.Lock()

    def after_run(self, dispatcher, choice, problem, ops) -> torch.Tensor:
        """Fold this call's output into its flag; every ``every`` calls, check. Returns the call's result."""
        if ops.out.numel() == 0:
            return ops.out
        capturing = _capturing(problem.device)
        wid = (choice.key, choice.backend.name)
        w = self._watches.get(wid)
        if w is None:
            if capturing:
                # creating the flag now would capture its zero-fill: every replay would reset it
                self._log_unguarded(wid)
                return ops.out
            with self._lock:
                w = self._watches.get(wid)
                if w is None:
                    w = self._watches[wid] = _Watch(torch.zeros((), dtype=torch.bool, device=problem.device),
                                                    choice, problem)
        w.choice, w.problem = choice, problem
        w.flag.logical_or_(nonfinite_from_finite(ops, problem.out_dtype))
        if capturing:
            return ops.out
        self._calls += 1
        if self._calls % self.every:
            return ops.out
        return self._check(dispatcher, current=(wid, problem, ops))

    def check(self, dispatcher) -> list[Finding]:
        """Read every flag now (one host sync per device) and blacklist flagged backends; returns what was found.

        Raises:
            InvalidInputError: called while a CUDA graph is being captured (a check needs a host sync).
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise InvalidInputError(
                "fp4dispatch.dispatch.guard.check: cannot run during CUDA graph capture (it reads device flags, a host "
                "sync); call it after capture or between replays")
        findings: list[Finding] = []
        self._check(dispatcher, findings=findings)
        return findings

    # -- internals ---------------------------------------------------------------------------------------------
    def _check(self, dispatcher, current=None, findings: list[Finding] | None = None):
        with self._lock:
            items = list(self._watches.items())
        flagged = []
        by_dev: dict[torch.device, list] = {}
        for wid, w in items:
            by_dev.setdefault(w.flag.device, []).append((wid, w))
        for group in by_dev.values():
            values = torch.stack([w.flag for _, w in group]).tolist()  # the one host sync of this device
            flagged += [(wid, w) for (wid, w), bad in zip(group, values) if bad]
        redo = None
        for wid, w in flagged:
            with self._lock:
                self._watches.pop(wid, None)
            new = self._blacklist(dispatcher, w, must_recompute=current is not None and wid == current[0])
            if findings is not None:
                findings.append(Finding(_key_str(w.choice.key), w.choice.backend.name,
                                        new.backend.name if new is not None else None))
            if current is not None and wid == current[0]:
                redo = new
        if current is None:
            return None
        _, problem, ops = current
        if redo is None:
            return ops.out
        return dispatcher.execute(redo, problem, ops)

    def _blacklist(self, dispatcher, w: _Watch, must_recompute: bool):
        choice, problem = w.choice, w.problem
        name, ks = choice.backend.name, _key_str(choice.key)
        reason = f"incorrect: non-finite output from finite inputs (guard mode, {problem})"
        try:
            new = dispatcher.blacklist(choice, problem, reason)
        except NoUsableBackendError:
            if must_recompute:
                raise
            log.warning("fp4dispatch guard: backend %s returned non-finite values from finite inputs on %s; "
                        "blacklisted for this key, and no other backend can serve it", name, ks)
            return None
        log.warning("fp4dispatch guard: backend %s returned non-finite values from finite inputs on %s; "
                    "blacklisted for this key, using %s%s", name, ks, new.backend.name,
                    " (this call recomputed)" if must_recompute else "")
        return new

    def _log_unguarded(self, wid: tuple) -> None:
        if wid not in self._unguarded:
            self._unguarded.add(wid)
            log.warning("fp4dispatch guard: %s on %s is not guarded inside this CUDA graph: run the shape once "
                        "before capture (fp4dispatch.graphs.warmup)", wid[1], _key_str(wid[0]))


def _key_str(key) -> str:
    return key_str(key) if key is not None else "forced"
