"""compiled_attention under torch.compile: the forward and backward as PyTorch operators.

Dynamo must not trace maskc's Python (sympy tracing, plans, block maps, launches), and
`fullgraph=True` allows no graph break, so under Dynamo compiled_attention calls `attention()`
here, which Dynamo traces: one call that Dynamo runs for real at trace time
(`torch.compiler.assume_constant_result`) names the call's (mask_mod, score_mod, block_map)
in a process registry by a string key, and the graph records one operator,
`maskc::attention(q, k, v, call, scale, enable_gqa) -> (out, lse, token)`.

The operators are `torch.library.custom_op`s, opaque to the compiler: at run time their
implementations do what the eager call does (the mods' traces, re-checked by their guards; the
plan and block map, from the runtime's caches; the launches). So the mods' captured values, read
when the operator runs, never enter the graph or its guards: a new document-id tensor or window
value, and the new block map it makes, recompile nothing. (`triton_op` with `wrap_triton` would
have the compiler trace the planning Python, baking those values into the graph, and cannot run
Triton's interpreter for CPU tensors.)

The backward operator runs with the forward's own plan, as the eager autograd Function does:
the forward returns a token, a CPU int64 scalar naming its plan.
"""
from __future__ import annotations

import itertools
import threading
import weakref

import torch

from maskc.analysis.blockmap import BlockMap
from maskc.runtime import launch, plan
from maskc.runtime.dtypes import accumulator
from maskc.trace.mods import as_mask_mod, as_score_mod

_lock = threading.Lock()
# key -> (mask, score, block_map), each held so that the ids in _KEYS stay theirs
_CALLS: dict[str, tuple] = {}
_KEYS: dict[tuple[int, int, int], str] = {}

# Tokens: a serial number per plan, while the plan lives, so that a repeated call returns the
# same token (torch.library.opcheck compares repeated runs); the plans of the most recent tokens
# are held for their backward, which bounds the memory held whatever runs.
_PENDING = 1024
_NO_PAIRS = -1  # the token of a forward with no (q, kv) pair: its backward gives zeros
_serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_forwards = plan._Slots(_PENDING)
_counter = itertools.count()


def attention(q, k, v, mask_mod, score_mod, scale, enable_gqa: bool, block_map):
    """(out, lse) of compiled_attention through the maskc operators; what Dynamo traces."""
    call = registered(mask_mod, score_mod, block_map)
    out, lse, _ = torch.ops.maskc.attention(q, k, v, call, None if scale is None else float(scale), enable_gqa)
    return out, lse


@torch.compiler.assume_constant_result
def registered(mask_mod, score_mod, block_map) -> str:
    """The registry key of this (mask_mod, score_mod, block_map): Dynamo runs this at trace time on
    the real objects and guards on their identity, so another mod or map compiles its own graph.
    Its values are not guarded: the operator reads them when it runs."""
    mask, score = as_mask_mod(mask_mod), as_score_mod(score_mod)
    if block_map is not None:
        if not isinstance(block_map, BlockMap):
            raise TypeError(f"block_map must be a maskc.BlockMap from maskc.block_map(), got "
                            f"{type(block_map).__name__}")
        if mask is None:
            mask = block_map.mask_mod
    ids = (id(mask), id(score), id(block_map))
    with _lock:
        key = _KEYS.get(ids)
        if key is None:
            names = [m.__name__ for m in (mask, score) if m is not None] or ["keep_all"]
            key = _KEYS[ids] = f"{'+'.join(names)}#{len(_CALLS)}"
            _CALLS[key] = (mask, score, block_map)
    return key


# -- forward ---------------------------------------------------------------------------------
@torch.library.custom_op("maskc::attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: str, scale: float | None,
             enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask, score, block_map = _registered_call(call)
    B, Hq, Lq, _ = q.shape
    if k.shape[0] != B:
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    if 0 in (B, Hq, Lq, k.shape[2]):
        out, lse = launch.no_pairs(q, v)
        return out, lse, torch.tensor(_NO_PAIRS)
    if block_map is not None:
        problem = plan.given(q, k, v, mask, score, scale, block_map)
    else:
        problem = plan.planned(q, k, v, mask, score, scale, launch.seconds)
    out, lse = launch.forward(q, k, v, problem)
    return out, lse, torch.tensor(_token(problem))


@_forward.register_fake
def _forward_fake(q, k, v, call, scale, enable_gqa):
    # runs at trace time: wrong inputs fail there, with the eager call's errors
    plan.check_tensors(q, k, v, enable_gqa)
    B, Hq, Lq, _ = q.shape
    out = q.new_empty((B, Hq, Lq, v.shape[3]))
    lse = q.new_empty((B, Hq, Lq), dtype=accumulator(q.dtype))
    return out, lse, torch.empty((), dtype=torch.int64)


def _token(problem) -> int:
    with _lock:
        token = _serials.get(problem)
        if token is None:
            token = _serials[problem] = next(_counter)
    _forwards.put(token, problem)
    return token


def _registered_call(call: str) -> tuple:
    found = _CALLS.get(call)
    if found is None:
        raise RuntimeError(f"maskc::attention got call '{call}', which this process never registered; the operator "
                       f"is made by compiled_attention under torch.compile, not called directly")
    return found


# -- backward --------------------------------------------------------------------------------
@torch.library.custom_op("maskc::attention_backward", mutates_args=())
def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              token: torch.Tensor, d_out: torch.Tensor | None,
              d_lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token = int(token)
    if token == _NO_PAIRS:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    problem = _forwards.get(token)
    if problem is None:
        raise RuntimeError(f"maskc's backward under torch.compile lost its forward's plan: forwards of more than "
                           f"{_PENDING} other plans ran since; run the backward sooner after its forward")
    B = q.shape[0]
    shared = k.shape[0] != B
    if shared:
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    dq, dk, dv = launch.backward(q, k, v, out, lse, d_out, d_lse, problem)
    if shared:  # k and v served every batch of q: their gradients sum over it
        dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return dq, dk, dv


@_backward.register_fake
def _backward_fake(q, k, v, out, lse, token, d_out, d_lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, token = output
    ctx.save_for_backward(q, k, v, out, lse, token)


def _grad(ctx, d_out, d_lse, _):
    q, k, v, out, lse, token = ctx.saved_tensors
    dq, dk, dv = torch.ops.maskc.attention_backward(q, k, v, out, lse, token, d_out, d_lse)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


__all__ = ["attention", "registered"]
