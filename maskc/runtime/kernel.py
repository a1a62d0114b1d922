"""CompiledKernel: a generated kernel file, found in memory or on disk, or rendered."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import triton
from triton.runtime.errors import InterpreterError

from maskc._version import __version__
from maskc.codegen.printer import describe
from maskc.codegen.render import AST_LOCK, KERNEL_NAMES, codegen_hash, parameters, render
from maskc.codegen.source import KernelSource
from maskc.runtime import loader
from maskc.runtime.cache import KERNELS

# NOTE: Triton's interpreter (3.9) patches triton.language's builtins for the length of a
# launch and restores them after, and keeps the grid position in one global builder, so two
# threads interpreting at once undo each other's patches mid-kernel (InterpreterError, 20-40%
# of calls with two threads). Interpreted launches take turns on this lock, which is also the
# one Python parsing takes (codegen/render.py); compiled CUDA launches do not take it.
_INTERPRETER = AST_LOCK
_NUMPY = tuple(int(part) for part in np.__version__.split(".")[:2])
# NOTE: the interpreter runs a kernel's arithmetic in numpy, which warns where a GPU is silent.
# The kernels compute whole tiles: lanes past q_len or kv_len (zero rows of q, k, v, whose
# score_mod and exp2 can overflow, or give 1/0 in d(score_mod)/d(score)) make inf and NaN that
# a tl.where or a masked store drops (tests/test_interpreter_fp_errors.py checks that they stay
# there). What a kept lane computes is what the compiled kernel and torch compute, without a
# warning either.
_FP_ERRORS = {"over": "ignore", "invalid": "ignore", "divide": "ignore"}


@dataclass
class CompiledKernel:
    """A generated kernel file. `source` is exactly the text that runs, read from `path` and
    checked (what runs is this text, not the file read again); `parameters` names each
    @triton.jit function's arguments in order."""

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

    @property
    def options(self) -> dict:
        """Triton compile options the file's arithmetic needs (KernelSource.fuse_multiply_add)."""
        return {} if self.kernel_source.fuse_multiply_add else {"enable_fp_fusion": False}

    def function(self, interpret: bool, name: str | None = None):
        """A @triton.jit function of the file (the first by default): interpreted for CPU
        tensors, compiled for CUDA."""
        name = name or KERNEL_NAMES[self.kernel_source.kind][0]
        module = self._functions.get(interpret)
        if module is None:
            with KERNELS.loading(self.path, self.source) as self.path:
                module = self._functions[interpret] = loader.load(self.path, interpret=interpret, text=self.source)
        fn = getattr(module, name)
        return _Interpreted(fn) if interpret else fn


class _Interpreted:
    """An interpreted @triton.jit function whose launches (`fn[grid](...)`) hold _INTERPRETER."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def serialised(*args, **kwargs):
            with _INTERPRETER, np.errstate(**_FP_ERRORS):
                try:
                    return launch(*args, **kwargs)
                except InterpreterError as error:
                    if "only 0-dimensional arrays can be converted" in str(error) and _NUMPY >= (2, 4):
                        raise RuntimeError(
                            f"Triton {triton.__version__}'s interpreter, which runs maskc's kernels on CPU tensors, "
                            f"fails with numpy {np.__version__} (Triton 3.6's needs numpy < 2.4); install "
                            f"'numpy<2.4' or a newer Triton to run attention on CPU tensors") from error
                    raise

        return serialised


def kernel_for(kind: str, mask, score, dtype: torch.dtype, device: torch.device,
               grad_slots: tuple[int, ...] = (), negative_indices: bool = True) -> CompiledKernel:
    """The `kind` (codegen.source.KINDS) kernel for traced mask and score, from memory, disk or
    rendering; a backward computing the gradients of the captured tensors `grad_slots` is a
    file of its own, and so is one for calls whose captured-tensor indices are all nonnegative
    (`negative_indices` False: no wrap to pay for). Tiles, head dims and dtypes (but float64's
    exact scores) are launch values: they do not change the file."""
    source = KernelSource.of(kind, mask, score, exact=dtype == torch.float64, grad_slots=grad_slots,
                             negative_indices=negative_indices)
    kernel = KERNELS.get(source)
    if kernel is not None:
        return kernel
    if device.type == "cuda":
        loader.warm_up()  # Triton's one-off set-up overlaps rendering and the caller's block map
    digest = source.digest(codegen_hash=codegen_hash(), maskc_version=__version__)
    text, path = KERNELS.source(f"{kind}_{digest}", lambda: render(source).text, _tags(source, mask, score))
    kernel = CompiledKernel(source, digest, text, path, parameters(text))
    KERNELS.put(source, kernel)
    return kernel


def provenance() -> dict:
    """What this install writes on a kernel file's tag line: a file tagged with another maskc
    version or codegen hash is one it never reads again (its name's digest covers both). The
    text does not depend on Triton's version, which is recorded for bug reports."""
    return {"maskc": __version__, "codegen": codegen_hash(), "triton": triton.__version__}


def _tags(source: KernelSource, mask, score) -> dict:
    """The tag line of a new file: provenance, and the mods it was first rendered for (the
    file serves every mod of the same signature)."""
    tags = provenance()
    for what, traced, expr in (("first_mask", mask, source.mask_expr), ("first_score", score, source.score_expr)):
        if traced is not None:
            tags[what] = f"{traced.name}: {describe(expr, limit=60)}"
    return tags


__all__ = ["CompiledKernel", "kernel_for", "provenance"]
