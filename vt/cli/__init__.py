"""The front ends: `vt info`, `vt run` (run.py) and `vt bench` (bench/), and what they share."""
from vt.cli.main import main

__all__ = ["main"]
