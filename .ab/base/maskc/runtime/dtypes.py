"""The dtypes maskc runs and what each computes in."""
from __future__ import annotations

import torch
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulator(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_accumulator(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def dot_precision(dtype) -> str:
    # float32 inputs get exact products; tf32 would cost about 1e-3 relative error
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def interpreter_safe(*tensors):
    """NOTE: Triton's interpreter (3.9) multiplies bf16 tl.dot operands as raw 16-bit
    integers, so on CPU bf16 runs in float32 (exact for bf16 inputs) and is rounded back."""
    if tensors[0].device.type != "cuda" and tensors[0].dtype == torch.bfloat16:
        return tuple(t.float() for t in tensors)
    return tensors


__all__ = ["DTYPES", "accumulator", "dot_precision", "interpreter_safe", "triton_accumulator"]
