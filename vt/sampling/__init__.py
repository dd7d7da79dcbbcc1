"""The sampler every forward's decode step ends with (the bundled model's and user forwards'):
CUDA kernels with their numpy twin, read per row from the step's sampling vectors."""
from vt.sampling.sample import Sample, sample_reference

__all__ = ["Sample", "sample_reference"]
