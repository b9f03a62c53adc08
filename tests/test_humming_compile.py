"""Humming's kernels for a shape's other M buckets, compiled in the background (backends/humming_compile.py), on CPU
against the Humming emulator (tests/_native_fakes.py): which keys start it, which kernels it compiles and in what
order, that it never loads a kernel into the CUDA driver, and that a failure stays a record. The GPU half (the cubins
are the ones a later first run uses, and a CUDA graph captured meanwhile is sound) is in tests/test_gpu_humming.py."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import _native_fakes as fakes
from fp4dispatch.backends import humming, humming_compile
from fp4dispatch.backends.humming import HummingBackend
from fp4dispatch.backends.humming_grouped import HummingGroupedBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.problem import Problem
from fp4dispatch.testing import make_operands

CPU = torch.device("cpu")
N, K = 128, 256
# Humming's table for the shape: the config of lo < M <= hi (Stream-K on, as its heuristics give it)
TABLE = [[0, 1, {"block_m": 16, "use_stream_k": True}], [1, 16, {"block_m": 32, "use_stream_k": True}],
         [16, 128, {"block_m": 64, "use_stream_k": True, "num_sms": 132}],
         [128, 1 << 30, {"block_m": 128, "use_stream_k": True}]]


@pytest.fixture
def fake(cc, monkeypatch):
    """The emulator installed as ``humming`` on a faked SM90, this module's records fresh, one compile at a time
    (so that the order is the hand-out order)."""
    assert humming_compile.wait_idle(60)  # another test's jobs (its own emulator's) are over before these records
    cc(90)
    f = fakes.FakeHumming()
    f.heuristics = [[lo, hi, dict(cfg)] for lo, hi, cfg in TABLE]
    mod = f.module("0.1.20", 90)
    monkeypatch.setitem(sys.modules, "humming", mod)
    for sub in ("layer", "forward", "tune", "kernel"):
        monkeypatch.setitem(sys.modules, f"humming.{sub}", getattr(mod, sub))
    monkeypatch.setattr(humming_compile, "_seen", set())
    monkeypatch.setattr(humming_compile, "started", [])
    monkeypatch.setattr(humming_compile, "failures", [])
    monkeypatch.setattr(humming_compile, "_workers", lambda lib: 1)
    return f


def _call(d: Dispatcher, m: int):
    ops = make_operands(Problem(m, N, K, torch.bfloat16, CPU), seed=m)
    return d.fp4_mm(ops.a, ops.b, ops.a_scale, ops.b_scale, ops.alpha)


def _block_ms(f) -> list[int]:
    return [c["block_m"] for c in f.kernel_class.compiled]


def test_a_key_decided_on_its_first_call_compiles_the_shapes_other_buckets_nearest_first(fake, tmp_path):
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    _call(d, 4)
    assert humming_compile.wait_idle(60)
    # the table's entries but the one of M = 4's bucket (the key's own first run compiles it), those nearest M = 4
    # first; never loaded into the CUDA driver, and let go of
    assert _block_ms(fake) == [16, 64, 128]
    assert fake.kernel_class.registered == [] and fake.kernel_class._instances == {}
    first = fake.kernel_class.compiled[0]
    # the kernel config as Humming's prepare_kernels makes it: the layer's (less sublayer_name) and the entry's,
    # Stream-K off, num_sms left to the launch
    assert first["shape_n"] == N and first["shape_k"] == K and first["sm_version"] == 90
    assert "sublayer_name" not in first and first["use_stream_k"] is False
    assert "num_sms" not in fake.kernel_class.compiled[1]
    # the shape's next key (another bucket) hands out nothing new
    _call(d, 64)
    assert humming_compile.wait_idle(60) and len(fake.kernel_class.compiled) == 3
    assert humming_compile.failures == []


def test_the_background_compile_is_switched_off_by_its_knob_and_a_bad_value_is_named(fake, tmp_path, monkeypatch):
    from fp4dispatch.errors import InvalidInputError

    monkeypatch.setenv("FP4DISPATCH_BACKGROUND_COMPILE", "0")
    _call(Dispatcher([HummingBackend()], cache_dir=tmp_path), 4)
    assert humming_compile.wait_idle(60) and fake.kernel_class.compiled == [] and humming_compile.started == []
    monkeypatch.setenv("FP4DISPATCH_BACKGROUND_COMPILE", "sometimes")
    with pytest.raises(InvalidInputError, match=r"^FP4DISPATCH_BACKGROUND_COMPILE='sometimes' is not valid; accepted: "
                                                r"1/true/yes/on or 0/false/no/off\. Unset it for the default '1'$"):
        Dispatcher([HummingBackend()], cache_dir=tmp_path)


def test_keys_warmed_up_together_compile_no_other_bucket(fake, tmp_path):
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    d.warmup([(4, N, K), (64, N, K)], device=CPU)
    _call(d, 4)  # decided by the warmup
    assert humming_compile.wait_idle(60) and fake.kernel_class.compiled == [] and humming_compile.started == []


def test_a_kernel_that_fails_to_compile_is_recorded_and_the_rest_still_compile(fake, tmp_path):
    fake.heuristics[2][2]["fail"] = True
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    out = _call(d, 4)
    assert humming_compile.wait_idle(60)
    assert torch.isfinite(out.float()).all()
    assert _block_ms(fake) == [16, 128]
    assert len(humming_compile.failures) == 1 and "NVRTC failed with exit code 1" in humming_compile.failures[0]


def test_nothing_is_compiled_for_a_gpu_of_another_architecture_than_the_threads(fake, tmp_path):
    sys.modules["humming"].device.current_device.sm_version = 80  # device 0, as Humming sees it in a new thread
    d = Dispatcher([HummingBackend()], cache_dir=tmp_path)
    _call(d, 4)
    assert humming_compile.wait_idle(60)
    assert fake.kernel_class.compiled == [] and humming_compile.started == []


def test_a_layer_not_prepared_yet_compiles_its_table_once_its_first_run_prepares_it(fake):
    problem = Problem(4, N, K, torch.bfloat16, CPU)
    b = HummingBackend()
    b.unavailable(CPU)
    b.compile_other_buckets(problem)  # the key's tune has not run it yet: its layer config is not known
    assert humming_compile.wait_idle(60) and fake.kernel_class.compiled == []
    b.run(problem, make_operands(problem, seed=1), {})  # its first run prepares the layer: the table is handed out
    assert humming_compile.wait_idle(60) and _block_ms(fake) == [16, 64, 128]


def test_a_hand_out_that_raises_inside_the_first_run_leaves_that_run_right(fake, monkeypatch):
    from fp4dispatch.backends.reference import reference_mm

    def broken(*args, **kwargs):
        raise RuntimeError("humming changed its kernel class")
    monkeypatch.setattr(humming, "compile_later", broken)
    problem = Problem(4, N, K, torch.bfloat16, CPU)
    b = HummingBackend()
    b.unavailable(CPU)
    b.compile_other_buckets(problem)  # handed out from the first run's _prepare, where a raise would fail the run
    ops = make_operands(problem, seed=1)
    b.run(problem, ops, {})
    torch.testing.assert_close(ops.out.float(), reference_mm(problem, ops).to(torch.bfloat16).float(), rtol=8e-3,
                               atol=1e-2)
    assert b.wanted == {} and fake.kernel_class.compiled == []


def test_a_grouped_layer_or_no_gpu_compiles_nothing_ahead(fake, cc):
    grouped = Problem(4, N, K, torch.bfloat16, CPU, experts=2)
    g = HummingGroupedBackend()
    g.unavailable(CPU)
    g.compile_other_buckets(grouped)  # its first run compiles its one table whole: nothing is left for later
    assert g.wanted == {}
    cc(None)
    problem = Problem(4, N, K, torch.bfloat16, CPU)
    b = HummingBackend()
    b.compile_other_buckets(problem)
    b.layers[humming._shape(problem)] = (fakes.FakeLayerConfig(n=N, k=K, dtype=torch.bfloat16), TABLE)
    b.compile_other_buckets(problem)
    assert humming_compile.wait_idle(60) and fake.kernel_class.compiled == [] and humming_compile.started == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a niceness per thread is Linux's")
def test_the_compilers_run_at_the_lowest_priority_and_the_caller_keeps_its_own(fake, tmp_path):
    fake.heuristics[0][2]["run_compiler"] = True
    before = os.getpriority(os.PRIO_PROCESS, 0)
    _call(Dispatcher([HummingBackend()], cache_dir=tmp_path), 4)
    assert humming_compile.wait_idle(60) and humming_compile.failures == []
    assert fake.kernel_class.compiler_nice == [humming_compile.NICE]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_as_many_compiles_at_once_as_hummings_own_parallel_build(monkeypatch):
    lib = types.SimpleNamespace(utils=types.SimpleNamespace(cpu=types.SimpleNamespace(
        get_parallel_build_workers=lambda: 3)))  # its rule: the CPUs this process may use, HUMMING_MAX_... caps it
    assert humming_compile._workers(lib) == 3
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert humming_compile._workers(types.SimpleNamespace()) == cpus  # a release without it


def test_a_process_that_is_exiting_starts_no_more_compiles(fake, tmp_path, monkeypatch):
    stopping = humming_compile.threading.Event()
    monkeypatch.setattr(humming_compile, "_stopping", stopping)
    stopping.set()  # what the atexit hook does
    _call(Dispatcher([HummingBackend()], cache_dir=tmp_path), 4)
    assert humming_compile.wait_idle(60) and fake.kernel_class.compiled == [] and humming_compile.started == []


def test_the_compile_threads_do_not_keep_a_process_alive(fake, tmp_path):
    _call(Dispatcher([HummingBackend()], cache_dir=tmp_path), 4)
    assert humming_compile.wait_idle(60)
    assert humming_compile._threads and all(t.daemon for t in humming_compile._threads)
