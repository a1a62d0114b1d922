"""maskc: compile attention masks into tile-skipping Triton kernels.

>>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.causal)
"""
from maskc import _log, masks, scores  # noqa: F401  (_log: the maskc logger, set up from the environment)
from maskc._version import __version__
from maskc.analysis import BlockMap, block_map
from maskc.errors import MaskcError, MaskTraceError
from maskc.plot import plot
from maskc.runtime import CacheInfo, CompiledKernel, cache_info, compile, compiled_attention
from maskc.trace import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["BlockMap", "CacheInfo", "CompiledKernel", "MaskMod", "MaskTraceError", "MaskcError", "ScoreMod",
           "__version__", "block_map", "cache_info", "compile", "compiled_attention", "mask_mod", "masks",
           "plot", "score_mod", "scores"]
