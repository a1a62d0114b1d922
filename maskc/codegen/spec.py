"""KernelSpec: everything that decides a generated kernel, and nothing else."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import sympy
import torch

from maskc.trace import dag
from maskc.trace.symbols import is_load, param_symbol
from maskc.trace.tracer import Traced


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's identity. Expressions are canonical; captured values are not in it."""

    kind: str  # "fwd" or "bwd"
    mask_signature: str  # "" when there is no mask
    score_signature: str  # "" when there is no score_mod
    tensor_ranks: tuple[int, ...]  # captured tensors, the mask's first
    param_kinds: tuple[str, ...]  # "i" or "f" per runtime scalar, the mask's first
    dtype: str
    head_dim: int
    head_dim_v: int
    gqa: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    partial_stages: int  # forward: pipelining depth of the PARTIAL loop
    mask_expr: sympy.Basic | None = field(default=None, compare=False, repr=False)
    score_expr: sympy.Basic | None = field(default=None, compare=False, repr=False)

    def key_fields(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("mask_expr", "score_expr")}

    def digest(self, *, codegen_hash: str, versions: str, arch: str) -> str:
        blob = json.dumps({**self.key_fields(), "codegen": codegen_hash, "versions": versions, "arch": arch},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def file_stem(self) -> str:
        return f"{self.kind}_{self.dtype}_d{self.head_dim}_bm{self.block_m}_bn{self.block_n}"


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
        renumber = {p.symbol: param_symbol(n + i, isinstance(p.value, int)) for i, p in enumerate(score.params)}
        score_expr = dag.transform(score.expr, lambda e: type(e)(e.args[0] + offset, *e.args[1:]) if is_load(e)
                                   else renumber.get(e, e))
        tensors += list(score.tensors)
        params += [type(p)(renumber[p.symbol], p.value, p.origin) for p in score.params]
    return mask_expr, score_expr, tuple(tensors), tuple(params)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}[dtype]


__all__ = ["KernelSpec", "dtype_name", "merge"]
