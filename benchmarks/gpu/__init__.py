"""The GPU acceptance call (benchmarks/gpu_acceptance.sh) and its parts."""
