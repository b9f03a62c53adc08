"""Autotune one key: verify every candidate (backend x config) on that shape, time the correct ones.

A candidate that raises or is wrong scores ``inf`` with its reason; failures are data (Triton's ``_bench``). The
inputs are the hostile check inputs of :mod:`fp4dispatch.dispatch.verify`, so a candidate is timed only once it has been
proven right on them. The phases, each timed into ``Tuning.seconds`` (docs/tuning.md, "Cold start"):

1. ``case``: the hostile inputs and their exact result;
2. ``compile``: the candidates' kernels compiled at once instead of one after another in the checks
   (``key_compiles.compile_ahead``); what the key waited for, since each candidate is checked and screened as soon
   as its own compiles are over, while the rest compile;
3. ``check``: each candidate once against the exact result;
4. ``screen``: with a ``screen`` timer, each correct candidate timed briefly; only the ``Search.keep`` fastest, and of
   those only the ones within ``Search.margin`` of the fastest, go on to
5. ``time``: the full timer. A screened-out candidate keeps its screen time (``timed: "screen"``): it stays a
   verified fallback, ranked behind every fully timed one.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..backends.base import Backend, Config, config_id, config_json
from ..backends.reference import reference_mm
from ..errors import InvalidInputError, describe_exception, out_of_memory
from ..problem import Problem
from ..routing import timing_routing
from .timer import DoBench
from .key_compiles import compile_ahead
from .verify import OUT_OF_MEMORY, CheckCase, check_run, make_case, reset_cuda_error

__all__ = ["Trial", "Tuning", "Search", "FULL", "tune", "verify_only", "check_trial", "merge_tunings", "PHASES",
           "COMPILE_PARTS"]

log = logging.getLogger("fp4dispatch")
PHASES = ("case", "compile", "check", "screen", "time")
COMPILE_PARTS = ("compile_triton", "compile_first_runs")  # within compile, overlapping: what it waited for


@dataclass(frozen=True)
class Search:
    """How much of a key's candidates is timed in full: the ``keep`` fastest by the screen timer, and of those only
    the ones at most ``1 + margin`` times the fastest screen time. ``keep=0`` times every correct candidate in full
    (``FP4DISPATCH_SEARCH=full``)."""

    keep: int = 3
    margin: float = 0.15

    def __post_init__(self):
        if not isinstance(self.keep, int) or self.keep < 0:
            raise InvalidInputError(f"Search: keep must be an int >= 0 (0: time every candidate); got {self.keep!r}")
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < math.inf):
            raise InvalidInputError(f"Search: margin must be a finite number >= 0 (a fraction of the fastest screen "
                                    f"time); got {self.margin!r}")


FULL = Search(keep=0)


@dataclass
class Trial:
    backend: str
    config: Config = field(default_factory=dict)
    time_ms: float = math.inf
    reason: str = ""  # empty when the trial is correct and timed
    # wall seconds of its check, its first run on this shape: a JIT compile or a weight preparation shows here
    check_s: float | None = None
    # ranked behind the fully timed ones: not among the few the screen kept, so its time is the screen timer's (or,
    # in a key tuned in two rounds, a full time that the merge put behind the kept ones: merge_tunings)
    screened: bool = False

    @property
    def ok(self) -> bool:
        return math.isfinite(self.time_ms)

    @property
    def short_of_memory(self) -> bool:
        """Failed for want of device memory (checked or timed): the process's state, no verdict on the backend."""
        return self.reason.startswith(OUT_OF_MEMORY)

    def to_json(self) -> dict:
        d = {"backend": self.backend, "config": config_json(self.config),
             "time_us": round(self.time_ms * 1e3, 3) if self.ok else None, "reason": self.reason}
        if self.screened:
            d["timed"] = "screen"
        return d if self.check_s is None else {**d, "check_s": round(self.check_s, 3)}


@dataclass
class Tuning:
    """A key's trials, fastest correct first (failed and incorrect last, with their reasons), and the wall seconds
    of each phase (``PHASES``) and, of a search, within compile (``COMPILE_PARTS``)."""

    trials: list[Trial]
    seconds: dict[str, float]


def check_trial(backend: Backend, case: CheckCase, cfg: Config) -> str:
    """"" when ``backend`` with ``cfg`` computes ``case`` right, else ``"failed: ..."`` / ``"incorrect: ..."``."""
    outcome = check_run(backend, case, cfg)
    return f"{outcome[0]}: {outcome[1]}" if outcome else ""


def _configs(backend: Backend, problem: Problem) -> tuple[list, str]:
    """(configs, "") or ([], reason): a backend that cannot list a config is a failed candidate, not a crash."""
    try:
        cfgs = list(backend.configs(problem))
    except Exception as e:  # noqa: BLE001
        return [], f"failed: configs() raised {describe_exception(e)}"
    return cfgs, "" if cfgs else "failed: configs() offered none"


def _bench(do_bench: DoBench, fn) -> tuple[float, str]:
    """(milliseconds, "") or (inf, reason)."""
    try:
        ms = float(do_bench(fn))
    except Exception as e:  # noqa: BLE001
        return math.inf, f"{OUT_OF_MEMORY if out_of_memory(e) else 'failed'} while timing: {describe_exception(e)}"
    if not math.isfinite(ms):
        return math.inf, "timer returned a non-finite time"
    # a negative time would win, and its decision is dropped as malformed when the cache file is read again
    return (ms, "") if ms >= 0 else (math.inf, f"timer returned a negative time ({ms} ms)")


def tune(problem: Problem, candidates: list[Backend], do_bench: DoBench, seed: int = 7, *,
         screen: DoBench | None = None, search: Search = Search(), only: set | None = None,
         screen_beside_compiles: bool = True) -> Tuning:
    """Every candidate x config checked; the correct ones timed (screened first when ``screen`` is given and
    ``search.keep`` > 0). ``only``: the (backend name, config id) pairs to try, the rest left out.
    ``screen_beside_compiles``: each candidate is screened as soon as it is checked, while the key's other compiles
    and first runs go on (a timer of GPU time: graph replays); False screens only once they are over (a timer of
    host time too: eager launches slow down beside compile threads and compiler processes, and would be mis-ranked)."""
    seconds = dict.fromkeys(PHASES, 0.0)
    t0 = time.perf_counter()
    case = make_case(problem, seed, reference_mm)
    # checked on the hostile case; timed on the same operands, but a grouped key on a realistic routing (the check's
    # may put every row on one expert, a dense GEMM on one L2-resident weight: not what a MoE layer runs). The
    # swizzled activation scales hold any routing of T rows, so only offs changes.
    timed = case.ops if not problem.experts else case.ops._replace(
        offs=timing_routing(problem.m, problem.experts, seed, problem.device))
    trials: list[Trial] = []
    pairs: list[tuple[Backend, Config]] = []
    for backend in candidates:
        cfgs, why = _configs(backend, problem)
        if why:
            trials.append(Trial(backend.name, {}, reason=why))
        pairs += [(backend, c) for c in cfgs if only is None or (backend.name, config_id(c)) in only]
    t1 = time.perf_counter()
    seconds["case"] = t1 - t0
    parts: dict[str, float] = {}

    def check(group: list[tuple[Backend, Config]]) -> list[tuple[Trial, Backend]]:
        ok = []
        for backend, cfg in group:
            t = Trial(backend.name, cfg)
            t0 = time.perf_counter()
            t.reason = check_trial(backend, case, cfg)
            t.check_s = time.perf_counter() - t0
            seconds["check"] += t.check_s
            trials.append(t)
            if not t.reason:
                ok.append((t, backend))
        return ok

    def run_timer(phase: str, timer: DoBench, group: list[tuple[Trial, Backend]]) -> None:
        t0 = time.perf_counter()
        for t, b in group:
            t.time_ms, t.reason = _bench(timer, lambda b=b, c=t.config: b.run(problem, timed, c))
            if t.reason:
                reset_cuda_error(problem.device)
        seconds[phase] += time.perf_counter() - t0

    screening = screen is not None and search.keep > 0

    def check_and_screen(group) -> list[tuple[Trial, Backend]]:
        # each candidate screened once it is checked and correct, as soon as there are two to rank (with ``late``)
        ok, screened = [], 0
        for pair in group:
            ok += check([pair])
            if screening and screen_beside_compiles and len(ok) + len(late) > 1:
                run_timer("screen", screen, ok[screened:])
                screened = len(ok)
        return ok

    with compile_ahead(problem, case, pairs, parts) as ahead:
        seconds["compile"] = time.perf_counter() - t1  # handing the Triton compiles out
        late = [p for p in pairs if p[0].name in ahead.first_runs.names]
        early = [p for p in pairs if p[0].name not in ahead.first_runs.names]
        # each checked and screened as soon as its compiles are over, while the others' and the first runs of
        # ``late``'s libraries go on
        before = len(trials)
        correct = check_and_screen(ahead.triton.in_order(problem, early))
        t2 = time.perf_counter()
        ahead.first_runs.wait()
        seconds["compile"] += ahead.triton.waited + time.perf_counter() - t2
        # a first run wrote an input that the early candidates ran on (found now, or by a check beside it, which put
        # it back): their outcomes prove nothing
        if ahead.first_runs.names and case.restored:  # (the case is this key's own: nothing was restored before)
            log.warning("fp4dispatch: a first run on %s changed its inputs %s; checking the other candidates again",
                        problem, ", ".join(dict.fromkeys(case.restored)))
            del trials[before:]
            correct = check_and_screen(early)
    screening = screening and len(correct) + len(late) > 1
    if screening and not screen_beside_compiles:
        run_timer("screen", screen, correct)
    # within compile: until the Triton configs were compiled, and until the first runs were over (they overlap)
    seconds.update(zip(COMPILE_PARTS, (parts.get("triton", 0.0), parts.get("first_runs", 0.0))))
    more = check(late)
    if screening:
        run_timer("screen", screen, more)
    correct += more
    final = correct
    if screening:
        ranked = sorted((p for p in correct if p[0].ok), key=lambda p: p[0].time_ms)
        best = ranked[0][0].time_ms if ranked else math.inf
        final = [p for p in ranked[:search.keep] if p[0].time_ms <= best * (1 + search.margin)]
        for t, _ in ranked:
            t.screened = True
        for t, _ in final:
            t.screened = False
    run_timer("time", do_bench, final)
    for t in trials:
        log.debug("tune %s: %s[%s] -> %s", problem, t.backend, config_id(t.config), t.to_json())
    trials.sort(key=_rank)
    return Tuning(trials, seconds)


def _rank(t: Trial) -> tuple:
    # fully timed first, then the screened-out ones (their times come from the other timer), then the failures
    return not t.ok, t.screened, t.time_ms


def merge_tunings(first: Tuning, second: Tuning, search: Search | None = None) -> Tuning:
    """One key's two tunings (same timers, disjoint candidates) as one: trials ranked together, phase seconds
    added. ``search`` (when the two were screened): of the fully timed trials of both, only the ``keep`` fastest
    within ``margin`` of the best stay ahead, as one screened search would have left them; the others rank with the
    screened-out ones."""
    trials = sorted(first.trials + second.trials, key=_rank)
    if search is not None and search.keep:
        full = [t for t in trials if t.ok and not t.screened]
        if full:
            best = full[0].time_ms
            for i, t in enumerate(full):
                t.screened = i >= search.keep or t.time_ms > best * (1 + search.margin)
            trials.sort(key=_rank)
    return Tuning(trials, {p: first.seconds.get(p, 0.0) + second.seconds.get(p, 0.0)
                           for p in dict.fromkeys([*first.seconds, *second.seconds])})


def verify_only(problem: Problem, candidates: list[Backend], seed: int = 7) -> Tuning:
    """Priority order, no timing (``FP4DISPATCH_TUNE=0``, and the CPU, where load would decide): the first config
    of each backend is verified; its rank stands in for a time so that the order survives sorting and the cache."""
    t0 = time.perf_counter()
    case = make_case(problem, seed, reference_mm)
    t1 = time.perf_counter()
    trials = []
    for rank, backend in enumerate(candidates):
        cfgs, why = _configs(backend, problem)
        cfg = cfgs[0] if cfgs else {}
        reason = why or check_trial(backend, case, cfg)
        trials.append(Trial(backend.name, cfg, math.inf if reason else float(rank), reason))
    trials.sort(key=lambda t: t.time_ms)
    return Tuning(trials, {**dict.fromkeys(PHASES, 0.0), "case": t1 - t0, "check": time.perf_counter() - t1})
