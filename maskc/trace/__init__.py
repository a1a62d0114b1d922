"""Stage 1 of the pipeline: Python mask_mod / score_mod -> canonical sympy expression."""
from maskc.trace.mods import MaskMod, ScoreMod, as_mask_mod, as_score_mod, mask_mod, score_mod
from maskc.trace.tracer import Param, Traced, trace

__all__ = ["MaskMod", "ScoreMod", "Param", "Traced", "as_mask_mod", "as_score_mod", "mask_mod", "score_mod", "trace"]
