"""Render kernel source from the Jinja templates: Python decides, the template prints."""
from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path

import jinja2
import sympy

from maskc._version import __version__
from maskc.codegen.printer import TritonPrinter, tensor_args
from maskc.codegen.separable import separate
from maskc.codegen.spec import KernelSpec
from maskc.trace.symbols import SCORE

TEMPLATES = {"fwd": "attention_fwd.py.jinja", "bwd": "attention_bwd.py.jinja"}
# The @triton.jit functions each kind of file defines.
KERNEL_NAMES = {"fwd": ("attention_fwd",), "bwd": ("attention_bwd_dq", "attention_bwd_dkdv", "attention_bwd_delta")}


@functools.lru_cache(maxsize=None)
def _environment(folder: str | None = None) -> jinja2.Environment:
    # Templates are loaded from the installed package (maskc/_templates), never the source
    # tree; benchmarks/ab_fwd.py names another folder to time edited copies side by side.
    root = resources.files("maskc._templates") if folder is None else Path(folder)
    loader = jinja2.FunctionLoader(lambda name: root.joinpath(name).read_text())
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


@functools.lru_cache(maxsize=None)
def codegen_hash() -> str:
    """Hash of what decides a kernel's text: every template (included fragments too) and
    maskc's codegen modules. Any edit to either gives new cache entries, so a developer
    changing the printer within one version never runs a stale cached kernel."""
    digest = hashlib.sha256()
    templates = resources.files("maskc._templates").iterdir()
    modules = Path(__file__).parent.glob("*.py")
    for entry in sorted(templates, key=lambda e: e.name):
        if entry.name.endswith(".jinja"):
            digest.update(entry.name.encode() + b"\0" + entry.read_bytes())
    for module in sorted(modules):
        digest.update(module.name.encode() + b"\0" + module.read_bytes())
    return digest.hexdigest()[:16]


def render(spec: KernelSpec, templates: str | None = None) -> str:
    """The Triton source of the kernel file described by `spec` (from the templates in the
    folder `templates`, else maskc's own)."""
    printer = TritonPrinter()
    extra = []
    for slot, rank in enumerate(spec.tensor_ranks):
        extra += tensor_args(slot, rank)
    extra += [f"p{i}" for i in range(len(spec.param_kinds))]
    # Only the forward uses the split. float64 runs exist for exact checks (gradcheck): there
    # the score mod runs as written, since the split form measured 2e-7 relative error in
    # float64 against 6e-16 (some term of it is computed in float32; not pinned down).
    separable = separate(spec.score_expr) if spec.kind == "fwd" and spec.dtype != "fp64" else None
    score_grad = None
    if spec.score_expr is not None:
        derivative = sympy.diff(spec.score_expr, SCORE)
        score_grad = None if derivative == 1 else printer.doprint(derivative)
    return _environment(templates).get_template(TEMPLATES[spec.kind]).render(
        kernel_name=KERNEL_NAMES[spec.kind][0],
        template_name=TEMPLATES[spec.kind],
        maskc_version=__version__,
        mask_text=str(spec.mask_expr) if spec.mask_expr is not None else "none (every pair kept)",
        score_text=str(spec.score_expr) if spec.score_expr is not None else "none (plain scores)",
        mask_expr=printer.doprint(spec.mask_expr) if spec.mask_expr is not None else "True",
        score_expr=printer.doprint(spec.score_expr) if spec.score_expr is not None else None,
        score_grad_expr=score_grad,
        separable=separable is not None,
        coefficient_expr=printer.doprint(separable.coefficient) if separable else None,
        row_expr=printer.doprint(separable.row) if separable else None,
        column_expr=printer.doprint(separable.column) if separable else None,
        extra_args=extra,
    )
