"""``python -m fp4dispatch.tune``: the tuning CLI (its code: fp4dispatch/cli/tune.py)."""
from __future__ import annotations

import sys

from .cli.tune import TuneOptions, build_parser, main

__all__ = ["main", "build_parser", "TuneOptions"]

if __name__ == "__main__":
    sys.exit(main())
