"""The benchmarks behind `vt bench` (vt/cli/bench.py parses their flags): the workloads
(synthetic, model, torch, sampler, serve in process and through HTTP, torch-decode, torch-ttft,
invariance), the peers they are measured against (a hand-written torch CUDA-graph loop,
transformers), the measurement, the result cells and the reports. Nothing here imports vt.cli."""
