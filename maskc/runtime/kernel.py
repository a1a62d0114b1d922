"""CompiledKernel: a generated kernel file, found in memory or on disk, or rendered."""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from maskc._version import __version__
from maskc.codegen.render import KERNEL_NAMES, codegen_hash, parameters, render
from maskc.codegen.source import KernelSource
from maskc.runtime import loader
from maskc.runtime.cache import KERNELS

# NOTE: Triton's interpreter (3.9) patches triton.language's builtins for the length of a
# launch and restores them after, and keeps the grid position in one global builder, so two
# threads interpreting at once undo each other's patches mid-kernel (InterpreterError, 20-40%
# of calls with two threads). Interpreted launches take turns on this lock; compiled CUDA
# launches do not take it.
_INTERPRETER = threading.Lock()


@dataclass
class CompiledKernel:
    """A generated kernel file. `source` is exactly the text that runs, read from `path`;
    `parameters` names each @triton.jit function's arguments in order."""

    kernel_source: KernelSource
    signature: str
    source: str
    path: Path
    parameters: dict[str, tuple[str, ...]]
    _functions: dict = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> KernelSource:
        """Deprecated name of `kernel_source`."""
        warnings.warn("CompiledKernel.spec is now kernel_source (a KernelSource: what the template reads; tiles are "
                      "launch values)", DeprecationWarning, stacklevel=2)
        return self.kernel_source

    def function(self, interpret: bool, name: str | None = None):
        """A @triton.jit function of the file (the first by default): interpreted for CPU
        tensors, compiled for CUDA."""
        name = name or KERNEL_NAMES[self.kernel_source.kind][0]
        module = self._functions.get(interpret)
        if module is None:
            self.path = KERNELS.importable(self.path, self.source)
            module = self._functions[interpret] = loader.load(self.path, interpret=interpret)
        fn = getattr(module, name)
        return _Interpreted(fn) if interpret else fn


class _Interpreted:
    """An interpreted @triton.jit function whose launches (`fn[grid](...)`) hold _INTERPRETER."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def serialised(*args, **kwargs):
            with _INTERPRETER:
                return launch(*args, **kwargs)

        return serialised


def kernel_for(kind: str, mask, score, dtype: torch.dtype, device: torch.device) -> CompiledKernel:
    """The `kind` ("fwd" or "bwd") kernel for traced mask and score, from memory, disk or
    rendering. Tiles, head dims and dtypes (but float64's exact scores) are launch values:
    they do not change the file."""
    source = KernelSource.of(kind, mask, score, exact=dtype == torch.float64)
    kernel = KERNELS.get(source)
    if kernel is not None:
        return kernel
    if device.type == "cuda":
        loader.warm_up()  # Triton's one-off set-up overlaps rendering and the caller's block map
    digest = source.digest(codegen_hash=codegen_hash(), maskc_version=__version__)
    text, path = KERNELS.source(f"{kind}_{digest}", lambda: render(source).text)
    kernel = CompiledKernel(source, digest, text, path, parameters(text))
    KERNELS.put(source, kernel)
    return kernel


__all__ = ["CompiledKernel", "kernel_for"]
