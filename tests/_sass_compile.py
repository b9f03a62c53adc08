"""Compile a Triton or Gluon kernel for sm_90a on this machine, no GPU needed, with the ptxas and cuobjdump that ship
inside Triton's wheel, and read its SASS. Imports no Gluon, so plain-Triton checks run with any Triton
(tests/test_triton_sass.py); tests/_sass_tools.py builds the Gluon kernels with it."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton

__all__ = ["compile_sm90", "nvidia_tools_missing", "opcodes"]


def _bin(tool: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def nvidia_tools_missing() -> str | None:
    """Why this machine cannot turn PTX into SASS, or None."""
    missing = [t for t in ("ptxas", "cuobjdump") if not os.access(_bin(t), os.X_OK)]
    return f"Triton's wheel has no {' or '.join(missing)} here" if missing else None


def compile_sm90(make_source, sig: dict, consts: dict, warps: int, div16: tuple, out: str | None = None,
                 arg_names: list | None = None, **opts) -> dict:
    """``make_source(kernel signature, constants, attrs)`` (Triton's ``ASTSource`` or Gluon's, with the kernel bound)
    compiled for sm_90a: {"sass", "ptxas" (its -v report), "shared" (bytes)}; with ``out``, its TTGIR, PTX, cubin and
    SASS are also written there. ``div16`` names the arguments to specialize as multiples of 16, as a launch with such
    values would, found by their place among the kernel's ``arg_names`` (Triton's attributes go by a parameter's
    index there; default: the order of ``sig``, then ``consts``); ``opts`` are further compile options
    (``num_stages``, ``maxnreg``)."""
    from triton.backends.compiler import GPUTarget

    sig = dict(sig, **{k: "constexpr" for k in consts})
    names = list(arg_names) if arg_names is not None else list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    # FP fusion on, as every Triton the kernels run on defaults to (Triton 3.9 warns that its default will change)
    c = triton.compile(make_source(sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "enable_fp_fusion": True, **opts})
    out = out or tempfile.mkdtemp(prefix="sm90_build")
    os.makedirs(out, exist_ok=True)
    open(f"{out}/k.ttgir", "w").write(c.asm["ttgir"])
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.7", c.asm["ptx"])  # the bundled ptxas may be older than the PTX
    open(f"{out}/k.ptx", "w").write(ptx)
    r = subprocess.run([_bin("ptxas"), "-arch=sm_90a", "-v", f"{out}/k.ptx", "-o", f"{out}/k.cubin"],
                       capture_output=True, text=True)
    s = subprocess.run([_bin("cuobjdump"), "-sass", f"{out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/k.sass", "w").write(s)
    return {"sass": s, "ptxas": r.stderr, "shared": c.metadata.shared}


def opcodes(sass: str) -> list[str]:
    """The opcode (with its modifiers, predicate dropped) of every instruction of a cuobjdump listing."""
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)
