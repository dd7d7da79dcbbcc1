"""The repository's scripts, each run as `python3 tools/NAME.py` (tools/README.md), and
importable as `tools.NAME` from the repository root: the tests drive the harnesses they share
with the GPU runs (the fuzz, the fault fuzz, the soak) and the measuring tools through their
functions. pytest puts the root on sys.path (pyproject.toml, `pythonpath`); a script puts
it there itself (its "run from a checkout" line), so one script imports another as
`tools.NAME` both ways.
Not part of the installed distribution (setuptools packages only `vt`)."""
