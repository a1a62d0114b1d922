"""ALiBi (Attention with Linear Biases): causal attention whose scores get a per-head penalty
slope[h] * (kv_idx - q_idx), so far-away keys count less.

The score_mod is traced like a mask: the slopes tensor becomes a kernel argument indexed by
the head, and the bias is computed in the kernel from q_idx and kv_idx; no L×L bias tensor is
ever built. Shows the causal block map, checks maskc against the float64 reference, and prints
the mask and score lines of the generated kernel.

Run:  python examples/alibi.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    p = Problem.pick()
    slopes = maskc.scores.alibi_slopes(p.H).to(p.device)
    sys.exit(run_example(p, maskc.masks.causal, maskc.scores.alibi(slopes)))
