"""Compile-only checks of the Gluon kernels' sm_90a SASS (no GPU needed; Triton's own ptxas). ``wgws``: no write to
the register operand of a wgmma still in flight (benchmarks/sass_race.py; the rolled loop that did this gave wrong
results on the H200), no register spills in the K loop, shared memory within the H200's 227 KB; the racy rolled loop of
benchmarks/gluon_probe.py is the checker's positive control. ``gvws``: the proxy fence before each ring slot is freed,
no spills in its step loop, its CTAs per SM within the shared memory. ``wgds``: the fence before the decoded tile is
handed over. The ``wgdy`` benchmark kernel: still builds race-free. Runs only with the Triton the kernels are written
for."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from fp4dispatch.kernels import gluon_missing
from fp4dispatch.kernels.fused import _GVWS_TILES, _WGWS_TILES

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


@pytest.mark.parametrize("parts", [2, 1])
def test_wgds_sass_fences_the_decoded_tile_no_loop_spills_and_fits(parts):
    """The decode warps' loop orders their stores of the decoded tile (and their reads of the words) before the
    arrives that hand the tile to the wgmma and free the words' slot: a proxy fence (MEMBAR.ALL.CTA) between the last
    STSM and the first arrive. No spills in any loop; shared memory within an SM's with fp32 out (the most)."""
    wg, race = _bench("wgds"), _bench("sass_race")
    from fp4dispatch.kernels.fused import _WGDS
    built = wg.build_wgds(_WGDS["BN"], _WGDS["BM"], _WGDS["BKB"], _WGDS["stages"], _WGDS["astages"],
                          _WGDS["dstages"], 128, parts, out_type="fp32")
    code = race._parse(built["sass"])
    loops = race.hot_loops(code, "F2FP")
    assert loops, "no decode loop found in the SASS"
    first, last = min(loops, key=lambda fl: fl[1] - fl[0])
    body = [x for _, x in code[first:last + 1]]
    stores = [i for i, x in enumerate(body) if "STSM" in x or x.startswith("STS")]
    arrives = [i for i, x in enumerate(body) if "SYNCS.ARRIVE" in x]
    assert stores and arrives and max(stores) < min(arrives)
    assert any("MEMBAR" in x for x in body[max(stores):min(arrives)]), "no fence between the tile and its arrive"
    assert race.hot_loops(code), "no wgmma loop found in the SASS"
    assert race.loop_spills(built["sass"]) == [] and not [x for x in body if "STL" in x or "LDL" in x]
    assert built["shared"] <= SMEM_SM90


@pytest.mark.parametrize("swap", [False, True], ids=["out", "swap"])
def test_wgdy_benchmark_kernel_still_builds_race_free(swap):
    """``benchmarks/wgdy_kernel.py`` (measured and dropped, sixteenth session) reuses the library's decode, scale
    layout and epilogue: it must keep building, with no write to an in-flight wgmma operand and no loop spills, so that
    its RESULTS numbers stay reproducible."""
    wd, race = _bench("wgdy"), _bench("sass_race")
    built = wd.build_wgdy(128, 256, 4, 5, swap)
    assert race.hot_loops(race._parse(built["sass"])), "no wgmma loop found in the SASS"
    assert race.races(built["sass"]) == [] and race.loop_spills(built["sass"]) == []
    assert built["shared"] <= SMEM_SM90


def test_sass_race_flags_the_rolled_loop():
    probe, race = _bench("gluon_probe"), _bench("sass_race")
    built = probe.build(probe.probe_kernel, probe.signature(64, 16, 16),
                        {"BN": 64, "BM": 16, "BKB": 16, "STAGES": 3, "WAIT": 1, "RAW": probe.raw_layout(16)}, 4,
                        ("sb_ptr", "out_ptr", "KB", "CB", "N"))
    assert race.races(built["sass"])  # one group in flight while the next step decodes into the same registers


@pytest.mark.parametrize("dp", [True, False], ids=["dp4a", "f16x2"])
@pytest.mark.parametrize("mb", [1, 2])
@pytest.mark.parametrize("tile", _GVWS_TILES, ids=[f"R{t[0]}-BW{t[1]}-S{t[2]}-C{t[3]}" for t in _GVWS_TILES])
def test_gvws_sass_fences_before_freeing_a_slot_no_loop_spills_and_fits(tile, mb, dp):
    """In the consumer's step loop, the proxy fence (MEMBAR.ALL.CTA) comes before the arrive that frees the ring
    slot: ptxas leaves uses of the slot's loaded values after the arrive, and without the fence the producer's next
    TMA write overtook reads still in flight (wrong sums at 2-3 CTAs per SM on the H200, tenth session)."""
    gv, race = _bench("gemv_ws"), _bench("sass_race")
    r, bw, stages, ctas = tile
    built = gv.build_gvws(r, bw, mb, stages, 4, ctas, DP=dp)
    code = race._parse(built["sass"])
    loops = race.hot_loops(code, "F2FP")  # the scale bytes' e4m3x2 -> f16x2 conversions (and the f16x2 decode)
    assert loops, "no decode loop found in the SASS"
    first, last = min(loops, key=lambda fl: fl[1] - fl[0])
    body = [x for _, x in code[first:last + 1]]
    arrive = next(i for i, x in enumerate(body) if "SYNCS.ARRIVE" in x)
    assert any("MEMBAR" in x for x in body[:arrive]), "no fence before the slot is freed"
    assert not [x for x in body if "STL" in x or "LDL" in x]
    assert built["shared"] * ctas <= SMEM_SM90
    if dp:  # _dp4's table stays in registers: as constants, ptxas copied them from a uniform register before every
        # prmt (67 such copies in the R 8 step locally; a few copies of loop indices remain)
        assert len([x for x in body if re.match(r"IMAD\.U32 R\d+, RZ, RZ, UR\d+", x)]) < 8

