"""CPU tests of ``fp4dispatch.kernels.runtime``: a fake JIT function stands in for Triton's, so the cache key and the
argument list of a direct launch are checked without a GPU."""
from __future__ import annotations

import inspect
import logging

import pytest
import torch

from fp4dispatch.kernels import runtime as L


def _kernel(x_ptr, y_ptr, n, BLOCK: int, FLAG: bool = False, EXTRA: int = 7):
    pass


class FakeCompiled:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def run(self):  # the attribute launch() looks for
        pass

    def __getitem__(self, grid):
        def runner(*args):
            if isinstance(self.fail, Exception):
                raise self.fail
            if self.fail:
                raise TypeError("function takes exactly 12 arguments")
            self.log.append(("direct", grid, args))
        return runner


class FakeJIT:
    signature = inspect.signature(_kernel)

    def __init__(self, fail=False):
        self.log, self.fail = [], fail

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log, self.fail)
        return call


@pytest.fixture(autouse=True)
def compiled_path(monkeypatch):
    monkeypatch.setattr(L, "jit_interpreted", lambda: False)
    monkeypatch.setattr(L, "_fast", True)
    monkeypatch.setattr(L, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_second_call_launches_the_compiled_kernel_with_every_parameter():
    fn = FakeJIT()
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32, num_warps=4)
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32, num_warps=4)
    assert [e[0] for e in fn.log] == ["jit", "direct"]
    # three grid dims (the compiled kernel's launcher reads grid[2]); signature order, defaults filled in
    assert fn.log[0][1] == fn.log[1][1] == (4, 1, 1) and fn.log[1][2] == (x, y, 10, 32, False, 7)


@pytest.mark.parametrize("change", ["int", "constexpr", "option", "grid", "alignment", "dtype"])
def test_anything_triton_specializes_on_misses_the_cache(change):
    fn = FakeJIT()
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32, num_warps=4)
    args, kw, grid = [x, y, 10], {"BLOCK": 32, "num_warps": 4}, (4, 1)
    if change == "int":
        args[2] = 16
    elif change == "constexpr":
        kw["FLAG"] = True
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "grid":
        grid = (8, 1)
    elif change == "alignment":
        args[0] = x[1:]  # address mod 16 differs: Triton may have assumed 16-byte alignment
    else:
        args[1] = y.view(torch.int32)
    L.launch(fn, grid, *args, **kw)
    assert [e[0] for e in fn.log] == ["jit", "jit"]


class FakeDesc:
    """Duck-typed like Triton's and Gluon's host ``TensorDescriptor``."""

    def __init__(self, base, block_shape, layout="swizzle128"):
        self.base, self.shape, self.strides = base, list(base.shape), list(base.stride())
        self.block_shape, self.layout = block_shape, layout


@pytest.mark.parametrize("change", [None, "base", "block", "layout", "dtype"])
def test_tma_descriptors_key_by_what_types_the_kernel(change):
    fn = FakeJIT()
    x, y = torch.zeros(64, 32, dtype=torch.float16), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), FakeDesc(x, [16, 32]), y, 10, BLOCK=32)
    d = {None: FakeDesc(x, [16, 32]),  # a new descriptor of the same tensor and type: the compiled kernel serves it
         "base": FakeDesc(torch.zeros(128, 32, dtype=torch.float16), [16, 32]),  # the launcher reads base and shape
         "block": FakeDesc(x, [32, 32]), "layout": FakeDesc(x, [16, 32], "swizzle64"),
         "dtype": FakeDesc(x.view(torch.int16), [16, 32])}[change]
    L.launch(fn, (4, 1), d, y, 10, BLOCK=32)
    want = ["jit", "direct"] if change in (None, "base") else ["jit", "jit"]
    assert [e[0] for e in fn.log] == want
    if change in (None, "base"):
        assert fn.log[1][2][0] is d  # the descriptor itself goes to the compiled kernel's launcher


class PtrOnly:
    """A descriptor base that is no tensor (``runtime.Address``: cached descriptors hold no tensor): address, dtype."""

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype, self.shape = ptr, dtype, (64, 32)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple:
        return (32, 1)


@pytest.mark.parametrize("ptr, want", [(1 << 20, ["jit", "direct"]), ((1 << 20) + 8, ["jit", "jit"])])
def test_descriptors_over_a_bare_address_key_like_tensors(ptr, want):
    fn = FakeJIT()
    y = torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), FakeDesc(PtrOnly(1 << 20, torch.float16), [16, 32]), y, 10, BLOCK=32)
    L.launch(fn, (4, 1), FakeDesc(PtrOnly(ptr, torch.float16), [16, 32]), y, 10, BLOCK=32)
    assert [e[0] for e in fn.log] == want  # the same alignment: the compiled kernel; another: Triton's path


def test_failed_direct_launch_switches_to_the_jit_path(caplog):
    fn = FakeJIT(fail=True)
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
        L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"]
    assert caplog.text.count("direct launch of a compiled Triton kernel failed (TypeError") == 1


def test_a_cuda_error_in_a_direct_launch_propagates_and_keeps_the_fast_path(caplog):
    """A CUDA error (here: a capture voided before the launch) is not about the argument list: it is the call's, as
    kernel[grid]'s would be, and the later launches stay direct (it once switched them off for the process)."""
    fn = FakeJIT()
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    compiled = L._COMPILED[next(iter(L._COMPILED))][0]
    compiled.fail = RuntimeError("Triton Error [CUDA]: operation failed due to a previous error during capture")
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        with pytest.raises(RuntimeError, match="previous error during capture"):
            L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    compiled.fail = False
    L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    assert L._fast and [e[0] for e in fn.log] == ["jit", "direct"] and "direct launch" not in caplog.text


def test_interpreter_always_takes_the_jit_path(monkeypatch):
    monkeypatch.setattr(L, "jit_interpreted", lambda: True)
    fn = FakeJIT()
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    for _ in range(2):
        L.launch(fn, (4, 1), x, y, 10, BLOCK=32)
    assert [e[0] for e in fn.log] == ["jit", "jit"] and L._COMPILED == {}


class FakeLauncherRun:
    """Shaped like Triton 3.6's CudaLauncher: what ``direct_launcher`` reads."""

    def __init__(self, log, scratch=0):
        self.log = log
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        self.log.append(("launcher", args))


class FakeCompiledWithLauncher(FakeCompiled):
    def __init__(self, log, scratch=0):
        super().__init__(log)
        self.run = FakeLauncherRun(log, scratch)
        self.function, self.packed_metadata = 0xF00, (4, 1, 0)


@pytest.mark.parametrize("case", ["direct", "hooks", "global_scratch"])
def test_a_kept_kernel_is_launched_through_its_launcher_unless_triton_must_see_it(monkeypatch, case):
    """The compiled kernel's launcher gets what ``compiled[grid]`` would give it (grid, the current stream, handle,
    flags, no scratch, metadata, no launch metadata and no hooks, every parameter); with a launch hook set (a
    profiler) or a kernel that needs Triton's per-launch scratch, the call goes through ``compiled[grid]``."""
    monkeypatch.setattr(L, "raw_stream", lambda idx: 0x5157)
    monkeypatch.setattr(L, "launch_hooks_set", lambda: case == "hooks")
    log: list = []
    compiled = FakeCompiledWithLauncher(log, scratch=64 if case == "global_scratch" else 0)

    class JIT:
        signature = inspect.signature(_kernel)

        def __getitem__(self, grid):
            def call(*args, **kwargs):
                log.append(("jit", grid, args, kwargs))
                return compiled
            return call

    fn = JIT()
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.float32)
    L.launch(fn, (4,), x, y, 10, BLOCK=32)
    L.launch(fn, (4,), x, y, 10, BLOCK=32)
    if case == "direct":
        assert log[1] == ("launcher", (4, 1, 1, 0x5157, 0xF00, False, True, None, None, (4, 1, 0), None, None, None,
                                       x, y, 10, 32, False, 7))
    else:
        assert log[1][0] == "direct"
