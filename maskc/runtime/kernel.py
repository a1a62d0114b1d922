"""CompiledKernel and maskc.compile(): a specialised kernel, looked up or generated."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from maskc._version import __version__
from maskc.codegen.render import KERNEL_NAMES, codegen_hash, render
from maskc.codegen.spec import KernelSpec, dtype_name, merge
from maskc.runtime import loader
from maskc.runtime.cache import KERNELS
from maskc.runtime.configs import TileConfig, forward_config
from maskc.trace.mods import as_mask_mod, as_score_mod

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# NOTE: Triton's interpreter (3.9) patches triton.language's builtins for the length of a
# launch and restores them after, and keeps the grid position in one global builder, so two
# threads interpreting at once undo each other's patches mid-kernel (InterpreterError, 20-40%
# of calls with two threads). Interpreted launches take turns on this lock; compiled CUDA
# launches do not take it.
_INTERPRETER = threading.Lock()


@dataclass
class CompiledKernel:
    """A generated kernel file. `source` is exactly the text that runs, read from `path`."""

    spec: KernelSpec
    signature: str
    source: str
    path: Path
    _functions: dict = field(default_factory=dict, repr=False)

    def function(self, interpret: bool, name: str | None = None):
        """A @triton.jit function of the file (the first by default): interpreted for CPU
        tensors, compiled for CUDA."""
        name = name or KERNEL_NAMES[self.spec.kind][0]
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


def arch_of(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    return "interpreter"


def compile(mask_mod=None, score_mod=None, *, dtype=torch.bfloat16, head_dim: int = 128,
            head_dim_v: int | None = None, enable_gqa: bool = False, block_size=None, device=None) -> CompiledKernel:
    """The forward kernel specialised to `mask_mod` and `score_mod`, from cache or freshly generated.

    >>> kernel = maskc.compile(mask_mod=maskc.masks.causal, dtype=torch.bfloat16, head_dim=128)
    >>> print(kernel.source)     # the Triton source that runs
    >>> kernel.path              # where it is cached on disk
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    mask, score = as_mask_mod(mask_mod), as_score_mod(score_mod)
    return kernel_for("fwd", mask.traced if mask else None, score.traced if score else None, dtype, head_dim,
                      head_dim_v or head_dim, enable_gqa, block_size, device)


def kernel_for(kind, mask, score, dtype, head_dim, head_dim_v, gqa, block_size, device,
               config: TileConfig | None = None) -> CompiledKernel:
    """The `kind` ("fwd" or "bwd") kernel for traced mask and score, from memory, disk or
    rendering; `config` (an autotuned choice) replaces the default tiles for the head dim."""
    if dtype not in _DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype}; cast q, k and v")
    for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}; "
                             f"pad or split the heads")
    config = config or forward_config(head_dim, device.type)
    if block_size is not None:
        block_size = tuple(block_size)
        if len(block_size) != 2 or any(not isinstance(b, int) or b < 16 or b > 256 or b & (b - 1)
                                       for b in block_size):
            raise ValueError(f"block_size must be two powers of two from 16 to 256, got {block_size!r}; "
                             f"use for example (64, 64)")
        config = config._replace(block_m=block_size[0], block_n=block_size[1])
    arch = arch_of(device)
    key = (kind, mask.signature if mask else "", score.signature if score else "", dtype, head_dim, head_dim_v, gqa,
           config, arch)
    kernel = KERNELS.get(key)
    if kernel is not None:
        return kernel
    if device.type == "cuda":
        loader.warm_up()  # Triton's one-off set-up overlaps rendering and the caller's block map
    mask_expr, score_expr, tensors, params = merge(mask, score)
    spec = KernelSpec(
        kind=kind, mask_signature=key[1], score_signature=key[2], tensor_ranks=tuple(t.dim() for t in tensors),
        param_kinds=tuple("i" if isinstance(p.value, int) else "f" for p in params), dtype=dtype_name(dtype),
        head_dim=head_dim, head_dim_v=head_dim_v, gqa=gqa, block_m=config.block_m, block_n=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
        partial_stages=config.partial_stages, mask_expr=mask_expr, score_expr=score_expr)
    digest = spec.digest(codegen_hash=codegen_hash(), versions=f"maskc {__version__} triton {triton.__version__}",
                         arch=arch)
    source, path = KERNELS.source(f"{spec.file_stem}_{digest}", lambda: render(spec))
    kernel = CompiledKernel(spec, digest, source, path)
    KERNELS.put(key, kernel)
    return kernel
