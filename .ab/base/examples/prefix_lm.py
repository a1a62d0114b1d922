"""Prefix-LM attention: bidirectional over the first `prefix` tokens (the prompt), causal after.

Shows the block map (a FULL block over the prefix columns, causal below the diagonal),
checks maskc against the float64 reference, and prints the mask line of the generated
kernel, with the prefix length as a runtime parameter.

Run:  python examples/prefix_lm.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    p = Problem.pick()
    # A prefix that ends inside a tile, so some prefix tiles are PARTIAL too.
    sys.exit(run_example(p, maskc.masks.prefix_lm(p.L // 4 + p.L // 16)))
