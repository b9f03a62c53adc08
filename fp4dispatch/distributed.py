"""Tuning on several devices: under torchrun (ranks split the shapes and all-gather the decisions) and ``--devices``
(one spawned process per GPU).

torchrun mode is on when ``torch.distributed`` is already initialized (any backend, gloo included) or when
``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set; in the latter case the default group is created here --
``nccl`` when CUDA is available (device ``cuda:$LOCAL_RANK``), ``gloo`` otherwise -- and destroyed at the end.
Each rank tunes ``shapes[rank::world]`` (its decisions reach the disk cache as usual), the ranks all-gather the
decision records, each adopts the others' in memory only, and every rank returns the same rows. On a shared
filesystem the cache file therefore gets each decision from exactly one rank.

``--devices`` spawns one process per device. Devices whose fingerprints are equal (same GPU model, driver and
libraries) share one cache file, so they split the shape list among themselves instead of each tuning it all.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import torch

from .fingerprint import device_fingerprint, fingerprint_hash

__all__ = ["torchrun_detected", "process_group", "run_torchrun", "run_on_devices", "resolve_devices", "split_shares"]

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
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        made = True
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        yield dist.get_rank(), dist.get_world_size(), device
    finally:
        if made:
            dist.destroy_process_group()


def run_torchrun(shapes: list, opts, backends=None, do_bench=None) -> dict:
    """Tune this rank's share of ``shapes``, all-gather every rank's rows and decision records, adopt the others'.

    Returns ``{"rank", "world_size", "device", "rows", "backends"}``; ``rows`` are the same on every rank.
    """
    import torch.distributed as dist

    from .tune import backend_rows, make_dispatcher, tune_rows

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


def _child_env() -> None:
    # NVLink multicast (NVLS) must stay off on the shared test machines; no child uses NCCL, but keep it safe
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def _device_job(device: str, shapes: list, opts, position: int) -> dict:
    from .tune import backend_rows, make_dispatcher, tune_rows

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    d = make_dispatcher(opts)
    rows = tune_rows(d, dev, shapes, opts, tuned_by=device, position=position)
    return {"device": device, "rows": rows, "backends": backend_rows(d, dev), "error": None}


def run_on_devices(devices: list[str], shapes: list, opts) -> list[dict]:
    """Tune in one spawned process per device; one result dict per device (``error`` and ``unfinished``, its share
    of the shapes, set if its process died)."""
    shares = split_shares(devices, shapes)
    ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
    results = []
    with ProcessPoolExecutor(max_workers=len(devices), mp_context=ctx, initializer=_child_env) as ex:
        futures = [ex.submit(_device_job, dev, shares[i], opts, i) for i, dev in enumerate(devices)]
        for dev, share, fut in zip(devices, shares, futures):
            try:
                results.append(fut.result())
            except Exception as e:  # noqa: BLE001 - a crashed device must not hide the others' results
                results.append({"device": dev, "rows": [], "backends": [], "unfinished": share,
                                "error": f"{type(e).__name__}: {e}".strip(": ")})
    return results
