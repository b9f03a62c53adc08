"""CPU pins of the kernels/ restructure: the heuristics offer exactly the candidates the old ``configs_for`` offered
(same families, tiles, splits and order) for every (M, N, K) of a grid on seven faked devices, and each launcher makes
exactly the launches the old ``fused_mm`` made for each of those configs (kernel, grid, arguments, constexprs,
options). Both fixtures were computed with the code of commit 8af9a38 (tests/data/*_8af9a38.json)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fp4dispatch.kernels import config as C
from fp4dispatch.kernels.config_json import from_json
from fp4dispatch.kernels import runtime, target
from fp4dispatch.kernels.heuristics import configs_for

DATA = Path(__file__).parent / "data"


def from_old(d: dict) -> C.KernelConfig:
    """The typed config of an old dict config (``{"kernel": codename, ...}``); an unknown key fails."""
    d = dict(d)
    kind = d.pop("kernel")
    take = d.pop

    def done(cfg):
        assert not d, f"keys of a {kind} config with no field: {d}"
        return cfg

    if kind == "gemv":
        return done(C.BytewiseGemvConfig(take("MB"), take("BN"), take("BKB"), take("split"), take("warps")))
    if kind == "gemv2":
        return done(C.CudaCoreGemvConfig(take("MB"), take("BN"), take("BKB"), take("split"), take("warps"),
                                         stages=take("stages"), pair_decode=take("PAIR"), fp16x2=take("H2", False),
                                         prefetch=take("prefetch", False), e4m3x2_convert=take("CVT", False),
                                         max_registers=take("maxnreg", None)))
    if kind == "mma":
        return done(C.MmaBf16Config(take("BM"), take("BN"), take("BKB"), take("split"), take("warps"), take("stages")))
    if kind == "wmma":
        return done(C.WgmmaRegisterAConfig(take("BM"), take("BN"), take("BKB"), take("split"), take("warps"),
                                           take("stages"), predecode_a=take("APRE", False),
                                           stream_k=take("stream", False)))
    if kind == "gvws":
        return done(C.TmaGemvConfig(take("MB"), take("R"), take("BW"), take("stages"), warps=take("warps"),
                                    ctas_per_sm=take("ctas"), int8_dot=take("DP")))
    if kind == "wgws":
        return done(C.WgmmaWarpSpecializedConfig(take("BM"), take("BN"), take("BKB"), take("stages"),
                                                 persistent=take("persist", False), swap=take("swap", False)))
    assert kind == "wgds", kind
    return done(C.WgmmaDecodeWarpsConfig(take("BM"), take("BN"), take("BKB"), take("stages"), take("astages"),
                                         take("dstages"), take("parts"), split_k=take("split", 1),
                                         persistent=take("persist", False)))


@pytest.fixture(scope="module")
def candidates() -> dict:
    return json.loads((DATA / "candidates_8af9a38.json").read_text())


def _fake_device(monkeypatch, kind: str, cap, sms: int, gluon: bool, interpreted: bool) -> torch.device:
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: interpreted)
    monkeypatch.setattr(runtime, "_SMS", {0: sms})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: tuple(cap))
    monkeypatch.setattr(target, "gluon_missing", lambda: None if gluon else "faked: no Gluon")
    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")


@pytest.mark.parametrize("profile", ["sm90_132_gluon", "sm90_114_gluon", "sm90_132_no_gluon", "sm89_142", "sm80_108",
                                     "sm120_170", "cpu_interpreter"])
def test_candidates_are_the_old_ones(monkeypatch, candidates, profile):
    dev = _fake_device(monkeypatch, *candidates["profiles"][profile])
    old = [from_old(c) for c in candidates["configs"]]
    cases = iter(candidates["cases"][profile])
    for n, k in candidates["nk"]:
        for m in candidates["ms"]:
            want = [old[i] for i in candidates["lists"][next(cases)]]
            assert configs_for(m, n, k, dev) == want, (profile, m, n, k)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ["T", list(x.shape), str(x.dtype), list(x.stride())]
    return list(x) if isinstance(x, tuple) else x


def test_launches_are_the_old_ones(monkeypatch, candidates):
    """Every config's launches, on meta tensors (no memory, no GPU) with the compiled-kernel options (not interpreted,
    PDL on, 8 SMs), against what the old launchers made. The Gluon modules import on any Triton with Gluon. One
    deliberate change since (its record edited, the file's "about" says so): a stream-K launch that cuts no tile
    passes one fp32 partial and int32 counters where it passed out twice, which Triton could not compile."""
    import hashlib

    from fp4dispatch.kernels.fp4_mm import fp4_mm
    from fp4dispatch.kernels.gemm import wgmma_decode_warps, wgmma_warp_specialized
    from fp4dispatch.kernels.gemv import tma_warp_specialized

    got = []

    def rec_launch(fn, grid, *args, **kw):
        got.append([fn.__name__, list(grid), [_describe(a) for a in args],
                    {k: _describe(v) for k, v in sorted(kw.items())}])

    def rec_desc(ptr, dtype, shape, strides, block, layout):
        return ("desc", str(dtype), list(shape), list(strides), list(block),
                hashlib.sha1(repr(layout).encode()).hexdigest()[:12])

    monkeypatch.setattr(runtime, "jit_interpreted", lambda: False)
    monkeypatch.setattr(runtime, "pdl", lambda device, enabled: {"launch_pdl": True, "PDL": True} if enabled else {})
    monkeypatch.setattr(runtime, "launch", rec_launch)
    for mod in (tma_warp_specialized, wgmma_warp_specialized, wgmma_decode_warps):
        monkeypatch.setattr(mod, "launch", rec_launch)
        monkeypatch.setattr(mod, "tma_desc", rec_desc)
    records = json.loads((DATA / "launches_8af9a38.json").read_text())["records"]
    assert len(records) == len(candidates["configs"])
    for rec in records:
        cfg = from_old(candidates["configs"][rec["config"]])
        m, n, k = rec["mnk"]
        meta = dict(device="meta")
        a, b = torch.empty(m, k // 2, dtype=torch.uint8, **meta), torch.empty(n, k // 2, dtype=torch.uint8, **meta)
        sa = torch.empty(-(-m // 128) * 128 * -(-k // 64) * 4, dtype=torch.float8_e4m3fn, **meta)
        sb = torch.empty(-(-n // 128) * 128 * -(-k // 64) * 4, dtype=torch.float8_e4m3fn, **meta)
        got.clear()
        fp4_mm(a, b, sa, sb, torch.empty(1, **meta), torch.empty(m, n, dtype=torch.bfloat16, **meta), cfg)
        assert json.loads(json.dumps(got)) == rec["launches"], (cfg, rec["mnk"])


def test_configs_refuse_what_cannot_run_naming_the_field():
    from fp4dispatch.errors import InvalidInputError

    ok = C.WgmmaDecodeWarpsConfig()
    assert from_json(ok.to_json()) == ok and ok.to_json()["family"] == "gemm_wgmma_decode_warps"
    bad = [(dict(decoded_stages=1), "decoded_stages must be >= max"), (dict(stages=3), "stages must be a multiple"),
           (dict(block_n=128), "block_n must be 64"), (dict(decode_partitions=3), "decode_partitions must be 1 or 2")]
    for change, msg in bad:
        with pytest.raises(InvalidInputError, match=f"WgmmaDecodeWarpsConfig.{msg}"):
            C.WgmmaDecodeWarpsConfig(**change)
    with pytest.raises(InvalidInputError, match=r"CudaCoreGemvConfig.k_blocks must be a multiple of 4.*got 2"):
        C.CudaCoreGemvConfig(1, 4, 2, 1, 4)
    with pytest.raises(InvalidInputError, match="WgmmaRegisterAConfig.split_k must be an int >= 1; got 0"):
        C.WgmmaRegisterAConfig(16, 64, 16, 0, 4, 3)
    with pytest.raises(InvalidInputError, match="WgmmaWarpSpecializedConfig.stages must be >= 2"):
        C.WgmmaWarpSpecializedConfig(256, 128, 4, 1)
    with pytest.raises(InvalidInputError, match="TmaGemvConfig.rows must be 1 or 2"):
        C.TmaGemvConfig(4, 16, 32, 5)
    with pytest.raises(InvalidInputError, match="family must be one of"):
        from_json({"family": "wgds"})


def test_configs_are_short_and_json():
    for m in (1, 2, 3, 16, 17, 64, 128, 512, 1024, 8192):
        cfgs = configs_for(m, 8192, 8192, torch.device("cpu"))
        assert 1 <= len(cfgs) <= 7
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
        assert all(c.k_blocks >= 2 for c in cfgs)  # dot K = 8 * k_blocks must be >= 16


def _cuda(monkeypatch, cap, gluon: bool = True) -> torch.device:
    """A CUDA device of capability ``cap`` with 132 SMs and compiled kernels (no GPU)."""
    return _fake_device(monkeypatch, "cuda", cap, 132, gluon, False)


def _of(cfgs, kind):
    return [c for c in cfgs if isinstance(c, kind)]


@pytest.mark.parametrize("cap, want", [((9, 0), True), ((8, 9), True), ((8, 0), False)])
def test_convert_configs_only_where_the_instruction_exists(monkeypatch, cap, want):
    cuda = _cuda(monkeypatch, cap, gluon=False)
    for m in (1, 3):
        cfgs = configs_for(m, 8192, 8192, cuda)
        assert any(getattr(c, "e4m3x2_convert", False) for c in _of(cfgs, C.CudaCoreGemvConfig)) is want
        # the untuned default never needs SM89 (the register-A kernel is offered only from SM89)
        assert not (isinstance(cfgs[0], C.CudaCoreGemvConfig) and cfgs[0].e4m3x2_convert)
        assert len(cfgs) <= 7


@pytest.mark.parametrize("m, n, k, grown", [(16, 768, 6144, True), (128, 768, 6144, True), (16, 2048, 6144, True),
                                            (128, 2048, 6144, True), (16, 8192, 8192, False),
                                            (128, 8192, 8192, False), (128, 6144, 2048, False)])
def test_register_a_split_fills_the_gpu_on_small_shapes(monkeypatch, m, n, k, grown):
    from fp4dispatch.kernels.heuristics import REGISTER_A_TILES

    every = _of(configs_for(m, n, k, _cuda(monkeypatch, (9, 0), gluon=False)), C.WgmmaRegisterAConfig)
    assert len(every) == len(set(every))  # no duplicates
    assert [c.stream_k for c in every].count(True) == (m > 16)  # stream-K: its split is unused
    cfgs = [c for c in every if not c.stream_k]
    table = REGISTER_A_TILES[min(b for b in REGISTER_A_TILES if m <= b)]
    for bm, bn, bkb, warps, stages, split, *pre in table:
        tiles = -(-n // bn) * -(-m // bm)
        steps = k // 16 // bkb
        if tiles * split < 132:  # under one wave: as many CTAs as the SMs hold, keeping >= 2 K steps per split
            want = min(max(split, C.register_a_resident(bm, warps) * 132 // tiles), steps // 2)
        else:  # a full wave already: the tabled split stays
            want = min(split, steps // 2)
        got = [c.split_k for c in cfgs if (c.block_m, c.block_n, c.k_blocks, c.warps, c.stages, c.predecode_a)
               == (bm, bn, bkb, warps, stages, pre[0] if pre else True)]
        assert want in got, (bm, bn, split, want, got)
    # the small shapes get a larger split than the table's on some tile; the large ones keep the table's splits
    assert any(c.split_k not in {t[5] for t in table} for c in cfgs) is grown


@pytest.mark.parametrize("k, streamed", [(128, False), (256, True), (4096, True)])
def test_stream_k_is_offered_only_where_a_tile_has_more_than_one_k_step(monkeypatch, k, streamed):
    """At one K step per tile the stream-K config would run its first tile's kernel (wgmma_register_a.STEPS_NOTE):
    the same candidate twice. Both ops' register-operand tiles take 8 blocks (128 values) per K step at M = 128."""
    from fp4dispatch.kernels.heuristics import w4a16_configs_for

    cuda = _cuda(monkeypatch, (9, 0), gluon=False)
    for cls, cfgs in ((C.WgmmaRegisterAConfig, configs_for(128, 4096, k, cuda)),
                      (C.WgmmaRegisterAW4A16Config, w4a16_configs_for(128, 4096, k, cuda))):
        ra = _of(cfgs, cls)
        assert ra[0].k_blocks == 8
        assert [c.stream_k for c in ra].count(True) == streamed, (cls, k)


@pytest.mark.parametrize("cap, rank", [((9, 0), 2), ((8, 9), 1), ((8, 0), 0)])
def test_w4a16_register_operand_tiles_first_on_hopper_offered_from_sm89_and_no_gemv_there(monkeypatch, cap, rank):
    from fp4dispatch.kernels.config_grouped import MmaW4A16GroupedConfig
    from fp4dispatch.kernels.heuristics import grouped_configs_for, w4a16_configs_for, w4a16_grouped_configs_for

    cuda = _cuda(monkeypatch, cap, gluon=False)
    for m in (1, 8, 16, 17, 128, 4096):
        cfgs = w4a16_configs_for(m, 8192, 8192, cuda)
        ra = _of(cfgs, C.WgmmaRegisterAW4A16Config)
        assert bool(ra) is (rank > 0) and len(cfgs) <= 7
        # the tl.dot tiles come first where the register-operand ones are not first; the GEMV (M <= 8) lost to both
        # on the H200 at every shape, so SM90 does not offer it
        assert isinstance(cfgs[0], C.WgmmaRegisterAW4A16Config if rank == 2 else C.MmaW4A16Config)
        assert bool(_of(cfgs, C.CudaCoreW4A16Config)) is (m <= 8 and rank != 2)
        assert all(c.k_blocks % 4 == 0 and c.launches == 2 for c in ra)
        # from M = 17 the first tile also as stream-K (one wave whatever the tile count), as for fp4_mm
        assert [c.stream_k for c in ra].count(True) == (rank > 0 and m > 16)
        assert not ra or m <= 16 or ra[-1] == dataclasses.replace(ra[0], split_k=1, stream_k=True)
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
    for t, e in ((8, 256), (256, 256), (4096, 16)):  # decode (a row per expert) and prefill
        for cfgs in (grouped_configs_for(t, e, 4096, 7168, cuda), w4a16_grouped_configs_for(t, e, 4096, 7168, cuda)):
            reg = [c for c in cfgs if isinstance(c, MmaW4A16GroupedConfig) and c.register_a]
            assert bool(reg) is (rank > 0) and len(cfgs) <= 7
            assert (cfgs[0] in reg) is (rank == 2)
            # decode batches also get the dense register-operand tiles of M <= 16 (16-block K steps), prefill not
            dense16 = {(16, 64, 16, 4, 3), (16, 128, 16, 8, 3)}
            got = {(c.block_m, c.block_n, c.k_blocks, c.warps, c.stages) for c in reg}
            assert (dense16 <= got) is (rank > 0 and t <= 8 * min(e, t))
            assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs


def test_w4a16_register_operand_configs_refuse_what_cannot_run_naming_the_field():
    from fp4dispatch.errors import InvalidInputError
    from fp4dispatch.kernels.config_grouped import MmaW4A16GroupedConfig

    with pytest.raises(InvalidInputError, match=r"WgmmaRegisterAW4A16Config.k_blocks must be a multiple of 4 "
                                                r"\(the K order goes by scale groups of 4\); got 2"):
        C.WgmmaRegisterAW4A16Config(16, 64, 2, 1, 4, 3)
    with pytest.raises(InvalidInputError, match=r"WgmmaRegisterAW4A16Config.block_m must be >= 16"):
        C.WgmmaRegisterAW4A16Config(8, 64, 4, 1, 4, 3)
    with pytest.raises(InvalidInputError, match=r"MmaW4A16GroupedConfig.k_blocks must be a multiple of 4 with "
                                                r"register_a \(the K order goes by scale groups of 4\); got 2"):
        MmaW4A16GroupedConfig(16, 64, 2, 4, 3, register_a=True)
    assert MmaW4A16GroupedConfig(16, 64, 2, 4, 3).k_blocks == 2  # the plain tile takes any power of two
    for cls in (C.WgmmaRegisterAConfig, C.WgmmaRegisterAW4A16Config):
        with pytest.raises(InvalidInputError, match=rf"{cls.__name__}.split_k must be 1 with stream_k \(stream-K "
                                                    r"cuts K itself\); got 2"):
            cls(16, 64, 4, 2, 4, 3, stream_k=True)
        with pytest.raises(InvalidInputError, match=rf"{cls.__name__}.stream_ctas must be None without stream_k; "
                                                    r"got 3"):
            cls(16, 64, 4, 1, 4, 3, stream_ctas=3)


@pytest.mark.parametrize("cap, rank", [((9, 0), 2), ((8, 9), 1), ((12, 0), 1), ((8, 0), 0)])
def test_register_a_first_on_hopper_offered_from_sm89(monkeypatch, cap, rank):
    cuda = _cuda(monkeypatch, cap, gluon=False)  # the Gluon kernels: their own tests below
    for m in (3, 16, 17, 128, 4096):
        cfgs = configs_for(m, 8192, 8192, cuda)
        ra = _of(cfgs, C.WgmmaRegisterAConfig)
        assert bool(ra) is (rank > 0) and len(cfgs) <= 7
        assert isinstance(cfgs[0], C.WgmmaRegisterAConfig) is (rank == 2)
        assert bool(_of(cfgs, C.MmaBf16Config)) is (rank < 2)  # SM90 drops the older bf16 tiles; elsewhere they stay
        if rank == 2 and m <= 16:  # the last M <= 16 tile decodes A in its loop (one launch for small shapes)
            assert not cfgs[len(ra) - 1].predecode_a
    # M <= 2 keeps the CUDA-core GEMV first without Gluon
    assert isinstance(configs_for(1, 8192, 8192, cuda)[0], C.CudaCoreGemvConfig)


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((10, 0), False), ((12, 0), False)])
def test_warp_specialized_first_above_m128_on_sm90_only(monkeypatch, cap, offered):
    cuda = _cuda(monkeypatch, cap)
    big, narrow, small = (256, 128, ""), (256, 64, ""), (128, 128, "")  # (block_m, block_n, variant)
    persist, swap, swap64 = (256, 128, "persistent"), (256, 128, "swap"), (256, 64, "swap")
    for m, n, tiles in ((64, 8192, []), (128, 8192, []), (129, 8192, [small]),
                        (300, 8192, [persist, big, narrow, small]), (512, 8192, [persist, big, narrow, small]),
                        (513, 8192, [persist, big, narrow]), (8192, 8192, [persist, big, narrow]),
                        (4096, 2048, [swap, persist, big, narrow, swap64]),
                        (300, 256, [swap, persist, big, narrow, small, swap64])):
        cfgs = configs_for(m, n, 8192, cuda)
        ws = _of(cfgs, C.WgmmaWarpSpecializedConfig)
        got = [(c.block_m, c.block_n, "persistent" if c.persistent else "swap" if c.swap else "") for c in ws]
        assert got == (tiles if offered else []), (m, n, cfgs)
        assert cfgs[:len(ws)] == ws and len(cfgs) <= 7  # first: the untuned default above M = 128
        assert _of(cfgs, C.WgmmaRegisterAConfig)  # the tuner still compares
    # TMA needs 16-byte weight rows (K % 32 == 0); a Triton without the Gluon it is written for offers none
    assert not _of(configs_for(1024, 8192, 8208, cuda), C.WgmmaWarpSpecializedConfig)
    monkeypatch.setattr(target, "gluon_missing", lambda: "no gluon here")
    assert not _of(configs_for(1024, 8192, 8192, cuda), C.WgmmaWarpSpecializedConfig)
    monkeypatch.setattr(target, "gluon_missing", lambda: None)
    monkeypatch.setattr(runtime, "jit_interpreted", lambda: True)
    assert not _of(configs_for(1024, 8192, 8192, cuda), C.WgmmaWarpSpecializedConfig)


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((12, 0), False)])
def test_tma_gemv_first_at_m_le_2_on_sm90_only(monkeypatch, cap, offered):
    from fp4dispatch.kernels.heuristics import TMA_GEMV_TILES

    cuda = _cuda(monkeypatch, cap)
    for m in (1, 2):
        cfgs = configs_for(m, 8192, 8192, cuda)
        gv = _of(cfgs, C.TmaGemvConfig)
        assert [(c.rows_per_quarter, c.k_blocks, c.stages, c.ctas_per_sm) for c in gv] == (
            list(TMA_GEMV_TILES) if offered else [])
        assert cfgs[:len(gv)] == gv and all(c.rows == m and c.int8_dot for c in gv)  # first: the untuned default
        assert _of(cfgs, C.CudaCoreGemvConfig) and len(cfgs) <= 7  # the tuner still compares
    assert not _of(configs_for(3, 8192, 8192, cuda), C.TmaGemvConfig)
    # its boxes need N % 32 == 0 (a box of a 32-row quarter) and K % 32 == 0 (16-byte rows)
    assert not _of(configs_for(1, 8200, 8192, cuda), C.TmaGemvConfig)
    assert not _of(configs_for(1, 8192, 8208, cuda), C.TmaGemvConfig)


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((12, 0), False)])
def test_grouped_tma_gemv_first_for_decode_batches_on_sm90_only(monkeypatch, cap, offered):
    from fp4dispatch.kernels.config_grouped import TmaGemvGroupedConfig
    from fp4dispatch.kernels.heuristics import (GROUPED_TMA_GEMV_ROWS, TMA_GEMV_TILES, grouped_configs_for,
                                                w4a16_grouped_configs_for)

    cuda = _cuda(monkeypatch, cap)
    first, second = TMA_GEMV_TILES
    # a row per touched expert on average (up to GROUPED_TMA_GEMV_ROWS)
    for t, e in ((1, 256), (64, 256), (GROUPED_TMA_GEMV_ROWS * 256, 256)):
        cfgs = grouped_configs_for(t, e, 4096, 7168, cuda)
        tma = _of(cfgs, TmaGemvGroupedConfig)
        want = [(2, *first), (1, *first), (1, *second)] if offered else []
        assert [(c.rows, c.rows_per_quarter, c.k_blocks, c.stages, c.ctas_per_sm) for c in tma] == want
        assert cfgs[:len(tma)] == tma and all(c.int8_dot and c.warps == 4 for c in tma)
        assert len(cfgs) <= 7 and len(cfgs) > len(tma)  # the tuner still compares the other families
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
        assert not _of(w4a16_grouped_configs_for(t, e, 4096, 7168, cuda), TmaGemvGroupedConfig)
    # prefill batches, and what its boxes cannot hold: N % 128 (each expert whole scale groups), K % 32
    for t, e, n, k in ((GROUPED_TMA_GEMV_ROWS * 256 + 1, 256, 4096, 7168), (8, 256, 4160, 7168),
                       (8, 256, 4096, 7184)):
        assert not _of(grouped_configs_for(t, e, n, k, cuda), TmaGemvGroupedConfig)
    assert TmaGemvGroupedConfig(1, 16, 32, 5) != C.TmaGemvConfig(1, 16, 32, 5)  # the dense op's launcher refuses it


@pytest.mark.parametrize("cap, offered", [((9, 0), True), ((8, 9), False), ((12, 0), False)])
def test_decode_warps_offered_at_m_65_to_128_on_sm90_only(monkeypatch, cap, offered):
    from dataclasses import replace

    from fp4dispatch.kernels.heuristics import DECODE_WARPS

    cuda = _cuda(monkeypatch, cap)
    for m in (64, 65, 100, 128, 129):
        cfgs = configs_for(m, 8192, 8192, cuda)
        want = [DECODE_WARPS, replace(DECODE_WARPS, persistent=True)] if offered and 64 < m <= 128 else []
        assert _of(cfgs, C.WgmmaDecodeWarpsConfig) == want, (m, cfgs)
        if want:  # after the first register-A tile, which stays the untuned default; the tuner compares them
            assert isinstance(cfgs[0], C.WgmmaRegisterAConfig) and cfgs[1:3] == want and len(cfgs) <= 7
    # its boxes need N % 32 == 0 (rows taken the way the scales are stored) and K % 32 == 0 (16-byte rows)
    assert not _of(configs_for(128, 8200, 8192, cuda), C.WgmmaDecodeWarpsConfig)
    assert not _of(configs_for(128, 8192, 8208, cuda), C.WgmmaDecodeWarpsConfig)


@pytest.mark.parametrize("cap, gluon, offered", [((9, 0), True, True), ((9, 0), False, False), ((8, 9), True, False)])
def test_w4a16_decode_warps_offered_at_m_65_to_128_on_sm90_with_gluon(monkeypatch, cap, gluon, offered):
    """w4a16_mm gets the decode-warps GEMM (its own config class, for its own launcher) at 64 < M <= 128, as fp4_mm
    does, after the first tile, with the same K split as fp4_mm's."""
    from dataclasses import replace

    from fp4dispatch.kernels.heuristics import DECODE_WARPS, w4a16_configs_for

    cuda = _cuda(monkeypatch, cap, gluon=gluon)
    base = C.WgmmaDecodeWarpsW4A16Config(**vars(DECODE_WARPS))
    assert base.family == "w4a16_wgmma_decode_warps" and base.launches == 2
    for m, (n, k), split in ((64, (8192, 8192), 1), (65, (8192, 8192), 1), (128, (768, 6144), 4),
                             (129, (8192, 8192), 1)):
        cfgs = w4a16_configs_for(m, n, k, cuda)
        want = ([replace(base, split_k=split)] if split > 1 else []) + [base, replace(base, persistent=True)]
        want = want if offered and 64 < m <= 128 else []
        assert _of(cfgs, C.WgmmaDecodeWarpsW4A16Config) == want, (m, cfgs)
        assert not any(type(c) is C.WgmmaDecodeWarpsConfig for c in cfgs)  # the NVFP4 kernel's class never
        assert cfgs[1:1 + len(want)] == want and len(cfgs) <= 7
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
    # its boxes need N % 32 == 0 and K % 32 == 0, as fp4_mm's
    assert not _of(w4a16_configs_for(128, 8200, 8192, cuda) + w4a16_configs_for(128, 8192, 8208, cuda),
                   C.WgmmaDecodeWarpsW4A16Config)


@pytest.mark.parametrize("cap, gluon, offered", [((9, 0), True, True), ((9, 0), False, False), ((8, 9), True, False)])
def test_w4a16_warp_specialized_first_above_m128_on_sm90_with_gluon_never_swapped(monkeypatch, cap, gluon, offered):
    """w4a16_mm gets fp4_mm's warp-specialized tiles (its own config class, for its own launcher) above M = 128, first,
    plain and persistent but never swapped (the weight would be the operand decoded first), with K % 32 == 0."""
    from fp4dispatch.errors import InvalidInputError
    from fp4dispatch.kernels.heuristics import w4a16_configs_for

    cuda = _cuda(monkeypatch, cap, gluon=gluon)
    with pytest.raises(InvalidInputError, match=r"^WgmmaWarpSpecializedW4A16Config.swap must be False \(swapped, "
                                                r"the operand decoded first would be the weight: a whole "
                                                r"dequantize\); got True$"):
        C.WgmmaWarpSpecializedW4A16Config(256, 128, 4, 5, swap=True)
    for m, n in ((128, 8192), (129, 8192), (300, 8192), (4096, 8192), (4096, 2048)):
        cfgs = w4a16_configs_for(m, n, 8192, cuda)
        ws = _of(cfgs, C.WgmmaWarpSpecializedW4A16Config)
        fp4 = [c for c in configs_for(m, n, 8192, cuda) if isinstance(c, C.WgmmaWarpSpecializedConfig) and not c.swap]
        want = [C.WgmmaWarpSpecializedW4A16Config(**vars(c)) for c in fp4] if offered and m > 128 else []
        assert ws == want, (m, n, cfgs)
        assert cfgs[:len(ws)] == ws and len(cfgs) <= 7 and _of(cfgs, C.WgmmaRegisterAW4A16Config)
        if ws:  # then the register-operand stream-K tile, which the cut left out from M = 257 (it wins at M = 300)
            assert cfgs[len(ws)].family == "w4a16_wgmma_register_a" and cfgs[len(ws)].stream_k, (m, n, cfgs)
        assert not any(type(c) is C.WgmmaWarpSpecializedConfig for c in cfgs)  # the NVFP4 kernel's class never
        assert all(c.family == "w4a16_wgmma_warp_specialized" and c.launches == 2 for c in ws)
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
    # its TMA needs 16-byte weight rows (K % 32 == 0)
    assert not _of(w4a16_configs_for(1024, 8192, 8208, cuda), C.WgmmaWarpSpecializedW4A16Config)


def test_decode_warps_split_k_where_its_tiles_leave_sms_idle(monkeypatch):
    """Fewer tiles than SMs (N <= 2048 at M = 128 on 132 SMs): a split-K config comes first among the decode-warps
    candidates, in the parts that minimize the busiest SM's K steps plus the partials' cost, one wave of them."""
    from dataclasses import replace

    from fp4dispatch.kernels.heuristics import DECODE_WARPS, decode_warps_split

    cuda = _cuda(monkeypatch, (9, 0))
    # (N, K) -> parts: 2048x6144 32 tiles of 48 steps -> 4 parts of 12 (at most 132 // 32); 768x6144 12 tiles -> 4
    # (12 + 18 against 5 + 36 for 10 parts); 6144x2048 96 tiles: a second wave of parts, none
    for (n, k), split in {(2048, 6144): 4, (768, 6144): 4, (6144, 2048): 1, (8192, 8192): 1, (28672, 8192): 1}.items():
        cfgs = configs_for(128, n, k, cuda)
        want = ([replace(DECODE_WARPS, split_k=split)] if split > 1 else []) + [
            DECODE_WARPS, replace(DECODE_WARPS, persistent=True)]
        assert _of(cfgs, C.WgmmaDecodeWarpsConfig) == want, (n, k)
        assert isinstance(cfgs[0], C.WgmmaRegisterAConfig) and cfgs[1:1 + len(want)] == want and len(cfgs) <= 7
    # (N tiles, tiles, K steps): 992 rows make 8 groups of 2 N tiles, M = 300 three M tiles, K = 2080 17 steps
    assert C.decode_warps_work(300, 992, 130, DECODE_WARPS) == (16, 48, 17)
    assert decode_warps_split(12, 3, 132) == 1  # parts of >= 2 steps
    assert decode_warps_split(12, 96, 132) == 6 and decode_warps_split(132, 48, 132) == 1


@pytest.mark.parametrize("cap, gluon, offered", [((9, 0), True, True), ((9, 0), False, False), ((8, 9), True, False)])
def test_w4a16_tma_mma_offered_first_up_to_m16_on_sm90_with_gluon(monkeypatch, cap, gluon, offered):
    """gemv/tma_mma_w4a16 (its own config class) at M <= 16, before the register-operand tiles: a token box of 1
    row at M = 1, 8 to M = 8, 16 to M = 16; each ring the deepest (<= 6 slots) whose CTAs fit an SM's shared memory;
    its boxes need N % 32 == 0 and K % 32 == 0, and it is offered at K % 64 == 0 only (the form that has run on a
    GPU)."""
    from fp4dispatch.kernels.heuristics import SMEM_SM90, TMA_MMA_W4A16_TILES, w4a16_configs_for

    cuda = _cuda(monkeypatch, cap, gluon=gluon)
    for m, rows in ((1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (17, None)):
        cfgs = w4a16_configs_for(m, 8192, 8192, cuda)
        got = _of(cfgs, C.TmaMmaW4A16Config)
        assert [from_json(json.loads(json.dumps(c.to_json()))) for c in cfgs] == cfgs
        if not offered or rows is None:
            assert not got, (m, cfgs)
            continue
        assert cfgs[:len(got)] == got and len(got) == len(TMA_MMA_W4A16_TILES) and len(cfgs) <= 7, (m, cfgs)
        assert isinstance(cfgs[len(got)], C.WgmmaRegisterAW4A16Config), (m, cfgs)
        for c, (r, bw, kw, ctas) in zip(got, TMA_MMA_W4A16_TILES):
            assert (c.rows, c.rows_per_quarter, c.k_blocks, c.k_warps, c.ctas_per_sm) == (rows, r, bw, kw, ctas)
            stage = bw * (36 * r + 32 * rows)  # weight words, scales, token rows (bytes)
            assert 2 <= c.stages <= 6 and c.stages * stage * ctas <= SMEM_SM90, c
            assert c.stages == 6 or (c.stages + 1) * stage * ctas > SMEM_SM90, c
    assert not _of(w4a16_configs_for(1, 8200, 8192, cuda) + w4a16_configs_for(1, 8192, 8208, cuda),
                   C.TmaMmaW4A16Config)
    # K % 64 == 32 (its whole-row token boxes, not yet run on a GPU) is not offered
    assert not _of(w4a16_configs_for(1, 8192, 8224, cuda) + w4a16_configs_for(16, 8192, 2080, cuda),
                   C.TmaMmaW4A16Config)


def test_tma_mma_w4a16_config_refuses_what_its_kernel_cannot_run_naming_the_field():
    from fp4dispatch.errors import InvalidInputError

    ok = C.TmaMmaW4A16Config(1, 16, 32, 5, k_warps=1, ctas_per_sm=2)
    assert ok.warps == 4 and C.TmaMmaW4A16Config(16, 8, 64, 3, k_warps=4).warps == 8
    assert from_json(ok.to_json()) == ok and ok.to_json()["family"] == "w4a16_gemv_tma_mma"
    base = dict(rows=1, rows_per_quarter=16, k_blocks=32, stages=5)
    bad = [(dict(rows=2), r"rows must be 1, 8 or 16 \(one token, or whole mma.sync columns\); got 2"),
           (dict(rows_per_quarter=32), r"rows_per_quarter must be 8 or 16; got 32"),
           (dict(rows_per_quarter=8), r"k_warps must be a power of two, warps % 4 == 0; got 1"),
           (dict(k_warps=3), r"k_warps must be a power of two, warps % 4 == 0; got 3"),
           (dict(k_blocks=8, k_warps=2), r"k_blocks must be a power of two, a multiple of 8 \* k_warps \(each warp "
                                         r"whole 8-block chunks\); got 8"),
           (dict(k_blocks=48), r"k_blocks must be a power of two"),
           (dict(stages=1), r"stages must be >= 2 \(the producer refills a slot while the next is read\); got 1")]
    for change, msg in bad:
        with pytest.raises(InvalidInputError, match=f"^TmaMmaW4A16Config.{msg}"):
            C.TmaMmaW4A16Config(**{**base, **change})
