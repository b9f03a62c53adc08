"""Humming's heuristic tuning tables, kept on disk.

``humming.tune.get_heuristics_config`` makes a layer's whole table (a config per range of M, searched at every M up
to 8192, or 65536 for a grouped layer) in Python, under the GIL: for a grouped layer some 800 searches and seconds
of CPU, in every process that runs the layer (the probe worker that makes its first run, the tuning process, each
process that later serves the layer through Humming). The table depends only on Humming's release, the GPU and the
layer's config, so it is kept in the cache directory (``FP4DISPATCH_CACHE_DIR``, else the platform's), one JSON file
per hash of those, with Stream-K already off (``humming.py`` says why). JSON is also the form ``humming_forward``
takes it in, so a table read back gives the same kernels as one just made. A file that cannot be read or written
costs only the search.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from ..settings import default_cache_dir

__all__ = ["heuristics_table", "table_path"]

log = logging.getLogger("fp4dispatch")


def _heuristic_test() -> bool:
    """Humming's switch that changes its heuristics (``humming.tune.get_heuristics_config``: its tests' source)."""
    source = os.environ.get("HUMMING_TEST_TUNING_SOURCE", "heuristic" if "PYTEST_CURRENT_TEST" in os.environ else "")
    return "heuristic" in (s.strip() for s in source.split("+"))


def table_path(lib, layer_config, gemm_type: str, device: torch.device) -> Path:
    """The file of this layer's table: a hash of Humming's release, the GPU and the layer config's repr."""
    gpu = ((torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
            torch.cuda.get_device_properties(device).multi_processor_count) if device.type == "cuda" else "cpu")
    what = [getattr(lib, "__version__", "?"), getattr(lib, "__commit_id__", "?"), repr(gpu), repr(layer_config),
            gemm_type, _heuristic_test()]
    digest = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    return default_cache_dir() / "humming-tables" / f"{digest}.json"


def _valid(table) -> bool:
    return (isinstance(table, list) and bool(table)
            and all(isinstance(e, list) and len(e) == 3 and isinstance(e[2], dict) for e in table))


def heuristics_table(lib, layer_config, gemm_type: str, device: torch.device) -> list:
    """Humming's table for ``layer_config`` on ``device`` (``[lo, hi, config]`` entries, Stream-K off): read from
    the cache directory, else searched by Humming and written there."""
    path = table_path(lib, layer_config, gemm_type, device)
    try:
        table = json.loads(path.read_text())
        if _valid(table):
            return table
    except (OSError, ValueError):
        pass
    # a copy (Humming caches its own), as it will be read back (tuples as lists): the same JSON string either way
    table = json.loads(json.dumps(lib.tune.get_heuristics_config(layer_config, gemm_type=gemm_type, device=device)))
    for _lo, _hi, cfg in table:
        cfg["use_stream_k"] = False  # determinism: see humming.py
    _write(path, table)
    return table


def _write(path: Path, table: list) -> None:
    """``table`` into ``path`` whole or not at all (another process may be reading it)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(table, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("fp4dispatch: Humming's table not kept in %s (%s)", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
