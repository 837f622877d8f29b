"""The GPU path end to end: kernels, decode step time and bandwidth, the engine comparison."""
