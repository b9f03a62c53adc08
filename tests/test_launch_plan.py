"""Launch plans (fp4dispatch/kernels/plan.py) and kept scratch (workspace.py) on the CPU, with a fake Triton: a fake
JIT function whose ``[grid]`` returns a fake compiled kernel, whose launcher is shaped like Triton 3.6's (a C
function, wrapped by a closure that expands descriptor parameters). The GPU side (plans replayed on real kernels
against the reference) is in tests/test_triton_gpu.py."""
from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import threading
import weakref

import pytest
import torch

from fp4dispatch.kernels import plan, runtime, workspace


def _kernel(a_ptr, w_desc, out_ptr, ws_ptr, cnt_ptr, M, N, BLOCK=8):
    """The fake kernel's signature (what runtime.launch reads of a JIT function)."""


@dataclasses.dataclass
class FakeDesc:
    """What plan.py reads of a host TMA descriptor (Gluon's is a dataclass with these fields)."""
    base: object
    shape: list
    strides: list
    block_shape: list


class FakeLauncher:
    def __init__(self, calls: list, desc_indices=(1,), scratch=0):
        self.calls = calls
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.launch = self._wrap(self._c_launch, set(desc_indices), [{"meta": i} for i in desc_indices])

    def _c_launch(self, *args):  # stands for the compiled C launcher
        self.calls.append(args)

    @staticmethod
    def _wrap(launcher, tensordesc_indices, tensordesc_meta):  # Triton 3.6's wrap_handle_tensordesc, reduced
        def inner(*args):
            assert tensordesc_indices is not None and tensordesc_meta is not None
            return launcher(*args)
        return inner


class FakeCompiled:
    def __init__(self, calls: list, **kw):
        self.run = FakeLauncher(calls, **kw)
        self.function = 0xF00
        self.packed_metadata = (4, 1, 0)

    def __getitem__(self, grid):
        return lambda *args: None


class FakeJit:
    def __init__(self, compiled: FakeCompiled):
        self.signature = inspect.signature(_kernel)
        self.compiled = compiled
        self.first_launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.first_launches += 1
            return self.compiled
        return launch


@pytest.fixture()
def fake_cuda(monkeypatch):
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)
    monkeypatch.setattr(runtime, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "raw_stream", lambda idx: 0x5157)
    monkeypatch.setattr(runtime, "launch_hooks_set", lambda: False)
    monkeypatch.setattr(runtime, "capturing", lambda: False)
    monkeypatch.setattr(workspace, "_SCRATCH", {})
    monkeypatch.setattr(workspace, "_COUNTERS", {})


def _ops(m=4, n=32, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 255, (m, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(0, 255, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.zeros(128, 4, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8),
            torch.ones(1), torch.empty(m, n, dtype=torch.bfloat16))


def _family_run(fn, split=True):
    """A kernel family's run: scratch, counters, a descriptor over the weight, one launch."""
    def run(a, b, sa, sb, alpha, out):
        ws = workspace.scratch("splitk", (2, a.shape[0], b.shape[0]), torch.float32, a.device)
        cnt = workspace.counters(64, a.device)
        desc = FakeDesc(runtime.Address(b.data_ptr(), torch.int64), [b.shape[0], 4], [4, 1], [8, 2])
        runtime.launch(fn, (3, 2), a, desc, out, ws, cnt, a.shape[0], b.shape[0], BLOCK=16)
    return run


class Expand:
    def __init__(self):
        self.made = []

    def __call__(self, desc, meta):
        self.made.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["meta"]), *desc.shape, *desc.strides]


def _plan(ops, calls, expand, **kw):
    fn = FakeJit(FakeCompiled(calls, **kw))
    run = _family_run(fn)
    rec = plan.record(lambda: run(*ops))
    return plan.build(rec, ops, "cfg", torch.device("cpu"), expand), fn


def test_replay_binds_the_new_addresses_and_keeps_constants(fake_cuda):
    calls, expand = [], Expand()
    ops = _ops()
    (p, why), _ = _plan(ops, calls, expand)
    assert p is not None, why
    assert [n[0] for n in p.needs] == ["scratch", "counters"]
    new = _ops(seed=1)
    assert p(*new)
    args = calls[-1]
    ws_ptr = workspace._SCRATCH[("cpu", 0x5157, threading.get_ident(), "splitk")].data_ptr()  # kept for the (fake) current stream
    cnt_ptr = workspace._COUNTERS[workspace._key(torch.device("cpu"), None)].data_ptr()
    # grid, stream, function, cooperative, pdl, 2 scratch, metadata, launch metadata, 2 hooks
    assert args[:13] == (3, 2, 1, 0x5157, 0xF00, False, True, None, None, (4, 1, 0), None, None, None)
    # a, the descriptor's map + shape + strides, out, scratch, counters, M, N, BLOCK
    assert args[13:] == (new[0].data_ptr(), ("map", new[1].data_ptr(), 1), 32, 4, 4, 1, new[5].data_ptr(), ws_ptr,
                           cnt_ptr, 4, 32, 16)


def test_descriptor_map_is_made_once_per_address_and_survives_in_place_writes(fake_cuda):
    calls, expand = [], Expand()
    ops = _ops()
    (p, _), _ = _plan(ops, calls, expand)
    made = len(expand.made)
    for _ in range(3):
        assert p(*ops)
    ops[1].copy_(torch.randint(0, 255, ops[1].shape, dtype=torch.uint8))  # new values, same address: same map
    assert p(*ops)
    assert len(expand.made) == made
    b2 = ops[1].clone()  # another weight of the layer shape: one more map
    assert p(ops[0], b2, *ops[2:])
    assert expand.made[-1] == b2.data_ptr() and len(expand.made) == made + 1
    assert calls[-1][14] == ("map", b2.data_ptr(), 1)


def test_descriptor_cache_is_bounded_and_keeps_no_tensor_alive(fake_cuda, monkeypatch):
    monkeypatch.setattr(plan, "MAX_DESCRIPTORS", 2)
    calls, expand = [], Expand()
    ops = _ops()
    (p, _), _ = _plan(ops, calls, expand)
    weights = [ops[1].clone() for _ in range(5)]
    for w in weights:
        assert p(ops[0], w, *ops[2:])
    d = p.launches[0].descriptors[0][3]
    assert 1 <= len(d.cache) <= 2
    ref = weakref.ref(weights[-1])
    del weights, w
    gc.collect()
    assert ref() is None  # the plan holds addresses, never the weight


@pytest.mark.parametrize("case", ["unaligned", "shared", "foreign", "global_scratch", "descriptor_index", "hooks"])
def test_a_plan_is_refused_or_gives_way_when_it_could_be_wrong(fake_cuda, monkeypatch, case):
    calls, expand = [], Expand()
    ops = _ops()
    if case == "unaligned":
        base = torch.empty(ops[5].numel() * 2 + 8, dtype=torch.bfloat16)
        out = base[1:1 + ops[5].numel()].view(ops[5].shape)
        assert plan.unplannable((*ops[:5], out)) == "an operand is not 16-byte aligned"
        return
    if case == "shared":
        assert plan.unplannable((ops[0], ops[0], *ops[2:])) == "two operands share an address"
        return
    if case == "foreign":
        fn = FakeJit(FakeCompiled(calls))
        stray = torch.empty(8)
        rec = plan.record(lambda: runtime.launch(fn, (1,), stray, None, ops[5], ops[5], ops[5], 1, 1))
        p, why = plan.build(rec, ops, "cfg", torch.device("cpu"), expand)
        assert p is None and why == "parameter 0 is a tensor that is none of the operands or scratch buffers"
        return
    if case == "global_scratch":
        (p, why), _ = _plan(ops, calls, expand, scratch=128)
        assert p is None and why == "the kernel needs global or profiling scratch, which Triton allocates per launch"
        return
    if case == "descriptor_index":
        (p, why), _ = _plan(ops, calls, expand, desc_indices=(2,))
        assert p is None and why == "parameter 1 is a descriptor the launcher does not expand"
        return
    (p, why), _ = _plan(ops, calls, expand)
    monkeypatch.setattr(runtime, "launch_hooks_set", lambda: True)
    n = len(calls)
    assert p(*ops) is False and len(calls) == n  # a profiler's hook must see the launch: ordinary path


def test_scratch_is_kept_per_stream_grown_and_never_kept_under_capture(fake_cuda):
    cpu = torch.device("cpu")
    keep: list = []

    def address(purpose, nbytes, capturing=False):
        return workspace.address(("scratch", purpose, nbytes), cpu, 0, capturing, keep)

    p1 = address("predecode", 1024)
    assert address("predecode", 512) == p1  # reused: no allocation per call
    assert workspace.scratch("predecode", (4, 64), torch.float32, cpu).data_ptr() == p1
    p2 = address("predecode", 4096)  # grown
    kept = workspace._SCRATCH[("cpu", 0, threading.get_ident(), "predecode")]
    assert kept.numel() >= 4096 and kept.data_ptr() == p2
    assert address("splitk", 64) != p2  # one buffer per purpose
    big = workspace.MAX_KEPT_BYTES + 16
    address("predecode", big)
    assert keep[-1].numel() == big and workspace._SCRATCH[("cpu", 0, threading.get_ident(), "predecode")] is kept
    keep.clear()
    c1, c2 = address("predecode", 256, True), address("predecode", 256, True)
    # a captured call gets its own memory from the graph's pool; the kept buffer is never handed to a graph
    assert len({c1, c2, kept.data_ptr()}) == 3 and len(keep) == 2
    assert workspace._SCRATCH[("cpu", 0, threading.get_ident(), "predecode")] is kept


def test_a_captured_replay_gets_fresh_scratch_and_an_eager_one_the_kept_buffer(fake_cuda, monkeypatch):
    """An eager replay reuses the kept buffer's address until the buffer is replaced (workspace.generation), then
    takes the new one; a captured replay never gets the kept buffer."""
    calls, expand = [], Expand()
    ops = _ops()
    (p, _), _ = _plan(ops, calls, expand)
    assert p(*ops)
    eager_ws = calls[-1][20]
    assert p(*ops) and calls[-1][20] == eager_ws
    cpu = torch.device("cpu")
    workspace.address(("scratch", "splitk", 1 << 16), cpu, 0x5157, False, [])  # another call grows the buffer
    assert p(*ops) and calls[-1][20] == workspace._SCRATCH[("cpu", 0x5157, threading.get_ident(), "splitk")].data_ptr() != eager_ws
    eager_ws = calls[-1][20]
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    assert p(*ops) and calls[-1][20] != eager_ws


def test_each_thread_gets_its_own_scratch_on_a_stream(fake_cuda):
    """Two threads queueing calls on one stream could interleave one call's pre-decode between another's pre-decode
    and GEMM: their kept buffers must differ."""
    cpu = torch.device("cpu")
    got = []

    def take():
        got.append(workspace.address(("scratch", "predecode", 1024), cpu, 0, False, []))
    take()
    t = threading.Thread(target=take)
    t.start()
    t.join()
    take()
    assert got[0] == got[2] != got[1]


def test_a_finished_threads_scratch_is_dropped_and_old_addresses_go_stale(fake_cuda):
    """A thread per request must not leave 64 MiB behind each, and a later thread that gets the same identifier
    must not be served an address read by the finished one (workspace.generation moves on)."""
    cpu = torch.device("cpu")
    seen = {}

    def work():
        workspace.address(("scratch", "predecode", 1024), cpu, 0, False, [])
        seen["ident"], seen["generation"] = workspace.thread_key(), workspace.generation
    t = threading.Thread(target=work)
    t.start()
    t.join()
    del t
    gc.collect()
    assert not [k for k in workspace._SCRATCH if k[2] == seen["ident"]]
    assert workspace.generation > seen["generation"]


def test_a_plan_whose_launcher_raises_is_dropped_with_a_warning(caplog):
    class Broken:
        def __call__(self, *ops):
            raise TypeError("function takes exactly 21 arguments")
    plans = plan.Plans("fp4_mm", lambda *a: None)
    key, cfg = ("k",), object()
    plans.table[key] = (cfg, Broken())
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        assert plans.replay(key, plans.table[key], ()) is False
    assert plans.table[key] == (cfg, None)  # the ordinary path from now on
    assert "the fp4_mm launch plan of" in caplog.text and "failed (TypeError: function takes exactly 21" in caplog.text


def test_a_cuda_error_in_a_plan_propagates_and_keeps_the_plan(caplog):
    """A CUDA error is the call's (the ordinary path would raise it too), not a sign that the launcher wants other
    arguments: the plan stays for the key's later calls (a voided capture once dropped it for the process)."""
    class Voided:
        def __call__(self, *ops):
            raise RuntimeError("Triton Error [CUDA]: operation failed due to a previous error during capture")
    plans = plan.Plans("fp4_mm", lambda *a: None)
    key, cfg, launcher = ("k",), object(), Voided()
    plans.table[key] = (cfg, launcher)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        with pytest.raises(RuntimeError, match="previous error during capture"):
            plans.replay(key, plans.table[key], ())
    assert plans.table[key] == (cfg, launcher) and "launch plan" not in caplog.text


def test_the_plans_of_an_op_record_once_per_key_replay_after_and_stay_bounded(fake_cuda, monkeypatch):
    """plan.Plans, as fp4_mm and w4a16_mm use it: the first call of a key runs the op's path once (recorded), later
    ones replay without it; another config or shape is another key; unplannable operands take the ordinary path
    every time; past MAX_PLANS the oldest key goes. A W4A16 call has five operands (no activation scales)."""
    monkeypatch.setattr(runtime, "compiling_ahead", lambda: False)
    monkeypatch.setattr(plan, "MAX_PLANS", 2)
    calls: list = []
    fn = FakeJit(FakeCompiled(calls))
    ordinary = []

    def run(a, b, sb, alpha, out, config):  # a w4a16_mm family's run: scratch, a descriptor over the weight, a launch
        ordinary.append(config)
        ws = workspace.scratch("permute_a", (a.shape[0], 64), torch.bfloat16, a.device)
        desc = FakeDesc(runtime.Address(b.data_ptr(), torch.int64), [b.shape[0], 4], [4, 1], [8, 2])
        runtime.launch(fn, (2, 1), ws, desc, out, a, sb, a.shape[0], b.shape[0], BLOCK=16)
    monkeypatch.setattr(plan, "_expand_descriptor", lambda: Expand())
    plans = plan.Plans("w4a16_mm", run)
    ops = (torch.randn(4, 64, dtype=torch.bfloat16), *_ops()[1:2], _ops()[3], torch.ones(1), _ops()[5])
    cfg, cfg2 = object(), object()
    plans(ops, cfg, (id(cfg), ops[0].shape, 0))
    assert ordinary == [cfg] and fn.first_launches == 1 and plans.table[(id(cfg), ops[0].shape, 0)][1] is not None
    for _ in range(3):
        plans(ops, cfg, (id(cfg), ops[0].shape, 0))
    assert ordinary == [cfg] and len(calls) == 3  # replayed: the op's path did not run again
    assert calls[-1][13] == workspace._SCRATCH[("cpu", 0x5157, threading.get_ident(), "permute_a")].data_ptr()
    assert calls[-1][19:22] == (ops[4].data_ptr(), ops[0].data_ptr(), ops[2].data_ptr())  # out, a, b_scale
    plans(ops, cfg2, (id(cfg2), ops[0].shape, 0))  # another config: another key, recorded once
    assert ordinary == [cfg, cfg2] and len(plans.table) == 2
    plans((ops[0], ops[0], *ops[2:]), cfg, (id(cfg), ops[0].shape, 1))  # two operands at one address: no plan
    assert ordinary[-1] is cfg and (id(cfg), ops[0].shape, 1) not in plans.table
    other = (torch.randn(8, 64, dtype=torch.bfloat16), *ops[1:4], torch.empty(8, 32, dtype=torch.bfloat16))
    plans(other, cfg, (id(cfg), other[0].shape, 0))  # a third key: the oldest (cfg at M = 4) goes
    assert list(plans.table) == [(id(cfg2), ops[0].shape, 0), (id(cfg), other[0].shape, 0)]


def test_workspace_prepare_takes_a_device_string_and_refuses_what_it_cannot_use(monkeypatch):
    """graphs.py tells users to call ``workspace.prepare(device, stream)`` before capturing on their own stream: a
    device string raised AttributeError, a CUDA device on a machine without CUDA torch's AssertionError."""
    from fp4dispatch.errors import InvalidInputError

    monkeypatch.setattr(workspace, "_COUNTERS", {})
    workspace.prepare("cpu", tiles=8)
    assert workspace._COUNTERS[("cpu", 0)].numel() == workspace.MIN_COUNTERS
    with pytest.raises(InvalidInputError, match=r"^workspace\.prepare: stream must be None \(the current stream\) or "
                                                r"a torch\.cuda\.Stream; got 's'\. Pass the stream the graph will be "
                                                r"captured on$"):
        workspace.prepare("cpu", "s")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidInputError, match=r"^workspace\.prepare: device cuda:0 was asked for, but CUDA is not "
                                                r"available here .*; use CPU tensors$"):
        workspace.prepare(torch.device("cuda", 0))
