"""Where tuning runs: one device in this process (``tune_rows``), one worker process per GPU (``--devices``), or one
torchrun rank per GPU (ranks split the shapes and all-gather the decisions).

torchrun mode is on when ``torch.distributed`` is already initialized (any backend, gloo included) or when
``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set; in the latter case the default group is created here --
``nccl`` when CUDA is available (device ``cuda:$LOCAL_RANK``), ``gloo`` otherwise -- and destroyed at the end.
Each rank tunes ``shapes[rank::world]`` (its decisions reach the disk cache as usual), the ranks all-gather the
decision records, each adopts the others' in memory only, and every rank returns the same rows. On a shared
filesystem the cache file therefore gets each decision from exactly one rank.

``--devices`` starts one worker process per device (fp4dispatch/worker_process.py: not ``multiprocessing``, which
would run the caller's main script again in each). Devices whose fingerprints are equal (same GPU model, driver and
libraries) share one cache file, so they split the shape list among themselves instead of each tuning it all.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from .. import worker_process
from ..dispatch.timer import for_device
from ..settings import read_settings
from ..dispatch.dispatcher import Dispatcher, key_str
from ..errors import FP4DispatchError
from ..kernels.compile_processes import worker_count
from ..dispatch.fingerprint import device_fingerprint, fingerprint_hash
from ..problem import Problem, m_bucket

__all__ = ["TuneOptions", "OUT_DTYPES", "make_dispatcher", "tune_rows", "backend_rows", "auto_mode_notes",
           "torchrun_detected", "process_group", "run_torchrun", "run_on_devices", "merge_device_results",
           "resolve_devices", "split_shares", "main"]

OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# -- one device, this process -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneOptions:
    """What a tuning run needs; picklable, so device processes and torchrun ranks get the same."""

    out_dtype: str = "bfloat16"
    op: str = "fp4_mm"  # or "w4a16": w4a16_mm keys (activations of the out dtype; bf16 for float32 out)
    isolate: bool = True
    cache_dir: str | None = None
    progress: bool = True


def make_dispatcher(opts: TuneOptions, backends=None, do_bench=None) -> Dispatcher:
    """A dispatcher with the CLI's settings (``--isolate``, ``--cache-dir``) over the environment's."""
    settings = dataclasses.replace(read_settings(), isolate=opts.isolate)
    return Dispatcher(backends, cache_dir=opts.cache_dir, do_bench=do_bench, settings=settings)


def _bf16_baseline_us(m: int, n: int, k: int, device: torch.device, timer: str = "graph") -> float:
    """cuBLAS bf16 ``x @ W.T`` of the same shape (random operands), timed like the tuner times the backends
    (``FP4DISPATCH_TIMER``: CUDA-graph replays by default), so the ratio compares like with like."""
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    return round(for_device(device, timer)(lambda: torch.mm(a, w.t())) * 1e3, 3)


def _summarize(entry: dict, n: int, k: int) -> dict:
    """Winner, time, TFLOP/s, tried backends (best time, slowest first run) and the runner-up of one cached decision
    record."""
    winner, ranking = entry.get("backend"), list(entry.get("ranking", []))
    timed = entry.get("mode", "tuned") != "priority"  # FP4DISPATCH_TUNE=0 records priority ranks, not times
    best: dict[str, dict] = {}
    for t in ranking:  # sorted by time: a backend's first trial is its best
        b = best.setdefault(t["backend"], {"backend": t["backend"], "time_us": t.get("time_us") if timed else None,
                                           "reason": t.get("reason", "")})
        if isinstance(t.get("check_s"), (int, float)):  # its slowest first run over its configs (a JIT compile)
            b["check_s"] = max(b.get("check_s", 0.0), t["check_s"])
    best.setdefault(winner, {"backend": winner, "time_us": entry.get("time_us") if timed else None, "reason": ""})
    time_us = entry.get("time_us") if timed else None
    m_t = int(entry.get("tuned_at_m") or 1)
    runner = next((b for name, b in best.items() if name != winner and b["time_us"] is not None), None)
    row = {"winner": winner, "config": entry.get("config") or {}, "time_us": time_us, "tuned_at_m": m_t,
           "tflops": float(f"{2 * m_t * n * k / (time_us * 1e-6) / 1e12:.4g}") if time_us else None,
           "tried": list(best.values()), "runner_up": runner["backend"] if runner else None,
           "runner_up_us": runner["time_us"] if runner else None, "speedup_vs_runner_up": None,
           "mode": entry.get("mode", "tuned"), "tune_s": entry.get("tune_s")}
    if runner and time_us:
        row["speedup_vs_runner_up"] = round(runner["time_us"] / time_us, 3)
    return row


def tune_rows(d: Dispatcher, device: torch.device, shapes: list, opts: TuneOptions, *, tuned_by: str = "",
              position: int = 0, seconds: dict | None = None) -> list[dict]:
    """Decide every shape on ``device`` (cached decisions are reused) and return one JSON-able row per shape.
    ``seconds`` (if given) receives the wall time of each stage: probe, compile, decide, baseline, and "beside" and
    "hand_out": the parts of the probe spent deciding the keys among the backends already probed, and handing their
    compiles out before that (``compile_keys``)."""
    from tqdm import tqdm

    dt = OUT_DTYPES[opts.out_dtype]
    adt = torch.uint8 if opts.op == "fp4_mm" else dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
    problems = [Problem(s.m, s.n, s.k, dt, device, adt, s.experts) for s in shapes]
    ops = tuple(dict.fromkeys(p.op for p in problems))
    if opts.progress and sys.stderr.isatty():  # probing native backends in workers can take a while on a GPU
        print(f"probing the backends of {', '.join(ops) or 'no op'} on {device} and compiling the new keys' kernels "
              "...", file=sys.stderr)
    stage = dict.fromkeys(("probe", "compile", "decide", "baseline"), 0.0)
    # the new keys' backends probed and their kernels compiled together (the two overlap), and each key checked and
    # timed alone: among the backends already probed while the probe workers still work, among the rest after them
    cached = set(d.cache_for(device).decisions)  # before compile_keys, which records the keys it decides
    compiled = d.compile_keys(problems, stages=stage, decide=True)
    t0 = time.perf_counter()
    d.report(device, ops)  # the ops whose keys were all decided: compile_keys probed only the new keys' ops
    stage["probe"] += time.perf_counter() - t0
    if compiled and opts.progress and sys.stderr.isatty():
        print(f"probed the backends and compiled or handed out the kernels of {compiled} new keys in "
              f"{stage['probe'] + stage['compile']:.1f} s (deciding them beside the probe: "
              f"{stage.get('beside', 0.0):.1f} s of it), then decided them while those compiled: "
              f"{stage['decide']:.1f} s", file=sys.stderr)
    rows = []
    bar = tqdm(shapes, desc=f"tuning {device}", unit="shape", file=sys.stderr, position=position,
               disable=None if opts.progress else True)
    for s, problem in zip(bar, problems):
        ks = key_str(problem.key)
        row = {"key": ks, "op": opts.op if not s.experts else problem.call, "experts": s.experts, "m": s.m,
               "m_bucket": m_bucket(s.m), "n": s.n, "k": s.k,
               "layers": list(s.layers), "out_dtype": opts.out_dtype, "tuned_by": tuned_by,
               "source": "cache" if ks in cached else "tuned"}
        bar.set_postfix_str(ks)  # the key being decided (the slow part: compiles, checks, timing)
        t0 = time.perf_counter()
        try:
            entry = d.entry_for(problem)
        except FP4DispatchError as e:  # no usable backend, or FP4DISPATCH_BACKEND names one that cannot run
            row.update(status="no_backend", reasons=getattr(e, "reasons", None) or {"error": str(e)})
            rows.append(row)
            continue
        finally:
            stage["decide"] += time.perf_counter() - t0
        if entry is None:  # a forced backend (FP4DISPATCH_BACKEND) decides without tuning
            entry = {"backend": d.choose(problem).backend.name, "mode": "forced"}
        row.update(status="ok", **_summarize(entry, s.n, s.k))
        row["cublas_bf16_us"] = row["speedup_vs_cublas_bf16"] = None
        if device.type == "cuda":
            t0 = time.perf_counter()
            row["cublas_bf16_us"] = _bf16_baseline_us(row["tuned_at_m"], s.n, s.k, device, d.settings.timer)
            stage["baseline"] += time.perf_counter() - t0
            if row["time_us"]:
                row["speedup_vs_cublas_bf16"] = round(row["cublas_bf16_us"] / row["time_us"], 3)
        rows.append(row)
    bar.close()
    if seconds is not None:
        seconds.update({k: round(v, 2) for k, v in stage.items()})
    return rows


def backend_rows(d: Dispatcher, device: torch.device, ops: tuple[str, ...] = ("fp4_mm",)) -> list[dict]:
    """Per backend on ``device``: status, reason, and how many decided keys it won. The backends of ``ops`` are
    probed (``fp4_mm``'s by default: ``auto_mode_notes`` goes by them); another op's that the run did not need are
    listed as not probed."""
    native = {b.name for b in d.backends if getattr(b, "fp4_tensor_cores", False)}
    return [{"device": str(device), "name": r.name, "status": r.status, "reason": r.reason, "wins": len(r.wins),
             "fp4_tensor_cores": r.name in native} for r in d.report(device, ops)]


def auto_mode_notes(backends: list[dict]) -> list[str]:
    """Per device of ``backend_rows``: what ``Fp4Linear(mode="auto")`` runs there and why."""
    notes = []
    for dev in sorted({b["device"] for b in backends}):
        native = [b["name"] for b in backends if b["device"] == dev and b.get("fp4_tensor_cores")
                  and b["status"] == "ok"]
        notes.append(f"Fp4Linear(mode='auto') on {dev}: " + (f"W4A4 ({native[0]} runs on FP4 tensor cores)" if native
                     else "W4A16 (no backend on FP4 tensor cores is healthy here)"))
    return notes


# -- torchrun ranks ----------------------------------------------------------------------------------------------
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def torchrun_detected() -> bool:
    """True when running as one rank of a torch.distributed job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return all(os.environ.get(k) for k in _TORCHRUN_ENV)


@contextmanager
def process_group() -> Iterator[tuple[int, int, torch.device]]:
    """``(rank, world_size, device)``; creates the default group when torchrun's env is set but nobody has yet."""
    import torch.distributed as dist

    made = False
    if not dist.is_initialized():
        _check_ranks()
        if torch.cuda.is_available():
            torch.cuda.set_device(_local_gpu())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        made = True
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        if made:
            dist.destroy_process_group()


def _check_ranks() -> None:
    """torchrun's RANK and WORLD_SIZE, before the group waits for its ranks (a rank past the world waited forever)."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(f"torchrun: RANK must be an integer in 0..WORLD_SIZE-1 and WORLD_SIZE a positive integer; "
                         f"got RANK={rank!r}, WORLD_SIZE={world!r}. Launch with torchrun, which sets them")


def _local_gpu() -> int:
    """This rank's GPU: ``LOCAL_RANK``, which must name a visible one (nccl gives each rank a GPU of its own)."""
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise ValueError(f"torchrun: LOCAL_RANK={local} needs GPU {local}, but this machine has {count} visible "
                         f"GPU(s); start at most {count} process(es) per node (--nproc-per-node {count}), or tune on "
                         "the CPU with CUDA_VISIBLE_DEVICES=\"\"")
    return local


def run_torchrun(shapes: list, opts, backends=None, do_bench=None) -> dict:
    """Tune this rank's share of ``shapes``, all-gather every rank's rows and decision records, adopt the others'.

    Returns ``{"rank", "world_size", "device", "rows", "backends"}``; ``rows`` are the same on every rank.
    """
    import torch.distributed as dist

    with process_group() as (rank, world, device):
        d = make_dispatcher(opts, backends, do_bench)
        mine = tune_rows(d, device, shapes[rank::world], opts, tuned_by=f"rank{rank}", position=0)
        decisions = d.cache_for(device).decisions
        entries = {r["key"]: decisions[r["key"]] for r in mine if r["key"] in decisions}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (mine, entries))
        others = {}
        for r, (_, e) in enumerate(gathered):
            if r != rank:
                others.update(e)
        # in memory only: the rank that tuned a key already wrote it, so the file holds each decision once
        d.adopt_decisions(others, device, persist=False)
        rows = sorted((row for rs, _ in gathered for row in rs), key=_row_order)
        return {"rank": rank, "world_size": world, "device": str(device), "rows": rows,
                "backends": backend_rows(d, device)}


def _row_order(row: dict) -> tuple:
    return row["n"], row["k"], row["m_bucket"]


# -- --devices: one worker process per GPU -----------------------------------------------------------------------
def resolve_devices(spec: str) -> list[str]:
    """``"all"`` or ``"0,1"`` -> ``["cuda:0", "cuda:1"]``; raises ValueError naming the problem."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--devices {spec}: no CUDA device is visible (torch.cuda.is_available() is False); "
                         "--devices needs GPUs. Drop --devices to tune on this machine's CPU")
    if spec.strip() == "all":
        return [f"cuda:{i}" for i in range(count)]
    out = []
    for item in spec.split(","):
        try:
            i = int(item)
        except ValueError:
            raise ValueError(f"--devices must be 'all' or a comma list of GPU indices like 0,1; got {spec!r}") from None
        if not 0 <= i < count:
            raise ValueError(f"--devices: GPU index {i} does not exist; this machine has {count} visible GPU(s) "
                             f"(0..{count - 1})")
        if f"cuda:{i}" not in out:
            out.append(f"cuda:{i}")
    return out


def split_shares(devices: list[str], shapes: list) -> list[list]:
    """Per device, the shapes it tunes: devices with equal fingerprints share a cache file, so they split the list
    round-robin; a device of another kind tunes every shape."""
    groups: dict[str, list[int]] = {}
    for i, dev in enumerate(devices):
        groups.setdefault(fingerprint_hash(device_fingerprint(torch.device(dev))), []).append(i)
    shares: list[list] = [[] for _ in devices]
    for members in groups.values():
        for j, s in enumerate(shapes):
            shares[members[j % len(members)]].append(s)
    return shares


def _child_env(devices: int) -> None:
    # NVLink multicast (NVLS) must stay off on the shared test machines; no child uses NCCL, but keep it safe
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # the device processes compile at once: each gets its share of the cores for its compile workers, unless the
    # variable says otherwise (empty or blank is unset, as read_settings reads it)
    if not os.environ.get("FP4DISPATCH_COMPILE_WORKERS", "").strip():
        os.environ["FP4DISPATCH_COMPILE_WORKERS"] = str(worker_count(devices))


def _device_job(device: str, shapes: list, opts, position: int, devices: int) -> dict:
    _child_env(devices)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    d = make_dispatcher(opts)
    rows = tune_rows(d, dev, shapes, opts, tuned_by=device, position=position)
    return {"device": device, "rows": rows, "backends": backend_rows(d, dev), "error": None}


def main() -> None:
    """A device process: one ``_device_job`` from stdin; its result, or ("error", why), on the answer pipe."""
    worker_process.log_to_parent()
    worker_process.serve_job(_device_job, lambda why: ("error", why))


def run_on_devices(devices: list[str], shapes: list, opts) -> list[dict]:
    """Tune in one process per device, all at once; one result dict per device (``error`` and ``unfinished``, its
    share of the shapes, set if its process failed or died)."""
    shares = split_shares(devices, shapes)
    workers, results = [], []
    try:
        for i, dev in enumerate(devices):
            workers.append(worker_process.start_job(__name__, pickle.dumps((dev, shares[i], opts, i, len(devices)))))
        for dev, share, (proc, answers) in zip(devices, shares, workers):
            try:
                answer = worker_process.read_answer(answers, None)
            except EOFError:
                answer = ("error", f"it died, exit code {proc.wait()}")
            if isinstance(answer, tuple):
                answer = {"device": dev, "rows": [], "backends": [], "unfinished": share, "error": answer[1]}
            results.append(answer)
    finally:
        for proc, answers in workers:
            answers.close()
            proc.stdin.close()
            if proc.poll() is None and len(results) < len(devices):  # interrupted: the others are not waited for
                proc.kill()
            proc.wait()
    return results


def merge_device_results(results: list[dict]) -> tuple[list[dict], list[dict], list[str]]:
    """One sorted row list, the backend records of every device, and a note per device whose process failed or died
    (its unfinished shapes become ``error`` rows, so the run exits 1)."""
    rows, backends, notes = [], [], []
    for res in results:
        rows += res["rows"]
        backends += res["backends"]
        if res["error"]:
            notes.append(f"{res['device']}: its tuning process failed ({res['error']})")
            rows += [{"key": ("" if not s.experts else f"grouped-e{s.experts}-") + f"m{m_bucket(s.m)}-n{s.n}-k{s.k}",
                      "m": s.m, "m_bucket": m_bucket(s.m), "n": s.n,
                      "k": s.k, "layers": list(s.layers), "tuned_by": res["device"], "status": "error",
                      "error": res["error"]} for s in res["unfinished"]]
    return sorted(rows, key=_row_order), backends, notes
