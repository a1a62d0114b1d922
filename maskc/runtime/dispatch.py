"""Which kernel family runs an attention call, decided in one place for every way of calling
it: eager `compiled_attention` and its torch.compile operators (runtime/ops.py) ask `family()`
and `prefill_problem()` here, so a call runs the same kernel, and gives the same bits, however
it was made (tests/test_torch_compile.py, tests/gpu/test_cuda_graphs.py).

- NO_PAIRS: an empty batch, head, query or key dimension: zeros, no kernel.
- DECODE: the split-KV decoding kernel (maskc/inference/decode.py): every call with kv_lens,
  and a call without gradients or dropout whose query rows a kv head packs fit one tile
  (decode.wanted). (Dropout with kv_lens is refused before: runtime/api.py.)
- PREFILL: the prefill kernels (Triton's, or Gluon's on Hopper where runtime/hopper.py chose
  it), through a Problem (runtime/plan.py).
"""
from __future__ import annotations

from maskc.inference import decode
from maskc.runtime import launch, plan

NO_PAIRS, DECODE, PREFILL = "no pairs", "decode", "prefill"


def family(q, k, differentiable: bool, block_map=None, kv_lens=None, dropping: bool = False) -> str:
    """The family of a checked call with queries q and keys k; `differentiable`: whether
    autograd may record a backward, `dropping`: whether the call has dropout (the decoding
    kernel has neither)."""
    B, Hq, Lq, _ = q.shape
    if 0 in (B, Hq, Lq, k.shape[2]):
        return NO_PAIRS
    if kv_lens is not None or (not dropping and decode.wanted(q, k, differentiable, block_map)):
        return DECODE
    return PREFILL


def prefill_problem(q, k, v, mask, score, scale, block_map=None) -> plan.Problem:
    """The Problem of a PREFILL call: checked against the caller's block map, or planned (and
    remembered) with the map maskc builds."""
    if block_map is not None:
        return plan.given(q, k, v, mask, score, scale, block_map)
    return plan.planned(q, k, v, mask, score, scale, launch.seconds)


__all__ = ["DECODE", "NO_PAIRS", "PREFILL", "family", "prefill_problem"]
