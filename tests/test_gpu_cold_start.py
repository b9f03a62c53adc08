"""GPU test of the tuner's compile-ahead phase (issue 34): in a fresh process with an empty Triton cache, every
Triton kernel of a key's candidates is compiled in the compile phase, none in the checks, and every candidate still
computes its check right (the checks and timings run the kernels compiled ahead)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: Triton compiles the candidates' kernels for it")

_SCRIPT = r"""
import json, sys, torch
from triton import knobs
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.backends.triton_w4a16 import TritonW4A16Backend
from fp4dispatch.dispatch import tuner
from fp4dispatch.problem import Problem

phase, seen = ["ahead"], []
knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(phase[0])
ahead = tuner.compile_ahead
def marked(*args):
    ahead(*args)
    phase[0] = "check"
tuner.compile_ahead = marked
m, adt, backend = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3]
b = TritonFusedBackend() if backend == "fused" else TritonW4A16Backend()
p = Problem(m, 3072, 4096, torch.bfloat16, torch.device("cuda"), adt)
tuning = tuner.tune(p, [b], lambda fn: 1.0)
print(json.dumps({"ahead": seen.count("ahead"), "check": seen.count("check"),
                  "trials": [[str(t.config), t.reason] for t in tuning.trials], "seconds": tuning.seconds}))
"""


@pytest.mark.parametrize("m,adt,backend", [(16, "uint8", "fused"), (300, "uint8", "fused"),
                                           (4, "bfloat16", "w4a16")])
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
import json, sys, torch
from triton import knobs
from fp4dispatch.backends.triton_fused import TritonFusedBackend
from fp4dispatch.dispatch.dispatcher import Dispatcher

phase, seen = ["ahead"], []
knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(phase[0])
d = Dispatcher([TritonFusedBackend()], cache_dir=sys.argv[1])
compile_keys = d.compile_keys
def marked(problems, **kw):
    compile_keys(problems, **kw)
    phase[0] = "decide"
d.compile_keys = marked
choices = d.warmup([(1, 3072, 4096), (16, 3072, 4096), (300, 3072, 4096)])
print(json.dumps({"ahead": seen.count("ahead"), "decide": seen.count("decide"),
                  "modes": [e["mode"] for e in d.cache_for("cuda").decisions.values()]}))
"""


def test_warmup_compiles_every_key_before_deciding_any(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    p = subprocess.run([sys.executable, "-c", _WARMUP, str(tmp_path / "cache")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ahead"] >= 3 and got["decide"] == 0, got
    assert got["modes"] == ["tuned"] * 3
