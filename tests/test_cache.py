"""Disk cache: corrupt files never crash, concurrent writers never lose entries, JSON only."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp

import pytest
import torch

from fp4dispatch.dispatch.cache import SCHEMA_VERSION, DecisionCache
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.dispatch.fingerprint import device_fingerprint
from fp4dispatch.dispatch.records import clean_section
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs

FP = {"device_type": "cpu", "libs": {"torch": "x"}}


def _file(tmp_path):
    return DecisionCache(tmp_path, FP).path


CORRUPT = {
    "garbage": "not json at all {{{",
    "truncated": '{"schema_version": 1, "fingerprint": {"device_type": "cp',
    "list": "[1, 2, 3]",
    "future-schema": json.dumps({"schema_version": SCHEMA_VERSION + 1, "fingerprint": FP, "health": {},
                                 "decisions": {}, "shape_blacklist": {}}),
    # they compared equal to 1 and were read as schema 1
    "bool-schema": json.dumps({"schema_version": True, "fingerprint": FP, "health": {}, "decisions": {"k": {}},
                               "shape_blacklist": {}}),
    "float-schema": json.dumps({"schema_version": 1.0, "fingerprint": FP, "health": {}, "decisions": {"k": {}},
                                "shape_blacklist": {}}),
    "foreign": json.dumps({"schema_version": SCHEMA_VERSION, "fingerprint": {"device_type": "cuda", "gpu": "B200"},
                           "health": {}, "decisions": {"k": {}}, "shape_blacklist": {}}),
    "bad-section": json.dumps({"schema_version": SCHEMA_VERSION, "fingerprint": FP, "health": [],
                               "decisions": {}, "shape_blacklist": {}}),
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_corrupt_cache_warns_once_and_is_rebuilt(tmp_path, kind, caplog):
    path = _file(tmp_path)
    path.write_text(CORRUPT[kind])
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        c = DecisionCache(tmp_path, FP)
        assert c.decisions == {} and c.health == {}
        c.update("decisions", {"m1-n2-k16-bfloat16": {"backend": "x"}})
        c.update("decisions", {"m2-n2-k16-bfloat16": {"backend": "y"}})
    warnings = [r for r in caplog.records if "ignoring cache file" in r.getMessage()]
    assert len(warnings) == 1
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["fingerprint"] == FP
    assert set(data["decisions"]) == {"m1-n2-k16-bfloat16", "m2-n2-k16-bfloat16"}


def test_source_hash_names_the_package_code(tmp_path):
    from fp4dispatch.dispatch.fingerprint import source_hash

    def tree(name: str, files: dict) -> str:
        for rel, text in files.items():
            (tmp_path / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / rel).write_text(text)
        return str(tmp_path / name)
    base = {"x.py": "A = 1\n", "kernels/y.py": "TILES = (64, 128)\n", "notes.txt": "not code"}
    h = source_hash(tree("a", base))
    assert len(h) == 16 and h == source_hash(tree("b", base))  # content and paths, not where the package lies
    assert source_hash(tree("c", dict(base, **{"kernels/y.py": "TILES = (64, 256)\n"}))) != h
    assert source_hash(tree("d", {"x.py": "A = 1\n", "kernels/z.py": "TILES = (64, 128)\n"})) != h
    assert source_hash(tree("e", dict(base, **{"notes.txt": "edited"}))) == h  # only Python sources count
    assert source_hash(tree("f", {"README": "no code"})) is None
    assert device_fingerprint(torch.device("cpu"))["source"] == source_hash()


def test_equivalent_env_settings_share_one_cache_file(monkeypatch):
    from fp4dispatch.dispatch.fingerprint import fingerprint_hash

    def file_hash(**env):
        for k in ("FP4DISPATCH_TIMER", "FP4DISPATCH_DISABLE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return fingerprint_hash(device_fingerprint(torch.device("cpu")))

    default = file_hash()  # each spelling below was a file of its own
    assert file_hash(FP4DISPATCH_TIMER="graph") == file_hash(FP4DISPATCH_TIMER=" Graph ") == default
    assert file_hash(FP4DISPATCH_TIMER="eager") == file_hash(FP4DISPATCH_TIMER="EAGER") != default
    ab = file_hash(FP4DISPATCH_DISABLE="a,b")
    assert ab == file_hash(FP4DISPATCH_DISABLE="b,a") == file_hash(FP4DISPATCH_DISABLE="b, a,,a ") != default
    assert file_hash(FP4DISPATCH_DISABLE=" , ") == default
    monkeypatch.setenv("FP4DISPATCH_DISABLE", "b, a")
    assert device_fingerprint(torch.device("cpu"))["env"]["FP4DISPATCH_DISABLE"] == "a,b"


def test_dispatcher_survives_corrupt_file(tmp_path):
    cdir = tmp_path / "c"
    cdir.mkdir()
    path = DecisionCache(cdir, device_fingerprint(torch.device("cpu"))).path
    path.write_text('{"schema_version": 1, "decis')
    d = Dispatcher([FakeBackend("x")], cache_dir=cdir, do_bench=fake_do_bench)
    a, b, sa, sb, alpha = make_nvfp4_inputs(2, 32, 64)
    d.fp4_mm(a, b, sa, sb, alpha)
    assert "m2-n32-k64-bfloat16" in json.loads(path.read_text())["decisions"]


def test_no_temp_files_left_and_nested_merge(tmp_path):
    c = DecisionCache(tmp_path, FP)
    k = "m4-n64-k128-float32"
    c.update("shape_blacklist", {k: {"a": "incorrect"}}, merge_nested=True)
    c.update("shape_blacklist", {k: {"b": "failed"}}, merge_nested=True)
    assert c.shape_blacklist == {k: {"a": "incorrect", "b": "failed"}}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [c.path.name]


def test_unwritable_dir_keeps_decisions_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    c = DecisionCache(blocker / "sub", FP)  # a directory below a regular file cannot be made
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        c.update("decisions", {"k": {"backend": "x"}})
    assert c.decisions == {"k": {"backend": "x"}}
    assert any("could not write the cache" in r.getMessage() for r in caplog.records)


def _tune_rounds(cache_dir: str, first: int) -> None:
    """5 rounds (a fresh dispatcher each: it re-reads the file) over 25 keys, overlapping the next process's."""
    for _ in range(5):
        d = Dispatcher([FakeBackend("p", cost=1e-5), FakeBackend("q", cost=2e-5)], cache_dir=cache_dir,
                       do_bench=fake_do_bench)
        d.warmup([(1, 16 * (first + i), 64) for i in range(25)], out_dtype=torch.float32, device="cpu")


def test_many_processes_write_one_cache(tmp_path):
    ctx = mp.get_context("spawn")
    firsts = [1 + 10 * i for i in range(8)]  # 8 processes x 25 keys, each overlapping its neighbours' by 15
    procs = [ctx.Process(target=_tune_rounds, args=(str(tmp_path), f)) for f in firsts]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    assert [p.exitcode for p in procs] == [0] * 8
    files = list(tmp_path.glob("decisions-*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())  # 0 corrupt: parses, and every entry passes the schema
    for s in ("decisions", "verified", "health"):
        assert clean_section(s, data[s])[1] == []
    expected = {f"m1-n{16 * (f + i)}-k64-float32" for f in firsts for i in range(25)}
    assert set(data["decisions"]) == expected  # 0 lost
    assert set(data["health"]) == {"p", "q"}
    assert not list(tmp_path.glob(".decisions-*.tmp"))
