"""KernelSource: exactly what the templates read to print a kernel file, and nothing else.

Two problems whose kernels have the same text share one KernelSource, so one file and one
hash: dtypes, head dims and tile sizes are launch values (constexprs and pointer types that
Triton specialises on when it compiles), not part of the text. How a kernel is launched is a
runtime LaunchPlan (maskc/runtime/launch.py).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import sympy

from maskc.analysis.intervals import doubtful_indices
from maskc.codegen.separable import separate
from maskc.trace import dag
from maskc.trace.proxy import integral
from maskc.trace.symbols import Trunc, is_load, param_symbol
from maskc.trace.tracer import Traced

# forward, backward, decoding (split-KV), Hopper forward and dK/dV (Gluon)
KINDS = ("fwd", "bwd", "dec", "hfwd", "hbwd")


@dataclass(frozen=True)
class KernelSource:
    """A kernel file's identity. Expressions are canonical (their signatures stand for them);
    captured values are not in it."""

    kind: str  # one of KINDS
    mask_signature: str  # "" when there is no mask
    score_signature: str  # "" when there is no score_mod
    tensor_ranks: tuple[int, ...]  # captured tensors, the mask's first
    param_kinds: tuple[str, ...]  # "i" or "f" per runtime scalar, the mask's first
    # The forwards add a score of the form a·score + row + column in one FMA (codegen/separable.py),
    # and so does the Gluon dK/dV kernel where a is 1 (d(score_mod)/d(score) is then 1: its FULL
    # tiles need nothing of the score but the exponent), except for float64 inputs, which exist
    # for exact checks: there the mod runs as written.
    split_score: bool
    # The backward's captured float tensors whose gradients it accumulates (slots read by the
    # score mod); empty for every other kernel.
    grad_slots: tuple[int, ...] = ()
    # Whether a captured-tensor index can be negative where the kernel runs, which then counts
    # it from the end (torch's t[-1]) at the cost of a select per element; the runtime decides
    # it from the call's positions (analysis.intervals.indices_nonnegative), and it is True
    # where it cannot (decoding, paged caches, a kernel compiled ahead of any call).
    negative_indices: bool = True
    # Whether the GPU may fuse a multiply and an add into one FMA (Triton's enable_fp_fusion):
    # not where a mod decides on a float (`fuses_multiply_add`).
    fuse_multiply_add: bool = True
    mask_expr: sympy.Basic | None = field(default=None, compare=False, repr=False)
    score_expr: sympy.Basic | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, kind: str, mask: Traced | None, score: Traced | None, *, exact: bool,
           grad_slots: tuple[int, ...] = (), negative_indices: bool = True) -> "KernelSource":
        """The source of the `kind` kernel for traced mask and score; `exact` for float64 inputs;
        `grad_slots` the captured tensors whose gradients a backward kernel computes;
        `negative_indices` False where no captured-tensor index can be negative."""
        mask_expr, score_expr, tensors, params = merge(mask, score)
        separable = separate(score_expr) if kind in ("fwd", "hfwd", "hbwd") and not exact else None
        split = separable is not None and (kind != "hbwd" or separable.coefficient == 1)
        return cls(kind=kind, mask_signature=mask.signature if mask else "",
                   score_signature=score.signature if score else "", tensor_ranks=tuple(t.dim() for t in tensors),
                   param_kinds=tuple("i" if isinstance(p.value, int) else "f" for p in params), split_score=split,
                   grad_slots=tuple(grad_slots) if kind == "bwd" else (),
                   # one file where no index is in doubt, whatever the caller knows
                   negative_indices=negative_indices and bool(doubtful_indices((mask_expr, score_expr))),
                   fuse_multiply_add=fuses_multiply_add(mask_expr, score_expr), mask_expr=mask_expr, score_expr=score_expr)

    def digest(self, *, codegen_hash: str, maskc_version: str) -> str:
        """The hash of the text: these fields, the templates and codegen modules, and maskc's
        version (the provenance line prints it)."""
        fields = {k: v for k, v in self.__dict__.items() if k not in ("mask_expr", "score_expr")}
        blob = json.dumps({**fields, "codegen": codegen_hash, "maskc": maskc_version}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# Nodes whose value is a decision on their arguments' exact values: a pair kept or a branch
# taken (comparisons), an integer made of a float (rounding, an index), a sign.
_DECISIONS = (sympy.core.relational.Relational, sympy.floor, sympy.ceiling, Trunc, sympy.Mod, sympy.sign)


def fuses_multiply_add(*exprs) -> bool:
    """Whether a kernel of these expressions may let the GPU fuse a multiply and an add into one
    FMA: only where no decision is taken on a float. Eager torch rounds x * w before adding; an
    FMA does not, so `3 / (kv_idx + 1) >= t[q_idx]` (printed `-t + rcp * 3 >= 0`, fused to
    fma(rcp, 3, -t)) dropped pairs at exact ties that torch keeps. The templates write their
    own FMAs explicitly (tl.math.fma), so turning fusion off costs them nothing."""
    return all(all(map(integral, node.args)) for e in exprs if e is not None for node in dag.atoms(e, *_DECISIONS))


def merge(mask: Traced | None, score: Traced | None):
    """The mask's and the score's expressions with one numbering of tensors and parameters.

    Returns (mask_expr, score_expr, tensors, param_values): the score's tensor slots and
    parameters come after the mask's.
    """
    mask_expr = mask.expr if mask else None
    tensors = list(mask.tensors) if mask else []
    params = list(mask.params) if mask else []
    score_expr = None
    if score is not None:
        offset, n = len(tensors), len(params)
        renumber = tuple((p.symbol, param_symbol(n + i, isinstance(p.value, int))) for i, p in enumerate(score.params))
        score_expr = _renumbered(score.expr, offset, renumber)
        tensors += list(score.tensors)
        params += [type(p)(new, p.value, p.origin) for p, (_, new) in zip(score.params, renumber)]
    return mask_expr, score_expr, tuple(tensors), tuple(params)


@dag.identity_cache(maxsize=512)  # a call with a block map merges on every call
def _renumbered(expr: sympy.Basic, offset: int, renumber: tuple) -> sympy.Basic:
    """`expr` with its loads' tensor slots moved up by `offset` and its parameters renamed by the
    (old, new) pairs of `renumber`."""
    names = dict(renumber)
    return dag.transform(expr, lambda e: type(e)(e.args[0] + offset, *e.args[1:]) if is_load(e)
                         else names.get(e, e))


__all__ = ["KINDS", "KernelSource", "merge"]
