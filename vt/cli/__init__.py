"""The front ends: `vt info` (main.py), `vt run` (run.py) and `vt bench` (bench/), and what
they share (common.py: the usage error, the parser, backend/preset/model picking; limits.py:
the bounds of every size they accept). The `vt` console script is vt.cli.main:main."""
