"""Tensor descriptors: q, k, v and out handed to the copy engine (TMA) when their layout allows.

A descriptor covers the whole [B, H, L, D] tensor, so loads past L or D come back as zeros
and stores past them are dropped: the kernel needs no bounds masks on those paths.
"""
from __future__ import annotations

import functools

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4 has no host-side descriptors: pointers only
    TensorDescriptor = None

# On CUDA, descriptors are built per call, which cost about 30 µs of host time on the H100
# machine (benchmarks/bench_overhead.py: 118 vs 88 µs per call at B=1 H=1 L=128). Below
# this many (b, h, q, kv) pairs the kernel runs for well under 0.1 ms and that cost shows;
# above it the copy engine's gain (+5-20% at D=128) is worth it. The interpreter ignores it,
# so that CPU tests run the descriptor path on small shapes.
DESCRIPTOR_MIN_PAIRS = 1 << 27


def descriptors(operands):
    """One TensorDescriptor per (tensor, block_shape), or None when any of them cannot have one."""
    if TensorDescriptor is None or not _has_copy_engine(operands[0][0].device):
        return None
    if not all(fits(t) for t, _ in operands):
        return None
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), list(block)) for t, block in operands]


def fits(t: torch.Tensor) -> bool:
    """Whether the copy engine can read `t`: a 16-byte aligned base and strides, a contiguous last dim."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and s * size % 16 == 0 for s in t.stride()[:-1]))


@functools.cache
def _has_copy_engine(device: torch.device) -> bool:
    # CPU tensors run through the interpreter, which emulates descriptors: same source as Hopper.
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
