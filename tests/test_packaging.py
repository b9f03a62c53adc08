"""Packaging promises: optional libraries stay optional, README and CI agree, the CLI module runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BLOCKED_IMPORT = r'''
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("triton", "flashinfer", "sgl_kernel", "tqdm", "rich"):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
import fp4dispatch
from fp4dispatch.testing import make_nvfp4_inputs
a, b, sa, sb, al = make_nvfp4_inputs(3, 64, 64)
ref = fp4dispatch.fp4_mm(a, b, sa, sb, al, out_dtype=__import__("torch").float32)
st = {r.name: (r.status, r.reason) for r in fp4dispatch.get_dispatcher().report()}
assert st["reference"] == ("ok", ""), st
assert st["triton:fused"][0] == "unavailable" and "triton" in st["triton:fused"][1], st
assert st["flashinfer:cutlass"][0] == "unavailable", st
print("OK", tuple(ref.shape))
'''


def test_import_and_fp4_mm_without_optional_libraries(tmp_path):
    env = dict(os.environ, FP4DISPATCH_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK (3, 64)" in r.stdout


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) == 2, "README gives exactly two fresh-machine commands"
    main_job, tests = blocks
    assert "python3 -m fp4dispatch.tune" in main_job
    assert "pytest" in tests and tests.strip() in ci
