"""maskc: compile attention masks into tile-skipping Triton kernels.

>>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
"""
import importlib
import sys
import types

from maskc import _log  # noqa: F401  (the maskc logger, set up from the environment)
from maskc._version import __version__
from maskc.errors import MaskcError, MaskTraceError

# NOTE: the public names load on first use (PEP 562), so `import maskc` and the `maskc` command
# cost no sympy, Triton, Jinja or Dynamo (tests/test_import_cost.py). Each name's module; the
# submodules masks and scores are their own entries.
_LAZY = {
    "BlockMap": "maskc.analysis", "block_map": "maskc.analysis",
    "BlockMask": "maskc.integrations.flex", "and_masks": "maskc.integrations.flex",
    "create_block_mask": "maskc.integrations.flex", "create_mask": "maskc.integrations.flex",
    "flex_attention": "maskc.integrations.flex", "noop_mask": "maskc.integrations.flex",
    "or_masks": "maskc.integrations.flex",
    "plot": "maskc.plot",
    "CacheInfo": "maskc.runtime", "CompiledKernel": "maskc.runtime", "PagedKVCache": "maskc.runtime",
    "cache_info": "maskc.runtime.state", "clear_caches": "maskc.runtime.state",
    "compile": "maskc.runtime", "compiled_attention": "maskc.runtime",
    "invalidate": "maskc.runtime", "paged_attention": "maskc.runtime", "warmup": "maskc.runtime.warmup",
    "MaskMod": "maskc.trace", "ScoreMod": "maskc.trace", "mask_mod": "maskc.trace", "score_mod": "maskc.trace",
    "masks": None, "scores": None,
    # FlexAttention's, where this torch has them (maskc.integrations.flex.TORCH_TYPES)
    "AuxOutput": "maskc.integrations.flex", "AuxRequest": "maskc.integrations.flex",
    "FlexKernelOptions": "maskc.integrations.flex",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # NOTE: maskc.plot attaches BlockMap.plot, which every BlockMap a public name hands out has
    importlib.import_module("maskc.plot")
    module = importlib.import_module(_LAZY[name] or f"{__name__}.{name}")
    try:
        value = module if _LAZY[name] is None else getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later look-ups (and Dynamo's guards) read the module's dict
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # NOTE: importing the submodule maskc.plot binds maskc.plot to that module, over the
        # function the package exports under the same name: the function stays.
        if name == "plot" and value is sys.modules.get("maskc.plot"):
            value = value.plot
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["BlockMap", "BlockMask", "CacheInfo", "CompiledKernel", "MaskMod", "MaskTraceError", "MaskcError",
           "PagedKVCache", "ScoreMod", "__version__", "and_masks", "block_map", "cache_info", "clear_caches",
           "compile", "compiled_attention", "create_block_mask", "create_mask", "flex_attention", "invalidate",
           "mask_mod", "masks", "noop_mask", "or_masks", "paged_attention", "plot", "score_mod", "scores",
           "warmup"]
