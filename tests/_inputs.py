"""Seeded inputs for the tests: q, k, v and other standard normal tensors, the same on every
machine whatever ran before, since each call draws from a torch.Generator of its own (never
the global seed).

Values are drawn in float32 and cast, so a seed gives the same values, rounded, in every dtype.

>>> q, k, v = qkv(B=2, Hq=4, Hkv=2, Lq=45, Lkv=60, D=32)
>>> q, k, v, d_out = qkv(Lq=70, dtype=torch.bfloat16, requires_grad=True, grad_out=True)
>>> table = randn(2, 79, seed=5)
"""
import torch


def randn(*shape, seed=0, dtype=torch.float32, requires_grad=False) -> torch.Tensor:
    """Standard normal values of `shape` from a generator seeded with `seed`."""
    return _draw(torch.Generator().manual_seed(seed), shape, dtype, requires_grad)


def qkv(B=1, Hq=2, Hkv=None, Lq=40, Lkv=None, D=16, Dv=None, *, Bkv=None, dtype=torch.float32, seed=0,
        requires_grad=False, grad_out=False) -> tuple:
    """q [B, Hq, Lq, D], k [Bkv, Hkv, Lkv, D] and v [Bkv, Hkv, Lkv, Dv], drawn in that order from
    one generator seeded with `seed`; Hkv, Lkv, Dv and Bkv default to Hq, Lq, D and B. With
    `grad_out`, also a gradient of the output [B, Hq, Lq, Dv], drawn next, that never requires grad."""
    Hkv = Hq if Hkv is None else Hkv
    Lkv = Lq if Lkv is None else Lkv
    Dv = D if Dv is None else Dv
    Bkv = B if Bkv is None else Bkv
    generator = torch.Generator().manual_seed(seed)
    tensors = [_draw(generator, shape, dtype, requires_grad)
               for shape in ((B, Hq, Lq, D), (Bkv, Hkv, Lkv, D), (Bkv, Hkv, Lkv, Dv))]
    if grad_out:
        tensors.append(_draw(generator, (B, Hq, Lq, Dv), dtype, False))
    return tuple(tensors)


def _draw(generator, shape, dtype, requires_grad):
    return torch.randn(shape, generator=generator).to(dtype).requires_grad_(requires_grad)
