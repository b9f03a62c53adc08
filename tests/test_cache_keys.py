"""A kernel's Triton cache key must not depend on what its process compiled before (fp4dispatch/kernels/cache_keys.py):
Triton 3.6 merges a callee's constexpr globals into its caller's key only if the callee's key was computed first, so
``settle`` computes callees' keys before their callers', and ``runtime.launch`` and the compile worker settle a
kernel before it compiles."""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

from fp4dispatch.kernels import cache_keys  # noqa: E402

# a kernel calling one helper by name and one through its module, each helper using a constexpr global
HELPERS = textwrap.dedent("""
    import triton
    import triton.language as tl

    SHIFT = tl.constexpr(3)


    @triton.jit
    def shifted(x):
        return x + SHIFT
""")
KERNELS = textwrap.dedent("""
    import triton
    import triton.language as tl

    import {helpers} as helpers

    SCALE = tl.constexpr(2)


    @triton.jit
    def scaled(x):
        return x * SCALE


    @triton.jit
    def both_kernel(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, helpers.shifted(scaled(tl.load(x_ptr + offs))))
""")


def _modules(tmp_path, monkeypatch, tag: str):
    """Fresh kernel modules (their keys computed by nothing yet) named ``*_{tag}``."""
    (tmp_path / f"ck_helpers_{tag}.py").write_text(HELPERS)
    (tmp_path / f"ck_kernels_{tag}.py").write_text(KERNELS.format(helpers=f"ck_helpers_{tag}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(f"ck_kernels_{tag}"), importlib.import_module(f"ck_helpers_{tag}")


def test_settle_computes_every_callees_key_before_its_callers(tmp_path, monkeypatch):
    kernels, helpers = _modules(tmp_path, monkeypatch, "order")
    jit_type = type(kernels.both_kernel)
    owner = next(c for c in jit_type.__mro__ if "cache_key" in vars(c))
    plain = vars(owner)["cache_key"]
    computed: list[str] = []

    def recording(self):
        if getattr(self, "hash", None) is None:
            computed.append(self.__name__)
        return plain.fget(self)

    monkeypatch.setattr(owner, "cache_key", property(recording))
    cache_keys.settle(kernels.both_kernel)
    assert computed[-1] == "both_kernel" and set(computed) == {"shifted", "scaled", "both_kernel"}
    cache_keys.settle(kernels.both_kernel)  # settled once: nothing computed again
    cache_keys.settle(helpers.shifted)
    assert len(computed) == 3


def test_settle_leaves_what_is_no_jit_function_alone():
    cache_keys.settle(len)
    cache_keys.settle(None)


KEY_OF = textwrap.dedent("""
    import importlib, sys
    sys.path.insert(0, {path!r})
    kernels = importlib.import_module("ck_kernels_{tag}")
    helpers = importlib.import_module("ck_helpers_{tag}")
    from fp4dispatch.kernels.cache_keys import settle
    first = [kernels.both_kernel, kernels.scaled, helpers.shifted]
    for fn in (first if sys.argv[1] == "kernel-first" else first[::-1]):
        settle(fn)
    print(kernels.both_kernel.cache_key)
""")


def test_two_processes_that_compute_keys_in_opposite_orders_agree(tmp_path, monkeypatch):
    _modules(tmp_path, monkeypatch, "procs")
    code = KEY_OF.format(path=str(tmp_path), tag="procs")
    keys = [subprocess.run([sys.executable, "-c", code, order], capture_output=True, text=True, check=True,
                           timeout=300).stdout.strip() for order in ("kernel-first", "helpers-first")]
    assert keys[0] and keys[0] == keys[1]
