"""Sliding-window attention: each query sees itself and the `window` keys before it.

Shows the band-shaped block map (only tiles near the diagonal are loaded, so work grows
with L·window instead of L²), checks maskc against the float64 reference, and prints the
mask line of the generated kernel. The window is a closure variable, so it appears in
the kernel as a runtime parameter (p0): any other window reuses the same compiled kernel.

Run:  python examples/sliding_window.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    p = Problem.pick()
    sys.exit(run_example(p, maskc.masks.sliding_window(p.L // 4)))
