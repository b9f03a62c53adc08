"""``python -m fp4dispatch.tune``: warm the decision cache for your shapes and see which backends work here, and why.

Commands: ``tune`` (default), ``show``, ``clear [--all]``, ``export FILE``, ``import FILE``; ``--self-test`` probes
only. Exit codes: 0 every shape has a usable backend; 1 some shape has none (listed) or a command failed; 2 bad
arguments. See docs/tuning.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

from ..backends.base import OPS
from . import distributed, presets
from ..dispatch import cache as cache_mod
from ..dispatch.cache import DecisionCache, remove_leftovers
from ..settings import default_cache_dir, read_settings
from .distributed import TuneOptions, backend_rows, make_dispatcher
from ..dispatch.fingerprint import device_fingerprint
from ..errors import InvalidInputError
from ..problem import m_bucket
from .log_setup import log_to_stderr
from .output import console, finish, fmt, print_table
from .profile import ProfileError, export_profile, import_profile

__all__ = ["main", "build_parser", "TuneOptions"]

_COMMANDS = ("tune", "show", "clear", "export", "import")
_CACHE_FILE = re.compile(r"decisions-[0-9a-f]{16}\.json(\.lock)?")  # a cache file's name (fingerprint.py), its lock's
_CPU_NOTE = ("No CUDA device found: deciding on the CPU with the backends that run there (the exact reference), in "
             "priority order (nothing is timed on a CPU); the default CPU shapes are small")


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -- commands -------------------------------------------------------------------------------------------------------
def _collect_shapes(args, parser, on_gpu: bool) -> tuple[list, list[dict]]:
    raw: list[tuple[int, int, int, str]] = [(m, n, k, "") for group in args.shape for m, n, k in group]
    gemms: list[presets.Gemm] = []
    try:
        if args.preset:
            gemms += presets.preset_gemms(args.preset, args.tp or 1, args.ep or 1)
        if args.hf_config:
            cfg = presets.read_hf_config(args.hf_config)
            gemms += presets.gemms_from_config(cfg, args.tp or 1, f"--hf-config {args.hf_config}", args.ep or 1)
        raw += presets.config_rows(gemms, args.m or list(presets.DEFAULT_MS))
    except presets.ConfigError as e:
        parser.error(str(e))
    skipped = [{"layer": g.layer, "n": g.n, "k": g.k, "reason": g.skip} for g in gemms if g.skip]
    if not raw and not skipped:
        raw = presets.default_shapes(on_gpu)
    return presets.expand_shapes(raw), skipped


def _cmd_tune(args, parser, opts: TuneOptions, backends, do_bench) -> int:
    dev = _default_device()
    shapes, skipped = _collect_shapes(args, parser, dev.type == "cuda" or bool(args.devices))
    skip_notes = [f"skipped {s['layer']} (N={s['n']}, K={s['k']}): {s['reason']}" for s in skipped]
    if args.list:
        listing = [dataclasses.asdict(s) | {"m_bucket": m_bucket(s.m)} for s in shapes]
        if args.json:
            print(json.dumps({"command": "list", "shapes": listing, "skipped": skipped}, indent=1))
        else:
            for s in listing:
                rows = f"E={s['experts']} T" if s["experts"] else "M"  # a grouped key's M is T, the routed rows
                print(f"{rows}={s['m']} (bucket {s['m_bucket']}) N={s['n']} K={s['k']}  {', '.join(s['layers'])}")
            print("\n".join(skip_notes) if skip_notes else f"{len(listing)} shape{'s' if len(listing) != 1 else ''}")
        return 0
    notes = ([] if dev.type == "cuda" else [_CPU_NOTE]) + skip_notes
    payload: dict = {"command": "tune", "skipped": skipped}
    if distributed.torchrun_detected():
        try:
            res = distributed.run_torchrun(shapes, opts, backends, do_bench)
        except ValueError as e:  # a rank without a GPU of its own
            print(f"fp4dispatch.tune: {e}", file=sys.stderr)
            return 2
        payload.update(mode="torchrun", rank=res["rank"], world_size=res["world_size"], device=res["device"])
        return finish(args, payload, res["rows"], res["backends"], notes)
    if args.devices:
        rows, backs, errors = distributed.merge_device_results(distributed.run_on_devices(args.devices, shapes, opts))
        notes += errors
        payload.update(mode="devices", devices=args.devices)
        return finish(args, payload, rows, backs, notes)
    d = make_dispatcher(opts, backends, do_bench)
    seconds: dict = {}
    rows = distributed.tune_rows(d, dev, shapes, opts, tuned_by=str(dev), seconds=seconds)
    payload.update(mode="single", device=str(dev), cache=str(d.cache_for(dev).path), seconds=seconds)
    return finish(args, payload, rows, backend_rows(d, dev), notes, d.cache_for(dev))


def _cmd_self_test(args, opts: TuneOptions, backends) -> int:
    dev = _default_device()
    # a throw-away cache dir: the self-test always probes now and leaves the real cache alone
    with tempfile.TemporaryDirectory(prefix="fp4dispatch-selftest-") as tmp:
        d = make_dispatcher(dataclasses.replace(opts, cache_dir=tmp), backends)
        recs = backend_rows(d, dev, OPS)  # every backend, whatever op it computes
    usable = any(r["status"] == "ok" for r in recs)
    if args.json:
        print(json.dumps({"command": "self-test", "device": str(dev), "backends": recs,
                          "exit_code": 0 if usable else 1}, indent=1))
    else:
        if dev.type != "cuda":
            print("No CUDA device found: probing on the CPU.")
        width = max((len(r["name"]) for r in recs), default=0)
        for r in recs:
            print(f"{r['name']:<{width}}  {r['status']:<11}  {r['reason'] or '-'}")
        if not usable:
            print(f"No backend is usable on {dev}.")
    return 0 if usable else 1


def _device_cache(args, opts: TuneOptions) -> DecisionCache:
    dev = torch.device(args.devices[0]) if args.devices else _default_device()
    cache_dir = Path(opts.cache_dir) if opts.cache_dir else (read_settings().cache_dir or default_cache_dir())
    return DecisionCache(cache_dir, device_fingerprint(dev))  # no probing: show/clear/profiles only read files


def _cmd_show(args, opts: TuneOptions) -> int:
    cache = _device_cache(args, opts)
    if args.json:
        print(json.dumps({"command": "show", "path": str(cache.path), "exists": cache.path.exists(),
                          "fingerprint_hash": cache.hash, **cache.data}, indent=1))
        return 0
    con, tty = console()
    con.print(f"cache file: {cache.path} ({'present' if cache.path.exists() else 'not written yet'})")
    con.print(f"fingerprint {cache.hash}: " + json.dumps(cache.fingerprint, sort_keys=True))
    print_table(con, "Health", ["backend", "status", "reason"],
                 [[n, v.get("status", "?"), v.get("reason") or "-"] for n, v in sorted(cache.health.items())], tty)
    print_table(con, "Decisions", ["key", "winner", "config", "time (us)", "tuned at M", "mode"],
                 [[ks, e.get("backend", "?"), json.dumps(e.get("config") or {}), fmt(e.get("time_us")),
                   str(e.get("tuned_at_m", "-")), str(e.get("mode", "-"))]
                  for ks, e in sorted(cache.decisions.items())], tty)
    if cache.shape_blacklist:
        print_table(con, "Blacklisted per shape", ["key", "backend", "reason"],
                     [[ks, n, w] for ks, b in sorted(cache.shape_blacklist.items()) for n, w in b.items()], tty)
    others = sorted(p.name for p in cache.dir.glob("decisions-*.json") if p != cache.path)
    if others:
        con.print(f"other fingerprints in {cache.dir}: {', '.join(others)}")
    return 0


def _cmd_clear(args, opts: TuneOptions) -> int:
    cache = _device_cache(args, opts)
    try:
        removed = cache.clear()
        if args.all and cache.dir.is_dir():  # every fingerprint's file, writers' leftovers and lock files
            removed += remove_leftovers(cache.dir)
            for p in sorted(cache.dir.glob("**/decisions-*.json*")):
                if _CACHE_FILE.fullmatch(p.name):  # fp4dispatch's own only: a user's decisions-notes.json stays
                    p.unlink(missing_ok=True)
                    removed.append(p)
    except OSError as e:
        print(f"fp4dispatch.tune: could not clear {cache.dir}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"command": "clear", "removed": [str(p) for p in removed]}))
    else:
        print("\n".join(f"removed {p}" for p in removed) or f"nothing to clear in {cache.dir}")
    return 0


def _cmd_profile(args, opts: TuneOptions) -> int:
    cache = _device_cache(args, opts)
    try:
        if args.command == "export":
            prof = export_profile(cache, args.file)
            msg = {"command": "export", "file": args.file, "fingerprint_hash": cache.hash,
                   "decisions": len(prof["decisions"]), "health": len(prof["health"])}
        else:
            msg = {"command": "import", "file": args.file, "cache": str(cache.path), **import_profile(args.file, cache)}
    except ProfileError as e:
        print(f"fp4dispatch.tune: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"fp4dispatch.tune: could not write {args.file if args.command == 'export' else cache.path}: {e}",
              file=sys.stderr)
        return 1
    if cache.write_error:
        print(f"fp4dispatch.tune: {args.command}: nothing was written to {cache.path}: {cache.write_error}. Make "
              "the cache directory writable or pass --cache-dir", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(msg))
    elif args.command == "export":
        print(f"exported {msg['decisions']} decisions and {msg['health']} verdicts of fingerprint "
              f"{msg['fingerprint_hash']} to {args.file}")
    else:
        print(f"imported {msg['decisions']} decisions, {msg['health']} verdicts and {msg['shape_blacklist']} "
              f"blacklist entries into {msg['cache']}" + (f"; {msg['dropped']} more of its entries were over the "
                                                          f"cache's bound of {cache_mod.MAX_KEYS} keys a section"
                                                          if msg["dropped"] else ""))
    return 0


# -- arguments ------------------------------------------------------------------------------------------------------
def _argtype(fn):
    def convert(text: str):
        try:
            return fn(text)
        except ValueError as e:  # ConfigError and resolve_devices' errors: argparse prints them and exits 2
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = fn.__name__
    return convert


def _cache_dir(text: str) -> str:
    """``--cache-dir`` as ``FP4DISPATCH_CACHE_DIR`` is read: stripped, ``~`` expanded; blank refused (it wrote into
    the working directory, and the other commands looked in the default one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a directory; got {text!r}. Leave it out for the default")
    return str(Path(text.strip()).expanduser())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fp4dispatch.tune",
                                description="Warm the decision cache for your shapes; see which backends work, why.",
                                epilog="Commands: tune (default) | show | clear [--all] | export FILE | import FILE. "
                                       "Exit codes: 0 ok, 1 some shape has no usable backend, 2 bad arguments.")
    p.add_argument("command", nargs="?", default="tune", choices=_COMMANDS, help="what to do (default: tune)")
    p.add_argument("file", nargs="?", help="the profile file of export / import")
    g = p.add_argument_group("shapes (none given: a built-in mix for this device)")
    g.add_argument("--shape", action="append", default=[], type=_argtype(presets.parse_shape_spec), metavar="M,N,K",
                   help="repeatable; M may be a list 1,16,128 or a range 1-8192 (one M per bucket)")
    g.add_argument("--preset", choices=sorted(presets.PRESETS), help="a model's linear layers")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json; its linear layers")
    pos = _argtype(presets.parse_positive)
    g.add_argument("--tp", type=pos, help="tensor-parallel size of --preset / --hf-config (default 1)")
    g.add_argument("--ep", type=pos, help="expert-parallel size of --preset / --hf-config: E/EP experts per rank")
    g.add_argument("--m", type=_argtype(presets.parse_m_spec), metavar="M_LIST",
                   help="M values of --preset / --hf-config (default 1,16,128,1024,4096)")
    g.add_argument("--out-dtype", choices=tuple(distributed.OUT_DTYPES), default="bfloat16")
    g.add_argument("--op", choices=("fp4_mm", "w4a16"), default="fp4_mm",
                   help="the op to tune: fp4_mm (NVFP4 activations, default) or w4a16 (w4a16_mm: 16-bit activations "
                        "of the out dtype, bf16 for float32 out)")
    g.add_argument("--list", action="store_true", help="print the shapes that would be tuned, then exit")
    r = p.add_argument_group("running")
    r.add_argument("--self-test", action="store_true", help="probe every backend only: verdict and reason each")
    r.add_argument("--json", action="store_true", help="results as JSON on stdout (nothing else there)")
    r.add_argument("--devices", type=_argtype(distributed.resolve_devices), metavar="all|0,1",
                   help="tune each GPU in its own process (same-model GPUs split the shapes)")
    r.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="probe native backends in worker processes (default on)")
    r.add_argument("--cache-dir", type=_cache_dir, help="decision cache directory (default: FP4DISPATCH_CACHE_DIR or "
                   "the user cache)")
    r.add_argument("--all", action="store_true", help="clear: every fingerprint's file in the cache directory")
    r.add_argument("-v", "--verbose", action="store_true", help="log the dispatcher's decisions (INFO) to stderr")
    return p


def _check(args, parser) -> None:
    if args.command in ("export", "import") and not args.file:
        parser.error(f"{args.command} needs a FILE: python -m fp4dispatch.tune {args.command} profile.json")
    if args.command not in ("export", "import") and args.file:
        parser.error(f"unexpected argument {args.file!r}: only export / import take a FILE")
    shaping = args.shape or args.preset or args.hf_config or args.list
    if args.command != "tune" and (shaping or args.self_test):
        parser.error(f"{args.command} takes no shape options or --self-test; run them without {args.command!r}")
    if (args.tp or args.ep or args.m) and not (args.preset or args.hf_config):
        parser.error("--tp, --ep and --m apply to --preset / --hf-config; give one (or put M in --shape M,N,K)")
    if args.self_test and shaping:
        parser.error("--self-test probes only; drop the shape options")
    if args.devices and distributed.torchrun_detected():
        parser.error("--devices cannot be combined with torchrun: torchrun already gives each rank its GPU")
    if args.devices and args.command != "tune" and len(args.devices) != 1:
        parser.error(f"{args.command} works on one device; pass --devices with one index")
    if args.all and args.command != "clear":
        parser.error("--all applies to clear only")


def main(argv: list[str] | None = None, *, backends=None, do_bench=None) -> int:
    """Run the CLI; returns the exit code. ``backends`` replaces the built-in list and ``do_bench`` the timer
    (tests, custom builds); neither reaches ``--devices`` processes, which use the defaults."""
    parser = build_parser()
    try:
        args = parser.parse_args(presets.negative_values(sys.argv[1:] if argv is None else argv))
        _check(args, parser)
    except SystemExit as e:  # argparse: 0 after --help, 2 on a bad argument
        return int(e.code or 0)
    if args.verbose:
        log_to_stderr()
    opts = TuneOptions(out_dtype=args.out_dtype, op=args.op, isolate=args.isolate, cache_dir=args.cache_dir)
    try:
        if args.command != "tune":
            return {"show": _cmd_show, "clear": _cmd_clear}.get(args.command, _cmd_profile)(args, opts)
        if args.self_test:
            return _cmd_self_test(args, opts, backends)
        return _cmd_tune(args, parser, opts, backends, do_bench)
    except SystemExit as e:  # parser.error from a shape source (a bad --hf-config)
        return int(e.code or 0)
    except InvalidInputError as e:  # an FP4DISPATCH_* variable that is not valid: the message names it and the fix
        print(f"fp4dispatch.tune: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
