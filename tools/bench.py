"""Thin wrapper: `python3 tools/bench.py ARGS` is `vt bench ARGS` (vt/cli/bench/; docs/cli.md, "vt bench")."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from vt.cli.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
