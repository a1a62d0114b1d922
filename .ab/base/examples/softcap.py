"""Tanh soft-capping (Gemma 2, Grok): causal attention with scores squashed into (-cap, cap)
by cap * tanh(score / cap).

Shows the causal block map, checks maskc against the float64 reference, and prints the mask
and score lines of the generated kernel: the cap is a runtime parameter, and the score line
runs on every tile (FULL tiles too), while the mask line runs only on PARTIAL ones.

Run:  python examples/softcap.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    # A small cap, so the capping visibly changes the scores of these unit-variance inputs.
    sys.exit(run_example(Problem.pick(), maskc.masks.causal, maskc.scores.softcap(2.0)))
