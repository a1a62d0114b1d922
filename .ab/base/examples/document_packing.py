"""Document packing: several sequences packed into one row, each token attending (causally)
only to tokens of its own document.

The document ids are a captured tensor: it becomes a kernel argument, read in the mask
line as a load, and its values never enter the kernel's cache key (repack the batch and the
same kernel runs). Shows the block-diagonal block map, checks maskc against the float64
reference, and prints the mask line of the generated kernel.

Run:  python examples/document_packing.py
(CPU: small float32 inputs through Triton's interpreter; with CUDA: bf16, L=4096.)
"""
import sys

import torch

import maskc
from _common import Problem, run_example

if __name__ == "__main__":
    p = Problem.pick()
    # Five documents of unequal lengths (in tenths of L), boundaries mostly inside tiles.
    lengths = torch.tensor([3, 1, 4, 1, 1]) * p.L // 10
    lengths[-1] += p.L - int(lengths.sum())
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(p.device)
    print(f"document lengths: {lengths.tolist()}")
    sys.exit(run_example(p, maskc.masks.document(doc_ids, causal=True)))
