"""The same Triton cache key for a kernel in every process: ``settle(kernel)`` computes the cache keys of the JIT
functions it calls before its own.

A JIT function's cache key hashes its source, its callees' keys and the constexpr globals it uses, its callees'
included. Triton 3.6 (and earlier) merges a callee's globals into the caller's *before* it computes the callee's key,
when the callee has found none yet: a caller whose key is computed before its callee's leaves the callee's globals
out. The key then depends on which kernels the process happened to compile first, so two processes compile one
kernel under two keys, and a kernel compiled into the disk cache by a compile worker (compile_processes.py) is
compiled again by its caller. (Triton 3.9 computes the callee's key first.) Computing every callee's key before its
caller's gives each function the key that holds all the globals it uses, whatever else the process compiled before.

``runtime.launch`` settles a kernel before its first compile, and the compile worker before it compiles one.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from types import ModuleType

__all__ = ["settle"]

_settled: set[int] = set()  # id() of the functions whose keys are settled (a JIT function hashes by its cache key)
_lock = threading.RLock()


def settle(fn) -> None:
    """Compute the cache keys of ``fn``'s callees (depth first) and then ``fn``'s; a no-op once done, and for
    anything that is not a Triton JIT function."""
    if id(fn) in _settled:
        return
    with _lock:
        _visit(fn, set())


def _jit_types() -> tuple:
    from triton.runtime import jit

    return tuple(t for t in (getattr(jit, "JITCallable", None), jit.JITFunction) if t is not None)


def _visit(fn, path: set[int]) -> None:
    if id(fn) in _settled or id(fn) in path or not isinstance(fn, _jit_types()):
        return
    path.add(id(fn))  # a function that calls itself, directly or not, is visited once
    for callee in _callees(fn):
        _visit(callee, path)
    try:
        fn.cache_key  # noqa: B018 - computed now, after every callee's
    except Exception:  # noqa: BLE001 - Triton raises it again where it compiles the kernel
        return
    _settled.add(id(fn))


def _callees(fn) -> list:
    """The JIT functions that ``fn``'s source names: globals or closure variables (``helper``), or attributes of a
    module among them (``module.helper``); more than Triton records is harmless, as the order is all that counts."""
    try:
        tree = ast.parse(textwrap.dedent(fn.src))
        scope = {**fn.__globals__, **inspect.getclosurevars(fn.fn).nonlocals}
    except Exception:  # noqa: BLE001 - no source to read: its key is computed as Triton would
        return []
    jit, out = _jit_types(), []
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Name):
            value = scope.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = scope.get(node.value.id)
            value = getattr(base, node.attr, None) if isinstance(base, ModuleType) else None
        if isinstance(value, jit) and value is not fn and all(value is not c for c in out):
            out.append(value)
    return out
