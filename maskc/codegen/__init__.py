"""Stage 3 of the pipeline: expressions -> Triton source (printer + Jinja templates)."""
from maskc.codegen.printer import TritonPrinter
from maskc.codegen.render import render
from maskc.codegen.spec import KernelSpec

__all__ = ["KernelSpec", "TritonPrinter", "render"]
