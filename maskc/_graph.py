"""What torch.compile runs outside its graph: maskc's Python-side work (tracing a mod, analysing
a mask, a call with a mod maskc has not traced), which Dynamo must not trace: it cannot follow
sympy, and where it tried it crashed inside maskc with its own internal errors."""
from __future__ import annotations

import inspect

import torch


def outside_graph(fn, reason: str):
    """`fn` as Dynamo runs it: outside the graph (a graph break; with fullgraph=True, Dynamo's
    error naming `reason`, where this torch can say it: 2.8 and later, maskc supports 2.5).
    Made at import: Dynamo refuses to trace torch.compiler.disable."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=reason)
    return torch.compiler.disable(fn)
