"""GPU test of the tuner's compile-ahead phase (issue 34): in a fresh process with an empty Triton cache, the compile
of every Triton kernel of a key's candidates is handed out before the checks, none started by a check (each
candidate is checked once its own compiles are over, while the others' go on), and every candidate still computes
its check right (the checks and timings run the kernels compiled ahead); many keys' kernels are handed out
at once and the keys decided while they compile."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the tests below skip without CUDA anyway
    triton = None

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: Triton compiles the candidates' kernels for it")

_SCRIPT = r"""
import json, sys, torch
from triton import knobs
from fp4dispatch.backends.triton_dequant import TritonDequantBackend
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.backends.triton_w4a16 import TritonW4A16Backend
from fp4dispatch.dispatch import tuner
from fp4dispatch.problem import Problem

phase, seen = ["ahead"], []
# a compile starts (handed out ahead, or by a launch that finds no kernel): the checks must start none
knobs.runtime.jit_cache_hook = lambda **kw: seen.append(phase[0])
from contextlib import contextmanager
ahead = tuner.compile_ahead
@contextmanager
def marked(*args):
    with ahead(*args) as handed_out:
        phase[0] = "check"
        yield handed_out
tuner.compile_ahead = marked
m, adt, backend = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
b = {"fused": TritonFusedBackend, "w4a16": TritonW4A16Backend, "dequant": TritonDequantBackend}[backend]()
p = Problem(m, 3072, 4096, torch.bfloat16, torch.device("cuda"), adt)
tuning = tuner.tune(p, [b], lambda fn: 1.0)
print(json.dumps({"ahead": seen.count("ahead"), "check": seen.count("check"),
                  "trials": [[str(t.config), t.reason] for t in tuning.trials], "seconds": tuning.seconds}))
"""


@pytest.mark.parametrize("m,adt,backend", [(16, "uint8", "fused"), (300, "uint8", "fused"),
                                           (4, "bfloat16", "w4a16"), (16, "uint8", "dequant"),
                                           (4, "bfloat16", "dequant")])
def test_every_kernel_compiles_ahead_and_the_checks_pass(tmp_path, m, adt, backend):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(m), adt, backend], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["trials"] and all(reason == "" for _, reason in got["trials"]), got["trials"]
    assert got["ahead"] >= 1  # configs may share kernels (a pre-decode of A, one kernel for two K splits)
    assert got["check"] == 0, got


_WARMUP = r"""
import json, sys, threading, torch
from triton import knobs
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.dispatch import precompile
from fp4dispatch.dispatch.dispatcher import Dispatcher

phase, seen = ["probe"], []
knobs.runtime.jit_cache_hook = lambda **kw: seen.append((phase[0], threading.current_thread().name, kw.get("repr")))
ahead = precompile.compile_keys_ahead
def marked(jobs, *rest):
    phase[0] = "keys"
    ahead(jobs, *rest)
precompile.compile_keys_ahead = marked
d = Dispatcher([TritonFusedBackend()], cache_dir=sys.argv[1])
choices = d.warmup([(1, 3072, 4096), (16, 3072, 4096), (300, 3072, 4096)])
keys = [(t, r) for p, t, r in seen if p == "keys"]
entries = d.cache_for("cuda").decisions.values()
print(json.dumps({"handed_out": sum(t == "fp4dispatch-compile-keys" for t, _ in keys),
                  "elsewhere": [[t, str(r)[:300]] for t, r in keys if t != "fp4dispatch-compile-keys"],
                  "modes": [e["mode"] for e in entries],
                  "failed": [t for e in entries for t in e["ranking"] if t.get("reason")]}))
"""


def test_warmup_hands_out_every_kernel_of_its_keys_and_decides_them_on_those_kernels(tmp_path):
    """Every kernel compiled after the probe was handed out by ``compiling_keys``' thread: the decisions, made while
    those compiles ran, compiled nothing themselves, and every trial ran right on the kernels whose compiles they
    waited for."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    p = subprocess.run([sys.executable, "-c", _WARMUP, str(tmp_path / "cache")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["handed_out"] >= 3 and got["elsewhere"] == [] and got["failed"] == [], got
    assert got["modes"] == ["tuned"] * 3


if triton is not None:
    @triton.jit
    def _plus_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


def test_a_kernel_handed_out_and_finished_by_another_thread_is_launched_without_a_compile():
    """``compiling_keys``' thread hands a compile out (``compiles_ahead.collect``) and waits for it (``runtime.finish``)
    while its async mode is still open; the caller's thread then launches the kernel without compiling it again
    (Triton 3.6 keeps a handed-out kernel in the async mode only, until it is waited for), and right."""
    import threading

    from triton import knobs

    from fp4dispatch.kernels import runtime

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    y = torch.full_like(x, float("nan"))
    finished, release, seen, compiled_in = threading.Event(), threading.Event(), [], []

    def hand_out():
        with runtime.compiles_ahead(2) as ctx:
            kernels = ctx.collect()
            runtime.launch(_plus_one, (4,), x, y, 1000, BLOCK=256)
            torch.cuda.synchronize()
            seen.append((ctx.active, len(kernels), bool(torch.isnan(y).all())))  # handing out launches nothing
            runtime.finish(kernels)
            finished.set()
            release.wait(120)

    hook = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: compiled_in.append(threading.current_thread().name)
    worker = threading.Thread(target=hand_out, name="hand-out")
    worker.start()
    try:
        assert finished.wait(120) and seen == [(True, 1, True)]
        runtime.launch(_plus_one, (4,), x, y, 1000, BLOCK=256)
        torch.cuda.synchronize()
        assert torch.equal(y, x + 1)
    finally:
        release.set()
        worker.join()
        knobs.runtime.jit_cache_hook = hook
    assert compiled_in == ["hand-out"]


def test_the_graph_timer_captures_while_another_thread_allocates_and_synchronizes(caplog):
    """The tuner screens a key's candidates while a library's first run makes CUDA calls in another thread
    (key_compiles.FirstRuns): the timer's capture is thread_local, so those calls neither fail nor void it, and the
    candidate gets a graph time, not the eager fallback ("capture refused")."""
    import logging
    import threading

    from fp4dispatch.dispatch.timer import cuda_graph_do_bench

    stop, errors, rounds = threading.Event(), [], [0]

    def busy():
        size = 1 << 20
        while not stop.is_set():
            try:
                x = torch.empty(size, device="cuda")  # a new size each round: a cudaMalloc, not the allocator's cache
                x.fill_(1.0)
                torch.cuda.current_stream().synchronize()
                del x
                torch.cuda.empty_cache()
                size += 4096
                rounds[0] += 1
            except Exception as e:  # noqa: BLE001 - the assertion below reports it
                errors.append(repr(e))
                return

    x = torch.zeros(1 << 22, device="cuda")
    worker = threading.Thread(target=busy)
    with caplog.at_level(logging.DEBUG, logger="fp4dispatch"):
        worker.start()
        try:
            times = [cuda_graph_do_bench(lambda: x.add_(1.0), rep=5) for _ in range(5)]
        finally:
            stop.set()
            worker.join()
    assert errors == [] and rounds[0] > 0
    assert "capture refused" not in caplog.text and all(0 < t < 1 for t in times), (times, caplog.text)
