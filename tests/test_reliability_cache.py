"""Reliability defects 7-12: what the decision cache holds, its lock, its size, its leftovers, its modes, and an
unwritable cache (CPU, fakes). Each test starts with the defect's reproducer."""
from __future__ import annotations

import json
import logging

import pytest

from _reliability_helpers import CPU, KEY, disp, right
from fp4dispatch.dispatch.dispatcher import Dispatcher
from fp4dispatch.testing import FakeBackend, fake_do_bench, make_nvfp4_inputs


# -- 7. cache content never raises ------------------------------------------------------------------------------
def _set(path, value):
    """A mutation that sets data[path[0]][path[1]]... = value."""
    def mutate(data):
        node = data
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return json.dumps(data).encode()
    return mutate


HOSTILE = {
    "decision-is-a-string": _set(["decisions", KEY], "good"),
    "decision-is-a-list": _set(["decisions", KEY], ["good"]),
    "ranking-is-a-string": _set(["decisions", KEY, "ranking"], "abc"),
    "config-is-a-string": _set(["decisions", KEY, "config"], "xyz"),
    "time-is-a-string": _set(["decisions", KEY, "time_us"], "fast"),
    "tuned-at-negative": _set(["decisions", KEY, "tuned_at_m"], -1),
    "bad-key": _set(["decisions", "m4-n48-k64-bfloat16-extra"], {"backend": "good"}),
    "other-key-bad-entry": _set(["decisions", "m8-n48-k64-float32"], {"backend": 5}),
    "seconds-is-a-string": _set(["health", "good", "seconds"], "abc"),
    "seconds-is-null": _set(["health", "good", "seconds"], None),
    "status-is-a-list": _set(["health", "good", "status"], ["ok"]),
    "status-upper-case": _set(["health", "good", "status"], "OK"),
    "blacklist-is-a-number": _set(["shape_blacklist", KEY], 5),
    "verified-not-a-list": _set(["verified", KEY], {"good|default": "x"}),
    "fault-count-a-string": _set(["faults", KEY], {"good": {"count": "many", "last": 1.0, "reason": ""}}),
    "section-is-a-list": _set(["decisions"], []),
    # an integer too large for a float: was OverflowError in every call (math.isfinite on it)
    "seconds-huge-int": _set(["health", "good", "seconds"], 10**400),
    "time-huge-int": _set(["decisions", KEY, "time_us"], 10**400),
    "check-s-huge-int": _set(["decisions", KEY, "ranking", 0, "check_s"], 10**400),
    "fault-last-huge-int": _set(["faults", KEY], {"good": {"count": 1, "last": 10**400, "reason": ""}}),
    "fault-count-huge-int": _set(["faults", KEY], {"good": {"count": 10**400, "last": 1.0, "reason": ""}}),
    "tuned-at-huge-int": _set(["decisions", KEY, "tuned_at_m"], 10**400),
    "tuned-at-another-bucket": _set(["decisions", KEY, "tuned_at_m"], 2**40),
    "not-utf8": lambda data: b"\xff\xfe\x00{garbage",
    "deep-nesting": lambda data: b"[" * 200000,
    "truncated": lambda data: json.dumps(data).encode()[:40],
}


@pytest.mark.parametrize("mutation", list(HOSTILE))
def test_07_hostile_cache_content_is_dropped_with_one_warning(tmp_path, mutation, caplog):
    d = disp([FakeBackend("good")], tmp_path)
    assert right(d, 4) and right(d, 8)
    path = d.cache_for(CPU).path
    path.write_bytes(HOSTILE[mutation](json.loads(path.read_text())))
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        fresh = disp([FakeBackend("good")], tmp_path)  # a new process: was a crash on every call
        assert right(fresh, 4) and right(fresh, 8, seed=1)
        recs = fresh.report(CPU)
        assert "good" in str(recs) and recs[0].status == "ok"
    cache_warnings = [r for r in caplog.records if "cache file" in r.getMessage()]
    assert len(cache_warnings) == 1, [r.getMessage() for r in caplog.records]


def test_07_import_refuses_a_profile_with_a_malformed_entry(tmp_path, capsys):
    from fp4dispatch.tune import main

    d = Dispatcher(cache_dir=tmp_path / "c")  # the built-in backends, so the profile matches this device
    a, b, sa, sb, al = make_nvfp4_inputs(4, 48, 64)
    d.fp4_mm(a, b, sa, sb, al)
    assert main(["export", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "c")]) == 0
    prof = json.loads((tmp_path / "p.json").read_text())
    prof["decisions"]["m4-n48-k64-bfloat16"] = "reference"  # was accepted, then fp4_mm raised AttributeError
    (tmp_path / "p.json").write_text(json.dumps(prof))
    capsys.readouterr()
    assert main(["import", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "1 malformed entries, so nothing was imported" in err and "decisions['m4-n48-k64-bfloat16']" in err
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").glob("decisions-*.json"))


def test_07_huge_integers_neither_break_show_nor_pass_import(tmp_path, capsys, caplog):
    from fp4dispatch.tune import main

    d = disp([FakeBackend("good")], tmp_path)
    assert right(d, 4)
    cdir = str(tmp_path / "c")
    assert main(["export", str(tmp_path / "p.json"), "--cache-dir", cdir]) == 0
    path = d.cache_for(CPU).path
    data = json.loads(path.read_text())
    data["health"]["good"]["seconds"] = 10**400
    path.write_text(json.dumps(data))
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        assert main(["show", "--cache-dir", cdir]) == 0  # was OverflowError: int too large to convert to float
    assert any("health['good']: seconds must be a finite number >= 0; got 1000" in r.getMessage()
               for r in caplog.records)
    prof = json.loads((tmp_path / "p.json").read_text())
    prof["decisions"][KEY]["time_us"] = 10**400
    (tmp_path / "p.json").write_text(json.dumps(prof))
    capsys.readouterr()
    assert main(["import", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "1 malformed entries, so nothing was imported" in err
    assert f"decisions['{KEY}']: time_us must be null or a time; got 1000" in err
    (tmp_path / "deep.json").write_text("[" * 200000)  # was a RecursionError traceback
    assert main(["import", str(tmp_path / "deep.json"), "--cache-dir", str(tmp_path / "d")]) == 1
    assert "deep.json' is not readable JSON (RecursionError: " in capsys.readouterr().err


# -- 8. a peer holding the lock must not stall calls -------------------------------------------------------------
def test_08_a_held_lock_costs_a_call_at_most_the_short_wait(tmp_path):
    from filelock import FileLock

    d = disp([FakeBackend("good")], tmp_path)
    cache = d.cache_for(CPU)
    peer = FileLock(str(cache.path) + ".lock")  # another process's lock, in effect (flock is per open file)
    peer.acquire()
    try:
        import time

        t0 = time.perf_counter()
        assert right(d, 4) and right(d, 16)  # was 120.8 s for the first call and 60 s per new key
        waited = time.perf_counter() - t0
        assert waited < 30, waited  # a hang guard, not a timing goal: each write waits LOCK_TIMEOUT_S (1 s) once
        assert not cache.path.exists() or "m16-n48-k64-float32" not in cache.path.read_text()
    finally:
        peer.release()
    assert right(d, 2)  # the next write takes the free lock and writes everything kept in memory
    on_disk = json.loads(cache.path.read_text())["decisions"]
    assert {"m4-n48-k64-float32", "m16-n48-k64-float32", "m2-n48-k64-float32"} <= set(on_disk)


def test_08_at_exit_pending_writes_wait_longer_and_what_is_lost_is_said(tmp_path, monkeypatch, caplog):
    from filelock import FileLock

    from fp4dispatch.dispatch import cache as cache_mod

    assert cache_mod.EXIT_LOCK_TIMEOUT_S >= 10 * cache_mod.LOCK_TIMEOUT_S  # was the calls' 1 s, then lost silently
    monkeypatch.setattr(cache_mod, "EXIT_LOCK_TIMEOUT_S", 0.2)  # held throughout below: no need to wait 10 s
    monkeypatch.setattr(cache_mod, "_pending_caches", set())  # other tests' caches stay out of it
    c = cache_mod.DecisionCache(tmp_path, {"device_type": "cpu", "libs": {}})
    keys = [f"m1-n{16 * i}-k64-float32" for i in range(1, 6)]
    for ks in keys:
        c.update("decisions", {ks: {"backend": "x"}}, defer=True)
    c.update("verified", {keys[0]: {"x|default": [1]}}, defer=True)
    peer = FileLock(str(c.path) + ".lock")
    peer.acquire()
    try:
        with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
            cache_mod._flush_at_exit()
    finally:
        peer.release()
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg == (f"fp4dispatch: at exit, the cache lock {c.path}.lock was still held by another process (waited up "
                   f"to 0.2 s); not written to {c.path}, so a later process decides or proves these again: decisions: "
                   f"{', '.join(keys[:3])} (+2 more); verified: {keys[0]}")
    cache_mod._flush_at_exit()  # the lock is free: everything is written, nothing is said
    assert set(json.loads(c.path.read_text())["decisions"]) == set(keys) and c.pending_summary() == ""


def test_08_a_pending_update_is_written_at_exit_after_its_cache_object_is_gone(tmp_path, monkeypatch):
    """The exit flush held its caches weakly: a command's dispatcher (tune's) gone, its pending update was lost."""
    import gc

    from fp4dispatch.dispatch import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_pending_caches", set())
    c = cache_mod.DecisionCache(tmp_path, {"device_type": "cpu", "libs": {}})
    path = c.path
    c.update("decisions", {"m1-n64-k64-float32": {"backend": "x"}}, defer=True)
    del c
    gc.collect()
    cache_mod._flush_at_exit()
    assert list(json.loads(path.read_text())["decisions"]) == ["m1-n64-k64-float32"]


# -- 9. scaling -------------------------------------------------------------------------------------------------
def test_09_an_oversized_file_is_not_read_and_sections_are_bounded(tmp_path, monkeypatch, caplog):
    from fp4dispatch.dispatch import cache as cache_mod

    d = disp([FakeBackend("good")], tmp_path)
    assert right(d, 4)
    path = d.cache_for(CPU).path
    data = json.loads(path.read_text())
    data["decisions"].update({f"m1-n{n}-k64-float32": data["decisions"][KEY] for n in range(1, 3000)})
    path.write_text(json.dumps(data))  # a valid file of ~1 MB: was re-read and rewritten whole on every write
    monkeypatch.setattr(cache_mod, "MAX_FILE_BYTES", 64 << 10)
    monkeypatch.setattr(cache_mod, "MAX_KEYS", 8)
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        fresh = disp([FakeBackend("good")], tmp_path)
        for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            assert right(fresh, m, seed=m)
    assert any("over the 65536-byte bound" in r.getMessage() for r in caplog.records)
    data = json.loads(path.read_text())
    assert path.stat().st_size < 64 << 10
    assert all(len(data[s]) <= 8 for s in ("decisions", "verified", "health"))


def test_09_a_file_at_every_key_bound_is_one_a_reader_takes():
    """MAX_FILE_BYTES was 16 MiB, and a file within the key bounds grew past it: the next read ignored it, and the next
    write replaced it with what was pending (3,800 decisions became 200)."""
    from fp4dispatch.dispatch.cache import MAX_FILE_BYTES, MAX_KEYS, MAX_RANKING

    cfg = {"family": "wgmma_decode_warps", "block_m": 128, "block_n": 64, "k_blocks": 8, "stages": 4,
           "a_stages": 3, "decode_partitions": 2, "split_k": 8, "persistent": True, "predecode_a": True,
           "num_warps": 4}  # longer than any offered config's JSON
    trial = {"backend": "triton:w4a16", "config": cfg, "time_us": 1234.567, "reason": "", "check_s": 12.345}
    entry = {**trial, "ranking": [trial] * MAX_RANKING, "tuned_at_m": 8192, "mode": "neighbours", "at": 1796456750,
             "tune_s": dict.fromkeys(("case", "compile", "check", "screen", "time", "compile_triton",
                                      "compile_first_runs"), 12.345), "from": ["m16384-n28672-k28672-bfloat16"] * 2}
    decisions = {f"w4a16-bfloat16-m16384-n{16 * i}-k28672-bfloat16": entry for i in range(1, MAX_KEYS + 1)}
    assert len(json.dumps({"decisions": decisions}, indent=1)) < MAX_FILE_BYTES // 2


def test_09_the_writer_keeps_a_file_within_what_a_reader_takes(tmp_path, monkeypatch, caplog):
    """Where the key bounds are not enough, the older half of every section goes: the file is never one the next
    reader ignores (and then rebuilds, every decision lost)."""
    from fp4dispatch.dispatch import cache as cache_mod
    from fp4dispatch.dispatch.cache import DecisionCache

    monkeypatch.setattr(cache_mod, "MAX_FILE_BYTES", 4096)
    fp = {"device_type": "cpu", "libs": {}}
    c = DecisionCache(tmp_path, fp)
    keys = [f"m1-n{16 * i}-k64-float32" for i in range(1, 41)]
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        for ks in keys:
            c.update("decisions", {ks: {"backend": "x", "config": {"block_n": 64}, "time_us": 1.0, "reason": ""}})
    assert c.path.stat().st_size <= 4096
    kept = list(DecisionCache(tmp_path, fp).decisions)  # read, not ignored
    assert kept and kept == keys[-len(kept):]  # the newest, in order
    assert (f"fp4dispatch: the cache {c.path} would pass 4096 bytes, more than a reader takes; the older half of "
            "every section was dropped") in caplog.text


def test_09_the_least_recently_written_keys_are_evicted_whatever_their_names(tmp_path, monkeypatch):
    from fp4dispatch.dispatch import cache as cache_mod
    from fp4dispatch.dispatch.cache import DecisionCache

    monkeypatch.setattr(cache_mod, "MAX_KEYS", 3)
    fp = {"device_type": "cpu", "libs": {}}
    old, new = "w4a16-bfloat16-m1-n16-k64-float32", ["m1-n16-k64-float32", "grouped-e2-m1-n16-k64-float32"]
    c = DecisionCache(tmp_path, fp)
    for ks in [old, *new, "m2-n16-k64-float32"]:
        c.update("decisions", {ks: {"backend": "x"}})

    def on_disk():
        return list(json.loads(c.path.read_text())["decisions"])
    assert on_disk() == [*new, "m2-n16-k64-float32"]  # was: the grouped key evicted (sorted first), the w4a16 one kept
    c.update("decisions", {new[0]: {"backend": "y"}})  # rewritten: the newest now
    DecisionCache(tmp_path, fp).update("decisions", {"m4-n16-k64-float32": {"backend": "x"}})  # another process
    assert on_disk() == ["m2-n16-k64-float32", new[0], "m4-n16-k64-float32"]


# -- 10. leftovers ----------------------------------------------------------------------------------------------
def test_10_temp_files_of_killed_writers_and_lock_files_are_cleaned(tmp_path, capsys):
    from fp4dispatch.tune import main

    d = disp([FakeBackend("good")], tmp_path)
    assert right(d, 4)
    path = d.cache_for(CPU).path
    stale = [path.parent / f".{path.name}.abc{i}.tmp" for i in range(3)]
    other = path.parent / ".decisions-0123456789abcdef.json.xyz.tmp"
    for p in stale + [other]:
        p.write_text("{half a fi")
    disp([FakeBackend("good")], tmp_path).cache_for(CPU)  # opening cleans this fingerprint's leftovers
    assert not any(p.exists() for p in stale) and other.exists()
    (path.parent / "decisions-0123456789abcdef.json.lock").write_text("")
    assert main(["clear", "--all", "--cache-dir", str(path.parent)]) == 0
    assert sorted(p.name for p in path.parent.iterdir()) == []


def _kill_writer(cache_dir: str) -> None:
    from fp4dispatch.dispatch.cache import DecisionCache

    c = DecisionCache(cache_dir, {"device_type": "cpu", "libs": {}})
    i = 0
    while True:
        i += 1
        c.update("decisions", {f"m1-n{i}-k64-float32": {"backend": "x", "config": {}, "time_us": 1.0,
                                                       "ranking": [{"backend": "x", "pad": "y" * 4000}] * 16}})


def test_10_kill_9_mid_write_never_corrupts_nor_sticks(tmp_path):
    import multiprocessing as mp
    import os
    import signal
    import time

    from fp4dispatch.dispatch.cache import DecisionCache

    ctx = mp.get_context("fork")  # the writer needs no fresh interpreter; fork keeps each round short
    for i in range(10):
        p = ctx.Process(target=_kill_writer, args=(str(tmp_path),))
        p.start()
        time.sleep(0.2 + 0.05 * i)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        c = DecisionCache(tmp_path, {"device_type": "cpu", "libs": {}})  # parses, cleans leftovers
        assert c.flush() and c.update("health", {"x": {"status": "ok", "reason": "", "seconds": 0.0}})
        assert not list(tmp_path.glob(".decisions-*.tmp"))
    assert json.loads(c.path.read_text())["decisions"]  # entries the killed writers completed are all there


# -- 11. sharing a cache across users ---------------------------------------------------------------------------
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_11_files_get_the_umask_mode(tmp_path, umask, mode):
    import os

    from fp4dispatch.dispatch import cache as cache_mod

    old = os.umask(umask)
    cache_mod._umask.cache_clear()
    try:
        d = disp([FakeBackend("good")], tmp_path)
        assert right(d, 4)
        path = d.cache_for(CPU).path
        assert path.stat().st_mode & 0o777 == mode  # was 0600 (mkstemp): no other user could read it
    finally:
        os.umask(old)
        cache_mod._umask.cache_clear()


# -- 12. an unwritable cache is reported, once ------------------------------------------------------------------
def test_12_unwritable_cache_fails_tune_and_import_and_warns_once(tmp_path, capsys, caplog):
    from fp4dispatch.tune import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad_dir = str(blocker / "cache")  # below a regular file: cannot be created, even by root
    code = main(["--shape", "4,48,64", "--cache-dir", bad_dir], backends=[FakeBackend("good")],
                do_bench=fake_do_bench)
    out = capsys.readouterr().out
    assert code == 1 and "could not write the cache" in out and "lost when this process ends" in out
    good = tmp_path / "good"
    assert main(["--shape", "4,48,64", "--cache-dir", str(good)]) == 0
    assert f"cache: {good}" in capsys.readouterr().out  # tune says where it wrote
    assert main(["export", str(tmp_path / "p.json"), "--cache-dir", str(good)]) == 0
    capsys.readouterr()
    assert main(["import", str(tmp_path / "p.json"), "--cache-dir", bad_dir]) == 1  # was "imported ..." and 0
    assert "nothing was written" in capsys.readouterr().err
    d = Dispatcher([FakeBackend("good")], cache_dir=bad_dir, do_bench=fake_do_bench)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        for m in range(1, 21):
            assert right(d, m, seed=m)
    assert sum("could not write the cache" in r.getMessage() for r in caplog.records) == 1  # was 18 in 20 calls


def test_a_file_where_the_cache_directory_should_be_is_named_as_such(tmp_path, caplog):
    """The warning was 'ignoring cache file .../decisions-<fp>.json (unreadable: Not a directory); it will be
    rebuilt': nothing can be rebuilt there."""
    from fp4dispatch.dispatch import cache as cache_mod

    blocker = tmp_path / "cache"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="fp4dispatch"):
        c = cache_mod.DecisionCache(blocker, {"device_type": "cpu", "libs": {}})
    assert c.decisions == {} and blocker.read_text() == "x"
    assert [r.getMessage() for r in caplog.records] == [
        f"fp4dispatch: the cache directory {blocker} is not a directory; decisions stay in memory. Point "
        "FP4DISPATCH_CACHE_DIR (or --cache-dir) at a directory"]
