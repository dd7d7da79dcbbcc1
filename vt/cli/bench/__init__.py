"""`vt bench`: the decode executor's modes against a hand-written torch CUDA-graph loop and the
device-bound ceiling, at equal device work, in one run. Entry point: vt.cli.bench.cli."""
