"""Stage 3 of the pipeline: expressions -> Triton source (printer + Jinja templates)."""
import warnings

from maskc.codegen.printer import TritonPrinter
from maskc.codegen.render import Rendered, render
from maskc.codegen.source import KernelSource


def __getattr__(name):
    if name == "KernelSpec":
        # The old name held launch choices (tiles, warps, stages) beside the source's fields.
        warnings.warn("maskc.codegen.KernelSpec is now KernelSource, which holds only what the templates read; "
                      "tiles, warps and stages are launch values (maskc/runtime/launch.py)", DeprecationWarning,
                      stacklevel=2)
        return KernelSource
    raise AttributeError(f"module 'maskc.codegen' has no attribute {name!r}")


__all__ = ["KernelSource", "Rendered", "TritonPrinter", "render"]
