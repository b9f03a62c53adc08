"""Compile-only checks of the Gluon kernels' sm_90a SASS (no GPU needed; Triton's own ptxas; tools in
tests/_sass_tools.py). ``wgmma_warp_specialized``: no write to the register operand of a wgmma still in flight (a
rolled K loop that did this gave wrong results), no register spills in the K loop, shared memory within an SM's
227 KB; a racy rolled loop is the checker's positive control. ``tma_warp_specialized``: the proxy fence before each
ring slot is freed, no spills in its step loop, its CTAs per SM within the shared memory. ``wgmma_decode_warps``: the
fence before the decoded tile is handed over. ``tma_mma_w4a16``: the fence before each slot is freed, no spills and
no shared-memory layout shuffles in its step loop, its CTAs per SM within the shared memory. And Gluon's count of
shared-memory bank conflicts of the loads that carry the most bytes (no kernel built). Runs only with the Triton the
kernels are written for."""
from __future__ import annotations

import re

import pytest
import torch

from fp4dispatch.kernels import gluon_missing
from fp4dispatch.kernels.heuristics import (DECODE_WARPS, SMEM_SM90, TMA_GEMV_TILES, WARP_SPECIALIZED_TILES,
                                            tma_mma_w4a16)

pytestmark = pytest.mark.skipif(gluon_missing() is not None, reason=str(gluon_missing()))


def _tools():
    import _sass_tools  # imports Gluon: only once the skip above has passed

    return _sass_tools


@pytest.mark.parametrize("form", ["out", "swap", "w4a16-bf16", "w4a16-fp16"])
@pytest.mark.parametrize("tile", WARP_SPECIALIZED_TILES,
                         ids=[f"BM{t[0]}-BN{t[1]}-BKB{t[2]}-S{t[3]}" for t in WARP_SPECIALIZED_TILES])
def test_wgws_sass_has_no_operand_race_no_loop_spills_and_fits(tile, form):
    """The NVFP4 GEMM (plain, swapped) and its W4A16 form, whose decode without CVT takes more instructions and
    registers (each activation dtype: bf16 decodes by other instructions than fp16)."""
    race = _tools()
    bm, bn, bkb, stages = tile
    w4a16 = {"w4a16-bf16": torch.bfloat16, "w4a16-fp16": torch.float16}.get(form)
    built = race.build_wgws(bn, bm, bkb, stages, form == "swap", w4a16)
    assert race.hot_loops(race._parse(built["sass"])), "no wgmma loop found in the SASS"
    assert race.races(built["sass"]) == []
    # no spills in the K loop (the epilogue, once per tile, may spill a few registers: BN 64 swapped does locally)
    assert race.loop_spills(built["sass"]) == []
    assert "serializ" not in built["ptxas"]  # ptxas C7510-C7515: wgmma serialized
    assert built["shared"] <= SMEM_SM90


@pytest.mark.parametrize("w4a16", [None, torch.bfloat16, torch.float16], ids=["nvfp4", "w4a16-bf16", "w4a16-fp16"])
@pytest.mark.parametrize("parts", [2, 1])
def test_wgds_sass_fences_the_decoded_tile_no_loop_spills_and_fits(parts, w4a16):
    """The decode warps' loop orders their stores of the decoded tile (and their reads of the words) before the
    arrives that hand the tile to the wgmma and free the words' slot: a proxy fence (MEMBAR.ALL.CTA) between the last
    STSM and the first arrive. No spills in any loop; shared memory within an SM's with fp32 out (the most). For the
    NVFP4 GEMM and for its W4A16 form (each activation dtype: bf16 decodes by other instructions than fp16)."""
    race, c = _tools(), DECODE_WARPS
    built = race.build_wgds(c.block_n, c.block_m, c.k_blocks, c.stages, c.act_stages, c.decoded_stages,
                            c.decode_registers, parts, out_type="fp32", w4a16=w4a16)
    code = race._parse(built["sass"])
    loops = race.hot_loops(code, "STSM")
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


def test_sass_race_flags_the_rolled_loop():
    from fp4dispatch.kernels.gemm.gluon_tiles import raw_layout

    race = _tools()
    built = race.build(race.probe_kernel, race.probe_signature(64, 16, 16),
                       {"BN": 64, "BM": 16, "BKB": 16, "STAGES": 3, "WAIT": 1, "RAW": raw_layout(16)}, 4,
                       ("sb_ptr", "out_ptr", "KB", "CB", "N"))
    assert race.races(built["sass"])  # one group in flight while the next step decodes into the same registers


@pytest.mark.parametrize("tile", TMA_GEMV_TILES, ids=[f"R{t[0]}-BW{t[1]}" for t in TMA_GEMV_TILES])
def test_tma_gemv_reads_its_words_and_activations_from_shared_memory_without_bank_conflicts(tile):
    """Gluon's own count of the excess accesses per wavefront (``gl.bank_conflicts``) of the loads that carry the
    most bytes: the weight words and the activation words (read alike by every thread of a row). Its scale bytes and
    the two wgmma GEMMs' word reads do conflict (docs/kernels.md says by how much): not pinned here."""
    from triton.experimental.gluon import language as gl

    from fp4dispatch.kernels.gemv.tma_warp_specialized import plain, word_layout

    race = _tools()
    r, bw = tile[0], tile[1]
    lw = word_layout(bw, 4)
    assert race.bank_conflicts(lw, plain(4), [4, r, bw // 4, 4], 64) == 0
    assert race.bank_conflicts(gl.SliceLayout(0, gl.SliceLayout(1, lw)), plain(2), [bw // 4, 4], 64) == 0


def test_decode_warps_read_their_scale_bytes_from_shared_memory_without_bank_conflicts():
    """The same count for the decode warps' scale bytes, through their permuted view."""
    from triton.experimental.gluon import language as gl

    from fp4dispatch.kernels.gemm.wgmma_decode_warps import scale_layout

    race = _tools()
    q = DECODE_WARPS.block_n // 4  # its scale box [BKB/4, R, 4, 4] read as [4, R, BKB/4, 4]
    scales = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[3, 0, 1, 2])
    assert race.bank_conflicts(scale_layout(4 * q, DECODE_WARPS.k_blocks), scales,
                               [4, q, DECODE_WARPS.k_blocks // 4, 4], 8) == 0


# the grouped GEMV as heuristics._tma_gemv_grouped offers it: int8 dot products, the 3-CTA tile at 1 row
_GVWS_BUILDS = [(tile, mb, dp, False) for tile in TMA_GEMV_TILES for mb in (1, 2) for dp in (True, False)] + [
    (TMA_GEMV_TILES[0], 2, True, True), (TMA_GEMV_TILES[0], 1, True, True), (TMA_GEMV_TILES[1], 1, True, True)]


@pytest.mark.parametrize("tile, mb, dp, grouped", _GVWS_BUILDS,
                         ids=[f"R{t[0]}-BW{t[1]}-S{t[2]}-C{t[3]}-{mb}-{'dp4a' if dp else 'f16x2'}"
                              f"{'-grouped' if g else ''}" for t, mb, dp, g in _GVWS_BUILDS])
def test_gvws_sass_fences_before_freeing_a_slot_no_loop_spills_and_fits(tile, mb, dp, grouped):
    """In the consumer's step loop, the proxy fence (MEMBAR.ALL.CTA) comes before the arrive that frees the ring
    slot: ptxas leaves uses of the slot's loaded values after the arrive, and without the fence the producer's next
    TMA write overtook reads still in flight (wrong sums at 2-3 CTAs per SM). The grouped form runs the same step."""
    race = _tools()
    r, bw, stages, ctas = tile
    built = race.build_gvws(r, bw, mb, stages, 4, ctas, DP=dp, grouped=grouped)
    code = race._parse(built["sass"])
    loops = race.hot_loops(code, "F2FP")  # the scale bytes' e4m3x2 -> f16x2 conversions (and the f16x2 decode)
    assert loops, "no decode loop found in the SASS"
    first, last = min(loops, key=lambda fl: fl[1] - fl[0])
    body = [x for _, x in code[first:last + 1]]
    arrive = next(i for i, x in enumerate(body) if "SYNCS.ARRIVE" in x)
    assert any("MEMBAR" in x for x in body[:arrive]), "no fence before the slot is freed"
    assert not [x for x in body if "STL" in x or "LDL" in x]
    assert built["shared"] * ctas <= SMEM_SM90
    if dp:  # the int8 dot products' table stays in registers: as constants, ptxas copies them from a uniform
        # register before every prmt (a few copies of loop indices remain)
        assert len([x for x in body if re.match(r"IMAD\.U32 R\d+, RZ, RZ, UR\d+", x)]) < 8



_TMA_MMA_BUILDS = [(cfg, dt) for m in (1, 8, 16) for cfg in tma_mma_w4a16(m) for dt in ("bf16", "fp16")]


@pytest.mark.parametrize("cfg, dt", _TMA_MMA_BUILDS,
                         ids=[f"rows{c.rows}-R{c.rows_per_quarter}-BW{c.k_blocks}-S{c.stages}-KW{c.k_warps}-{dt}"
                              for c, dt in _TMA_MMA_BUILDS])
def test_tma_mma_w4a16_sass_fences_before_freeing_a_slot_no_loop_spills_or_shuffles_and_fits(cfg, dt):
    """Every offered tile: in the consumer's step loop (the one that issues mma.sync) the proxy fence comes before the
    arrive that frees the slot (as in tma_warp_specialized), nothing spills, and no layout conversion goes through
    shared memory (the decode, the scales and the token pairs are built in the MMA fragments' own layout: an STS
    there would be a convert_layout that is not free); ctas_per_sm CTAs fit an SM's shared memory."""
    race = _tools()
    built = race.build_tma_mma(cfg, torch.bfloat16 if dt == "bf16" else torch.float16)
    code = race._parse(built["sass"])
    loops = race.hot_loops(code, "HMMA")
    assert loops, "no mma.sync loop found in the SASS"
    first, last = min(loops, key=lambda fl: fl[1] - fl[0])
    body = [x for _, x in code[first:last + 1]]
    arrive = next(i for i, x in enumerate(body) if "SYNCS.ARRIVE" in x)
    assert any("MEMBAR" in x for x in body[:arrive]), "no fence before the slot is freed"
    assert not [x for _, x in code if "STL" in x or "LDL" in x]
    assert not [x for x in body if x.startswith("STS")]
    assert built["shared"] * cfg.ctas_per_sm <= SMEM_SM90


@pytest.mark.parametrize("cfg", sorted({c for m in (1, 8, 16) for c in tma_mma_w4a16(m)}, key=str), ids=str)
def test_tma_mma_w4a16_reads_its_tokens_and_words_from_shared_memory_without_bank_conflicts(cfg):
    """Gluon's own count of the excess accesses per wavefront: none for the words nor for the swizzled token boxes
    that every offered tile gets at K % 64 == 0 (``swizzled_tokens``). The unswizzled boxes of whole token rows are
    the checker's control: every row starts in the same bank, so 4 lanes of a quarter warp meet in one with 8 or
    16 rows, 2 with one row."""
    from triton.experimental.gluon import language as gl

    from fp4dispatch.kernels.gemv import mma_sync_operands as ops, tma_mma_w4a16 as tm
    from fp4dispatch.kernels.gemv.tma_warp_specialized import plain

    race = _tools()
    mb, kw, rg = cfg.rows, cfg.k_warps, cfg.rows_per_quarter // 4
    c = cfg.k_blocks // 8 // kw
    assert tm.swizzled_tokens(mb, cfg.k_blocks, 8192) and not tm.swizzled_tokens(mb, cfg.k_blocks, 8192 + 32)
    swizzled = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=64, rank=3)
    assert race.bank_conflicts(ops.token_lanes(mb, c, kw, rg), swizzled, [kw * c * mb, 2, 16], 64) == 0
    rows = race.bank_conflicts(ops.row_token_lanes(c, kw, rg), plain(5), [8 if mb > 1 else 1, kw, c, 4, 16], 32)
    assert rows == (3 if mb > 1 else 1)
    assert race.bank_conflicts(ops.weight_lanes(c, kw, rg), plain(7), [kw, c, rg, 2, 8, 4, 2], 64) == 0
