"""maskc.warmup: the kernels a call runs, compiled ahead of it, without running attention."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from maskc.analysis.blockmap import BlockMap
from maskc.runtime import launch
from maskc.runtime.api import compiled_attention


@dataclass(frozen=True)
class Warmup:
    """What maskc.warmup did: each kernel the call runs ("attention_fwd of fwd_<digest>.py"),
    with the seconds spent compiling and loading it (about 0 where Triton's caches held it,
    and for the interpreter, which compiles nothing), and the warmup's own wall time, planning
    and rendering included."""

    kernels: dict[str, float]
    seconds: float


def warmup(q, k, v, mask_mod=None, score_mod=None, *, scale=None, enable_gqa=False,
           block_map: BlockMap | None = None, kv_lens: torch.Tensor | None = None, backward: bool = False) -> Warmup:
    """Compile the kernels that `compiled_attention(q, k, v, ...)` with these arguments runs,
    and plan the call, without running attention: the call then compiles nothing. With
    `backward`, a call that computes gradients and its backward (else a call without gradients,
    which takes the decoding kernel with kv_lens or few query rows).

    A new mask's first call compiles its kernels before it returns: about 1 s for a Triton
    kernel, 3 s for a Gluon one on Hopper; Triton keeps them on disk, so a new process loads
    them. Call this where that second belongs elsewhere (a server's start, before timing).
    q, k and v give shapes, dtypes, layouts and the device, not values: torch.empty tensors
    serve. The mods' captured tensors are read as the call reads them. Bad input raises what
    the call would raise. On CPU tensors it plans the call and renders its kernels (the
    interpreter compiles nothing). With MASKC_AUTOTUNE=1, a length bucket not tuned yet is
    timed, which runs the forward.

    >>> q = torch.empty(8, 32, 4096, 128, dtype=torch.bfloat16, device="cuda")
    >>> maskc.warmup(q, q, q, maskc.masks.causal, backward=True)
    Warmup(kernels={'attention_fwd_hopper of hfwd_....py': 3.1, ...}, seconds=4.2)
    """
    start = time.perf_counter()
    with launch.compiling_only() as compiled:
        if backward:
            # the caller's tensors stay as they are; a float one is read through a view that needs a gradient
            q, k, v = (t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                       for t in (q, k, v))
            with torch.enable_grad():
                out = compiled_attention(q, k, v, mask_mod, score_mod, scale, enable_gqa, block_map=block_map,
                                         kv_lens=kv_lens)
                torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
        else:
            with torch.no_grad():
                compiled_attention(q, k, v, mask_mod, score_mod, scale, enable_gqa, block_map=block_map,
                                   kv_lens=kv_lens)
    return Warmup(dict(compiled), time.perf_counter() - start)


__all__ = ["Warmup", "warmup"]
