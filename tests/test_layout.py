"""The shape of the package, checked statically (no Triton needed): no module of fp4dispatch imports, directly or
through others (lazy imports included), a module that imports it back; no file over 400 lines; no runtime module
imports the test helpers; the kernels import no layer above them; and backends/triton_fused.py reaches a kernel
through fp4_mm only."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fp4dispatch"
KERNELS = PACKAGE / "kernels"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The fp4dispatch modules ``name`` imports anywhere in its body (``from pkg import mod`` counts as
    importing pkg.mod; the implicit import of a parent package does not count)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    got = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            got |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            pkg = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for a in node.names:
                got |= {f"{pkg}.{a.name}"} if f"{pkg}.{a.name}" in mods else ({pkg} if pkg in mods else set())
    return got - {name}


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    assert not [m for m in graph if m in reach(m)], {m: sorted(graph[m]) for m in graph if m in reach(m)}


def test_files_are_short_and_runtime_code_never_imports_test_helpers():
    for p in PACKAGE.rglob("*.py"):
        text = p.read_text()
        assert len(text.splitlines()) <= 400, p
        if p.name != "testing.py":
            assert "fp4dispatch.testing" not in text and not re.search(r"from \.+testing import", text), p


def test_the_backend_reaches_kernels_through_fp4_mm():
    src = (KERNELS.parent / "backends" / "triton_fused.py").read_text()
    kernel_imports = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)
                      and n.module and n.module.startswith("kernels")}
    assert kernel_imports == {"kernels", "kernels.heuristics", "kernels.fp4_mm"}, kernel_imports


def test_kernel_families_only_launch_and_take_scratch_from_the_workspace():
    """A launch plan (kernels/plan.py) replays a family's launches and its workspace scratch, nothing else: a torch
    allocation or a torch op in a family module would be missing from every replayed call."""
    allocating = {"empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like", "cat",
                  "stack", "mm", "matmul", "tensor", "arange"}
    in_place = {"fill_", "zero_", "copy_", "clone", "contiguous", "to", "float", "half", "bfloat16", "index_fill_"}
    def jitted(fn: ast.FunctionDef) -> bool:  # device code: @triton.jit, @gluon.jit, @jit
        return any("jit" in ast.unparse(d) for d in fn.decorator_list)

    checked = 0
    for p in sorted((KERNELS / "gemm").glob("*.py")) + sorted((KERNELS / "gemv").glob("*.py")):
        host = [f for f in ast.parse(p.read_text()).body if isinstance(f, ast.FunctionDef) and not jitted(f)]
        checked += any(f.name == "run" for f in host)
        for node in (n for f in host for n in ast.walk(f)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "torch":
                assert f.attr not in allocating, f"{p.name}:{node.lineno}: torch.{f.attr} in a kernel family"
            assert f.attr not in in_place, f"{p.name}:{node.lineno}: .{f.attr}() on a tensor in a kernel family"
    # every family's launcher was looked at: those of fp4_mm's, w4a16_mm's and grouped_mm's tables
    from fp4dispatch.kernels import fp4_mm, grouped_mm, w4a16_mm
    assert checked == len({*fp4_mm.LAUNCHERS.values(), *w4a16_mm.LAUNCHERS.values(), *grouped_mm.LAUNCHERS.values()})


def test_kernels_import_no_layer_above_them():
    """The kernels are the bottom layer: they may use the device checks, the errors and the worker process, never
    the dispatcher, the backends or the API that choose and call them."""
    mods = _modules()
    below = {"fp4dispatch.devices", "fp4dispatch.errors", "fp4dispatch.worker_process"}
    above = {m: sorted(x for x in _imports(m, p, mods) if not x.startswith("fp4dispatch.kernels") and x not in below)
             for m, p in mods.items() if m.startswith("fp4dispatch.kernels")}
    assert not {m: a for m, a in above.items() if a}
