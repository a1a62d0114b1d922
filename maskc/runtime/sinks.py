"""Attention sinks (gpt-oss's `sinks`, transformers' `s_aux`): one learned logit per query head
that joins every row's softmax denominator and carries no value.

Per row, with s_j the scaled, score-modded scores of the kept keys and σ = sinks[h]:
out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^σ), lse = log(Σ_j e^{s_j} + e^σ).
"""
from __future__ import annotations

import torch


def check_sinks(sinks, q: torch.Tensor) -> None:
    """Refuse a `sinks` that is not a floating tensor [Hq] on q's device."""
    hq = q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a float tensor of shape [Hq] = [{hq}] (one logit per query head), got "
                        f"{type(sinks).__name__}; pass torch.tensor(values, device=q.device)")
    if sinks.dim() != 1 or sinks.shape[0] != hq:
        raise ValueError(f"sinks must have shape [Hq] = [{hq}] (one logit per query head), got shape "
                         f"{list(sinks.shape)}; pass one logit per head of q (a model's sinks parameter, "
                         f"not expanded over batch or positions)")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor of shape [Hq] = [{hq}], got dtype {sinks.dtype}; "
                        f"cast it with sinks.float()")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}; move it with "
                         f"sinks.to(q.device)")


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the kernels without sinks → (out, lse) with them, through the lse:
    lse' = logaddexp(lse, sinks[h]) and out' = out · e^(lse - lse').

    An epilogue in plain torch, because the kernels already return the lse: autograd carries the
    gradients of sinks, and of q, k and v through the kernels' (out, lse) backward, and Dynamo
    traces it into the caller's graph (fusing it into the kernels is a later speed-up).
    A row with no kept key (lse -inf) gives out 0 and lse sinks[h], with finite gradients.
    """
    dtype = torch.promote_types(lse.dtype, torch.float32)  # float64 for float64 inputs
    lse, sink = lse.to(dtype), sinks.to(dtype)[:, None]
    # a sink of -inf turns a head's sink off; where the row keeps no key either, the total is
    # -inf and logaddexp's gradient 0/0: take the rows' logaddexp at a finite stand-in there
    nothing = torch.isneginf(lse) & torch.isneginf(sink)
    total = torch.logaddexp(torch.where(nothing, 0.0, lse), sink)
    total = torch.where(nothing, float("-inf"), total)
    share = torch.exp(lse - torch.where(nothing, 0.0, total))  # 0 on rows with no kept key
    return (out.to(dtype) * share.unsqueeze(-1)).to(out.dtype), total
