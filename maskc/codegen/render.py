"""Render kernel source from the Jinja templates: Python decides, the template prints."""
from __future__ import annotations

import functools
import hashlib
from importlib import resources

import jinja2

from maskc._version import __version__
from maskc.codegen.printer import TritonPrinter, tensor_args
from maskc.codegen.spec import KernelSpec

KERNEL_NAME = "attention_fwd"
FWD_TEMPLATE = "attention_fwd.py.jinja"


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    # Templates are loaded from the installed package (maskc/_templates), never the source tree.
    loader = jinja2.FunctionLoader(lambda name: resources.files("maskc._templates").joinpath(name).read_text())
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


@functools.lru_cache(maxsize=None)
def template_hash(name: str = FWD_TEMPLATE) -> str:
    text = resources.files("maskc._templates").joinpath(name).read_text()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render_forward(spec: KernelSpec) -> str:
    """The Triton source of the forward kernel described by `spec`."""
    printer = TritonPrinter()
    extra = []
    for slot, rank in enumerate(spec.tensor_ranks):
        extra += tensor_args(slot, rank)
    extra += [f"p{i}" for i in range(len(spec.param_kinds))]
    mask_expr = printer.doprint(spec.mask_expr) if spec.mask_expr is not None else None
    score_expr = printer.doprint(spec.score_expr) if spec.score_expr is not None else None
    return _environment().get_template(FWD_TEMPLATE).render(
        kernel_name=KERNEL_NAME,
        maskc_version=__version__,
        mask_text=str(spec.mask_expr) if spec.mask_expr is not None else "none (every pair kept)",
        score_text=str(spec.score_expr) if spec.score_expr is not None else "none (plain scores)",
        mask_expr=mask_expr or "True",
        score_expr=score_expr,
        extra_args=extra,
    )
