"""CPU tests of the Gluon kernels' host side (no GPU): what their launchers refuse, the TMA descriptors they build,
their PDL options; and the int8 dot-product numerics of the TMA-fed GEMV replayed in Python."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton backends are unavailable")


def _gluon_module(name: str):
    """A Gluon kernel module (they import on any Triton whose Gluon has what they use; building them needs 3.6)."""
    import importlib

    try:
        return importlib.import_module(f"fp4dispatch.kernels.{name}")
    except Exception as e:  # noqa: BLE001 - this Triton's Gluon lacks something the module uses
        pytest.skip(f"fp4dispatch.kernels.{name} does not import here ({type(e).__name__}: {e})")


def test_decode_warps_split_buffers_typed_even_unsplit(monkeypatch):
    """wgds compiles its split epilogue whatever SPLIT is: unsplit, alpha stands in as an fp32 workspace and int32
    counters (never touched); split, a [BN, BM] fp32 block per (tile, part) and the stream's zeroed counters."""
    from fp4dispatch.kernels import workspace
    split_buffers = _gluon_module("gemm.wgmma_decode_warps").split_buffers

    monkeypatch.setattr(workspace, "_COUNTERS", {})
    alpha, out = torch.ones(1), torch.empty(3, 5)
    ws, cnt = split_buffers(1, 12, 64 * 128, alpha, out)
    assert ws is alpha and cnt.dtype == torch.int32 and cnt.data_ptr() == alpha.data_ptr()
    ws, cnt = split_buffers(4, 12, 64 * 128, alpha, out)
    assert ws.dtype == torch.float32 and ws.numel() == 4 * 12 * 64 * 128
    assert cnt.dtype == torch.int32 and cnt.numel() >= 12 and int(cnt.count_nonzero()) == 0


def test_decode_warps_refuses_what_tma_cannot_describe():
    run = _gluon_module("gemm.wgmma_decode_warps").run
    from fp4dispatch.kernels.heuristics import DECODE_WARPS

    a, s = torch.zeros(128, 1024, dtype=torch.uint8), torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"WgmmaDecodeWarpsConfig needs N % 32 == 0, K % 32 == 0 and a 16-byte "
                                         r"aligned b and b_scale; got N=1000, K=2048, data_ptr\(\) % 16 of "
                                         r"\(b, b_scale\) = \(0, 0\)"):
        run(a, torch.zeros(1000, 1024, dtype=torch.uint8), s, s, s, s, DECODE_WARPS)
    with pytest.raises(ValueError, match=r"got N=1024, K=2064"):
        run(torch.zeros(4, 8 * 129, dtype=torch.uint8), torch.zeros(1024, 8 * 129, dtype=torch.uint8), s, s, s, s,
            DECODE_WARPS)


def test_w4a16_decode_warps_refuses_what_tma_cannot_describe_naming_its_op():
    run = _gluon_module("gemm.wgmma_decode_warps_w4a16").run
    from fp4dispatch.kernels.config import WgmmaDecodeWarpsW4A16Config
    from fp4dispatch.kernels.heuristics import DECODE_WARPS

    cfg, s = WgmmaDecodeWarpsW4A16Config(**vars(DECODE_WARPS)), torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^w4a16_mm: WgmmaDecodeWarpsW4A16Config needs N % 32 == 0, K % 32 == 0 "
                                         r"and a 16-byte aligned b and b_scale; got N=1000, K=2048, "
                                         r"data_ptr\(\) % 16 of \(b, b_scale\) = \(0, 0\)\. "
                                         r"Use another config from w4a16_configs_for\(\)$"):
        run(torch.zeros(4, 2048, dtype=torch.bfloat16), torch.zeros(1000, 1024, dtype=torch.uint8), s, s, s, cfg)


def test_tma_gemv_refuses_what_tma_cannot_describe():
    from fp4dispatch.kernels.config import TmaGemvConfig

    run = _gluon_module("gemv.tma_warp_specialized").run
    cfg = TmaGemvConfig(1, 16, 32, 5, warps=4, ctas_per_sm=2)
    a, s = torch.zeros(1, 1024, dtype=torch.uint8), torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"TmaGemvConfig needs M <= rows, N % 32 == 0, K % 32 == 0 and 16-byte "
                                         r"aligned operands; got M=1, rows=1, N=1000, K=2048"):
        run(a, torch.zeros(1000, 1024, dtype=torch.uint8), s, s, s, s, cfg)
    with pytest.raises(ValueError, match=r"got M=2, rows=1, N=256, K=2048"):
        run(torch.zeros(2, 1024, dtype=torch.uint8), torch.zeros(256, 1024, dtype=torch.uint8), s, s, s, s, cfg)



def test_tma_mma_w4a16_refuses_what_tma_cannot_describe_and_more_tokens_than_its_box(monkeypatch):
    """Its launcher names the config, the need, what it got and where to look; a good call builds the three
    descriptors (the weight one 8-block chunk a box) and a persistent grid of ctas_per_sm CTAs per SM."""
    from fp4dispatch.kernels import runtime
    from fp4dispatch.kernels.config import TmaMmaW4A16Config

    mod = _gluon_module("gemv.tma_mma_w4a16")
    cfg = TmaMmaW4A16Config(1, 16, 32, 5, k_warps=1, ctas_per_sm=2)
    b, s = torch.zeros(1024, 1024, dtype=torch.uint8), torch.zeros(1024, 128, dtype=torch.uint8)
    x, alpha = torch.zeros(1, 2048, dtype=torch.bfloat16), torch.ones(1)
    for a, w, what in ((torch.zeros(2, 2048, dtype=torch.bfloat16), b, r"M=2, rows=1, N=1024, K=2048"),
                       (x, torch.zeros(1000, 1024, dtype=torch.uint8), r"M=1, rows=1, N=1000, K=2048"),
                       (torch.zeros(1, 2064, dtype=torch.bfloat16), torch.zeros(1024, 1032, dtype=torch.uint8),
                        r"M=1, rows=1, N=1024, K=2064")):
        with pytest.raises(ValueError, match=r"^w4a16_mm: TmaMmaW4A16Config needs M <= rows, N % 32 == 0, K % 32 == 0 "
                                             rf"and 16-byte aligned a, b and b_scale; got {what}, data_ptr\(\) % 16 "
                                             r"of \(a, b, b_scale\) = \(0, 0, 0\)\. Use another config from "
                                             r"w4a16_configs_for\(\)$"):
            mod.run(a, w, s, alpha, torch.empty(a.shape[0], w.shape[0]), cfg)
    got = []
    monkeypatch.setattr(mod, "launch", lambda fn, grid, *args, **kw: got.append((grid, args, kw)))
    monkeypatch.setattr(mod, "tma_desc", lambda ptr, dtype, shape, strides, block, layout: (
        shape, strides, block, layout.swizzle_byte_width))
    monkeypatch.setattr(runtime, "num_sms", lambda device: 8)
    mod.run(x, b, s, alpha, torch.empty(1, 1024), cfg)
    (grid, args, kw), = got
    # one token row, K % 64 == 0, 32 blocks a step: its lines as one swizzled box per step (8 lines of 16 int64)
    assert grid == (16,) and args[:3] == (((32, 32, 128), (4096, 128, 1), (4, 16, 8), 0),
                                          ((8, 32, 128), (4096, 128, 1), (1, 8, 64), 0),
                                          ((1, 32, 16), (512, 16, 1), (1, 8, 16), 128))
    assert args[5:] == (1, 1024, 16, 4)  # M, N, tiles (8 groups of 128 rows, 2 tiles each), steps (128 blocks / 32)
    assert kw == dict(R=16, BW=32, MB=1, STAGES=5, KW=1, BF16=True, SWZ=True, num_warps=4, maxnreg=128)
    # 16 token rows: a swizzled box [16, 2, 16] per 8-block chunk; K % 64 == 32: the unswizzled box of whole rows
    for k, acts, swz in ((2048, ((12, 32, 16), (512, 16, 1), (16, 2, 16), 128), True),
                         (2080, ((12, 520), (520, 1), (16, 128), 0), False)):
        got.clear()
        w, sk = torch.zeros(1024, k // 2, dtype=torch.uint8), torch.zeros(1024, -(-k // 64) * 4, dtype=torch.uint8)
        mod.run(torch.zeros(12, k, dtype=torch.bfloat16), w, sk, alpha, torch.empty(12, 1024),
                TmaMmaW4A16Config(16, 16, 32, 4, k_warps=1, ctas_per_sm=2))
        (_, args, kw), = got
        assert args[2] == acts and kw["SWZ"] is swz and kw["MB"] == 16

def test_grouped_tma_gemv_refuses_what_tma_cannot_describe_and_launches_nothing_for_no_rows(monkeypatch):
    from fp4dispatch.kernels.config_grouped import TmaGemvGroupedConfig

    mod = _gluon_module("gemv.tma_warp_specialized_grouped")
    cfg = TmaGemvGroupedConfig(2, 16, 32, 5, warps=4, ctas_per_sm=2)
    s, offs = torch.zeros(128, 128, dtype=torch.uint8), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^fp4_grouped_mm: TmaGemvGroupedConfig needs N % 128 == 0, K % 32 == 0 and "
                                         r"16-byte aligned operands; got N=960, K=2048, data_ptr\(\) % 16 of \(a, b, "
                                         r"a_scale, b_scale\) = \(0, 0, 0, 0\)\. Use another config from "
                                         r"grouped_configs_for\(\)$"):
        mod.run(torch.zeros(3, 1024, dtype=torch.uint8), torch.zeros(4, 960, 1024, dtype=torch.uint8), s, s, s, s,
                offs, cfg)
    with pytest.raises(ValueError, match=r"got N=1024, K=2064"):
        mod.run(torch.zeros(3, 8 * 129, dtype=torch.uint8), torch.zeros(4, 1024, 8 * 129, dtype=torch.uint8), s, s,
                s, s, offs, cfg)
    monkeypatch.setattr(mod, "launch", lambda *a, **k: pytest.fail("launched for T = 0"))
    mod.run(torch.zeros(0, 1024, dtype=torch.uint8), torch.zeros(4, 1024, 1024, dtype=torch.uint8), s, s, s,
            torch.zeros(0, 1024), offs, cfg)


def _needs_gluon():
    from fp4dispatch.kernels import gluon_missing

    if gluon_missing():
        pytest.skip(gluon_missing())


def test_tma_gemv_descriptors_are_cached_and_hold_no_tensor():
    import gc
    import weakref

    _needs_gluon()
    from fp4dispatch.kernels.gemv import tma_warp_specialized as gv

    a, sa = torch.zeros(1, 4096, dtype=torch.uint8), torch.zeros(128, 512, dtype=torch.uint8)
    b, sb = torch.zeros(8192, 4096, dtype=torch.uint8), torch.zeros(8192, 512, dtype=torch.uint8)
    first = gv.descriptors(a, b, sa, sb, 16, 32, 1)
    assert all(x is y for x, y in zip(first, gv.descriptors(a, b, sa, sb, 16, 32, 1)))  # a hit: no rebuilding
    assert [d.block_shape for d in first] == [[4, 16, 32], [1, 8, 64], [1, 32], [1, 8, 4]]
    assert first[0].shape == [256, 32, 512] and first[1].shape == [64, 128, 128] and first[1].strides == [16384, 128, 1]
    gone = weakref.ref(b)
    del b, first
    gc.collect()
    assert gone() is None  # the cache keeps an address, not the weight


@pytest.mark.parametrize("swap", [False, True])
def test_warp_specialized_cached_descriptors_describe_what_from_tensor_does(monkeypatch, swap):
    """The descriptors come from ``runtime.tma_desc``: every field Triton's launcher reads (address, dtype, shape,
    strides, block, layout) equals what ``TensorDescriptor.from_tensor`` builds from the tensors."""
    _needs_gluon()
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4dispatch.kernels.config import WgmmaWarpSpecializedConfig
    from fp4dispatch.kernels.gemm import wgmma_warp_specialized as ws

    m, n, k = 300, 1024, 2048
    yd = torch.zeros(n if swap else m, k // 4, dtype=torch.float16)  # what predecode returns: [rows, K/64 * 64]
    monkeypatch.setattr(ws, "predecode", lambda *args, **kw: yd)
    got = []
    monkeypatch.setattr(ws, "launch", lambda fn, grid, *args, **kw: got.append(args[:2]))
    a, b = torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.zeros(1, dtype=torch.uint8)
    ws.run(a, b, s, s, s, s, WgmmaWarpSpecializedConfig(256, 128, 4, 5, swap=swap))
    xl, yl = ws.word_tile_layout(128, 4), ws.operand_layout(256, 4, torch.float16)
    want = (TensorDescriptor.from_tensor((a if swap else b).view(torch.int64), [128, 4], xl),
            TensorDescriptor.from_tensor(yd, [256, 64], yl))
    for d, w in zip(got[0], want):
        assert (d.base.data_ptr(), d.base.dtype, list(d.shape), list(d.strides), list(d.block_shape), d.layout,
                d.padding) == (w.base.data_ptr(), w.base.dtype, list(w.shape), list(w.strides), list(w.block_shape),
                               w.layout, w.padding)


def test_gluon_gemms_wait_for_the_predecode_only_with_pdl(monkeypatch):
    """With PDL (``runtime.pdl``'s options) the pre-decode before both Gluon GEMMs triggers its dependents early
    (EARLY) and they launch with launch_pdl (only the partition that loads the pre-decoded operand waits; neither
    kernel has a PDL parameter); without, neither."""
    _needs_gluon()
    from fp4dispatch.kernels import runtime
    from fp4dispatch.kernels.config import WgmmaWarpSpecializedConfig
    from fp4dispatch.kernels.gemm import wgmma_decode_warps as dw
    from fp4dispatch.kernels.gemm import wgmma_warp_specialized as ws
    from fp4dispatch.kernels.gemm.wgmma_register_a import pdl_after_predecode
    from fp4dispatch.kernels.heuristics import DECODE_WARPS

    assert pdl_after_predecode({}) == ({}, {})
    assert pdl_after_predecode({"launch_pdl": True, "PDL": True}) == (
        {"launch_pdl": True, "PDL": True, "EARLY": True}, {"launch_pdl": True})
    monkeypatch.setattr(runtime, "pdl", lambda device, enabled: {"launch_pdl": True, "PDL": True} if enabled else {})
    m, n, k = 300, 1024, 2048
    pre, got = [], []
    monkeypatch.setattr(ws, "predecode", lambda *args, **kw: pre.append(kw) or
                        torch.zeros(m, k // 4, dtype=torch.float16))
    monkeypatch.setattr(ws, "launch", lambda fn, grid, *args, **kw: got.append(kw))
    a, b = torch.zeros(m, k // 2, dtype=torch.uint8), torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.zeros(1, dtype=torch.uint8)
    for pdl in (True, False):
        ws.run(a, b, s, s, s, s, WgmmaWarpSpecializedConfig(256, 128, 4, 5, pdl=pdl))
    # decode warps: 128 x 768, K = 6144
    monkeypatch.setattr(dw, "predecode", lambda *args, **kw: pre.append(kw) or
                        torch.zeros(128, 6144 // 4, dtype=torch.float16))
    monkeypatch.setattr(dw, "launch", lambda fn, grid, *args, **kw: got.append(kw))
    a, b = torch.zeros(128, 3072, dtype=torch.uint8), torch.zeros(768, 3072, dtype=torch.uint8)
    sa, sb = torch.zeros(128 * 384, dtype=torch.uint8), torch.zeros(768 * 384, dtype=torch.uint8)
    for pdl in (True, False):
        dw.run(a, b, sa, sb, torch.ones(1), torch.empty(128, 768), DECODE_WARPS.__class__(pdl=pdl))
    for i, on in ((0, True), (1, False), (2, True), (3, False)):
        assert bool(pre[i].get("EARLY")) == on and bool(pre[i].get("PDL")) == on, i
        assert bool(got[i].get("launch_pdl")) == on and "PDL" not in got[i], i


def test_gluon_missing_names_the_triton_it_needs(monkeypatch):
    import triton

    from fp4dispatch.kernels import target

    target.gluon_missing.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    try:
        assert target.gluon_missing() == (
            "the Gluon kernels (wgmma_warp_specialized, wgmma_decode_warps, tma_warp_specialized) are written for "
            "Triton 3.6's Gluon; this is Triton 3.9.0")
    finally:
        target.gluon_missing.cache_clear()


def test_warp_specialized_refuses_what_tma_cannot_describe():
    from fp4dispatch.kernels.config import WgmmaWarpSpecializedConfig

    run = _gluon_module("gemm.wgmma_warp_specialized").run
    a = torch.zeros(4, 8 * 129, dtype=torch.uint8)  # K = 2064: K/16 = 129 words per row, 1032-byte rows
    with pytest.raises(ValueError, match=r"WgmmaWarpSpecializedConfig needs K % 32 == 0 and a 16-byte aligned b; "
                                         r"got K=2064"):
        run(a, torch.zeros(8, 8 * 129, dtype=torch.uint8), a, a, a, a, WgmmaWarpSpecializedConfig(256, 128, 4, 5))
    # swapped, the activation's words are the ones TMA loads: its base must be aligned
    words = torch.zeros(4 * 1024 + 1, dtype=torch.uint8)[1:].view(4, 1024)  # K = 2048, base 1 byte off
    with pytest.raises(ValueError, match=r"needs K % 32 == 0 and a 16-byte aligned a; got K=2048, "
                                         r"data_ptr\(\) % 16 = 1"):
        run(words, torch.zeros(8, 1024, dtype=torch.uint8), a, a, a, a,
            WgmmaWarpSpecializedConfig(256, 128, 4, 5, swap=True))


def test_w4a16_warp_specialized_refuses_what_tma_cannot_describe_naming_its_op():
    from fp4dispatch.kernels.config import WgmmaWarpSpecializedW4A16Config

    run = _gluon_module("gemm.wgmma_warp_specialized_w4a16").run
    s = torch.zeros(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^w4a16_mm: WgmmaWarpSpecializedW4A16Config needs K % 32 == 0 and a "
                                         r"16-byte aligned b; got K=2064, data_ptr\(\) % 16 = 0\. Use another "
                                         r"config from w4a16_configs_for\(\)$"):
        run(torch.zeros(4, 2064, dtype=torch.bfloat16), torch.zeros(8, 8 * 129, dtype=torch.uint8), s, s, s,
            WgmmaWarpSpecializedW4A16Config(256, 128, 4, 5))


def test_w4a16_warp_specialized_launches_the_nvfp4_kernel_on_the_permuted_activations(monkeypatch):
    """On meta tensors (no GPU): the activation permute, then one ``wgws_kernel`` launch with W4A16 set, its Y
    descriptor over the permuted copy in the activations' dtype (K padded to whole scale groups), the weight's
    descriptor and grid as the NVFP4 launch has them."""
    from fp4dispatch.kernels import runtime
    from fp4dispatch.kernels.config import WgmmaWarpSpecializedConfig, WgmmaWarpSpecializedW4A16Config

    ws = _gluon_module("gemm.wgmma_warp_specialized")
    w4 = _gluon_module("gemm.wgmma_warp_specialized_w4a16")
    got = []

    def rec_launch(fn, grid, *args, **kw):
        got.append((fn.__name__, tuple(grid), args, kw))

    def rec_desc(ptr, dtype, shape, strides, block, layout):
        return (dtype, tuple(shape), tuple(strides), tuple(block))

    monkeypatch.setattr(runtime, "pdl", lambda device, enabled: {"launch_pdl": True, "PDL": True} if enabled else {})
    monkeypatch.setattr(runtime, "launch", rec_launch)
    monkeypatch.setattr(runtime, "_SMS", {0: 8})
    monkeypatch.setattr(ws, "launch", rec_launch)
    monkeypatch.setattr(ws, "tma_desc", rec_desc)
    meta = dict(device="meta")
    m, n, k = 300, 1024, 2080
    b = torch.empty(n, k // 2, dtype=torch.uint8, **meta)
    sb = torch.empty(n * 36 * 4, dtype=torch.uint8, **meta)
    alpha = torch.empty(1, **meta)
    for dt in (torch.bfloat16, torch.float16):
        for persistent in (False, True):
            got.clear()
            out = torch.empty(m, n, dtype=torch.bfloat16, **meta)
            w4.run(torch.empty(m, k, dtype=dt, **meta), b, sb, alpha, out,
                   WgmmaWarpSpecializedW4A16Config(256, 128, 4, 5, persistent=persistent))
            (permute, *_), (name, grid, args, kw) = got
            assert permute == "permute_a_kernel" and name == "wgws_kernel" and kw["W4A16"] is True
            assert args[1] == (dt, (m, 2112), (2112, 1), (256, 64))  # K padded to 33 groups of 64
            assert args[0] == (torch.int64, (n, 130), (130, 1), (128, 4))
            assert grid == ((8,) if persistent else (16,)) and kw["SWAP"] is False and kw["num_warps"] == 8
    # the NVFP4 launch leaves W4A16 at the kernel's default
    got.clear()
    a = torch.empty(m, k // 2, dtype=torch.uint8, **meta)
    ws.run(a, b, torch.empty(384 * 36 * 4, dtype=torch.uint8, **meta), sb, alpha,
           torch.empty(m, n, dtype=torch.bfloat16, **meta), WgmmaWarpSpecializedConfig(256, 128, 4, 5))
    assert got[-1][0] == "wgws_kernel" and "W4A16" not in got[-1][3]


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode) in Python: byte i of the result from nibble i of sel's low 16 bits."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        v = src[nib & 7]
        out |= ((0xFF if v & 0x80 else 0) if nib & 8 else v) << (8 * i)
    return out


def _i8(word: int) -> list[int]:
    return [int.from_bytes(word.to_bytes(4, "little")[i:i + 1], "little", signed=True) for i in range(4)]


def test_dp4_table_and_sign_split_give_twice_e2m1_for_every_code():
    """The TMA-fed GEMV's int8 dot products (kernels/numerics/int8_dot.py), its PTX steps replayed in Python: the
    two-register table holds 2*|e2m1| of codes 0..7; prmt of a word gives the positive codes' magnitudes (0 for the negative ones, since every table byte
    has its sign bit clear), prmt of the word with its sign bits flipped the negative ones'; A's signed bytes come
    from (p | 0x80) - n per byte without borrows. So dp4a sums are exactly 4 * w * a, for all 16 x 16 code pairs."""
    from fp4dispatch.format import E2M1_VALUES
    from fp4dispatch.kernels.numerics import int8_dot

    t0, t1 = int8_dot.TABLE
    for code in range(16):
        word = code * 0x11111111  # the code in all 8 nibbles
        pos, neg = _prmt(t0, t1, word & 0xFFFF), _prmt(t0, t1, (word ^ 0x88888888) & 0xFFFF)
        want = 2 * E2M1_VALUES[code]
        assert (pos & 0xFF, neg & 0xFF) == ((want, 0) if want >= 0 else (0, -want)), code
        signed = (((pos | 0x80808080) - neg) & 0xFFFFFFFF) ^ 0x80808080  # act_i8's bytewise p - n
        assert _i8(signed) == [want] * 4, code
    for a in range(16):
        for b in range(16):
            wa, wb = a * 0x1111, b * 0x1111
            sa = _i8((((_prmt(t0, t1, wa) | 0x80808080) - _prmt(t0, t1, wa ^ 0x8888)) & 0xFFFFFFFF) ^ 0x80808080)
            p, n = _prmt(t0, t1, wb), _prmt(t0, t1, wb ^ 0x8888)  # dp_block: dp4a(p, a) - dp4a(n, a)
            got = sum(x * y for x, y in zip(p.to_bytes(4, "little"), sa)) - sum(
                x * y for x, y in zip(n.to_bytes(4, "little"), sa))
            assert got == 16 * E2M1_VALUES[a] * E2M1_VALUES[b], (a, b)
