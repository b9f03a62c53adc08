"""Compile-only checks of the Gluon ``wgws`` kernel's sm_90a SASS (no GPU needed; Triton's own ptxas): no write to
the register operand of a wgmma still in flight (benchmarks/sass_race.py; the rolled loop that did this gave wrong
results on the H200), no register spills in the K loop, shared memory within the H200's 227 KB. The racy rolled loop of
benchmarks/gluon_probe.py is the checker's positive control. Runs only with the Triton the kernel is written for."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fp4dispatch.kernels import gluon_missing
from fp4dispatch.kernels.fused import _WGWS_TILES

pytestmark = pytest.mark.skipif(gluon_missing() is not None, reason=str(gluon_missing()))

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SMEM_SM90 = 227 * 1024  # the most shared memory one CTA may use on an H100/H200


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # gluon_ws imports its sibling gluon_probe
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("swap", [False, True], ids=["out", "swap"])
@pytest.mark.parametrize("tile", _WGWS_TILES, ids=[f"BM{t[0]}-BN{t[1]}-BKB{t[2]}-S{t[3]}" for t in _WGWS_TILES])
def test_wgws_sass_has_no_operand_race_no_loop_spills_and_fits(tile, swap):
    ws, race = _bench("gluon_ws"), _bench("sass_race")
    bm, bn, bkb, stages = tile
    built = ws.build_wgws(bn, bm, bkb, stages, swap)
    assert race.hot_loops(race._parse(built["sass"])), "no wgmma loop found in the SASS"
    assert race.races(built["sass"]) == []
    # no spills in the K loop (the epilogue, once per tile, may spill a few registers: BN 64 swapped does locally)
    assert race.loop_spills(built["sass"]) == []
    assert "serializ" not in built["ptxas"]  # ptxas C7510-C7515: wgmma serialized
    assert built["shared"] <= SMEM_SM90


def test_sass_race_flags_the_rolled_loop():
    probe, race = _bench("gluon_probe"), _bench("sass_race")
    built = probe.build(probe.probe_kernel, probe.signature(64, 16, 16),
                        {"BN": 64, "BM": 16, "BKB": 16, "STAGES": 3, "WAIT": 1, "RAW": probe.raw_layout(16)}, 4,
                        ("sb_ptr", "out_ptr", "KB", "CB", "N"))
    assert race.races(built["sass"])  # one group in flight while the next step decodes into the same registers
