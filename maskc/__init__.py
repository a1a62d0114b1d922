"""maskc: compile attention masks into tile-skipping Triton kernels.

>>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
"""
from maskc import _log, masks, scores  # noqa: F401  (_log: the maskc logger, set up from the environment)
from maskc._version import __version__
from maskc.analysis import BlockMap, block_map
from maskc.errors import MaskcError, MaskTraceError
from maskc.integrations import flex as _flex
from maskc.integrations.flex import (BlockMask, and_masks, create_block_mask, create_mask, flex_attention, noop_mask,
                                     or_masks)
from maskc.plot import plot
from maskc.runtime import (CacheInfo, CompiledKernel, PagedKVCache, cache_info, compile, compiled_attention,
                           invalidate, paged_attention)
from maskc.trace import MaskMod, ScoreMod, mask_mod, score_mod


def __getattr__(name: str):
    # FlexAttention's AuxRequest, AuxOutput and FlexKernelOptions, where this torch has them
    if name in _flex.TORCH_TYPES:
        return getattr(_flex, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlockMap", "BlockMask", "CacheInfo", "CompiledKernel", "MaskMod", "MaskTraceError", "MaskcError",
           "PagedKVCache", "ScoreMod", "__version__", "and_masks", "block_map", "cache_info", "compile",
           "compiled_attention", "create_block_mask", "create_mask", "flex_attention", "invalidate", "mask_mod", "masks",
           "noop_mask", "or_masks", "paged_attention", "plot", "score_mod", "scores"]
