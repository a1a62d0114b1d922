"""The GPU lane: maskc's kernels compiled on CUDA, against the float64 reference (conftest.py)."""
