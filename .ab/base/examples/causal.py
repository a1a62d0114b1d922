"""Causal attention: each query sees itself and every earlier key (q_idx >= kv_idx).

Shows the block map of a causal mask (FULL below the diagonal, PARTIAL on it, EMPTY above,
so about half the tiles are never loaded), checks maskc against the float64 reference, and
prints the one line of the generated kernel that evaluates the mask on diagonal tiles.

Run:  python examples/causal.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    sys.exit(run_example(Problem.pick(), maskc.masks.causal))
