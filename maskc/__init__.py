"""maskc: compile attention masks into tile-skipping Triton kernels."""
from maskc import masks, scores
from maskc.analysis import BlockMap, block_map
from maskc.errors import MaskcError, MaskTraceError
from maskc.trace import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["BlockMap", "MaskMod", "MaskTraceError", "MaskcError", "ScoreMod", "block_map", "mask_mod", "masks",
           "score_mod", "scores"]
