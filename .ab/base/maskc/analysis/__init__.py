"""Stage 2 of the pipeline: expression + lengths + tile sizes -> BlockMap."""
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.build import block_map
from maskc.analysis.classify import EMPTY, FULL, PARTIAL

__all__ = ["BlockMap", "EMPTY", "FULL", "PARTIAL", "block_map"]
