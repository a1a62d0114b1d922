"""Stage 1 of the pipeline: Python mask_mod / score_mod -> canonical sympy expression."""
# NOTE: imported first, for its side effect: it registers the torch functions that traced values
# answer (proxy.register), and no module imports it otherwise.
from maskc.trace import _functions, vector  # noqa: F401  (they register their handlers in maskc.trace.proxy)
from maskc.trace.mods import MaskMod, ScoreMod, as_mask_mod, as_score_mod, mask_mod, score_mod
from maskc.trace.tracer import Param, Traced, trace

__all__ = ["MaskMod", "ScoreMod", "Param", "Traced", "as_mask_mod", "as_score_mod", "mask_mod", "score_mod", "trace"]
